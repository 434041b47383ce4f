"""The training loop: rollouts, credit by any registered estimator, PPO-style updates.

One iteration: sample tasks, play G episodes per task with the current policy
(`stepcredit.rollout.collect`), update iStar's PRM when the estimator needs
one, assign credit with `stepcredit.credit.compiled_compute_advantages`, then run
`epochs` passes of minibatch updates over the step rows. Metrics go to
tensorboardX and JSONL; orbax checkpoints hold the whole state (policy,
optimizer, critic, PRM, reference, PRNG key, iteration, curriculum stage), so
a killed run resumes where its last checkpoint left it, bit for bit: tasks,
sampling keys and minibatch orders are functions of (seed, iteration) and of
the checkpointed key.

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
import dataclasses
import importlib
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from stepcredit import advantages as adv
from stepcredit.batch import Trajectory, collate
from stepcredit.credit import compiled_compute_advantages
from stepcredit.envs import registry as env_registry
from stepcredit.envs.pool import EnvPool
from stepcredit.models.tokenizer import WordTokenizer
from stepcredit.models.transformer import TransformerConfig, TransformerPolicy, score_actions
from stepcredit.rollout import Rollout, choice_markers, collect
from stepcredit.train import asynchronous
from stepcredit.train import update as learner
from stepcredit.train.checkpoint import Checkpointer
from stepcredit.train.config import TrainConfig
from stepcredit.train.curriculum import horizon_stage, learning_rate_at, step_limit
from stepcredit.train.devices import (DataParallel, agreed_by_process_0,
                                      check_same_on_every_process, from_process_0,
                                      max_over_processes, mean_over_processes)
from stepcredit.train.metrics import MetricsLogger
from stepcredit.train.rows import (RowIndex, StepRowBatch, build_rows, length_groups,
                                   rows_from_tokens, tokens_from_rows)


class _NoMetrics:
    """The metrics logger of a process other than process 0: it writes nothing."""

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        del iteration, metrics


def build_tokenizer(env: str) -> WordTokenizer:
    """A word tokenizer covering every text of the environment `env` (its `vocabulary()`)."""
    module = importlib.import_module(f"stepcredit.envs.{env}")
    return WordTokenizer.from_vocabularies(module.vocabulary())


def model_config(config: TrainConfig, vocab_size: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab_size, d_model=config.d_model,
                             num_layers=config.num_layers, num_heads=config.num_heads,
                             mlp_dim=config.mlp_dim or 4 * config.d_model)


def make_env(config: TrainConfig, split: str, max_steps: int | None = None):
    """An environment of `config.env` on `split`, with the run's step limit unless given."""
    kwargs: dict[str, Any] = {"split": split, "difficulty": config.difficulty, "seed": config.seed}
    max_steps = config.max_steps if max_steps is None else max_steps
    if max_steps is not None:
        kwargs["max_steps"] = max_steps
    return env_registry.make(config.env, **kwargs)


def with_fitted_prompt_budget(config: TrainConfig) -> TrainConfig:
    """`config` with a prompt budget fitted to the environment's expert prompts
    (`warm_start.fit_prompt_budget`), so no admissible list or history is dropped."""
    from stepcredit.train.warm_start import fit_prompt_budget

    budget = fit_prompt_budget(lambda: make_env(config, "train"), build_tokenizer(config.env),
                               config.rollout, seed=config.seed)
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout,
                                                                   max_prompt_tokens=budget))


def _dynamic_sampling(config: TrainConfig) -> bool:
    if config.dynamic_sampling is None:
        return config.estimator.startswith("dapo")
    return config.dynamic_sampling


def _loss_config(config: TrainConfig, estimator: adv.Estimator,
                 tokenizer: WordTokenizer) -> learner.LossConfig:
    """The learner's losses, with the critic on only for critic-based estimators and the
    rollout's action constraint, so that scoring sees the distribution that sampled."""
    loss = config.loss
    return dataclasses.replace(loss, value_coef=(loss.value_coef or 0.5) if estimator.needs_critic
                               else 0.0,
                               temperature=config.rollout.temperature if
                               config.rollout.temperature > 0 else 1.0,
                               decoupled=loss.decoupled or config.async_mode,
                               choice_markers=choice_markers(tokenizer, config.rollout),
                               action_width=config.rollout.action_length)


