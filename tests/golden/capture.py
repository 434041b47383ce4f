"""Captures the outputs the refactor of the estimator binding must keep.

Run once, before a change that should not alter any number:

    python -m tests.golden.capture

(or, after a change that moves one training run on purpose,
`python -m tests.golden.capture --rerecord-run LABEL`). It writes
`tests/golden/outputs.npz`: every registered estimator's credit on the fixed
batch of `tests.test_credit.random_batch`, offline credit of every estimator
that runs offline on the fixed log of `tests.data.test_offline`, and the
metrics and final policy parameters of short training runs from a fixed seed
(`RUNS`). `tests/golden/test_unchanged.py` recomputes all of it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

GOLDEN = os.path.join(os.path.dirname(__file__), "outputs.npz")

# Two iterations each, on the tiny shapes of tests/train/test_trainer.py: one run per
# training recipe (critic, PRM, base estimator, clip-high with dynamic sampling, KL reference).
RUNS = {
    "step_gae": ["--estimator", "step_gae", "--kl-coef", "0.01"],
    "token_gae": ["--estimator", "token_gae"],
    "grpo": ["--estimator", "grpo"],
    "empg": ["--estimator", "empg"],
    "dapo+empg": ["--estimator", "dapo+empg"],
    "grpo+istar": ["--estimator", "grpo+istar"],
}
TINY = ["--env", "alfworld", "--iterations", "2", "--tasks-per-iteration", "2", "--group-size", "2",
        "--max-steps", "4", "--d-model", "32", "--num-layers", "1", "--minibatch-rows", "16",
        "--epochs", "1", "--max-prompt-tokens", "96", "--max-action-tokens", "6",
        "--checkpoint-every", "1", "--seed", "3", "--warm-start-steps", "40",
        "--warm-start-tasks", "16"]


def measures_time(key: str) -> bool:
    """Metrics of wall time (durations, rates), which no two runs share."""
    metric = key.split("/metric/", 1)[-1]
    return metric.startswith(("time/", "async/")) or metric.endswith("_per_second")


def estimator_outputs() -> dict[str, np.ndarray]:
    from stepcredit import advantages as adv
    from stepcredit.credit import compute_advantages
    from tests.test_credit import random_batch

    steps, tokens, extra = random_batch()
    out = {}
    for name in adv.names():
        credit = compute_advantages(steps, tokens, name, **extra)
        for field in credit._fields:
            value = getattr(credit, field)
            if value is not None:
                out[f"credit/{name}/{field}"] = np.asarray(value)
    return out


def offline_outputs(workdir: str) -> dict[str, np.ndarray]:
    from stepcredit import advantages as adv
    from stepcredit.data import save_trajectories
    from stepcredit.data.offline import compute_credit
    from tests.data.test_offline import _trajectories

    source = os.path.join(workdir, "steps.jsonl")
    save_trajectories(_trajectories(), source)
    out = {}
    for name in adv.names():
        entry = adv.get(name)
        if (entry.needs_prm or entry.needs_mc_values or entry.needs_progress
                or entry.needs_information_gain or name in ("empg", "token_gae")):
            continue  # inputs that the fixed log's step rows do not hold
        target = os.path.join(workdir, f"{name.replace('+', '_')}.jsonl")
        compute_credit(source, target, name, progress=False)
        with open(target, encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        for column in ("advantage", "return", "token_advantages", "token_returns"):
            if column in records[0]:
                values = [r[column] for r in records]
                flat = np.concatenate([np.ravel(v) for v in values]).astype(np.float32)
                out[f"offline/{name}/{column}"] = flat
    return out


def training_outputs(workdir: str, runs: dict[str, list[str]] = RUNS) -> dict[str, np.ndarray]:
    import jax

    from stepcredit.cli import main
    from stepcredit.train.config import TrainConfig
    from stepcredit.train.metrics import read_metrics
    from stepcredit.train.trainer import Trainer

    out = {}
    for label, flags in runs.items():
        logdir = os.path.join(workdir, label.replace("+", "_"))
        assert main(["train", *TINY, *flags, "--logdir", logdir]) == 0
        for row in read_metrics(logdir):
            for key, value in row.items():
                if not measures_time(f"/metric/{key}") and key != "iteration":
                    out.setdefault(f"train/{label}/metric/{key}", []).append(value)
        with open(os.path.join(logdir, "config.json"), encoding="utf-8") as f:
            trainer = Trainer(TrainConfig.from_json(f.read()), log=lambda _: None)
        trainer.restore()
        leaves = jax.tree_util.tree_leaves_with_path(trainer.state.policy)
        for path, leaf in leaves:
            out[f"train/{label}/policy/{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    return {k: np.asarray(v) for k, v in out.items()}


# The recording's parts, each recomputable on its own (by key prefix), so a test runner can
# spread them over processes: the estimators, offline credit, and each training run.
PARTS = ("credit", "offline", *(f"train/{label}" for label in RUNS))


def compute_part(part: str, workdir: str) -> dict[str, np.ndarray]:
    """The arrays of one of `PARTS` (keys `<part>/...`)."""
    if part == "credit":
        return estimator_outputs()
    if part == "offline":
        return offline_outputs(workdir)
    label = part.removeprefix("train/")
    return training_outputs(workdir, {label: RUNS[label]})


def compute_all() -> dict[str, np.ndarray]:
    with tempfile.TemporaryDirectory() as workdir:
        return {key: value for part in PARTS for key, value in compute_part(part, workdir).items()}


def rerecord_run(label: str) -> dict[str, np.ndarray]:
    """The recorded arrays with training run `label`'s replaced by today's code's."""
    recorded = dict(np.load(GOLDEN))
    with tempfile.TemporaryDirectory() as workdir:
        fresh = training_outputs(workdir, {label: RUNS[label]})
    prefix = f"train/{label}/"
    return {**{k: v for k, v in recorded.items() if not k.startswith(prefix)}, **fresh}


if __name__ == "__main__":
    import argparse

    import tests.conftest  # noqa: F401  (the test session's devices and cache)

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rerecord-run", choices=sorted(RUNS),
                        help="replace only this training run's arrays (a change that moved it "
                             "on purpose, named in test_unchanged.RERECORDED)")
    args = parser.parse_args()
    outputs = rerecord_run(args.rerecord_run) if args.rerecord_run else compute_all()
    tmp = GOLDEN + ".tmp.npz"
    np.savez_compressed(tmp, **outputs)
    os.replace(tmp, GOLDEN)
    print(f"wrote {len(outputs)} arrays to {GOLDEN}", file=sys.stderr)
