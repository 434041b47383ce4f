"""Sampling an action for every step row with a KV cache, under `jax.jit`.

`generate` prefills the cache with the left-padded prompts in one pass, then
runs a `lax.while_loop` over new tokens (one cached forward pass per token)
until every row has sampled the end-of-action token or `max_new_tokens` is
reached. A one-token action (`max_new_tokens=1`, the choice format) needs no
cache: the last block then runs at the last prompt column only
(`TransformerPolicy.hidden_at`), and, given choice markers, also at the labels
the policy points at (`TransformerPolicy.choice_logits`); its prompts run in at most
two passes, the short ones at fewer columns than the batch's longest
(`sharing.prefill_passes`), and the tokens are sampled for every row at once.
Shapes are static: the batch size, the prompt width P (or a pass's rows and
width) and `max_new_tokens` fix the compiled programs; the temperature and the
special ids are traced, so changing them does not recompile.

Token exactness: the returned ids are the ids that were sampled, with the
log-probs and entropies of the distribution they were sampled from. Scoring the
row `prompt + tokens[:length]` with `score_rows(..., temperature=T)` gives the
same log-probs and entropies (up to float rounding; greedy rows, T <= 0, carry the
log-probs of temperature 1 and are scored at 1), and its value at the first
action token equals `values` here: the trainer never re-tokenizes decoded text.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stepcredit.models.sharing import SharedRows, prefill_passes
from stepcredit.models.transformer import (
    check_rows,
    init_cache,
    positions_from_mask,
    token_logprobs_and_entropy,
)


class Generation(NamedTuple):
    """What `generate` returns for a batch of B prompts and M = max_new_tokens.

    Attributes:
      tokens: `[B, M]` int32 sampled ids; the end-of-action id is included when
        sampled; `pad_id` after a row's end.
      logprobs: `[B, M]` float32 log-probability of each sampled token under the
        sampling distribution softmax(logits / T), or softmax(logits) when
        greedy (T = 0); 0 after a row's end.
      entropies: `[B, M]` float32 entropy of that same distribution; 0 after a
        row's end.
      lengths: `[B]` int32 number of generated tokens (end-of-action included).
      finished: `[B]` bool, true where the end-of-action id was sampled (false:
        the action was cut at `max_new_tokens`).
      values: `[B]` float32 critic output at the last prompt token, V(s_t), the
        value of the step's first action token (a token's value is that of the
        state before it, verl's shifted slice).
    """

    tokens: jax.Array
    logprobs: jax.Array
    entropies: jax.Array
    lengths: jax.Array
    finished: jax.Array
    values: jax.Array


def _sample(key, logits, temperature, done):
    """Samples one token per row from `logits` `[B, V]`; returns (ids, logp, entropy)."""
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    ids = jnp.where(greedy, jnp.argmax(logits, axis=-1),
                    jax.random.categorical(key, scaled, axis=-1)).astype(jnp.int32)
    logp, entropy = token_logprobs_and_entropy(scaled[:, None], ids[:, None], ~done[:, None])
    return ids, logp[:, 0], entropy[:, 0]


def generate(graphdef: nnx.GraphDef, state: nnx.State, prompt_tokens: jax.Array,
             prompt_mask: jax.Array, key: jax.Array, *, max_new_tokens: int,
             eoa_id: int | jax.Array, pad_id: int | jax.Array,
             temperature: float | jax.Array = 1.0,
             choice_markers: tuple[int, ...] = (),
             shared: SharedRows | None = None,
             label_slots: int | None = None) -> Generation:
    """Samples one action per prompt with a KV cache.

    Args:
      graphdef, state: from `nnx.split(model)` of a `TransformerPolicy` (static
        graphdef).
      prompt_tokens: `[B, P]` int ids, left-padded so every prompt ends at
        column P - 1 (`pack_rows(prompts, length=P, pad_id=..., side="left")`).
      prompt_mask: `[B, P]` bool, true on real prompt tokens; each row needs at
        least one.
      key: a PRNG key (unused when greedy).
      max_new_tokens: M, the most tokens sampled per row (static).
      eoa_id: the end-of-action id; a row stops after sampling it.
      pad_id: written after a row's end.
      temperature: T > 0 samples from softmax(logits / T); T <= 0 is greedy
        (argmax), with log-probs and entropies of softmax(logits).
      choice_markers: when given (static), the one token (`max_new_tokens`
        must be 1) is drawn from the labels that these markers follow in the
        prompt (a numbered list of admissible actions), by
        `TransformerPolicy.choice_logits`; `score_rows` with the same markers
        gives the same log-probs.
      shared: equal prompts read one prompt pass: the prompt (the prefill of
        the cache) runs on rows `shared.unique` `[U]` only, row b reads that of
        `unique[inverse[b]]` and samples its own tokens
        (`stepcredit.models.sharing.shared_prompts`); None runs every row. With
        `max_new_tokens=1`, the short prompts' pass may also run at fewer
        columns than P (`sharing.prefill_passes`), equal up to float rounding.
      label_slots: with `choice_markers`, the most labels a prompt holds
        (static, `stepcredit.models.transformer.label_slots`); None: all
        `MAX_CHOICES`.

    Returns:
      A `Generation`.

    Raises:
      ValueError: `choice_markers` with `max_new_tokens` > 1, or prompts and mask that
        are not `[B, P]` of one shape.
      TypeError: ids that are not integers, or a mask neither bool nor 0/1 integers.
    """
    check_rows("generate", "prompt_tokens", prompt_tokens, prompt_mask=prompt_mask)
    if choice_markers and max_new_tokens != 1:
        raise ValueError(f"generate: choice_markers choose one label, so max_new_tokens must be "
                         f"1, got {max_new_tokens}")
    if max_new_tokens > 1:
        return _generate_cached(graphdef, state, prompt_tokens, prompt_mask, key,
                                max_new_tokens=max_new_tokens, eoa_id=eoa_id, pad_id=pad_id,
                                temperature=temperature, shared=shared)
    # One token needs no cache: each pass runs the last block at its last column only.
    tokens, mask = np.asarray(prompt_tokens), np.asarray(prompt_mask, bool)
    passes, inverse = prefill_passes(mask, shared)
    outputs = [_first_token_logits(graphdef, state, tokens[p.rows, -p.width:],
                                   mask[p.rows, -p.width:], choice_markers=choice_markers,
                                   label_slots=label_slots) for p in passes]
    return _sample_first_token(tuple(outputs), inverse, key, temperature, eoa_id)


@functools.partial(jax.jit, static_argnames=("graphdef", "choice_markers", "label_slots"))
def _first_token_logits(graphdef, state, tokens, mask, *, choice_markers, label_slots):
    """`(logits [U, V], values [U])` at the last column of every row (U rows of one pass)."""
    model = nnx.merge(graphdef, state)
    last_column = jnp.full((tokens.shape[0], 1), tokens.shape[1] - 1, jnp.int32)
    if choice_markers:
        logits, values = model.choice_logits(tokens, mask, last_column, choice_markers,
                                             label_slots)
        return logits[:, -1], values[:, -1]
    hidden, values = model.hidden_at(tokens, mask, last_column)
    return model.logits(hidden[:, -1]), values[:, -1]


@jax.jit
def _sample_first_token(outputs, inverse, key, temperature, eoa_id) -> Generation:
    """Row b samples from the outputs at `inverse[b]` of the passes' concatenated
    `(logits, values)`; the key is split as `_generate_cached` splits it for its first
    token."""
    logits = jnp.concatenate([o[0] for o in outputs])[inverse]
    values = jnp.concatenate([o[1] for o in outputs])[inverse]
    _, sub = jax.random.split(key)
    ids, logp, entropy = _sample(sub, logits, temperature, jnp.zeros(inverse.shape, bool))
    finished = ids == eoa_id
    return Generation(ids[:, None], logp[:, None], entropy[:, None],
                      jnp.ones(ids.shape, jnp.int32), finished, values.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _generate_cached(graphdef, state, prompt_tokens, prompt_mask, key, *, max_new_tokens,
                     eoa_id, pad_id, temperature, shared) -> Generation:
    """`generate` for `max_new_tokens` > 1: a prefill of the cache, then one cached
    forward pass per token in a `lax.while_loop`."""
    model = nnx.merge(graphdef, state)
    b, p = prompt_tokens.shape
    prompt_mask = prompt_mask.astype(bool)
    run_tokens, run_mask = ((prompt_tokens, prompt_mask) if shared is None else
                            (prompt_tokens[shared.unique], prompt_mask[shared.unique]))
    total = p + max_new_tokens
    columns = jnp.arange(total)
    key_valid = jnp.concatenate([prompt_mask, jnp.ones((b, max_new_tokens), bool)], axis=1)
    run_valid = key_valid if shared is None else key_valid[shared.unique]
    prefill_mask = (columns[None, :] <= jnp.arange(p)[:, None])[None] & run_valid[:, None, :]
    cache = init_cache(model.config, run_tokens.shape[0], total)
    logits, values, cache = model.decode(run_tokens, positions_from_mask(run_mask),
                                         prefill_mask, cache, 0)
    if shared is not None:
        cache = jax.tree.map(lambda x: x[shared.inverse], cache)
    next_position = jnp.sum(prompt_mask, axis=1, dtype=jnp.int32)
    if shared is not None:
        logits, values = logits[shared.inverse], values[shared.inverse]
    done = jnp.zeros((b,), bool)
    key, sub = jax.random.split(key)
    ids, logp, entropy = _sample(sub, logits, temperature, done)
    out_tokens = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(ids)
    out_logp = jnp.zeros((b, max_new_tokens), jnp.float32).at[:, 0].set(logp)
    out_entropy = jnp.zeros((b, max_new_tokens), jnp.float32).at[:, 0].set(entropy)
    done = ids == eoa_id

    def cond(carry):
        i, _, _, done, *_ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, key, cache, done, out_tokens, out_logp, out_entropy = carry
        # Feed token i - 1 (column p + i - 1), then sample token i.
        column = p + i - 1
        attn_mask = (key_valid & (columns[None, :] <= column))[:, None, :]
        positions = (next_position + i - 1)[:, None]
        logits, _, cache = model.decode(out_tokens[:, i - 1][:, None], positions, attn_mask,
                                        cache, column)
        key, sub = jax.random.split(key)
        ids, logp, entropy = _sample(sub, logits, temperature, done)
        out_tokens = out_tokens.at[:, i].set(jnp.where(done, pad_id, ids))
        out_logp = out_logp.at[:, i].set(logp)
        out_entropy = out_entropy.at[:, i].set(entropy)
        done = done | (ids == eoa_id)
        return i + 1, key, cache, done, out_tokens, out_logp, out_entropy

    carry = (jnp.int32(1), key, cache, done, out_tokens, out_logp, out_entropy)
    _, _, _, done, out_tokens, out_logp, out_entropy = jax.lax.while_loop(cond, body, carry)
    lengths = jnp.where(done, jnp.argmax(out_tokens == eoa_id, axis=1) + 1, max_new_tokens)
    return Generation(out_tokens, out_logp, out_entropy, lengths.astype(jnp.int32), done,
                      values[:, -1].astype(jnp.float32))