class Trainer:
    """Owns the model state and runs iterations; see the module docstring.

    Args:
      config: a `TrainConfig`.
      log: where progress lines go (print by default).
    """

    def __init__(self, config: TrainConfig, *, log: Callable[[str], None] = print):
        self.config = config
        self.process_index = jax.process_index()
        self.multiprocess = jax.process_count() > 1
        self.primary = self.process_index == 0  # evaluates, logs and checkpoints
        self.log = log if self.primary else (lambda _: None)
        self.estimator = adv.get(config.estimator)
        if self.multiprocess and (config.num_devices or config.async_mode):
            raise ValueError("TrainConfig: with several processes the update uses every "
                             "process's devices and runs synchronously; leave num_devices=0 "
                             "and async_mode=False")
        devices = jax.devices() if self.multiprocess else jax.local_devices()
        if config.num_devices > len(devices):
            raise ValueError(f"TrainConfig: num_devices={config.num_devices} but only "
                             f"{len(devices)} local devices exist")
        self.data_parallel = DataParallel(devices[:config.num_devices or len(devices)])
        self.data_parallel.check_minibatch(config.minibatch_rows)
        if config.critic_warmup_iterations and not self.estimator.needs_critic:
            raise ValueError(f"TrainConfig: critic_warmup_iterations="
                             f"{config.critic_warmup_iterations} needs an estimator with a critic; "
                             f"{config.estimator!r} has none")
        self.estimator_config = dict(config.estimator_config)
        self.tokenizer = build_tokenizer(config.env)
        self.model_config = model_config(config, self.tokenizer.vocab_size)
        model = TransformerPolicy(self.model_config, rngs=nnx.Rngs(config.seed))
        self.graphdef, policy = nnx.split(model)
        self.tx = learner.make_optimizer(learning_rate=config.learning_rate,
                                         weight_decay=config.weight_decay,
                                         grad_clip=config.grad_clip)
        self.loss_config = _loss_config(config, self.estimator, self.tokenizer)
        self.row_length = config.rollout.max_prompt_tokens + config.rollout.action_length
        default_env = make_env(config, "train")
        self.default_max_steps = config.max_steps or default_env.max_steps
        self.num_train_tasks = default_env.num_tasks
        default_env.close()
        state: dict[str, Any] = {"policy": policy, "opt": self.tx.init(policy),
                                 "key": jax.random.key(config.seed),
                                 "iteration": jnp.int32(0), "stage": jnp.int32(0)}
        if self.estimator.needs_prm:
            self.prm_tx = learner.make_optimizer(learning_rate=config.prm_learning_rate,
                                                 weight_decay=0.0, grad_clip=10.0)
            state["prm"] = jax.tree.map(jnp.copy, policy)  # iStar: the PRM starts as the policy
            state["prm_opt"] = self.prm_tx.init(state["prm"])
        if self.loss_config.kl_coef:
            state["reference"] = jax.tree.map(jnp.copy, policy)
        self.state = state
        # Orbax refuses a manager in a process that takes no part in saving.
        self.checkpointer = (Checkpointer(os.path.join(config.logdir, "checkpoints"),
                                          primary_only=self.multiprocess)
                             if self.primary else None)

    # ----------------------------------------------------------------- rollouts
    def step_limit(self, iteration: int) -> int:
        return step_limit(iteration, self.config.horizon_schedule,
                          switch_every=self.config.horizon_switch_every,
                          default=self.default_max_steps)

    def tasks(self, iteration: int, round_: int = 0) -> list[int]:
        """The training tasks of an iteration: a fixed function of (seed, iteration, round)."""
        rng = np.random.default_rng([self.config.seed, iteration, round_]
                                    + ([self.process_index] if self.multiprocess else []))
        return rng.choice(self.num_train_tasks, self.config.tasks_per_iteration,
                          replace=False).tolist()

    def rollout(self, policy, tasks: list[int], key: jax.Array, limit: int) -> Rollout:
        config = self.config
        envs = [make_env(config, "train", limit) for _ in range(len(tasks) * config.group_size)]
        with EnvPool(envs) as pool:
            return collect(self.graphdef, policy, pool, tasks, config.group_size, self.tokenizer,
                           key, config.rollout)

    def _filled_rollout(self, policy, iteration: int, key: jax.Array,
                        limit: int) -> tuple[Rollout, dict]:
        """One batch; with dynamic sampling, all-equal groups are replaced by fresh tasks."""
        rollout = self.rollout(policy, self.tasks(iteration), key, limit)
        if not _dynamic_sampling(self.config):
            return rollout, {}
        g = self.config.group_size
        kept, dropped, round_ = [], 0, 0
        candidates = rollout
        while True:
            groups = [candidates.trajectories[i:i + g]
                      for i in range(0, len(candidates.trajectories), g)]
            for group in groups:
                scores = {t.score for t in group}
                if len(scores) == 1:
                    dropped += 1
                elif len(kept) < self.config.tasks_per_iteration:
                    kept.append(group)
            round_ += 1
            if len(kept) >= self.config.tasks_per_iteration or round_ > 3:
                break
            key, sub = jax.random.split(key)
            candidates = self.rollout(policy, self.tasks(iteration, round_), sub, limit)
        if not kept:  # every group was uniform: learn nothing rather than something wrong
            kept = [rollout.trajectories[i:i + g] for i in range(0, len(rollout.trajectories), g)]
        trajectories = [dataclasses.replace(t, group_id=k) for k, group in enumerate(kept)
                        for t in group]
        return Rollout(trajectories, rollout.metrics), {"dapo/groups_dropped": float(dropped),
                                                        "dapo/sampling_rounds": float(round_)}

    # ----------------------------------------------------------------- learning
    def _score(self, params, rows: StepRowBatch):
        """Scores all rows in minibatch-sized chunks of similar length (`length_groups`)."""
        full = rows.tokens.shape[1]
        parts, order = [], []
        for chunk, width in length_groups(rows.mask.sum(1), self.config.minibatch_rows,
                                          limit=full):
            scores = learner.score(params, rows.tokens[chunk, :width], rows.mask[chunk, :width],
                                   rows.action_mask[chunk, :width],
                                   jnp.float32(self.loss_config.temperature),
                                   graphdef=self.graphdef,
                                   choice_markers=self.loss_config.choice_markers,
                                   width=self.loss_config.action_width)
            parts.append(jax.tree.map(lambda x: jnp.pad(x, ((0, 0), (0, full - width))), scores))
            order.append(chunk)
        inverse = np.argsort(np.concatenate(order))
        return jax.tree.map(lambda *xs: jnp.concatenate(xs)[inverse], *parts)

    def _prm_update(self, rows: StepRowBatch, index: RowIndex, tokens, steps, shape):
        """iStar: one preference-loss step on the PRM; returns PRM log-probs in the token view."""
        config = self.config
        success = np.asarray(steps.score) > 0
        ref_logp = jnp.asarray(tokens.logp)
        num_groups = int(np.max(steps.group_id)) + 1

        def loss_fn(prm):
            scores = self._score_differentiable(prm, rows)
            prm_view = tokens_from_rows(scores, index, rows.action_mask, shape)
            return adv.trajectory_preference_loss(
                prm_view, ref_logp, tokens.action_mask, tokens.step_index, success,
                steps.group_id, beta=config.prm_beta, num_groups=num_groups)

        before = tokens_from_rows(self._score(self.state["prm"], rows).logprobs, index,
                                  rows.action_mask, shape)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(self.state["prm"])
        if self.multiprocess:
            grads = mean_over_processes(grads)
        updates, self.state["prm_opt"] = self.prm_tx.update(grads, self.state["prm_opt"],
                                                           self.state["prm"])
        self.state["prm"] = optax.apply_updates(self.state["prm"], updates)
        after = tokens_from_rows(self._score(self.state["prm"], rows).logprobs, index,
                                 rows.action_mask, shape)
        out = {"prm/loss": float(loss), **{f"prm/{k}": float(v) for k, v in metrics.items()}}
        return (before if config.prm_rewards_from == "pre_update_prm" else after), out

    def _score_differentiable(self, params, rows: StepRowBatch):
        return score_actions(self.graphdef, params, rows.tokens, rows.mask, rows.action_mask,
                             self.loss_config.temperature, width=self.loss_config.action_width,
                             choice_markers=self.loss_config.choice_markers).logprobs

    def learn(self, trajectories: list[Trajectory], limit: int) -> dict[str, float]:
        """Credit assignment and `epochs` passes of minibatch updates on one batch."""
        config = self.config
        num_tokens = limit * config.rollout.action_length
        steps, tokens, _ = collate(trajectories, max_steps=limit, max_tokens=num_tokens,
                                   with_observations=False)
        shape = tokens.tokens.shape
        rows, index = build_rows(trajectories, num_steps=limit, row_length=self.row_length,
                                 pad_id=self.tokenizer.special.pad,
                                 multiple=config.minibatch_rows)
        tick = time.perf_counter()
        old = jax.block_until_ready(self._score(self.state["policy"], rows))
        metrics: dict[str, float] = {}
        prm_logp = None
        if self.estimator.needs_prm:
            prm_logp, prm_metrics = self._prm_update(rows, index, tokens, steps, shape)
            metrics.update(prm_metrics)
        score_seconds = time.perf_counter() - tick

        tick = time.perf_counter()
        token_values = tokens_from_rows(old.values, index, rows.action_mask, shape)
        # Plain EMPG reweights a base advantage: GRPO's episode advantage (TrainConfig).
        base = (compiled_compute_advantages(steps, tokens, "grpo").step_advantages
                if config.estimator == "empg" else None)
        credit = compiled_compute_advantages(
            steps, tokens, config.estimator, token_values=token_values, prm_logp=prm_logp,
            ref_logp=tokens.logp, base_advantages=base,
            **({"beta": config.prm_beta} if prm_logp is not None else {}), **self.estimator_config)
        advantages = rows_from_tokens(credit.token_advantages, index, rows.action_mask)
        returns, value_mask = self._value_targets(credit, rows, index)
        jax.block_until_ready(advantages)
        credit_seconds = time.perf_counter() - tick

        ref_logp = (self._score(self.state["reference"], rows).logprobs
                    if "reference" in self.state else old.logprobs)
        warming_critic = int(self.state["iteration"]) < config.critic_warmup_iterations
        data = learner.Minibatch(
            tokens=jnp.asarray(rows.tokens), mask=jnp.asarray(rows.mask),
            action_mask=jnp.asarray(rows.action_mask & rows.valid[:, None]),
            advantages=jnp.zeros_like(advantages) if warming_critic else advantages,
            old_logp=old.logprobs, behav_logp=jnp.asarray(rows.behav_logp),
            ref_logp=ref_logp, old_values=old.values, returns=returns, value_mask=value_mask)
        tick = time.perf_counter()
        update_metrics = self._epochs(data)
        update_seconds = time.perf_counter() - tick
        valid_adv = np.asarray(advantages)[np.asarray(data.action_mask)]
        metrics.update(update_metrics)
        metrics.update({
            "advantage/mean": float(valid_adv.mean()) if valid_adv.size else 0.0,
            "advantage/std": float(valid_adv.std()) if valid_adv.size else 0.0,
            "advantage/abs_max": float(np.abs(valid_adv).max()) if valid_adv.size else 0.0,
            "batch/rows": float(rows.valid.sum()), "train/critic_warmup": float(warming_critic),
            "time/credit": credit_seconds, "time/score": score_seconds,
            "time/update": update_seconds})
        return metrics

    def _value_targets(self, credit, rows: StepRowBatch, index: RowIndex):
        zeros = jnp.zeros(rows.tokens.shape, jnp.float32)
        none = jnp.zeros(rows.tokens.shape, bool)
        if not self.loss_config.value_coef or credit.returns is None:
            return zeros, none
        if credit.returns.ndim == 2 and credit.step_advantages is not None:
            # StepPO: the critic learns one V(s_t) per step, at the step's first action token.
            per_row = jnp.asarray(credit.returns)[rows.trajectory, rows.step]
            mask = jnp.asarray(rows.first_action & rows.valid[:, None])
            return jnp.where(mask, per_row[:, None], 0.0), mask
        mask = jnp.asarray(rows.action_mask & rows.valid[:, None])
        return rows_from_tokens(credit.returns, index, mask), mask

    def _epochs(self, data: learner.Minibatch) -> dict[str, float]:
        config = self.config
        m = config.minibatch_rows
        rng = np.random.default_rng([config.seed, int(self.state["iteration"]), 7])
        history = []
        dp = self.data_parallel
        learning_rate = learning_rate_at(
            int(self.state["iteration"]), base=config.learning_rate,
            schedule=config.learning_rate_schedule, iterations=config.iterations,
            final_fraction=config.final_learning_rate_fraction,
            warmup=config.learning_rate_warmup_iterations)
        opt = learner.with_learning_rate(self.state["opt"], learning_rate)
        policy, opt = dp.replicate((self.state["policy"], opt))
        if self.multiprocess:  # as many minibatches on every process: pad with empty rows
            extra = max_over_processes(data.tokens.shape[0]) - data.tokens.shape[0]
            data = jax.tree.map(lambda x: jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1)),
                                data)
        lengths = np.asarray(data.mask).sum(1)
        schedule = [step for _ in range(config.epochs)
                    for step in self._minibatches(lengths, data.tokens.shape[1], rng)]
        for chunk, width in schedule:
            batch = dp.shard(jax.tree.map(lambda x: x[chunk, :width], data))
            policy, opt, metrics = learner.train_step(
                policy, opt, batch, graphdef=self.graphdef, tx=self.tx, config=self.loss_config)
            history.append(metrics)
            # Every process sees the same global minibatch's KL, so all stop together.
            if (config.target_kl is not None and float(dp.gather(metrics["policy/approx_kl"]))
                    > 1.5 * config.target_kl):
                break
        self.state["policy"], self.state["opt"], history = dp.gather((policy, opt, history))
        means = {k: float(np.mean([float(h[k]) for h in history])) for k in history[0]}
        return {**means, "optim/learning_rate": learning_rate,
                "update/minibatches": float(len(history)),
                "update/minibatches_planned": float(len(schedule))}

    def _minibatches(self, lengths: np.ndarray, width: int,
                     rng: np.random.Generator) -> list[tuple[np.ndarray, int]]:
        """One epoch's minibatches, (rows, width): rows of similar length together, or, with
        several processes (whose steps must line up), a random order at full width."""
        m = self.config.minibatch_rows
        if not self.multiprocess:
            return length_groups(lengths, m, limit=width, rng=rng)
        order = rng.permutation(len(lengths))
        return [(order[i:i + m], width) for i in range(0, len(order), m)]

    # -------------------------------------------------------------- warm start
    def warm_start(self) -> dict[str, float]:
        """Supervised steps on expert demonstrations of training tasks (before RL)."""
        from stepcredit.train.warm_start import demonstration_rows

        config = self.config
        tick = time.perf_counter()
        rows = demonstration_rows(lambda: make_env(config, "train"), self.tokenizer,
                                  config.rollout, num_tasks=min(config.warm_start_tasks,
                                                                self.num_train_tasks),
                                  seed=config.seed, row_length=self.row_length,
                                  multiple=config.minibatch_rows)
        rng = np.random.default_rng([config.seed, 11])
        lengths, full = rows.mask.sum(1), rows.tokens.shape[1]
        chunks, losses_seen = [], []
        for step in range(config.warm_start_steps):
            if not chunks:  # one pass over the demonstrations in length groups
                chunks = length_groups(lengths, config.minibatch_rows, limit=full, rng=rng)
            chunk, width = chunks.pop()
            self.state["policy"], self.state["opt"], loss = learner.supervised_step(
                self.state["policy"], self.state["opt"], rows.tokens[chunk, :width],
                rows.mask[chunk, :width], rows.action_mask[chunk, :width],
                graphdef=self.graphdef, tx=self.tx,
                choice_markers=self.loss_config.choice_markers,
                width=self.loss_config.action_width)
            losses_seen.append(float(loss))
        # The RL optimizer starts fresh from the warm-started policy.
        self.state["opt"] = self.tx.init(self.state["policy"])
        if "reference" in self.state:
            self.state["reference"] = jax.tree.map(jnp.copy, self.state["policy"])
        if "prm" in self.state:
            self.state["prm"] = jax.tree.map(jnp.copy, self.state["policy"])
            self.state["prm_opt"] = self.prm_tx.init(self.state["prm"])
        return {"warm_start/loss_first": losses_seen[0], "warm_start/loss_last": losses_seen[-1],
                "warm_start/demonstration_rows": float(rows.valid.sum()),
                "time/warm_start": time.perf_counter() - tick}

    # -------------------------------------------------------------------- loop
    def iteration(self, iteration: int) -> dict[str, float]:
        """Collects one batch and learns from it; returns the iteration's metrics."""
        tick = time.perf_counter()
        limit = self.step_limit(iteration)
        key, rollout_key = jax.random.split(self.state["key"])
        self.state["key"] = key
        if self.multiprocess:
            rollout_key = jax.random.fold_in(rollout_key, self.process_index)
        rollout, sampling = self._filled_rollout(self.state["policy"], iteration, rollout_key,
                                                 limit)
        metrics = {**rollout.metrics, **sampling}
        metrics.update(self.learn(rollout.trajectories, limit))
        return self._advance(iteration, limit, metrics, tick)

    def start_worker(self, iteration: int) -> asynchronous.RolloutWorker:
        """Async mode: a worker playing batches with the latest published policy.

        The policy version is the learner's iteration count; batch i plays
        `tasks(i)` with the key `fold_in(worker_key, i)` at the step limit of
        the version that plays it.
        """
        self.state["key"], worker_key = jax.random.split(self.state["key"])

        def produce(policy, version: int, index: int):
            limit = self.step_limit(version)
            rollout, sampling = self._filled_rollout(
                policy, index, jax.random.fold_in(worker_key, index), limit)
            return rollout, sampling, limit

        policy = jax.tree.map(jnp.copy, self.state["policy"])
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
        metrics.update(self.learn(rollout.trajectories, limit))
        asynchronous.publish_copy(worker, self.state["policy"], iteration + 1)
        return self._advance(iteration, limit, metrics, tick)

    def _advance(self, iteration: int, limit: int, metrics: dict[str, float],
                 tick: float) -> dict[str, float]:
        self.state["iteration"] = jnp.int32(iteration + 1)
        self.state["stage"] = jnp.int32(horizon_stage(
            iteration, switch_every=self.config.horizon_switch_every,
            num_stages=max(len(self.config.horizon_schedule), 1)))
        metrics["curriculum/step_limit"] = float(limit)
        metrics["time/iteration"] = time.perf_counter() - tick
        metrics["time/credit_fraction"] = metrics["time/credit"] / metrics["time/iteration"]
        return metrics

    def restore(self) -> int:
        """Restores the latest checkpoint, if any; returns the next iteration to run.
        With several processes, process 0 reads it and sends it to the others."""
        if self.primary and self.checkpointer.latest_step() is not None:
            self.state = self.checkpointer.restore(self.state)
        if self.multiprocess:
            self.state = from_process_0(self.state)
        return int(self.state["iteration"])

    def save(self) -> None:
        self.checkpointer.save(int(self.state["iteration"]), self.state)
        with open(os.path.join(self.config.logdir, "config.json"), "w", encoding="utf-8") as f:
            f.write(self.config.to_json())
        self.tokenizer.save(os.path.join(self.config.logdir, "tokenizer.json"))

    def run(self, *, resume: bool = False) -> list[dict[str, float]]:
        """Trains for `config.iterations`, logging, evaluating and checkpointing as configured."""
        from stepcredit.train.evaluate import evaluate

        config = self.config
        self._run_started = time.perf_counter()
        os.makedirs(config.logdir, exist_ok=True)
        start = self.restore() if resume else 0
        logs = (MetricsLogger(config.logdir, resume_from=start if resume else None)
                if self.primary else contextlib.nullcontext(_NoMetrics()))
        with logs as logger:
            if start == 0 and (config.warm_start_steps or config.eval_every):
                # Iteration -1: the policy RL starts from, after any warm start (the baseline).
                initial = self.warm_start() if config.warm_start_steps else {}
                if initial:
                    self.log(f"warm start: loss {initial['warm_start/loss_first']:.3f} -> "
                             f"{initial['warm_start/loss_last']:.3f} in "
                             f"{initial['time/warm_start']:.1f}s")
                if config.eval_every and self.primary:
                    result = evaluate(self.graphdef, self.state["policy"], self.tokenizer, config,
                                      num_tasks=config.eval_tasks,
                                      temperature=config.eval_temperature)
                    initial.update({f"eval/{k}": v for k, v in result.items()})
                    self.log(f"initial policy: eval success {result['success']:.2f}")
                logger.log(-1, initial)
            began = time.perf_counter()
            worker = self.start_worker(start) if config.async_mode else None
            try:
                history = self._loop(start, began, logger, worker)
            finally:
                if worker is not None:
                    worker.close()
        return history

    def _loop(self, start: int, began: float, logger: MetricsLogger,
              worker: asynchronous.RolloutWorker | None) -> list[dict[str, float]]:
        """Iterations `start..iterations-1`: learn, evaluate, log, checkpoint, report progress."""
        from stepcredit.train.evaluate import evaluate

        config, history = self.config, []
        for iteration in range(start, config.iterations):
            metrics = (self.iteration(iteration) if worker is None
                       else self.async_iteration(iteration, worker))
            elapsed = time.perf_counter() - getattr(self, "_run_started", began)
            out_of_time = (config.time_limit_minutes is not None
                           and elapsed >= 60 * config.time_limit_minutes)
            if self.multiprocess:
                out_of_time = agreed_by_process_0(out_of_time)
            last = out_of_time or iteration + 1 == config.iterations
            metrics["time/elapsed"] = elapsed
            if self.primary and config.eval_every and ((iteration + 1) % config.eval_every == 0
                                                       or last):
                result = evaluate(self.graphdef, self.state["policy"], self.tokenizer, config,
                                  num_tasks=config.eval_tasks,
                                  temperature=config.eval_temperature)
                metrics.update({f"eval/{k}": v for k, v in result.items()})
            logger.log(iteration, metrics)
            history.append(metrics)
            if self.primary and ((iteration + 1) % config.checkpoint_every == 0 or last):
                self.save()
            done = iteration + 1 - start
            left = (time.perf_counter() - began) / done * (config.iterations - iteration - 1)
            if config.time_limit_minutes is not None:
                left = min(left, max(0.0, 60 * config.time_limit_minutes - elapsed))
            bar = "#" * int(20 * (iteration + 1) / config.iterations)
            self.log(f"[{bar:<20}] {iteration + 1}/{config.iterations} "
                     f"success {metrics['rollout/success']:.2f}"
                     + (f" eval {metrics['eval/success']:.2f}" if "eval/success" in metrics else "")
                     + f" | {metrics['time/iteration']:.1f}s/it, {left / 60:.1f} min left")
            if out_of_time:
                self.log(f"stopping: the time limit of {config.time_limit_minutes} min is reached")
                break
        if self.multiprocess:
            check_same_on_every_process({k: v for k, v in self.state.items()
                                         if k in ("policy", "prm")}, "the parameters")
        return history
