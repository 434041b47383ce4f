"""The data-parallel update on 4 fake CPU devices, in one process or over two, equals the
single-device update; two processes train one policy through `stepcredit train`."""

import dataclasses
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stepcredit.cli import main
from stepcredit.models.transformer import TransformerConfig, TransformerPolicy
from stepcredit.rollout import RolloutConfig
from stepcredit.train import update as learner
from stepcredit.train.config import TrainConfig
from stepcredit.train.devices import DataParallel, initialize_processes
from stepcredit.train.metrics import read_metrics
from stepcredit.train.trainer import Trainer

ROWS, LENGTH = 16, 24
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return str(s.getsockname()[1])


def minibatch(seed: int = 0) -> learner.Minibatch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 40, (ROWS, LENGTH)).astype(np.int32)
    lengths = rng.integers(LENGTH // 2, LENGTH + 1, ROWS)
    mask = np.arange(LENGTH)[None] < lengths[:, None]
    action = mask & (np.arange(LENGTH)[None] >= lengths[:, None] - 5)
    first = action & ~np.roll(action, 1, axis=1)
    logp = np.where(action, -rng.random((ROWS, LENGTH)) * 3, 0.0).astype(np.float32)
    return learner.Minibatch(
        tokens=jnp.asarray(tokens), mask=jnp.asarray(mask), action_mask=jnp.asarray(action),
        advantages=jnp.asarray(np.where(action, rng.normal(size=(ROWS, LENGTH)), 0.0), jnp.float32),
        old_logp=jnp.asarray(logp), behav_logp=jnp.asarray(logp - 0.05 * action),
        ref_logp=jnp.asarray(logp + 0.1 * action), old_values=jnp.zeros((ROWS, LENGTH)),
        returns=jnp.asarray(np.where(first, rng.normal(size=(ROWS, LENGTH)), 0.0), jnp.float32),
        value_mask=jnp.asarray(first))


def initial_params():
    return nnx.split(TransformerPolicy(
        TransformerConfig(vocab_size=48, d_model=32, num_layers=1, num_heads=4, mlp_dim=64),
        rngs=nnx.Rngs(0)))


def train_step(place_params, batch):
    """One `learner.train_step` from `initial_params()`, its inputs placed by `place_params`."""
    graphdef, params = initial_params()
    tx = learner.make_optimizer(learning_rate=1e-2, weight_decay=0.01, grad_clip=1.0)
    config = learner.LossConfig(value_coef=0.5, kl_coef=0.1, entropy_coef=0.01)
    state, opt = place_params((params, tx.init(params)))
    return learner.train_step(state, opt, batch, graphdef=graphdef, tx=tx, config=config)


def test_one_train_step_on_the_mesh_equals_the_single_device_step(mesh4):
    _, params = initial_params()
    batch = minibatch()
    single_params, _, single_metrics = train_step(lambda t: t, batch)
    dp = DataParallel(mesh4.devices.tolist())
    mesh_params, mesh_opt, mesh_metrics = train_step(dp.replicate, dp.shard(batch))

    kernel = next(x for x in jax.tree.leaves(mesh_params) if x.ndim == 2)
    assert kernel.sharding.is_fully_replicated and len(kernel.sharding.device_set) == 4
    # Adam's first step is about lr * sign(g): where |g| is near float noise the
    # summation order shows, so parameters agree to 1e-3 of the step (lr = 1e-2).
    for a, b in zip(jax.tree.leaves(single_params), jax.tree.leaves(mesh_params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
    assert set(mesh_metrics) == set(single_metrics)
    for name in single_metrics:
        np.testing.assert_allclose(float(mesh_metrics[name]), float(single_metrics[name]),
                                   rtol=1e-5, atol=1e-6, err_msg=name)
    moved = max(float(jnp.abs(a - b).max()) for a, b in
                zip(jax.tree.leaves(single_params), jax.tree.leaves(params)))
    assert moved > 1e-4  # the step did something
    back = dp.gather(mesh_opt)
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(back))


def test_minibatches_must_split_evenly_over_the_devices(mesh4):
    dp = DataParallel(mesh4.devices.tolist())
    dp.check_minibatch(16)
    with pytest.raises(ValueError, match="minibatch_rows=18 is not divisible by the 4 devices"):
        dp.check_minibatch(18)
    single = DataParallel(jax.devices()[:1])
    batch = minibatch()
    assert single.shard(batch) is batch and single.replicate(batch) is batch


def test_a_trainer_iteration_on_4_devices_matches_1_device(tmp_path):
    config = TrainConfig(env="alfworld", estimator="step_gae", iterations=1, tasks_per_iteration=2,
                         group_size=2, max_steps=3, d_model=32, num_layers=1, minibatch_rows=16,
                         epochs=1, rollout=RolloutConfig(max_prompt_tokens=96, max_action_tokens=6))
    results = []
    for devices in (1, 4):
        trainer = Trainer(dataclasses.replace(config, num_devices=devices,
                                              logdir=str(tmp_path / str(devices))),
                          log=lambda _: None)
        assert trainer.learner.data_parallel.num_devices == devices
        metrics = trainer.iteration(0)
        results.append((trainer.state.policy, metrics))
    (one, m1), (four, m4) = results
    # lr 3e-4: a few near-zero-gradient entries differ by ~2% of a step (see above).
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(four)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
    for name in ("loss/policy", "loss/value", "loss/total", "optim/grad_norm"):
        np.testing.assert_allclose(m4[name], m1[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_one_train_step_over_two_processes_equals_the_single_device_step(tmp_path):
    port = free_port()
    outs = [str(tmp_path / f"process{i}.npz") for i in range(2)]
    workers = [subprocess.Popen([sys.executable, "-m", "tests.train.multiprocess_worker", str(i),
                                 port, outs[i]], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for worker in workers:
        output, _ = worker.communicate(timeout=240)
        assert worker.returncode == 0, output[-3000:]
    single_params, _, single_metrics = train_step(lambda t: t, minibatch())
    expected = [np.asarray(x) for x in jax.tree.leaves(single_params)]
    for out in outs:
        with np.load(out) as saved:
            got = [saved[f"arr_{i}"] for i in range(len(expected))]
            metrics = {k.split(":", 1)[1]: float(saved[k]) for k in saved.files
                       if k.startswith("metric:")}
        for a, b in zip(expected, got):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
        assert set(metrics) == set(single_metrics)
        for name, value in single_metrics.items():
            np.testing.assert_allclose(metrics[name], float(value), rtol=1e-5, atol=1e-6,
                                       err_msg=name)


def train_in_two_processes(*args: str) -> list[str]:
    """`stepcredit train ARGS` in two processes joined on this machine; their outputs."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    common = [*args, "--num-processes", "2", "--coordinator", f"localhost:{free_port()}"]
    workers = [subprocess.Popen(
        [sys.executable, "-c", "import sys; from stepcredit.cli import main; "
         "sys.exit(main(sys.argv[1:]))", *common, "--process-id", str(i)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outputs = [worker.communicate(timeout=300)[0] for worker in workers]
    for worker, output in zip(workers, outputs):
        assert worker.returncode == 0, output[-3000:]
    return outputs


def test_two_processes_train_one_policy_and_resume_it(tmp_path):
    """`stepcredit train --num-processes 2`: each process plays its own tasks, the update
    spans both processes' devices, and a run ends only if both hold the same policy."""
    args = ["train", "--env", "alfworld", "--estimator", "grpo+istar", "--tasks-per-iteration",
            "2", "--group-size", "2", "--max-steps", "3", "--d-model", "32", "--num-layers", "1",
            "--minibatch-rows", "8", "--epochs", "1", "--max-prompt-tokens", "96",
            "--max-action-tokens", "6", "--logdir", str(tmp_path)]
    outputs = train_in_two_processes(*args, "--iterations", "1")
    assert "done: 1 iterations" in outputs[0] and "done:" not in outputs[1]
    # Process 0 reads the checkpoint and hands it to process 1.
    outputs = train_in_two_processes(*args, "--iterations", "2", "--resume")
    assert "[####################] 2/2" in outputs[0] and "1/2" not in outputs[0]
    rows = read_metrics(str(tmp_path))
    assert [r["iteration"] for r in rows] == [0, 1]  # written once, by process 0
    with open(tmp_path / "config.json", encoding="utf-8") as f:
        trainer = Trainer(TrainConfig.from_json(f.read()), log=lambda _: None)
    assert trainer.restore() == 2


def test_several_processes_need_a_coordinator(capsys):
    assert main(["train", "--num-processes", "2", "--process-id", "1"]) == 2
    assert "--num-processes > 1 needs --coordinator" in capsys.readouterr().err
    with pytest.raises(ValueError, match="process_id=2 must lie in"):
        initialize_processes("localhost:1", 2, 2)
