"""A small decoder-only transformer with a language-model head and a value head.

Architecture: token embedding, `num_layers` pre-LayerNorm blocks (multi-head
causal self-attention with rotary position embeddings, then a GELU MLP), a final
LayerNorm, a language-model head (tied to the embedding by default), a scalar
value head at every position and a pointer head that scores the labels of a
numbered list of admissible actions (`TransformerPolicy.choice_logits`).

Value convention (verl's shifted slice): `values[:, n]` is the
critic's estimate of the state after tokens `0..n`, so the value *of token n*
(the state before token n is generated) is `values[:, n - 1]`. The value at a
step's first action token, V(s_t), is the critic output at the last prompt token.
`score_rows` returns values already shifted to the token they belong to.

One class, three roles. The policy (actor and critic), iStar's implicit PRM and
the frozen KL reference are all `TransformerPolicy` instances with separate
parameters::

    policy = TransformerPolicy(config, rngs=nnx.Rngs(0))
    prm = nnx.clone(policy)          # iStar: the PRM starts from the policy's weights
    reference = nnx.clone(policy)    # frozen: never passed to an optimizer
    graphdef, params = nnx.split(policy)   # all state is nnx.Param

Hot loops use the pure functions below over split state under `jax.jit` (they
are jitted with `graphdef` static; calling them inside another jitted function
inlines them), not `nnx.jit`::

    logits, values = forward(graphdef, params, tokens, mask)
    scores = score_rows(graphdef, params, rows.tokens, rows.mask)

Padding: rows may be left- or right-padded (or both). `mask` marks real tokens;
positions default to `cumsum(mask) - 1`, so a row's first real token is at
position 0 wherever its padding lies. Padded positions attend to nothing real
and their outputs are meaningless: mask them out downstream.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stepcredit.models.sharing import SharedRows
from stepcredit.models.tokenizer import MAX_CHOICES

KVCache = tuple[tuple[jax.Array, jax.Array], ...]
"""Per layer, the cached keys and values, each `[B, S, num_heads, head_dim]`."""

_EXCLUDED_LOGIT = -1e9
"""The logit of the ids a choice excludes: finite, so that p log p is 0, not NaN."""


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The architecture of a `TransformerPolicy`.

    The defaults give about 1.7M parameters plus `vocab_size * d_model` for the
    embedding (about 2.2M with a 2,000-token vocabulary).

    Attributes:
      vocab_size: the number of token ids (at least the tokenizer's).
      d_model: the residual stream width.
      num_layers: the number of transformer blocks.
      num_heads: attention heads; `d_model / num_heads` must be even (RoPE).
      mlp_dim: the hidden width of each block's MLP.
      rope_base: the rotary embedding's base wavelength.
      tie_embeddings: the language-model head reuses the token embedding.
      layer_norm_eps: LayerNorm's epsilon.
      init_std: the standard deviation of the normal initialisation (GPT-2);
        each block's output projections are scaled by `1 / sqrt(2 num_layers)`.
    """

    vocab_size: int
    d_model: int = 256
    num_layers: int = 2
    num_heads: int = 4
    mlp_dim: int = 1024
    rope_base: float = 10_000.0
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransformerConfig: {name} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ValueError(f"TransformerConfig: d_model ({self.d_model}) / num_heads "
                             f"({self.num_heads}) must be an even integer (RoPE)")

    @property
    def head_dim(self) -> int:
        """The width of one attention head."""
        return self.d_model // self.num_heads


