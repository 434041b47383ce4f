"""The training loop: collect, learn, evaluate, log, checkpoint.

One iteration: sample tasks and play G episodes per task with the current
policy (`collection.Collector`), then assign credit with the estimator's
registry binding and run `epochs` passes of minibatch updates
(`learn.Learner`). The parts of a run (environment, tokenizer, model,
optimizers, the resolved configuration) come from `build.build`; the state
is a `TrainState`. Metrics go to tensorboardX and JSONL; orbax checkpoints
hold the whole state, so a killed run resumes where its last checkpoint left
it, bit for bit: tasks, sampling keys and minibatch orders are functions of
(seed, iteration) and of the checkpointed key.

The update is data-parallel over the local devices (`devices.DataParallel`).
With `async_mode`, a background worker plays the episodes while the learner
updates (`asynchronous.RolloutWorker`, AReaL); synchronous mode is the default.

Several processes (after `devices.initialize_processes`) train one policy: each
plays its own tasks with its own keys and computes its own credit, the update
runs over a mesh of every process's devices (the global minibatch stacks each
process's rows), and process 0 alone evaluates, logs and checkpoints (and, on
resume, reads the checkpoint and sends it to the others).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Callable

import jax
import jax.numpy as jnp

from stepcredit.train import asynchronous, information_gain, mappings
from stepcredit.train.build import build, make_env
from stepcredit.train.checkpoint import Checkpointer
from stepcredit.train.collection import Collector
from stepcredit.train.config import RESUMABLE_CHANGES, TrainConfig
from stepcredit.train.curriculum import horizon_stage, step_limit
from stepcredit.train.devices import (DataParallel, agreed_by_process_0,
                                      check_same_on_every_process, from_process_0)
from stepcredit.train.evaluate import evaluate
from stepcredit.train.learn import Learner
from stepcredit.train.metrics import MetricsLogger
from stepcredit.train.state import TrainState
from stepcredit.train.warm_start import supervised_warm_start


# What a run writes into its log directory.
RUN_FILES = ("config.json", "metrics.jsonl", "tokenizer.json", "checkpoints", "tensorboard")


class _NoMetrics:
    """The metrics logger of a process other than process 0: it writes nothing."""

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        del iteration, metrics


def write_whole(path: str, text: str) -> None:
    """Writes `text` to a temporary file beside `path`, then renames it over `path`."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(temporary, path)


def _holds(path: str) -> bool:
    """A file, or a folder with something in it (the checkpointer creates its folder empty)."""
    return os.path.isfile(path) or (os.path.isdir(path) and bool(os.listdir(path)))


def _data_parallel(config: TrainConfig, multiprocess: bool) -> DataParallel:
    if multiprocess and (config.num_devices or config.async_mode):
        raise ValueError("TrainConfig: with several processes the update uses every "
                         "process's devices and runs synchronously; leave num_devices=0 "
                         "and async_mode=False")
    devices = jax.devices() if multiprocess else jax.local_devices()
    if config.num_devices > len(devices):
        raise ValueError(f"TrainConfig: num_devices={config.num_devices} but only "
                         f"{len(devices)} local devices exist")
    data_parallel = DataParallel(devices[:config.num_devices or len(devices)])
    data_parallel.check_minibatch(config.minibatch_rows)
    return data_parallel


