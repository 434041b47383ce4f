"""Rollout and update throughput of a Qwen2.5-0.5B-shaped random model through stepcredit.llm.

Builds tunix's Qwen2.5-0.5B configuration with random weights (no checkpoint needed),
then measures, in one run:

  - rollout: `stepcredit.llm.generate.sample` on B prompts of P tokens, N new tokens
    each, in generated tokens per second (the first call, which compiles, is not timed);
  - update: one `stepcredit.llm.learn.Learner.learn` call on B one-step episodes of
    P + N tokens (GRPO credit, the step rows, one AdamW step of PPO's clipped loss on
    float32 master parameters), in tokens per second (the first call is not timed).

    python -m benchmarks.llm_throughput                # the 0.5B shape (a GPU run)
    python -m benchmarks.llm_throughput --tiny         # a 2-layer shape, a CPU check

Prints a Markdown table; `--output FILE` also writes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stepcredit.batch import StepRecord, Trajectory
from stepcredit.llm import checkpoint, generate, learn


def build(tiny: bool, dtype: str):
    from tunix.models.qwen2 import model as qwen2

    config = qwen2.ModelConfig.qwen2p5_0p5b()
    if tiny:
        config = dataclasses.replace(config, num_layers=2, embed_dim=64, hidden_dim=128, num_heads=4,
                                     head_dim=16, num_kv_heads=2, vocab_size=512)
    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    config = dataclasses.replace(config, dtype=dtypes[dtype], param_dtype=dtypes[dtype])
    mesh = checkpoint.default_mesh()
    with jax.set_mesh(mesh):
        model = qwen2.Qwen2(config, rngs=nnx.Rngs(0))
    tokenizer = _Tokenizer(config.vocab_size)
    return checkpoint.Checkpoint(model, tokenizer, "qwen2", config, mesh)


class _Tokenizer:
    """Just what tunix's sampler asks of a tokenizer: ids in, ids out."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def pad_id(self):
        return 0

    def eos_id(self):
        return self.vocab_size + 1  # never sampled: every row runs N tokens

    def bos_id(self):
        return None

    def encode(self, ids):
        return list(ids)

    def decode(self, ids):
        return " ".join(map(str, ids))

    def dedup_bos_ids(self, ids):
        return ids


def rollout(qwen, batch: int, prompt: int, new: int, repeats: int):
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, qwen.config.vocab_size, prompt)) for _ in range(batch)]
    generate.sample(qwen, prompts, max_new_tokens=new, seed=0)  # compiles
    start = time.perf_counter()
    for seed in range(1, repeats + 1):
        out = generate.sample(qwen, prompts, max_new_tokens=new, seed=seed)
    seconds = (time.perf_counter() - start) / repeats
    return sum(len(ids) for ids in out.ids) / seconds, seconds


def update(qwen, batch: int, prompt: int, new: int, repeats: int):
    """One `Learner.learn` call on a group of B one-step episodes (GRPO credit, the rows
    packed, one AdamW step of PPO's clipped loss over B x (P + N) tokens on float32 masters)."""
    rng = np.random.default_rng(1)
    vocab = qwen.config.vocab_size

    def batch_of_steps():
        return [Trajectory(steps=(StepRecord(
            observation_ids=[], action_ids=rng.integers(1, vocab, new).tolist(), action_logp=[-1.0] * new,
            reward=float(rng.normal()), prompt_ids=rng.integers(1, vocab, prompt).tolist()),), group_id=0)
            for _ in range(batch)]

    learner = learn.Learner(qwen, learn.LearnConfig(estimator="grpo", minibatch_rows=batch))
    jax.block_until_ready(learner.learn(batch_of_steps(), iteration=0))  # compiles
    start = time.perf_counter()
    for iteration in range(1, repeats + 1):
        jax.block_until_ready(learner.learn(batch_of_steps(), iteration=iteration))
    seconds = (time.perf_counter() - start) / repeats
    return batch * (prompt + new) / seconds, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer shape for a CPU check")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--new", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    batch = args.batch or (4 if args.tiny else 64)
    prompt = args.prompt or (16 if args.tiny else 512)
    new = args.new or (8 if args.tiny else 256)
    qwen = build(args.tiny, args.dtype)
    rollout_rate, rollout_s = rollout(qwen, batch, prompt, new, args.repeats)
    update_rate, update_s = update(qwen, batch, prompt, new, args.repeats)
    shape = "2-layer tiny Qwen2" if args.tiny else "Qwen2.5-0.5B shape"
    lines = [f"# LLM throughput: {shape}, {args.dtype}, random weights",
             "",
             f"`python -m benchmarks.llm_throughput{' --tiny' if args.tiny else ''} --dtype {args.dtype}` "
             f"on {jax.devices()[0].device_kind} ({jax.default_backend()}, {jax.device_count()} device(s)), "
             f"{platform.machine()}. B = {batch} rows, P = {prompt} prompt tokens, N = {new} new tokens.",
             "",
             "| phase | seconds per call | tokens per second |",
             "|---|---:|---:|",
             f"| rollout (`generate.sample`, N new tokens per row) | {rollout_s:.3f} | {rollout_rate:,.0f} |",
             f"| update (`Learner.learn`: credit and one AdamW PPO step over B x (P + N) tokens) "
             f"| {update_s:.3f} | {update_rate:,.0f} |"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
