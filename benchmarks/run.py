"""Credit-assignment kernels side by side with their peers, in one process.

    python -m benchmarks.run            # full suite, writes runs/benchmarks/RESULTS.md
    python -m benchmarks.run --output benchmarks/RESULTS.md   # updates the committed table
    python -m benchmarks.run --quick    # small sizes, a few repetitions
    python -m benchmarks.run --skip-gae --seconds 0.3   # every estimator at B=4096, G=512, T=16

Every row is a median over repeated calls after a warm-up call (compile time is
reported apart); every ratio divides by the memory floor (NumPy copying the
inputs' bytes: for an estimator, those of every input it reads) measured in the
same loop, interleaved with the row it divides, so machine load moves both. Every result with a float64 reference (the GAE kernels, GRPO,
GiGPO, EMPG) is checked against it.
Each implementation gets its inputs in its own array type: NumPy arrays for the
NumPy loops, CPU tensors for PyTorch, and for the jitted ones (rlax, stepcredit)
jax arrays already on the device, as a JAX trainer holds them.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import stepcredit
from benchmarks import baselines
from stepcredit.advantages import CreditInputs, apply, get, names
from stepcredit.advantages.gae import GAE_METHODS
from tests.reference import empg as empg_ref
from tests.reference import gae as gae_ref
from tests.reference import gigpo as gigpo_ref

GAMMA, LAM = 0.99, 0.95
TOLERANCE = 1e-5  # relative: a fraction of the reference's largest magnitude


def _block(out):
    return jax.block_until_ready(out)


def time_calls(fn, floor, min_seconds, max_reps):
    """Median seconds per call of `fn` and of `floor`, alternating one call each."""
    times, floor_times = [], []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < min_seconds):
        t0 = time.perf_counter()
        floor()
        floor_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _block(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), statistics.median(floor_times)


def max_error(actual, expected):
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    return float(np.max(np.abs(np.asarray(actual, np.float64) - expected), initial=0.0)) / scale


class Table:
    def __init__(self):
        self.rows = []

    def add(self, kernel, size, impl, seconds, floor, loop, compile_s, error):
        row = dict(kernel=kernel, size=size, impl=impl, ms=seconds * 1e3, floor_ms=floor * 1e3,
                   floor=seconds / floor, loop=(loop / seconds) if loop else None,
                   compile_s=compile_s, error=error)
        self.rows.append(row)
        loop_text = f"{row['loop']:8.1f}x" if row["loop"] else "        -"
        compile_text = f"{compile_s:6.2f}s" if compile_s is not None else "      -"
        error_text = f"{error:.1e}" if error is not None else "-"
        print(f"{kernel:22s} {size:>14s} {impl:28s} {row['ms']:10.3f} ms {row['floor']:8.1f}x floor "
              f"{loop_text} vs loop  compile {compile_text}  err {error_text}", flush=True)


def gae_inputs(batch, length, token_level, seed=0):
    """float32 `[B, T]` inputs with NaN at masked positions.

    Step level: random padding and holes. Token level: action segments of 8-64
    tokens alternating with observation segments, then padding.
    """
    rng = np.random.default_rng(seed)
    if token_level:
        positions = np.arange(length)
        period = rng.integers(16, 128, size=(batch, 1))
        mask = (positions[None] % period) < period // 2
    else:
        mask = rng.random((batch, length)) > 0.1
    mask &= np.arange(length)[None] < rng.integers(length // 2 + 1, length + 1, size=(batch, 1))
    rewards = np.where(mask, rng.normal(size=(batch, length)), np.nan).astype(np.float32)
    values = np.where(mask, rng.normal(size=(batch, length)), np.nan).astype(np.float32)
    bootstrap = np.where(rng.random(batch) < 0.5, rng.normal(size=batch), 0.0).astype(np.float32)
    return rewards, values, mask, bootstrap


def resident(*arrays):
    """The arrays as jax arrays on the default device (a jitted call then copies nothing in)."""
    return tuple(jax.device_put(x) for x in arrays)


def compiled(fn, *args):
    """`fn` jitted, its compile time (lowering included) and the compiled callable."""
    t0 = time.perf_counter()
    executable = jax.jit(fn).lower(*args).compile()
    return executable, time.perf_counter() - t0


def bench_gae(table, kernel, batch, length, args, methods):
    token_level = kernel == "token_gae"
    rewards, values, mask, bootstrap = gae_inputs(batch, length, token_level)
    floor = functools.partial(baselines.memory_floor, rewards, values, mask)
    reps = dict(min_seconds=args.seconds, max_reps=args.reps)
    size = f"B={batch} {'N' if token_level else 'T'}={length}"
    expected, _ = gae_ref_vectorised(rewards, values, mask, bootstrap)

    loop_s, floor_s = time_calls(lambda: baselines.numpy_gae_loop(rewards, values, mask, bootstrap,
                                                                  GAMMA, LAM), floor, **reps)
    out = baselines.numpy_gae_loop(rewards, values, mask, bootstrap, GAMMA, LAM)
    table.add(kernel, size, "NumPy per-step loop (verl)", loop_s, floor_s, loop_s, None,
              max_error(out[0], expected))
    if args.torch:
        import torch

        tensors = [torch.from_numpy(x) for x in (rewards, values, mask, bootstrap)]
        seconds, floor_s = time_calls(lambda: baselines.torch_gae_loop(*tensors, GAMMA, LAM), floor, **reps)
        out = baselines.torch_gae_loop(*tensors, GAMMA, LAM)
        table.add(kernel, size, "PyTorch per-step loop", seconds, floor_s, loop_s, None,
                  max_error(out[0].numpy(), expected))
    if not token_level:  # rlax has no mask: timed on the same arrays with every step valid
        dense = resident(*(np.nan_to_num(x) for x in (rewards, values)), bootstrap)
        fn, compile_s = compiled(functools.partial(baselines.rlax_gae(), gamma=GAMMA, lam=LAM), *dense)
        seconds, floor_s = time_calls(lambda: fn(*dense), floor, **reps)
        full = np.ones_like(mask)
        expected_dense, _ = gae_ref_vectorised(*(np.asarray(x) for x in dense[:2]), full,
                                               bootstrap)
        table.add(kernel, size, "rlax GAE, vmap + jit (no mask)", seconds, floor_s, loop_s, compile_s,
                  max_error(fn(*dense), expected_dense))
    estimator = get(kernel).fn
    inputs = resident(rewards, values, mask, bootstrap)
    for method in methods:
        def call(r, v, m, b, method=method):
            return estimator(r, v, m, bootstrap_value=b, gamma=GAMMA, lam=LAM, method=method)

        fn, compile_s = compiled(call, *inputs)
        seconds, floor_s = time_calls(lambda: fn(*inputs), floor, **reps)
        table.add(kernel, size, f"stepcredit {method}", seconds, floor_s, loop_s, compile_s,
                  max_error(fn(*inputs).advantages, expected))


def gae_ref_vectorised(rewards, values, mask, bootstrap):
    """Float64 GAE by the reference recursion, vectorised over the batch (fast enough for 16M)."""
    rewards, values = (np.asarray(x, np.float64) for x in (rewards, values))
    next_value, running = np.asarray(bootstrap, np.float64), np.zeros(len(rewards))
    advantages = np.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        valid = mask[:, t]
        delta = np.where(valid, rewards[:, t], 0.0) + GAMMA * next_value - np.where(valid, values[:, t], 0.0)
        running = np.where(valid, delta + GAMMA * LAM * running, running)
        advantages[:, t] = np.where(valid, running, 0.0)
        next_value = np.where(valid, values[:, t], next_value)
    return advantages, advantages + np.where(mask, values, 0.0)


def group_inputs(batch, num_groups, steps, tokens_per_step=4, seed=0):
    """Every credit input at `[B]`, `[B, T]` and `[B, N]` (N = T x tokens_per_step).

    Groups of B / G consecutive trajectories, each group two rollout trees;
    trajectories of 1 to T valid steps; anchors in [0, 4); each step has
    `tokens_per_step - 1` action tokens followed by one observation token.
    """
    rng = np.random.default_rng(seed)
    group_ids = np.repeat(np.arange(num_groups), batch // num_groups).astype(np.int32)
    mask = np.arange(steps)[None] < rng.integers(1, steps + 1, size=(batch, 1))
    step_rewards = np.where(mask, rng.normal(size=(batch, steps)), 0.0).astype(np.float32)
    action = np.arange(tokens_per_step) < tokens_per_step - 1
    step_index = np.where(mask[:, :, None] & action, np.arange(steps)[None, :, None], -1)
    step_index = step_index.reshape(batch, -1).astype(np.int32)
    tokens = step_index.shape[1]
    step_floats = lambda: np.where(mask, rng.normal(size=(batch, steps)), 0.0).astype(np.float32)  # noqa: E731
    token_floats = lambda: np.where(step_index >= 0, rng.normal(size=(batch, tokens)), 0.0).astype(np.float32)  # noqa: E731
    return CreditInputs(
        mask=mask, step_rewards=step_rewards, step_values=step_floats(),
        bootstrap_value=np.where(rng.random(batch) < 0.5, rng.normal(size=batch), 0.0).astype(np.float32),
        entropy=np.where(mask, rng.uniform(0.1, 3.0, size=(batch, steps)), 0.0).astype(np.float32),
        anchors=rng.integers(0, 4, size=(batch, steps)).astype(np.int32), group_ids=group_ids,
        scores=step_rewards.sum(axis=1), step_index=step_index, token_values=token_floats(),
        prm_logp=token_floats() - 1.0, ref_logp=token_floats() - 1.0,
        base_advantages=step_rewards,  # plain EMPG reweights these (the others ignore them)
        tree_ids=(np.arange(batch) // max(batch // (2 * num_groups), 1)).astype(np.int32),
        progress=step_floats(), grounding=mask & (rng.random((batch, steps)) < 0.8),
        mc_values=step_floats(), answer_logp=np.where(mask, -rng.uniform(0.1, 3.0, size=(batch, steps)),
                                                      0.0).astype(np.float32))


REFERENCE_LOOPS = {"grpo": "verl dict normalisation", "gigpo": "dict of (group, anchor) loops",
                   "empg": "per-step Python loop"}


def group_references(inputs, num_groups):
    """The float64 references that the group rows are checked against, by estimator."""
    arrays = {k: np.asarray(v) for k, v in inputs._asdict().items() if v is not None}
    return {
        "grpo": lambda: baselines.dict_grpo(arrays["scores"], arrays["group_ids"]),
        "gigpo": lambda: gigpo_ref.gigpo(arrays["step_rewards"], arrays["anchors"],
                                         arrays["group_ids"], arrays["mask"]),
        "empg": lambda: empg_ref.empg(arrays["base_advantages"], arrays["entropy"], arrays["mask"]),
    }


STEP_FLOOR_FIELDS = ("step_rewards", "anchors", "mask")


def estimator_floor(name, inputs):
    """The memory floor of estimator `name`: copying the `[B, T]` step arrays that every
    estimator row is held to (`STEP_FLOOR_FIELDS`) and every other credit input its
    registry entry reads (`Estimator.fields`: a token-level estimator's `[B, N]` arrays),
    so that no row's floor is below the step arrays' and none leaves out bytes it must
    read."""
    fields = dict.fromkeys((*STEP_FLOOR_FIELDS, *sorted(get(name).fields)))
    return functools.partial(baselines.memory_floor, *(getattr(inputs, f) for f in fields))


def bench_groups(table, batch, num_groups, steps, args, estimators):
    """Every estimator in `estimators` through `apply`, jitted, with the references' loops."""
    inputs = group_inputs(batch, num_groups, steps)
    reps = dict(min_seconds=args.seconds, max_reps=args.reps)
    size = f"B={batch} G={num_groups} T={steps}"
    references = group_references(inputs, num_groups)
    loops = {}
    for name in (n for n in references if n in estimators):
        loops[name], _ = time_calls(references[name], estimator_floor(name, inputs),
                                    min_seconds=0.0, max_reps=3)
    device_inputs = jax.tree.map(jax.device_put, inputs)
    for name in estimators:
        entry = get(name)
        config = {key: value for key, value in (("num_groups", num_groups),
                                                 ("num_trees", 2 * num_groups))
                  if key in entry.options}
        fn, compile_s = compiled(lambda x, name=name, config=config:
                                 apply(name, x, config).advantages, device_inputs)
        seconds, floor_s = time_calls(lambda: fn(device_inputs), estimator_floor(name, inputs),
                                      **reps)
        error = max_error(fn(device_inputs), references[name]()) if name in references else None
        if name in loops:
            # The floor interleaved with the kernel's calls: beside a loop of hundreds of
            # milliseconds the copy runs from a cold cache, several times slower.
            table.add(name, size, REFERENCE_LOOPS[name], loops[name], floor_s, loops[name],
                      None, 0.0)
        table.add(name, size, "stepcredit", seconds, floor_s, loops.get(name), compile_s, error)


def machine():
    cpu = "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()}, jax {jax.__version__} on {jax.default_backend()} "
            f"({devices}), numpy {np.__version__}, stepcredit {stepcredit.__version__}; "
            f"1-minute load average at the end {load:.1f}")