class Trainer:
    """Runs iterations of a run; see the module docstring.

    Args:
      config: a `TrainConfig`; `trainer.config` is its resolved form (what runs).
      log: where progress lines go (print by default).

    Attributes:
      parts: the run's parts (`build.Parts`): tokenizer, graphdef, optimizers.
      state: the `TrainState`.
      collector, learner: the rollout side and the learning side.
    """

    def __init__(self, config: TrainConfig, *, log: Callable[[str], None] = print):
        self.process_index = jax.process_index()
        self.multiprocess = jax.process_count() > 1
        self.primary = self.process_index == 0  # evaluates, logs and checkpoints
        self.log = log if self.primary else (lambda _: None)
        data_parallel = _data_parallel(config, self.multiprocess)
        self.parts, self.state = build(config)
        self.config = self.parts.config
        self.collector = Collector(self.parts, process_index=self.process_index
                                   if self.multiprocess else None)
        self.learner = Learner(self.parts, data_parallel, multiprocess=self.multiprocess)
        if self.parts.estimator.needs_information_gain and self.learner.answer_prefix is None:
            self.log(information_gain.no_answer_warning(self.config.env, self.config.estimator))
        # Orbax refuses a manager in a process that takes no part in saving.
        self.checkpointer = (Checkpointer(os.path.join(self.config.logdir, "checkpoints"),
                                          primary_only=self.multiprocess)
                             if self.primary else None)

    @property
    def graphdef(self):
        return self.parts.graphdef

    @property
    def tokenizer(self):
        return self.parts.tokenizer

    def step_limit(self, iteration: int) -> int:
        return step_limit(iteration, self.config.horizon_schedule,
                          switch_every=self.config.horizon_switch_every,
                          default=self.parts.default_max_steps)

    # -------------------------------------------------------------------- loop
    def iteration(self, iteration: int) -> dict[str, float]:
        """Collects one batch and learns from it; returns the iteration's metrics."""
        tick = time.perf_counter()
        mappings.release_compiled_programs()
        limit = self.step_limit(iteration)
        key, rollout_key = jax.random.split(self.state.key)
        self.state = self.state.replace(key=key)
        if self.multiprocess:
            rollout_key = jax.random.fold_in(rollout_key, self.process_index)
        rollout, sampling = self.collector.batch(self.state.policy, iteration, rollout_key, limit)
        self.state, learned = self.learner.learn(self.state, rollout.trajectories, limit)
        return self._advance(iteration, limit, {**rollout.metrics, **sampling, **learned}, tick)

    def start_worker(self, iteration: int) -> asynchronous.RolloutWorker:
        """Async mode: a worker playing batches with the latest published policy.

        The policy version is the learner's iteration count; batch i plays
        `tasks(i)` with the key `fold_in(worker_key, i)` at the step limit of
        the version that plays it.
        """
        key, worker_key = jax.random.split(self.state.key)
        self.state = self.state.replace(key=key)

        def produce(policy, version: int, index: int):
            limit = self.step_limit(version)
            rollout, sampling = self.collector.batch(policy, index,
                                                     jax.random.fold_in(worker_key, index), limit)
            return rollout, sampling, limit

        policy = jax.tree.map(jnp.copy, self.state.policy)
        return asynchronous.RolloutWorker(produce, policy, iteration, first_index=iteration)

    def async_iteration(self, iteration: int,
                        worker: asynchronous.RolloutWorker) -> dict[str, float]:
        """Learns from the next batch at most `max_staleness` versions old, then publishes."""
        tick = time.perf_counter()
        batch, dropped = asynchronous.take_fresh(worker, iteration, self.config.max_staleness)
        rollout, sampling, limit = batch.payload
        metrics = {**rollout.metrics, **sampling,
                   "async/staleness": float(iteration - batch.version),
                   "async/dropped_batches": float(dropped),
                   "async/batch_version": float(batch.version),
                   "time/wait_for_rollout": time.perf_counter() - tick}
        self.state, learned = self.learner.learn(self.state, rollout.trajectories, limit)
        asynchronous.publish_copy(worker, self.state.policy, iteration + 1)
        return self._advance(iteration, limit, {**metrics, **learned}, tick)

    def _advance(self, iteration: int, limit: int, metrics: dict[str, float],
                 tick: float) -> dict[str, float]:
        stage = horizon_stage(iteration, switch_every=self.config.horizon_switch_every,
                              num_stages=max(len(self.config.horizon_schedule), 1))
        self.state = self.state.replace(iteration=jnp.int32(iteration + 1),
                                        stage=jnp.int32(stage))
        metrics["curriculum/step_limit"] = float(limit)
        metrics["time/iteration"] = time.perf_counter() - tick
        metrics["time/credit_fraction"] = metrics["time/credit"] / metrics["time/iteration"]
        return metrics

    # ------------------------------------------------------------ checkpoints
    def restore(self) -> int:
        """Restores the newest intact checkpoint, if any; returns the next iteration to run.

        A damaged checkpoint is reported in one line and moved aside, and the one
        before it is used (`Checkpointer.restore_intact`). With several
        processes, process 0 reads it and sends it to the others.
        """
        tree = self.state.as_tree()
        if self.primary and self.checkpointer.latest_step() is not None:
            _, tree = self.checkpointer.restore_intact(tree, note=self.log)
        if self.multiprocess:
            tree = from_process_0(tree)
        self.state = TrainState.from_tree(tree)
        return int(self.state.iteration)

    def save(self) -> None:
        """Checkpoints the state and writes the resolved configuration and the tokenizer,
        each whole or not at all (a kill mid-write leaves the previous file: `--resume`
        reads config.json)."""
        self.checkpointer.save(int(self.state.iteration), self.state.as_tree())
        write_whole(os.path.join(self.config.logdir, "config.json"), self.config.to_json())
        write_whole(os.path.join(self.config.logdir, "tokenizer.json"), self.tokenizer.to_json())

    def evaluate(self) -> dict[str, float]:
        """The policy on the fixed panel of test tasks (`evaluate.evaluate`)."""
        return evaluate(self.graphdef, self.state.policy, self.tokenizer, self.config,
                        num_tasks=self.config.eval_tasks,
                        temperature=self.config.eval_temperature)

    # ---------------------------------------------------------------------- run
    def run(self, *, resume: bool = False, overwrite: bool = False) -> list[dict[str, float]]:
        """Trains for `config.iterations`, logging, evaluating and checkpointing as configured.

        Args:
          resume: continue the run in `config.logdir` from its newest intact
            checkpoint; its saved configuration must match this one except
            for `RESUMABLE_CHANGES` (the differing fields are named). Where the
            directory holds no intact checkpoint, the run starts at iteration
            0 and says so in one line.
          overwrite: replace a run already in `config.logdir` (its metrics,
            configuration, TensorBoard events and checkpoints). Without
            `resume` or `overwrite`, a directory holding a run is refused.

        Raises:
          ValueError: a run is in the way, the resumed run's configuration differs, or
            both `resume` and `overwrite` are asked for.
        """
        if resume and overwrite:
            raise ValueError("--resume and --overwrite: continue the run or replace it, not both")
        config = self.config
        started = time.perf_counter()
        if self.primary:
            self._check_logdir(resume=resume, overwrite=overwrite)
        os.makedirs(config.logdir, exist_ok=True)
        start = self.restore() if resume else 0
        if resume and start == 0:
            # A run killed before its first checkpoint, or a mistyped --logdir: either way it
            # starts over, and the metrics of iterations it will redo go.
            self.log(f"--resume: {config.logdir} holds no intact checkpoint; the run starts "
                     "at iteration 0")
        logs = (MetricsLogger(config.logdir, resume_from=start or None, note=self.log)
                if self.primary else contextlib.nullcontext(_NoMetrics()))
        with logs as logger:
            if start == 0 and (config.warm_start_steps or config.eval_every):
                logger.log(-1, self._initial_policy())
            worker = self.start_worker(start) if config.async_mode else None
            try:
                history = self._loop(start, started, logger, worker)
            finally:
                if worker is not None:
                    worker.close()
        return history

    def _check_logdir(self, *, resume: bool, overwrite: bool) -> None:
        logdir = self.config.logdir
        held = [name for name in RUN_FILES if _holds(os.path.join(logdir, name))]
        if resume:
            saved_path = os.path.join(logdir, "config.json")
            if os.path.exists(saved_path):
                with open(saved_path, encoding="utf-8") as f:
                    saved = TrainConfig.from_json(f.read())
                changed = saved.differences(self.config, ignore=RESUMABLE_CHANGES)
                if changed:
                    raise ValueError(f"--resume: the run in {logdir} was configured otherwise "
                                     f"(saved -> now): {'; '.join(changed)}; pass the original "
                                     "settings (they are in its config.json)")
        elif held and not overwrite:
            raise ValueError(f"--logdir {logdir} already holds a run ({', '.join(held)}); pass "
                             "--resume to continue it or --overwrite to replace it")
        elif held:
            for name in held:
                path = os.path.join(logdir, name)
                if name == "checkpoints":
                    self.checkpointer.clear()
                else:
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)

    def _initial_policy(self) -> dict[str, float]:
        """Iteration -1: the policy RL starts from, after any warm start (the baseline)."""
        initial: dict[str, float] = {}
        if self.config.warm_start_steps:
            self.state, initial = supervised_warm_start(
                self.state, self.parts, lambda: make_env(self.config, "train"))
            self.log(f"warm start: loss {initial['warm_start/loss_first']:.3f} -> "
                     f"{initial['warm_start/loss_last']:.3f} in "
                     f"{initial['time/warm_start']:.1f}s")
        if self.config.eval_every and self.primary:
            result = self.evaluate()
            initial.update({f"eval/{k}": v for k, v in result.items()})
            self.log(f"initial policy: eval success {result['success']:.2f}")
        return initial

    def _loop(self, start: int, started: float, logger: MetricsLogger,
              worker: asynchronous.RolloutWorker | None) -> list[dict[str, float]]:
        """Iterations `start..iterations-1`: learn, evaluate, log, checkpoint, report progress."""
        config, history = self.config, []
        began = time.perf_counter()
        for iteration in range(start, config.iterations):
            metrics = (self.iteration(iteration) if worker is None
                       else self.async_iteration(iteration, worker))
            elapsed = time.perf_counter() - started
            out_of_time = (config.time_limit_minutes is not None
                           and elapsed >= 60 * config.time_limit_minutes)
            if self.multiprocess:
                out_of_time = agreed_by_process_0(out_of_time)
            last = out_of_time or iteration + 1 == config.iterations
            metrics["time/elapsed"] = elapsed
            if self.primary and config.eval_every and ((iteration + 1) % config.eval_every == 0
                                                       or last):
                metrics.update({f"eval/{k}": v for k, v in self.evaluate().items()})
            logger.log(iteration, metrics)
            history.append(metrics)
            if self.primary and ((iteration + 1) % config.checkpoint_every == 0 or last):
                self.save()
            self._report(iteration, metrics, began, start, elapsed)
            if out_of_time:
                self.log(f"stopping: the time limit of {config.time_limit_minutes} min is reached")
                break
        if self.multiprocess:
            check_same_on_every_process({k: v for k, v in self.state.as_tree().items()
                                         if k in ("policy", "prm", "progress")}, "the parameters")
        return history

    def _report(self, iteration: int, metrics: dict[str, float], began: float, start: int,
                elapsed: float) -> None:
        config = self.config
        done = iteration + 1 - start
        left = (time.perf_counter() - began) / done * (config.iterations - iteration - 1)
        if config.time_limit_minutes is not None:
            left = min(left, max(0.0, 60 * config.time_limit_minutes - elapsed))
        bar = "#" * int(20 * (iteration + 1) / config.iterations)
        self.log(f"[{bar:<20}] {iteration + 1}/{config.iterations} "
                 f"success {metrics['rollout/success']:.2f}"
                 + (f" eval {metrics['eval/success']:.2f}" if "eval/success" in metrics else "")
                 + f" | {metrics['time/iteration']:.1f}s/it, {left / 60:.1f} min left")
