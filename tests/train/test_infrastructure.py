"""Curriculum, metrics logging and checkpoints of the trainer."""

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stepcredit.train.checkpoint import Checkpointer
from stepcredit.train.curriculum import horizon_stage, learning_rate_at, step_limit
from stepcredit.train.metrics import MetricsLogger, read_metrics


@pytest.mark.parametrize("iteration", [0, 1, 37, 50, 99, 100, 150])
def test_learning_rate_schedules_match_optax(iteration):
    # 101 iterations decay over 100 optimizer-schedule steps: the last one is at the final rate.
    at = functools.partial(learning_rate_at, iteration, base=1e-3, iterations=101,
                           final_fraction=0.1)
    assert at(schedule="constant") == 1e-3
    np.testing.assert_allclose(at(schedule="cosine"),
                               optax.cosine_decay_schedule(1e-3, 100, alpha=0.1)(iteration),
                               rtol=1e-6)
    np.testing.assert_allclose(at(schedule="linear"),
                               optax.linear_schedule(1e-3, 1e-4, 100)(iteration), rtol=1e-6)
    with pytest.raises(ValueError, match="schedule='step'"):
        at(schedule="step")


@pytest.mark.parametrize("iteration", [0, 3, 10, 11, 50, 100, 150])
def test_learning_rate_warmup_matches_optax(iteration):
    at = functools.partial(learning_rate_at, iteration, base=1e-3, iterations=101,
                           final_fraction=0.1, warmup=10)
    np.testing.assert_allclose(at(schedule="constant"),
                               optax.warmup_constant_schedule(0.0, 1e-3, 10)(iteration),
                               rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(
        at(schedule="cosine"),
        optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100, end_value=1e-4)(iteration),
        rtol=1e-6, atol=1e-12)
    linear = optax.join_schedules([optax.linear_schedule(0.0, 1e-3, 10),
                                   optax.linear_schedule(1e-3, 1e-4, 90)], [10])
    np.testing.assert_allclose(at(schedule="linear"), linear(iteration), rtol=1e-6, atol=1e-12)
    with pytest.raises(ValueError, match="warmup=-1"):
        learning_rate_at(0, base=1e-3, schedule="constant", iterations=10, final_fraction=0.1,
                         warmup=-1)


def test_horizon_curriculum_follows_the_released_schedule():
    schedule = (10, 20, 30)
    limits = [step_limit(i, schedule, switch_every=100, default=50) for i in (0, 99, 100, 250, 10_000)]
    assert limits == [10, 10, 20, 30, 30]
    assert step_limit(5, (), switch_every=100, default=50) == 50
    assert horizon_stage(250, switch_every=100, num_stages=3) == 2
    with pytest.raises(ValueError, match="switch_every=0"):
        horizon_stage(1, switch_every=0, num_stages=3)
    with pytest.raises(ValueError, match="every limit must be >= 1"):
        step_limit(1, (5, 0), switch_every=10, default=5)


def test_metrics_go_to_jsonl_and_tensorboard_and_resume_drops_later_rows(tmp_path):
    logdir = str(tmp_path / "run")
    with MetricsLogger(logdir) as logger:
        for i in range(4):
            logger.log(i, {"success": i / 4, "loss": float("nan") if i == 2 else 1.0})
    rows = read_metrics(logdir)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    assert rows[2]["loss"] is None and rows[3]["success"] == 0.75
    events = [f for _, _, files in os.walk(logdir) for f in files if "tfevents" in f]
    assert events

    from tensorboardX.proto import event_pb2
    path = next(os.path.join(d, f) for d, _, fs in os.walk(logdir) for f in fs if "tfevents" in f)
    tags = set()
    with open(path, "rb") as f:
        data = f.read()
    offset = 0
    while offset < len(data):  # TFRecord framing: length, crc, payload, crc
        length = int.from_bytes(data[offset:offset + 8], "little")
        event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
        tags |= {v.tag for v in event.summary.value}
        offset += 16 + length
    assert {"success", "loss"} <= tags

    with MetricsLogger(logdir, resume_from=2) as logger:
        logger.log(2, {"success": 0.9})
    assert [r["iteration"] for r in read_metrics(logdir)] == [0, 1, 2]
    assert read_metrics(logdir)[2]["success"] == 0.9


def test_checkpoint_round_trip_is_bit_exact(tmp_path):
    state = {"params": {"w": jnp.arange(6.0).reshape(2, 3)}, "key": jax.random.key(3),
             "iteration": jnp.int32(7), "stage": jnp.int32(1)}
    checkpointer = Checkpointer(str(tmp_path / "ckpt"))
    checkpointer.save(7, state)
    restored = checkpointer.restore(state)
    np.testing.assert_array_equal(restored["params"]["w"], state["params"]["w"])
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(state["key"]))
    assert int(restored["iteration"]) == 7 and checkpointer.latest_step() == 7
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Checkpointer(str(tmp_path / "empty")).restore(state)


def test_a_checkpoint_killed_mid_write_never_replaces_the_last_good_one(tmp_path):
    directory = str(tmp_path / "ckpt")
    script = textwrap.dedent(f"""
        import jax.numpy as jnp, numpy as np
        from stepcredit.train.checkpoint import Checkpointer
        c = Checkpointer({directory!r})
        c.save(1, {{"w": jnp.ones((4,))}})
        big = jnp.asarray(np.random.default_rng(0).random((32, 1024, 1024), dtype="float32"))
        print("saved", flush=True)
        c.save(2, {{"w": big}})  # 128 MB of incompressible data: slow enough to be killed
        print("finished", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.stdout.readline().strip() == "saved"
    deadline = time.monotonic() + 30
    while not any(".orbax-checkpoint-tmp" in name and name.startswith("2")
                  for name in os.listdir(directory)):
        assert time.monotonic() < deadline and proc.poll() is None, "the second save never started"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    checkpointer = Checkpointer(directory)
    assert checkpointer.latest_step() == 1
    np.testing.assert_array_equal(checkpointer.restore({"w": jnp.zeros(4)})["w"], np.ones(4))
