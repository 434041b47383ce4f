"""The learner's and the sampler's model time with and without last-block pruning.

Step rows are long prompts with one or a few action tokens, and the losses read
the model only at those tokens. `score_actions` therefore runs the last block's
queries, attention and MLP at the action columns only
(`TransformerPolicy.hidden_at`), and `generate` does the same for one-token
actions. This script times, in one run and on the same inputs, the gradient of
the action log-probs (what one update minibatch costs) and one-token sampling,
each against the full-width computation it replaced, and prints the ratios;
then the pointer's update gradient (the choice format) with every one of the
`MAX_CHOICES` label slots against the bound `label_slots` gives, on rows listing
12 and 20 actions; then the update gradient and one-token sampling with the
attention of `stepcredit.models.transformer` (causal blocks, the softmax's
division after the value product) against one softmax over every column.

    python benchmarks/learner_speed.py [--rows 64] [--widths 256 512] [--reps 5]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stepcredit.models import transformer
from stepcredit.models.generate import generate
from stepcredit.models.transformer import (TransformerConfig, TransformerPolicy, label_slots,
                                           score_actions)


def _seconds(fn, reps: int) -> float:
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(reps):
        tick = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - tick)
    return best


def _full_width_logp(graphdef, state, tokens, mask, column):
    """The previous learner path: every block over every column, then a gather."""
    model = nnx.merge(graphdef, state)
    hidden, _ = model.hidden(tokens, mask)
    logits = model.logits(hidden[:, column - 1])
    return jax.nn.log_softmax(logits)[jnp.arange(tokens.shape[0]), tokens[:, column]]


def _dense_attention(q, k, v, attn_mask):
    """The previous attention: one softmax over every key column, heads second in the
    matmuls (queries `[B, H, L, Dh]` in and out, as `transformer._attention`)."""
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    scores = jnp.einsum("blhd,bshd->bhls", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    scores = jnp.where(attn_mask[:, None], scores, jnp.finfo(scores.dtype).min)
    out = jnp.einsum("bhls,bshd->blhd", jax.nn.softmax(scores, axis=-1), v)
    return out.transpose(0, 2, 1, 3)


def _with_attention(attention, fn):
    """`fn()` with both of the transformer's attention paths set to `attention`, or left
    alone for None; caches are cleared so that the functions are traced again."""
    saved = transformer._attention, transformer._causal_attention
    if attention is not None:
        transformer._attention = transformer._causal_attention = attention
    jax.clear_caches()
    try:
        return fn()
    finally:
        transformer._attention, transformer._causal_attention = saved
        jax.clear_caches()


SEPARATOR = 5  # the marker after each label of the synthetic lists


def _listing_rows(rows: int, width: int, labels: int):
    """Rows of random words holding a list of `labels` actions (word, label, marker), the
    last token one of its labels."""
    tokens = np.random.default_rng(width).integers(300, 2048, (rows, width)).astype(np.int32)
    for j in range(labels):
        tokens[:, 40 + 3 * j] = 16 + j
        tokens[:, 41 + 3 * j] = SEPARATOR
    tokens[:, -1] = 16
    action_mask = np.zeros((rows, width), bool)
    action_mask[:, -1] = True
    return tokens, np.ones((rows, width), bool), action_mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    config = TransformerConfig(vocab_size=2048, d_model=args.d_model, num_layers=args.num_layers,
                               mlp_dim=4 * args.d_model)
    graphdef, state = nnx.split(TransformerPolicy(config, rngs=nnx.Rngs(0)))
    print(f"{args.rows} rows, d_model {args.d_model}, {args.num_layers} layers, "
          f"{jax.devices()[0].platform}; best of {args.reps}, seconds")
    print("| width | update: full | pruned | ratio | sampling: cached prefill | one-token "
          "| ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for width in args.widths:
        tokens = jax.random.randint(jax.random.key(width), (args.rows, width), 16, 2048)
        mask = jnp.ones((args.rows, width), bool)
        action_mask = jnp.zeros((args.rows, width), bool).at[:, -1].set(True)

        pruned = jax.jit(jax.grad(lambda s: score_actions(
            graphdef, s, tokens, mask, action_mask, 1.0, width=1).logprobs.sum()))
        full = jax.jit(jax.grad(lambda s: _full_width_logp(
            graphdef, s, tokens, mask, width - 1).sum()))
        prompt = tokens[:, :-1], mask[:, :-1]

        def sample(max_new_tokens):
            # eoa id -1 is never sampled, so the cached path decodes its second token too.
            return lambda: generate(graphdef, state, *prompt, jax.random.key(0),
                                    max_new_tokens=max_new_tokens, eoa_id=-1, pad_id=0)

        t_full, t_pruned = _seconds(lambda: full(state), args.reps), _seconds(
            lambda: pruned(state), args.reps)
        t_cached, t_one = _seconds(sample(2), args.reps), _seconds(sample(1), args.reps)
        print(f"| {width} | {t_full:.3f} | {t_pruned:.3f} | {t_full / t_pruned:.2f}x "
              f"| {t_cached:.3f} | {t_one:.3f} | {t_cached / t_one:.2f}x |")
    print("\nThe pointer's update gradient with every label slot (MAX_CHOICES) and with "
          "label_slots's bound")
    print("| width | labels a row | all slots | tight slots | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for width in args.widths:
        for labels in (12, 20):
            tokens, mask, action_mask = _listing_rows(args.rows, width, labels)
            slots = label_slots(tokens, mask, (SEPARATOR,))

            def pointer(slots):
                return jax.jit(jax.grad(lambda s: score_actions(
                    graphdef, s, tokens, mask, action_mask, 1.0, width=1,
                    choice_markers=(SEPARATOR,), label_slots=slots).logprobs.sum()))

            every, tight = pointer(None), pointer(slots)
            t_every, t_tight = (_seconds(lambda: every(state), args.reps),
                                _seconds(lambda: tight(state), args.reps))
            print(f"| {width} | {labels} | {t_every:.3f} | {t_tight:.3f} ({slots} slots) "
                  f"| {t_every / t_tight:.2f}x |")
    print("\nAttention: one softmax over every column (before) and causal blocks of "
          f"{transformer.ATTENTION_BLOCK} columns with the division after the value product "
          "(after), on rows whose lengths spread from half the width to all of it")
    print("| width | update: before | after | ratio | one-token sampling: before | after "
          "| ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for width in args.widths:
        rng = np.random.default_rng(width)
        tokens = jnp.asarray(rng.integers(16, 2048, (args.rows, width)), jnp.int32)
        lengths = rng.integers(width // 2, width + 1, args.rows)
        # Left-padded, as the sampler takes prompts; the update's rows end in one action token.
        mask = jnp.asarray(np.arange(width) >= width - lengths[:, None])
        action_mask = jnp.zeros((args.rows, width), bool).at[:, -1].set(True)

        def timings():
            gradient = jax.jit(jax.grad(lambda s: score_actions(
                graphdef, s, tokens, mask, action_mask, 1.0, width=1).logprobs.sum()))
            return (_seconds(lambda: gradient(state), args.reps),
                    _seconds(lambda: generate(graphdef, state, tokens, mask,
                                              jax.random.key(0), max_new_tokens=1, eoa_id=-1,
                                              pad_id=0), args.reps))

        (update_before, sample_before), (update_after, sample_after) = (
            _with_attention(_dense_attention, timings), _with_attention(None, timings))
        print(f"| {width} | {update_before:.3f} | {update_after:.3f} "
              f"| {update_before / update_after:.2f}x | {sample_before:.3f} | {sample_after:.3f} "
              f"| {sample_before / sample_after:.2f}x |")


if __name__ == "__main__":
    main()
