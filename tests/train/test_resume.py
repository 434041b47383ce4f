"""A run killed with SIGKILL after iteration k and resumed matches an uninterrupted run.

Both runs are `stepcredit train` subprocesses with the same seed; the estimator
(rloo+istar) and the KL term put every kind of state in the checkpoint: policy,
optimizer, PRM and its optimizer, reference, PRNG key, iteration, stage.
"""

import math
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np

from stepcredit.train.config import TrainConfig
from stepcredit.train.metrics import read_metrics
from stepcredit.train.trainer import Trainer

ITERATIONS, KILL_AFTER = 4, 2
ARGS = ["--env", "alfworld", "--estimator", "rloo+istar", "--kl-coef", "0.05", "--seed", "3",
        "--iterations", str(ITERATIONS), "--tasks-per-iteration", "2", "--group-size", "2",
        "--max-steps", "3", "--d-model", "32", "--num-layers", "1", "--minibatch-rows", "16",
        "--epochs", "2", "--max-prompt-tokens", "96", "--max-action-tokens", "6",
        "--checkpoint-every", "1"]
# Wall-clock measurements differ between runs; everything else must not.
TIMING = ("time/", "per_second")


def command(logdir, *extra):
    return [sys.executable, "-m", "stepcredit.cli", "train", *ARGS, "--logdir", str(logdir), *extra]


def environment():
    return {**os.environ,
            "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir or "",
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def final_state(logdir):
    with open(os.path.join(logdir, "config.json"), encoding="utf-8") as f:
        trainer = Trainer(TrainConfig.from_json(f.read()), log=lambda _: None)
    assert trainer.restore() == ITERATIONS
    state = trainer.state.as_tree()
    state["key"] = jax.random.key_data(state["key"])
    return state


def test_a_killed_and_resumed_run_matches_an_uninterrupted_one(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    env = environment()
    subprocess.run(command(whole), check=True, env=env, capture_output=True, timeout=300)

    proc = subprocess.Popen(command(broken), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    finished = broken / "checkpoints" / str(KILL_AFTER)  # orbax renames it into place when complete
    deadline = time.monotonic() + 300
    while not finished.is_dir():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before checkpoint {KILL_AFTER}"
        assert time.monotonic() < deadline, "no checkpoint after 300 s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # killed mid-run, not finished
    logged = [row["iteration"] for row in read_metrics(str(broken))]
    assert logged[:KILL_AFTER] == list(range(KILL_AFTER)) and len(logged) < ITERATIONS

    subprocess.run(command(broken, "--resume"), check=True, env=env, capture_output=True,
                   timeout=300)

    expected, resumed = final_state(whole), final_state(broken)
    assert set(expected) == set(resumed) >= {"policy", "opt", "prm", "prm_opt", "reference", "key"}
    paths = jax.tree_util.tree_leaves_with_path(expected)
    for (path, a), b in zip(paths, jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a),
                                      err_msg=jax.tree_util.keystr(path))

    rows_whole, rows_broken = read_metrics(str(whole)), read_metrics(str(broken))
    assert [r["iteration"] for r in rows_broken] == list(range(ITERATIONS))  # no duplicates
    for a, b in zip(rows_whole, rows_broken):
        assert set(a) == set(b)
        for name in a:
            if not any(t in name for t in TIMING):
                assert math.isclose(a[name], b[name], rel_tol=1e-6, abs_tol=1e-7), \
                    (a["iteration"], name, a[name], b[name])
