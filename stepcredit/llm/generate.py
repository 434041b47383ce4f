"""Sampling from a loaded checkpoint with tunix's sampler: token ids in, token ids out.

tunix's `Sampler` takes strings and re-tokenizes them; here it takes the prompt
ids themselves (the chat template's, `stepcredit.llm.chat.prompt_ids`), so the
ids the model is conditioned on are the ids stored and trained on. Its default
seed is one fixed key for every call, which makes the members of a group
sampled in separate calls the same sample: here every call names its seed.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Sequence

import jax
import numpy as np

from stepcredit.llm.checkpoint import Checkpoint


class Samples(NamedTuple):
    """Per prompt: the sampled ids (up to and without the end token) and their log-probs."""

    ids: list[np.ndarray]
    logprobs: list[np.ndarray]


# One sampler per (model, cache size): a new one would compile its prefill and decode again.
_SAMPLERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _sampler(checkpoint: Checkpoint, cache_size: int):
    from tunix.generate import sampler

    class IdsSampler(sampler.Sampler):
        def tokenize(self, input_ids) -> np.ndarray:
            return np.asarray(input_ids, dtype=np.int32)

    by_size = _SAMPLERS.setdefault(checkpoint.model, {})
    if cache_size not in by_size:
        # tunix's sampler holds the model's variables themselves: later updates reach it.
        config = checkpoint.config
        by_size[cache_size] = IdsSampler(checkpoint.model, checkpoint.tokenizer, sampler.CacheConfig(
            cache_size=cache_size, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim))
    return by_size[cache_size]


def sample(checkpoint: Checkpoint, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
           seed: int, temperature: float = 1.0, top_p: float | None = 1.0,
           stop_ids: Sequence[int] | None = None) -> Samples:
    """Samples a continuation of each prompt; temperature 0 is greedy.

        x_n ~ softmax(logits_n / temperature), restricted to the top-p mass

    Args:
      checkpoint: a loaded `Checkpoint`.
      prompts: token-id lists, one per row (rows with the same prompt are
        independent draws).
      max_new_tokens: most tokens sampled per row.
      seed: this call's seed, any integer (required: tunix reuses one key otherwise).
      temperature: > 0 samples, 0 takes the argmax.
      top_p: nucleus mass (1 or None keeps all tokens); ignored when greedy.
      stop_ids: tokens that end a row; default the tokenizer's end token.

    Returns:
      `Samples`: the ids of each row and the log-probs the sampler gave them.
    """
    if seed is None:
        raise ValueError("sample: seed is None; give each call its own seed (tunix reuses key 0)")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("sample: prompts must be non-empty lists of token ids")
    if temperature < 0 or max_new_tokens < 1:
        raise ValueError(f"sample: temperature={temperature} (>= 0) and max_new_tokens={max_new_tokens} "
                         f"(>= 1)")
    longest = max(len(p) for p in prompts)
    prompt_length = 1 << (longest - 1).bit_length()
    greedy = temperature == 0
    out = _sampler(checkpoint, prompt_length + max_new_tokens + 1)(
        [list(p) for p in prompts], max_generation_steps=max_new_tokens, max_prompt_length=prompt_length,
        return_logprobs=True, eos_tokens=list(stop_ids) if stop_ids else None,
        # tunix samples only with a top_p (or top_k); None would make it greedy
        temperature=1.0 if greedy else float(temperature),
        top_p=None if greedy else (1.0 if top_p is None else top_p),
        # a key holds 32 bits of its seed: larger seeds (the rollouts' mixes) are taken mod 2^32,
        # as PRNGKey itself would, instead of overflowing its int64 conversion
        seed=jax.random.PRNGKey(int(seed) % 2**32))
    ids = [np.asarray(t, np.int32) for t in out.tokens]
    logprobs = [np.asarray(lp, np.float32)[:len(t)] for lp, t in zip(out.logprobs, ids)]
    return Samples(ids, logprobs)
