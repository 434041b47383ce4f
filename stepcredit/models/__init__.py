"""Models: the word-level tokenizer, the Flax NNX transformer policy (language-model
and value heads; also the implicit PRM and the KL reference) and cached generation.

Models know nothing of environments: the tokenizer is built from word lists.
"""

from stepcredit.models.generate import Generation, generate
from stepcredit.models.sharing import SharedRows, shared_prompts, shared_rows
from stepcredit.models.tokenizer import (
    SpecialIds,
    Tokenizer,
    WordTokenizer,
    count_unknown,
    split_words,
)
from stepcredit.models.transformer import (
    KVCache,
    PackedRows,
    RowScores,
    TransformerConfig,
    TransformerPolicy,
    count_params,
    forward,
    init_cache,
    label_positions,
    pack_rows,
    positions_from_mask,
    prompt_values,
    score_actions,
    score_rows,
    token_logprobs_and_entropy,
)

__all__ = [
    "Generation",
    "KVCache",
    "PackedRows",
    "RowScores",
    "SharedRows",
    "SpecialIds",
    "Tokenizer",
    "TransformerConfig",
    "TransformerPolicy",
    "WordTokenizer",
    "count_params",
    "count_unknown",
    "forward",
    "generate",
    "init_cache",
    "label_positions",
    "pack_rows",
    "positions_from_mask",
    "prompt_values",
    "score_actions",
    "score_rows",
    "shared_prompts",
    "shared_rows",
    "split_words",
    "token_logprobs_and_entropy",
]