def write_markdown(table, path, command):
    lines = [
        "# Benchmark results",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}.",
        "",
        "`x floor`: time divided by the memory floor, NumPy copying the inputs' bytes (the",
        "median of the floor calls interleaved with every row of that kernel and size; `floor",
        "ms`); an estimator's inputs are the `[B, T]` step rewards, anchors and mask and every",
        "other credit input its registry entry reads (a token-level one's `[B, N]` arrays).",
        "`x loop`: how many times faster than the per-step loop",
        "(or dictionary) implementation of the same kernel and size. Medians of repeated calls",
        "after warm-up; compile time (lowering and XLA compilation) is apart. `error`: largest",
        "deviation from a float64 reference, relative to the reference's largest magnitude.",
        "Jitted implementations (rlax, stepcredit) take jax arrays already on the device; the",
        "loops take NumPy arrays (PyTorch: CPU tensors).",
        "",
        "| kernel | size | implementation | ms | floor ms | x floor | x loop | compile s | error |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    floors = {}
    for row in table.rows:
        floors.setdefault((row["kernel"], row["size"]), []).append(row["floor_ms"])
    for row in table.rows:
        floor_ms = statistics.median(floors[row["kernel"], row["size"]])
        loop = f"{row['loop']:.1f}" if row["loop"] else "-"
        compile_s = f"{row['compile_s']:.2f}" if row["compile_s"] is not None else "-"
        error = f"{row['error']:.1e}" if row["error"] is not None else "-"
        lines.append(f"| {row['kernel']} | {row['size']} | {row['impl']} | {row['ms']:.3f} | "
                     f"{floor_ms:.3f} | {row['ms'] / floor_ms:.1f} | {loop} | {compile_s} | {error} |")
    # The sections written by hand below the table (notes, profiles) stay.
    kept = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        start = old.find("\n## ")
        kept = old[start:] if start >= 0 else ""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as f:
        f.write("\n".join(lines) + "\n" + kept)
    os.replace(temporary, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 1024, 8192])
    parser.add_argument("--token-lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--methods", nargs="+", default=list(GAE_METHODS), choices=GAE_METHODS)
    parser.add_argument("--group-batch", type=int, default=4096)
    parser.add_argument("--num-groups", type=int, default=512)
    parser.add_argument("--estimators", nargs="+", default=list(names()), choices=names(),
                        metavar="NAME", help="registered estimators to time (default: all)")
    parser.add_argument("--skip-gae", action="store_true", help="only the estimators' rows")
    parser.add_argument("--seconds", type=float, default=1.0, help="time spent per row, at least")
    parser.add_argument("--reps", type=int, default=50, help="most calls per row")
    parser.add_argument("--output", default=os.path.join("runs", "benchmarks", "RESULTS.md"),
                        help="where the table goes (an uncommitted path by default; pass "
                             "benchmarks/RESULTS.md to update the committed table)")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.token_lengths = [16, 1024], [4096]
        args.group_batch, args.num_groups, args.seconds, args.reps = 512, 64, 0.2, 10
    try:
        import torch  # noqa: F401

        args.torch = True
    except ImportError:
        args.torch = False
        print("torch not installed: skipping the PyTorch loop", file=sys.stderr)

    if "native" in args.methods and jax.default_backend() != "cpu":
        # The compiled kernel is CPU-only; elsewhere "native" would time the sequential scan.
        args.methods = [m for m in args.methods if m != "native"]
        print(f"method 'native' is CPU-only: skipped on {jax.default_backend()}", file=sys.stderr)
    table = Table()
    for length in [] if args.skip_gae else args.lengths:
        bench_gae(table, "step_gae", args.batch, length, args, args.methods)
    for length in [] if args.skip_gae else args.token_lengths:
        bench_gae(table, "token_gae", args.batch, length, args, args.methods)
    bench_groups(table, args.group_batch, args.num_groups, 16, args, args.estimators)
    write_markdown(table, args.output, "python -m benchmarks.run " + " ".join(argv or sys.argv[1:]))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
