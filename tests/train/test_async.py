"""Asynchronous mode (AReaL): versioned batches, the staleness bound, decoupled PPO, shutdown."""

import threading
import time

import pytest

from stepcredit.cli import main
from stepcredit.rollout import RolloutConfig
from stepcredit.train.asynchronous import RolloutWorker, take_fresh
from stepcredit.train.config import TrainConfig
from stepcredit.train.metrics import read_metrics
from stepcredit.train.trainer import Trainer

TINY = ["--env", "alfworld", "--estimator", "grpo", "--tasks-per-iteration", "2",
        "--group-size", "2", "--max-steps", "3", "--d-model", "32", "--num-layers", "1",
        "--minibatch-rows", "16", "--epochs", "1", "--max-prompt-tokens", "96",
        "--max-action-tokens", "6", "--checkpoint-every", "10", "--async"]


def worker_threads():
    return [t for t in threading.enumerate() if t.name == "stepcredit-rollout-worker"]


def train_async(logdir, iterations: int, max_staleness: int) -> list[dict]:
    assert main(["train", *TINY, "--iterations", str(iterations), "--max-staleness",
                 str(max_staleness), "--logdir", str(logdir)]) == 0
    assert not worker_threads(), "the rollout worker outlived the run"
    return read_metrics(str(logdir))


def test_an_async_run_uses_batches_within_the_staleness_bound(tmp_path):
    rows = train_async(tmp_path, iterations=4, max_staleness=1)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        assert 0 <= row["async/staleness"] <= 1
        assert row["async/batch_version"] == row["iteration"] - row["async/staleness"]
        assert row["async/dropped_batches"] >= 0
        assert "policy/behav_weight_mean" in row  # the decoupled PPO loss ran


def test_with_eta_zero_only_fresh_batches_are_used(tmp_path):
    rows = train_async(tmp_path, iterations=3, max_staleness=0)
    assert all(r["async/staleness"] == 0 for r in rows)
    # The worker starts its next batch as soon as one is taken, before the update
    # publishes the new policy: that batch is one version stale and is dropped.
    assert sum(r["async/dropped_batches"] for r in rows) >= 2
    # Fresh batches were played by the policy being updated: behaviour = proximal.
    assert all(r["policy/behav_approx_kl"] < 1e-4 for r in rows)


def test_async_mode_turns_on_the_decoupled_loss():
    trainer = Trainer(TrainConfig(env="alfworld", async_mode=True, d_model=32, num_layers=1,
                                  minibatch_rows=16,
                                  rollout=RolloutConfig(max_prompt_tokens=96, max_action_tokens=6)),
                      log=lambda _: None)
    assert trainer.config.loss.decoupled
    assert not Trainer(TrainConfig(env="alfworld", d_model=32, num_layers=1, minibatch_rows=16),
                       log=lambda _: None).config.loss.decoupled


def test_batches_carry_the_version_that_played_them_and_stale_ones_are_dropped():
    def produce(params, version, index):
        time.sleep(0.01)
        return params, version, index

    with RolloutWorker(produce, "v0", 0) as worker:
        first = worker.get()
        assert (first.version, first.index, first.payload) == (0, 0, ("v0", 0, 0))
        worker.publish("v5", 5)
        batch, dropped = take_fresh(worker, version=5, max_staleness=0)
        assert batch.payload[:2] == ("v5", 5) and batch.version == 5
        assert dropped == batch.index - 1 >= 0  # every batch between was version 0
        batch, dropped = take_fresh(worker, version=6, max_staleness=1)
        assert batch.version == 5 and dropped == 0
    assert not worker.alive


def test_a_failing_worker_raises_in_the_learner_and_stops():
    def produce(params, version, index):
        if index == 1:
            raise OSError("environment server went away")
        return index

    worker = RolloutWorker(produce, None, 0)
    assert worker.get().payload == 0
    with pytest.raises(RuntimeError, match="rollout worker failed") as info:
        worker.get()
    assert isinstance(info.value.__cause__, OSError)
    worker.close(timeout=5)
    assert not worker.alive


def test_the_worker_is_shut_down_when_the_learner_fails(tmp_path, monkeypatch):
    config = TrainConfig(env="alfworld", iterations=2, tasks_per_iteration=2, group_size=2,
                         max_steps=3, d_model=32, num_layers=1, minibatch_rows=16, epochs=1,
                         rollout=RolloutConfig(max_prompt_tokens=96, max_action_tokens=6),
                         async_mode=True, logdir=str(tmp_path))
    trainer = Trainer(config, log=lambda _: None)

    def broken_learn(*args, **kwargs):
        raise FloatingPointError("learner failed")

    monkeypatch.setattr(trainer.learner, "learn", broken_learn)
    started = time.monotonic()
    with pytest.raises(FloatingPointError, match="learner failed"):
        trainer.run()
    assert not worker_threads()
    assert time.monotonic() - started < 120