def _rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotates `x` `[B, L, H, Dh]` by its `positions` `[B, L]` (rotate-half RoPE)."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * freqs
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class _Attention(nnx.Module):
    """Causal multi-head self-attention with RoPE and an optional KV cache."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(config.init_std)
        out_init = nnx.initializers.normal(config.init_std / math.sqrt(2 * config.num_layers))
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.rope_base = config.rope_base
        self.qkv = nnx.Linear(config.d_model, 3 * config.d_model, kernel_init=init, rngs=rngs)
        self.out = nnx.Linear(config.d_model, config.d_model, kernel_init=out_init, rngs=rngs)

    def __call__(self, x, positions, attn_mask, cache, cache_index, query_columns=None):
        b, length, _ = x.shape
        qkv = self.qkv(x).reshape(b, length, 3, self.num_heads, self.head_dim)
        q = _rope(qkv[:, :, 0], positions, self.rope_base)
        k = _rope(qkv[:, :, 1], positions, self.rope_base)
        v = qkv[:, :, 2]
        if query_columns is not None:
            q = jnp.take_along_axis(q, query_columns[:, :, None, None], axis=1)
        if cache is not None:
            k = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype),
                                             (0, cache_index, 0, 0))
            v = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype),
                                             (0, cache_index, 0, 0))
        # Heads first, so that they lead the matmuls' batch dimensions.
        q, keys, values = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        # New tokens written from column 0 attend causally among themselves (`decode`'s
        # contract), so the keys above each block can be skipped.
        from_start = cache is None or (isinstance(cache_index, int) and cache_index == 0)
        out = self.attend(q, keys, values, attn_mask,
                          causal=from_start and query_columns is None).transpose(0, 2, 1, 3)
        return self.out(out.reshape(b, q.shape[2], -1)), (k, v)

    def attend(self, q, k, v, attn_mask, *, causal: bool):
        """Queries `[B, H, L, Dh]` over keys and values `[B, H, S, Dh]` where `attn_mask`
        `[B, L, S]` allows; `causal`: the queries are the first L key columns under a
        causal mask (`_causal_attention`), else `_attention`."""
        return (_causal_attention if causal else _attention)(q, k, v, attn_mask)


ATTENTION_BLOCK = 128
"""Query columns per block of `_causal_attention`. Blocks of 64 gave the same update
gradient on a 2-core CPU (forward passes up to 15% faster) for twice the compiled kernels,
each of which XLA:CPU maps into the process, against Linux's default limit of 65,530
mappings."""


def _attention(q, k, v, attn_mask):
    """Softmax attention of queries `[B, H, L, Dh]` over keys and values
    `[B, H, S, Dh]`, where `attn_mask` `[B, L, S]` allows: `[B, H, L, Dh]`.

    softmax(s) v is computed as (exp(s - m) v) / sum exp(s - m) with m the row's
    largest score: the division then runs on `[.., L, Dh]` instead of the
    `[.., L, S]` weights. m only keeps exp in range and cancels in the ratio, so
    no gradient flows through it. A query that may attend to nothing (padding)
    gets the mean of all values, finite.
    """
    scores = jnp.einsum("bhld,bhsd->bhls", q, k) / math.sqrt(q.shape[-1])
    scores = jnp.where(attn_mask[:, None], scores, jnp.finfo(scores.dtype).min)
    weights = jnp.exp(scores - jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True)))
    return jnp.einsum("bhls,bhsd->bhld", weights, v) / weights.sum(axis=-1)[..., None]


def _causal_attention(q, k, v, attn_mask):
    """`_attention` of a row's columns over themselves under a causal `attn_mask`
    (false above the diagonal), by blocks of `ATTENTION_BLOCK` query columns, each
    over the keys up to its last column.

    The keys a block skips are masked for all its queries, so a real query's
    output is `_attention`'s up to float rounding (a padded query, which attends
    to no real key, may differ). A block's scores are `ATTENTION_BLOCK x` its
    end instead of `x L`, which halves the `L x L` work and keeps each block's
    scores small enough to stay in cache. The blocks are a static unrolled loop
    over columns, since their key lengths differ.
    """
    length = q.shape[2]
    if length <= ATTENTION_BLOCK:
        return _attention(q, k, v, attn_mask)
    outs = []
    for start in range(0, length, ATTENTION_BLOCK):
        end = min(start + ATTENTION_BLOCK, length)
        outs.append(_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                               attn_mask[:, start:end, :end]))
    return jnp.concatenate(outs, axis=2)


class _Block(nnx.Module):
    """A pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(config.init_std)
        out_init = nnx.initializers.normal(config.init_std / math.sqrt(2 * config.num_layers))
        d, eps = config.d_model, config.layer_norm_eps
        self.ln_attn = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)
        self.attn = _Attention(config, rngs=rngs)
        self.ln_mlp = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)
        self.mlp_in = nnx.Linear(d, config.mlp_dim, kernel_init=init, rngs=rngs)
        self.mlp_out = nnx.Linear(config.mlp_dim, d, kernel_init=out_init, rngs=rngs)

    def __call__(self, x, positions, attn_mask, cache, cache_index, query_columns=None):
        """`query_columns` `[B, W]`: compute the outputs at those columns only
        (`attn_mask` is then `[B, W, S]`); keys and values still cover every column."""
        h, kv = self.attn(self.ln_attn(x), positions, attn_mask, cache, cache_index,
                          query_columns)
        if query_columns is not None:
            x = jnp.take_along_axis(x, query_columns[..., None], axis=1)
        x = x + h
        x = x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln_mlp(x))))
        return x, kv


class TransformerPolicy(nnx.Module):
    """Decoder-only transformer with a language-model head and a value head.

    Also serves as iStar's implicit PRM and as the frozen KL reference (separate
    instances, e.g. via `nnx.clone`); see the module docstring.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        init = nnx.initializers.normal(config.init_std)
        d = config.d_model
        self.embed = nnx.Embed(config.vocab_size, d, embedding_init=init, rngs=rngs)
        self.blocks = nnx.List([_Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.ln_final = nnx.LayerNorm(d, epsilon=config.layer_norm_eps, rngs=rngs)
        self.lm_head = (None if config.tie_embeddings else
                        nnx.Linear(d, config.vocab_size, use_bias=False, kernel_init=init,
                                   rngs=rngs))
        self.value_head = nnx.Linear(d, 1, kernel_init=nnx.initializers.zeros, rngs=rngs)
        self.choice_query = nnx.Linear(d, d, kernel_init=init, rngs=rngs)
        self.choice_key = nnx.Linear(d, d, kernel_init=init, rngs=rngs)

    def _run(self, tokens, positions, attn_mask, cache, cache_index, last_query=None):
        x = self.embed(tokens)
        new_cache = []
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            columns, mask = (last_query if last_query is not None and i == last
                             else (None, attn_mask))
            x, kv = block(x, positions, mask, None if cache is None else cache[i],
                          cache_index, columns)
            new_cache.append(kv)
        h = self.ln_final(x)
        return h, self.value_head(h)[..., 0], tuple(new_cache)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """The language-model head: final hidden states `[..., d_model]` to `[..., vocab_size]`."""
        return self.embed.attend(hidden) if self.lm_head is None else self.lm_head(hidden)

    def hidden(self, tokens: jax.Array, mask: jax.Array,
               positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """`__call__` without the language-model head: `(hidden [B, L, d], values [B, L])`."""
        if positions is None:
            positions = positions_from_mask(mask)
        h, values, _ = self._run(tokens, positions, _causal_mask(mask), None, 0)
        return h, values

    def hidden_at(self, tokens: jax.Array, mask: jax.Array,
                  columns: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`hidden` at `columns` `[B, W]` only: `(hidden [B, W, d], values [B, W])`.

        Equal to gathering `hidden(tokens, mask)` at `columns`, but the last
        block computes its queries, attention and MLP at those W columns only
        (keys and values still cover the row), so its attention costs W x L
        instead of L x L: the learner needs the head at the action tokens only.
        """
        mask = mask.astype(bool)
        query_mask = (columns[:, :, None] >= jnp.arange(tokens.shape[1])) & mask[:, None, :]
        h, values, _ = self._run(tokens, positions_from_mask(mask), _causal_mask(mask), None, 0,
                                 last_query=(columns, query_mask))
        return h, values

    def choice_logits(self, tokens: jax.Array, mask: jax.Array, columns: jax.Array,
                      marker_ids: Sequence[int], slots: int | None = None
                      ) -> tuple[jax.Array, jax.Array]:
        """Logits at `columns` `[B, W]` over the labels of a numbered list, by pointing.

        A label is an id directly followed by one of `marker_ids` (the list
        `<adm> go to desk 1 <1> <sep> look <2> <sep>` ends each action with its
        label and `<sep>`), so its hidden state has read the action's text. With
        h the final hidden states, q = W_q h[column] and k_j = W_k h[label_j]:

            logit(label_j) = q . k_j / sqrt(d_model),

        and every other id gets an excluded logit. This scores each admissible
        action against the state, as DRRN does (arXiv 1511.04636), with a
        pointer over the prompt's own positions (arXiv 1506.03134): the policy
        needs to find the right action, not to copy its label's identity into
        the language-model head. A row without labels (its list was dropped to
        fit the prompt) keeps the language-model head, unconstrained.

        Args:
          tokens: `[B, L]` int ids.
          mask: `[B, L]` bool, true on real tokens.
          columns: `[B, W]` int, the columns whose next token is chosen.
          marker_ids: the ids that follow a label.
          slots: the most labels a row holds (static; `label_slots` counts them
            on the host); the last block runs at that many label columns. None:
            `MAX_CHOICES`. Labels past the slots are never offered.

        Returns:
          `(logits [B, W, vocab_size], values [B, W])`, values as `hidden_at`'s.
        """
        is_label = label_positions(tokens, mask, marker_ids)
        batch, width = columns.shape
        slots = min(slots or MAX_CHOICES, tokens.shape[1])
        label_columns = jax.vmap(lambda row: jnp.nonzero(row, size=slots, fill_value=0)[0])(
            is_label)
        is_slot = jnp.take_along_axis(is_label, label_columns, axis=1)
        hidden, values = self.hidden_at(tokens, mask,
                                        jnp.concatenate([columns, label_columns], axis=1))
        query = self.choice_query(hidden[:, :width])
        keys = self.choice_key(hidden[:, width:])
        scores = jnp.einsum("bwd,bcd->bcw", query, keys) / math.sqrt(query.shape[-1])
        vocab = self.config.vocab_size
        # Empty slots scatter to the out-of-range id `vocab`, which mode="drop" discards.
        label_ids = jnp.where(is_slot, jnp.take_along_axis(tokens, label_columns, axis=1), vocab)
        pointed = jnp.full((batch, width, vocab), _EXCLUDED_LOGIT, scores.dtype).at[
            jnp.arange(batch)[:, None], :, label_ids].set(scores, mode="drop")
        has_labels = jnp.any(is_label, axis=1)[:, None, None]
        return jnp.where(has_labels, pointed, self.logits(hidden[:, :width])), values[:, :width]

    def __call__(self, tokens: jax.Array, mask: jax.Array,
                 positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Full causal forward pass.

        Args:
          tokens: `[B, L]` int token ids.
          mask: `[B, L]` bool, true on real tokens (padding may sit left or right).
          positions: `[B, L]` int positions; default `positions_from_mask(mask)`.

        Returns:
          `(logits [B, L, vocab_size], values [B, L])`: position n predicts token
          n + 1, and `values[:, n]` is the critic output after token n.
        """
        h, values = self.hidden(tokens, mask, positions)
        return self.logits(h), values

    def decode(self, tokens: jax.Array, positions: jax.Array, attn_mask: jax.Array,
               cache: KVCache, cache_index: jax.Array | int
               ) -> tuple[jax.Array, jax.Array, KVCache]:
        """Forward pass of `L` new tokens against a KV cache of length `S`.

        Args:
          tokens: `[B, L]` int token ids, written at cache columns
            `cache_index .. cache_index + L - 1`.
          positions: `[B, L]` int positions of the new tokens.
          attn_mask: `[B, L, S]` bool: which cache columns each new token attends
            to (the caller makes it causal and excludes padding; with
            `cache_index` the Python int 0, the keys above each block of new
            tokens are skipped on that premise).
          cache: the cache from `init_cache` or the previous call.
          cache_index: scalar int, the first cache column written.

        Returns:
          `(logits [B, vocab_size], values [B, L], updated cache)`: the logits
          predict the token after the last new one (all a sampler needs; the
          head is not run on the rest of a prefill).
        """
        h, values, cache = self._run(tokens, positions, attn_mask, cache, cache_index)
        return self.logits(h[:, -1]), values, cache


def _causal_mask(mask: jax.Array) -> jax.Array:
    """`[B, L, L]`: column n attends to the real columns up to n."""
    length = mask.shape[1]
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None] & mask.astype(bool)[:, None, :]


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Positions `[B, L]` counting real tokens from 0 (`cumsum(mask) - 1`, 0 on left padding)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def init_cache(config: TransformerConfig, batch_size: int, length: int,
               dtype=jnp.float32) -> KVCache:
    """An all-zero KV cache: per layer, keys and values `[batch_size, length, H, Dh]`."""
    shape = (batch_size, length, config.num_heads, config.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                 for _ in range(config.num_layers))


def count_params(model_or_state) -> int:
    """The number of parameters of a module or a state."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(
        model_or_state, nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))


@jax.jit(static_argnums=0)
def forward(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, mask: jax.Array,
            positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`TransformerPolicy.__call__` over split state: `(logits [B, L, V], values [B, L])`.

    Args:
      graphdef, state: from `nnx.split(model)` (graphdef is static).
      tokens: `[B, L]` int ids.
      mask: `[B, L]` bool, true on real tokens.
      positions: `[B, L]` int; default `positions_from_mask(mask)`.
    """
    return nnx.merge(graphdef, state)(tokens, mask, positions)


@jax.jit(static_argnums=0)
def prompt_values(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, mask: jax.Array,
                  shared: SharedRows | None = None) -> jax.Array:
    """V(s) of left-padded prompts: the critic output at the last column, `[B]` float32.

    Equal to `forward(graphdef, state, tokens, mask)[1][:, -1]`, but the last
    block runs at that column only and the language-model head not at all.

    Args:
      graphdef, state: from `nnx.split(model)` (graphdef is static).
      tokens: `[B, P]` int ids, left-padded (every prompt ends at column P - 1).
      mask: `[B, P]` bool, true on real tokens.
      shared: equal prompts run once (as in `generate`); None runs every row.
    """
    model = nnx.merge(graphdef, state)
    if shared is not None:
        tokens, mask = tokens[shared.unique], mask[shared.unique]
    last = jnp.full((tokens.shape[0], 1), tokens.shape[1] - 1, jnp.int32)
    _, values = model.hidden_at(tokens, mask, last)
    values = values[:, 0].astype(jnp.float32)
    return values if shared is None else values[shared.inverse]


def token_logprobs_and_entropy(logits: jax.Array, targets: jax.Array,
                               mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Log-probability of each target token and the entropy of its distribution.

    logp[b, n] = log softmax(logits[b, n])[targets[b, n]],
    entropy[b, n] = -sum_v p_v log p_v with p = softmax(logits[b, n]).
    Divide `logits` by a temperature first to score at that temperature.

    Args:
      logits: `[B, L, V]` logits whose row n predicts `targets[:, n]`.
      targets: `[B, L]` int token ids.
      mask: `[B, L]` bool; positions where it is false get 0 in both outputs.

    Returns:
      `(logprobs [B, L], entropies [B, L])`, float32.
    """
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    mask = mask.astype(bool)
    return jnp.where(mask, logp, 0.0), jnp.where(mask, entropy, 0.0)


class RowScores(NamedTuple):
    """Per-token outputs of `score_rows`, aligned with the tokens they belong to.

    Attributes:
      logprobs: `[B, L]` log pi(token n | tokens < n); 0 at column 0 and padding.
      entropies: `[B, L]` entropy of the distribution that token n was drawn from.
      values: `[B, L]` V(state before token n) = critic output at the previous
        real position (verl's shifted slice); 0 at column 0 and padding.
    """

    logprobs: jax.Array
    entropies: jax.Array
    values: jax.Array


def label_positions(tokens: jax.Array, mask: jax.Array, marker_ids: Sequence[int]) -> jax.Array:
    """`[B, L]` bool: the real tokens directly followed by one of `marker_ids`.

    A numbered list in a prompt (`<adm> go to desk 1 <1> <sep> look <2> <sep>`)
    ends each item with its label and a marker, so with marker `<sep>` these
    are exactly the labels on offer.

    Args:
      tokens: `[B, L]` int ids.
      mask: `[B, L]` bool, true on real tokens.
      marker_ids: the ids that follow a label.
    """
    mask = mask.astype(bool)
    followed = jnp.isin(tokens[:, 1:], jnp.asarray(marker_ids, tokens.dtype)) & mask[:, 1:]
    return jnp.concatenate([followed & mask[:, :-1], jnp.zeros_like(mask[:, :1])], axis=1)


MIN_LABEL_SLOTS = 16
"""The fewest label slots `label_slots` gives (bounds the compiled shapes)."""


def label_slots(tokens, mask, marker_ids: Sequence[int]) -> int:
    """The label slots a batch needs (host NumPy): the most labels in a row
    (`label_positions`), rounded up to a power of two, at least `MIN_LABEL_SLOTS`
    and at most `MAX_CHOICES`. A tighter bound than `MAX_CHOICES` saves the last
    block's work at the empty slots (HotpotQA lists up to about 20 actions)."""
    tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
    followed = np.isin(tokens[:, 1:], np.asarray(marker_ids, tokens.dtype)) & mask[:, 1:]
    most = int((followed & mask[:, :-1]).sum(axis=1).max(initial=0))
    return min(MAX_CHOICES, max(MIN_LABEL_SLOTS, 1 << max(most - 1, 0).bit_length()))


def _has_previous(mask: jax.Array) -> jax.Array:
    """`[B, L]`: token n and the column before it are real (false in column 0).

    Column n is predicted by column n - 1; with left padding the previous
    column of a row's first real token is padding.
    """
    return jnp.concatenate([jnp.zeros_like(mask[:, :1]), mask[:, 1:] & mask[:, :-1]], axis=1)


def _token_values(values: jax.Array, has_prev: jax.Array) -> jax.Array:
    """V(state before token n): the critic output at column n - 1 (verl's shifted slice), else 0."""
    return jnp.where(has_prev, jnp.roll(values, 1, axis=1), 0.0).astype(jnp.float32)


def check_rows(fn: str, tokens_name: str, tokens, **masks) -> None:
    """Raises one line naming `fn` and the argument unless `tokens` holds `[B, L]` integer
    ids and every array of `masks` (by its argument's name) is a `[B, L]` bool or 0/1
    integer mask of the same shape. Reads dtypes and shapes only (no copy to the device)."""
    arrays = {tokens_name: tokens, **masks}
    for name, x in arrays.items():
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        if not (jnp.issubdtype(dtype, jnp.integer) or (name != tokens_name and dtype == bool)):
            raise TypeError(f"{fn}: {name} has dtype {dtype}; it must be "
                            + ("an integer type" if name == tokens_name
                               else "bool (or 0/1 integers)"))
        if np.ndim(x) != 2:
            raise ValueError(f"{fn}: {name} has shape {np.shape(x)} (rank {np.ndim(x)}); it "
                             "must have rank 2")
    for name, x in masks.items():
        if np.shape(x) != np.shape(tokens):
            raise ValueError(f"{fn}: {tokens_name} has shape {np.shape(tokens)} but {name} has "
                             f"shape {np.shape(x)}; both must be [B, L]")


@jax.jit(static_argnums=0, static_argnames=("choice_markers",))
def score_rows(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, mask: jax.Array,
               temperature: float | jax.Array = 1.0,
               choice_markers: tuple[int, ...] = ()) -> RowScores:
    """Scores step rows (prompt tokens then action tokens) with one forward pass.

    For every real token n after the row's first, the log-probability and
    entropy of the policy at `temperature` (softmax(logits / temperature)) and
    the value of the state before it. Select the action tokens with the rows'
    `action_mask`; the step value V(s_t) is `values` at the first action token.
    These equal what `generate` returned while sampling the same tokens.

    Args:
      graphdef, state: from `nnx.split(model)` (graphdef is static).
      tokens: `[B, L]` int ids.
      mask: `[B, L]` bool, true on real tokens (left or right padding).
      temperature: scalar > 0 (traced: changing it does not recompile).
      choice_markers: when given, the policy chooses among the labels that
        these markers follow (`TransformerPolicy.choice_logits`), as `generate`
        does with the same markers; score only the action tokens of such rows.

    Returns:
      `RowScores` of `[B, L]` arrays (0 where there is no previous real token).
    """
    check_rows("score_rows", "tokens", tokens, mask=mask)
    mask = mask.astype(bool)
    model = nnx.merge(graphdef, state)
    if choice_markers:
        every_column = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        logits, values = model.choice_logits(tokens, mask, every_column, choice_markers)
    else:
        logits, values = model(tokens, mask)
    has_prev = _has_previous(mask)
    logp, entropy = token_logprobs_and_entropy(logits[:, :-1] / temperature, tokens[:, 1:],
                                               has_prev[:, 1:])
    pad = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return RowScores(jnp.concatenate([pad, logp], axis=1),
                     jnp.concatenate([pad, entropy], axis=1), _token_values(values, has_prev))


@jax.jit(static_argnums=0, static_argnames=("width", "choice_markers", "label_slots"))
def score_actions(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, mask: jax.Array,
                  action_mask: jax.Array, temperature: float | jax.Array = 1.0, *, width: int,
                  choice_markers: tuple[int, ...] = (),
                  shared: SharedRows | None = None,
                  label_slots: int | None = None) -> RowScores:
    """`score_rows` at the action tokens only: the head runs on `width` positions per row.

    Each row's action tokens must be contiguous and at most `width` long (as
    step rows are: the prompt, then the sampled ids). The language-model head,
    the softmax and the last block's queries and MLP then cost `width`
    positions per row instead of L (`TransformerPolicy.hidden_at`), which is
    most of a row when prompts are long.

    Args:
      graphdef, state, tokens, mask, temperature, choice_markers: as `score_rows`.
      action_mask: `[B, L]` bool, true on the action tokens.
      width: the most action tokens in a row (static).
      shared: the model runs on rows `shared.unique` `[U]` only and row b reads
        the outputs of `unique[inverse[b]]`, then scores its own action tokens
        (`stepcredit.models.sharing.shared_rows` finds rows whose outputs are
        equal); None runs every row.
      label_slots: with `choice_markers`, the most labels a row holds (static,
        `label_slots`); None: `MAX_CHOICES`.

    Returns:
      `RowScores` of `[B, L]` arrays: log-probs, entropies and values equal to
      `score_rows`'s at the action tokens and 0 elsewhere.
    """
    check_rows("score_actions", "tokens", tokens, mask=mask, action_mask=action_mask)
    mask, action_mask = mask.astype(bool), action_mask.astype(bool)
    model = nnx.merge(graphdef, state)
    batch, length = tokens.shape
    wanted = jnp.argmax(action_mask, axis=1)[:, None] + jnp.arange(width)
    columns = jnp.minimum(wanted, length - 1)
    is_action = jnp.take_along_axis(action_mask, columns, axis=1) & (wanted < length)
    # Token n is predicted by the hidden state at n - 1, and its value is the critic's there.
    predicting = jnp.maximum(columns - 1, 0)
    run = (tokens, mask, predicting)
    if shared is not None:
        run = tuple(x[shared.unique] for x in run)
    if choice_markers:
        logits, values = model.choice_logits(*run, choice_markers, label_slots)
    else:
        hidden, values = model.hidden_at(*run)
        logits = model.logits(hidden)
    if shared is not None:
        logits, values = logits[shared.inverse], values[shared.inverse]
    logp, entropy = token_logprobs_and_entropy(logits / temperature,
                                               jnp.take_along_axis(tokens, columns, axis=1),
                                               is_action)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], columns.shape)
    # Clipped duplicate columns carry 0 (is_action is false there), so adding them changes nothing.
    zeros = jnp.zeros((batch, length), jnp.float32)
    has_prev = jnp.take_along_axis(_has_previous(mask), columns, axis=1) & is_action
    values = jnp.where(has_prev, values, 0.0).astype(jnp.float32)
    return RowScores(zeros.at[rows, columns].add(logp), zeros.at[rows, columns].add(entropy),
                     zeros.at[rows, columns].add(values))


class PackedRows(NamedTuple):
    """Token rows packed to one width by `pack_rows` (host NumPy arrays).

    Attributes:
      tokens: `[B, L]` int32 ids: each row's prompt then its action tokens.
      mask: `[B, L]` bool, true on real tokens.
      action_mask: `[B, L]` bool, true on action tokens (the ones trained on).
    """

    tokens: np.ndarray
    mask: np.ndarray
    action_mask: np.ndarray


def pack_rows(prompts: Sequence[Sequence[int]], actions: Sequence[Sequence[int]] | None = None,
              *, length: int, pad_id: int, side: str = "right") -> PackedRows:
    """Pads step rows (prompt ids followed by action ids) into fixed-size arrays.

    Args:
      prompts: B sequences of prompt ids.
      actions: B sequences of action ids (including the final end-of-action id
        when it was generated), or None for prompts alone (e.g. to `generate`).
      length: L, the padded row length; a longer row raises a ValueError.
      pad_id: the id written on padding.
      side: "right" (pad after) or "left" (pad before: every row ends at column
        L - 1, what `generate` expects of prompts).

    Returns:
      `PackedRows` of `[B, L]` arrays.
    """
    if side not in ("left", "right"):
        raise ValueError(f"pack_rows: side must be 'left' or 'right', got {side!r}")
    if actions is None:
        actions = [()] * len(prompts)
    if len(actions) != len(prompts):
        raise ValueError(f"pack_rows: {len(prompts)} prompts but {len(actions)} actions")
    b = len(prompts)
    tokens = np.full((b, length), pad_id, np.int32)
    mask = np.zeros((b, length), bool)
    action_mask = np.zeros((b, length), bool)
    for i, (prompt, action) in enumerate(zip(prompts, actions)):
        n = len(prompt) + len(action)
        if n > length:
            raise ValueError(f"pack_rows: row {i} has {len(prompt)} prompt + {len(action)} "
                             f"action tokens = {n} > length {length}")
        start = 0 if side == "right" else length - n
        tokens[i, start:start + n] = np.concatenate(
            [np.asarray(prompt, np.int32).reshape(-1), np.asarray(action, np.int32).reshape(-1)])
        mask[i, start:start + n] = True
        action_mask[i, start + len(prompt):start + n] = True
    return PackedRows(tokens, mask, action_mask)
