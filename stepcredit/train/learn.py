"""The learner: from one batch of trajectories to updated parameters.

`Learner.prepare` scores the batch's step rows with the policy that sampled
them, updates the implicit PRM when the estimator reads PRM log-probs (iStar's
preference loss) and SPA's progress estimator when it reads progress
contributions (`stepcredit.train.progress`), assigns credit through the
estimator's registry binding (`stepcredit.credit.compiled_compute_advantages`;
VinePPO's Monte Carlo values come with the batch, `stepcredit.train.vine`)
and builds the critic targets; `Learner.update` runs `epochs` passes of
minibatch PPO steps over the rows. Both are functions of a `TrainState` that
return a new one.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stepcredit import advantages as adv
from stepcredit.batch import Trajectory, collate
from stepcredit.credit import compiled_compute_advantages
from stepcredit.models.sharing import SharedRows, shared_rows
from stepcredit.models.transformer import label_slots
from stepcredit.train import information_gain, progress, update, vine
from stepcredit.train.build import Parts, make_env
from stepcredit.train.curriculum import learning_rate_at
from stepcredit.train.devices import DataParallel, max_over_processes, mean_over_processes
from stepcredit.train.rows import (RowIndex, StepRowBatch, build_rows, length_groups,
                                   rows_from_tokens, tokens_from_rows)
from stepcredit.train.state import TrainState


class Prepared(NamedTuple):
    """A batch ready for the update: the minibatch data of every step row and what it cost."""

    data: update.Minibatch
    metrics: dict[str, float]


class Learner:
    """Credit and updates for the run described by `parts`.

    Args:
      parts: the run's parts (`stepcredit.train.build.build`).
      data_parallel: the devices the update runs on.
      multiprocess: several processes train one policy (their minibatches must
        line up: the same count, in random order at full width).
    """

    def __init__(self, parts: Parts, data_parallel: DataParallel, *, multiprocess: bool = False):
        self.parts = parts
        self.config = parts.config
        self.estimator_config = dict(self.config.estimator_config)
        self.data_parallel = data_parallel
        self.multiprocess = multiprocess
        self.row_length = (self.config.rollout.max_prompt_tokens
                           + self.config.rollout.action_length)
        # IGPO: the answer action's ids before the answer (None: the env has no answers).
        self.answer_prefix = None
        if parts.estimator.needs_information_gain:
            env = make_env(self.config, "train")
            try:
                self.answer_prefix = information_gain.answer_prefix(
                    env, parts.tokenizer, self.config.rollout.action_format)
            finally:
                env.close()

    # ------------------------------------------------------------------ scoring
    def score(self, params, rows: StepRowBatch, *, width: int | None = None):
        """Scores all rows in minibatch-sized chunks of similar length (`length_groups`), at
        their first `width` action tokens (the longest action by default)."""
        full = rows.tokens.shape[1]
        parts, order = [], []
        temperature = jnp.float32(self.config.loss.temperature)
        for chunk, tokens, mask, action_mask in self._chunks(rows):
            scores = update.score(params, tokens, mask, action_mask, temperature,
                                  **self._scoring_options(tokens, mask, action_mask, width))
            parts.append(jax.tree.map(lambda x: jnp.pad(x, ((0, 0), (0, full - x.shape[1]))),
                                      scores))
            order.append(chunk)
        inverse = np.argsort(np.concatenate(order))
        return jax.tree.map(lambda *xs: jnp.concatenate(xs)[inverse], *parts)

    def _chunks(self, rows: StepRowBatch):
        """Minibatch-sized chunks of rows of similar length (`length_groups`), each cut to its
        own width: (row indices, tokens, mask, action_mask) per chunk."""
        for chunk, columns in length_groups(rows.mask.sum(1), self.config.minibatch_rows,
                                            limit=rows.tokens.shape[1]):
            yield chunk, *(x[chunk, :columns] for x in (rows.tokens, rows.mask, rows.action_mask))

    def _scoring_options(self, tokens, mask, action_mask, width: int | None = None) -> dict:
        """How a chunk's rows are scored: the model and pointer, the first `width` action
        tokens (the longest action by default), and the rows that share a context."""
        loss = self.config.loss
        return dict(graphdef=self.parts.graphdef, choice_markers=loss.choice_markers,
                    width=width or loss.action_width,
                    shared=self._shared(tokens, mask, action_mask),
                    label_slots=self._label_slots(tokens, mask))

    def _shared(self, tokens, mask, action_mask) -> SharedRows | None:
        """The kinds of rows the model runs once (`shared_rows`), or None: every row runs
        (`share_contexts` off, or every position scored)."""
        loss = self.config.loss
        if not (self.config.share_contexts and loss.action_width):
            return None
        return jax.tree.map(jnp.asarray, shared_rows(tokens, mask, action_mask,
                                                     markers=loss.choice_markers))

    def _label_slots(self, tokens, mask) -> int | None:
        """The most labels a row holds (`label_slots`), for the pointer; None without it."""
        markers = self.config.loss.choice_markers
        return label_slots(tokens, mask, markers) if markers else None

    def _weighted_gradient(self, params, rows: StepRowBatch, weights: np.ndarray):
        """The gradient in `params` of sum(weights * log-probs) over `rows`' action tokens,
        accumulated over the scoring's chunks (`update.weighted_logprob_gradient`)."""
        temperature = jnp.float32(self.config.loss.temperature)
        return self._summed_over_chunks(
            params, rows, lambda chunk, tokens, mask, action_mask:
            update.weighted_logprob_gradient(params, tokens, mask, action_mask,
                                             weights[chunk, :tokens.shape[1]], temperature,
                                             **self._scoring_options(tokens, mask, action_mask)))

    def _summed_over_chunks(self, params, rows: StepRowBatch, chunk_gradient):
        """The sum over `_chunks(rows)` of `chunk_gradient(chunk, tokens, mask, action_mask)`,
        a tree shaped like `params`."""
        grads = jax.tree.map(jnp.zeros_like, params)
        for chunk in self._chunks(rows):
            grads = jax.tree.map(jnp.add, grads, chunk_gradient(*chunk))
        return grads

    def _row_contributions(self, params, rows: StepRowBatch) -> jax.Array:
        """The progress estimator's `[R]` row contributions (`progress.row_contributions`),
        computed a chunk of rows at a time."""
        values = np.zeros(rows.tokens.shape[0], np.float32)
        for chunk, tokens, mask, _ in self._chunks(rows):
            values[chunk] = np.asarray(progress.row_values(params, tokens, mask,
                                                           graphdef=self.parts.graphdef))
        return jnp.asarray(values)

    def _row_gradient(self, params, rows: StepRowBatch, weights: np.ndarray):
        """The gradient in `params` of sum_r weights[r] c_r, accumulated over the chunks
        (`progress.weighted_row_gradient`)."""
        return self._summed_over_chunks(
            params, rows, lambda chunk, tokens, mask, _: progress.row_gradient(
                params, tokens, mask, weights[chunk], graphdef=self.parts.graphdef))

    def update_prm(self, state: TrainState, rows: StepRowBatch, index: RowIndex, tokens, steps,
                   shape, ref_logp: jax.Array) -> tuple[TrainState, jax.Array, dict[str, float]]:
        """One preference-loss step on the implicit PRM (iStar), against pi_old's `[B, N]`
        token log-probs `ref_logp`.

        The loss's gradient in the PRM's token log-probs is taken on the whole batch, then
        carried into the parameters a chunk of rows at a time (`_weighted_gradient`): the
        same gradient as one pass over the batch, in the memory of one chunk.

        Returns the new state, the PRM's `[B, N]` token log-probs in the token
        view (after the step, the paper's order, or before it with
        `prm_rewards_from="pre_update_prm"`, the authors' code) and metrics.
        """
        success = np.asarray(steps.score) > 0
        num_groups = int(np.max(steps.group_id)) + 1
        beta = self.estimator_config["beta"]  # the same beta scales the implicit rewards

        def loss_fn(prm_view):
            return adv.trajectory_preference_loss(
                prm_view, ref_logp, tokens.action_mask, tokens.step_index, success,
                steps.group_id, beta=beta, num_groups=num_groups)

        before = tokens_from_rows(self.score(state.prm, rows).logprobs, index, rows.action_mask,
                                  shape)
        (loss, metrics), upstream = jax.value_and_grad(loss_fn, has_aux=True)(before)
        weights = np.asarray(rows_from_tokens(upstream, index, rows.action_mask))
        grads = self._weighted_gradient(state.prm, rows, weights)
        if self.multiprocess:
            grads = mean_over_processes(grads)
        updates, prm_opt = self.parts.prm_tx.update(grads, state.prm_opt, state.prm)
        state = state.replace(prm=optax.apply_updates(state.prm, updates), prm_opt=prm_opt)
        after = tokens_from_rows(self.score(state.prm, rows).logprobs, index, rows.action_mask,
                                 shape)
        out = {"prm/loss": float(loss), **{f"prm/{k}": float(v) for k, v in metrics.items()}}
        return state, (before if self.config.prm_rewards_from == "pre_update_prm" else after), out

    def update_progress(self, state: TrainState, rows: StepRowBatch, index: RowIndex, tokens,
                        steps, trajectories: list[Trajectory]
                        ) -> tuple[TrainState, dict, dict[str, float]]:
        """`progress_steps` optimizer steps of SPA's progress estimator on the batch.

        The loss's gradient in the rows' contributions is taken on the whole batch, then
        carried into the estimator a chunk of rows at a time (`_row_gradient`): the same
        gradient as one pass over the batch, in the memory of one chunk.

        Returns the new state, the credit inputs `progress` (`[B, T]`
        contributions after the steps, the paper's order: the estimator is
        trained, then annotates) and `grounding`, and metrics: the loss before
        the first step and after the last, and the time.
        """
        tick = time.perf_counter()
        batch = progress.ProgressBatch(
            tokens=jnp.asarray(rows.tokens), mask=jnp.asarray(rows.mask),
            action_mask=jnp.asarray(rows.action_mask), index_b=jnp.asarray(index.b),
            index_n=jnp.asarray(index.n), step_index=jnp.asarray(tokens.step_index),
            step_mask=jnp.asarray(steps.mask), outcomes=jnp.asarray(steps.score))
        params, opt_state, losses = state.progress, state.progress_opt, []
        for _ in range(self.config.progress_steps):
            loss, upstream = progress.row_loss_and_grad(self._row_contributions(params, rows),
                                                        batch)
            grads = self._row_gradient(params, rows, np.asarray(upstream))
            if self.multiprocess:
                grads = mean_over_processes(grads)
            params, opt_state = progress.apply_gradient(params, opt_state, grads,
                                                        tx=self.parts.progress_tx)
            losses.append(float(loss))
        contributions = progress.contributions_of_rows(self._row_contributions(params, rows),
                                                       batch)
        after = float(adv.progress_loss(contributions, batch.step_mask, batch.outcomes))
        inputs = {"progress": contributions,
                  "grounding": progress.grounding_signal(trajectories, steps.mask.shape[1])}
        return state.replace(progress=params, progress_opt=opt_state), inputs, {
            "progress/loss": losses[0] if losses else after, "progress/loss_after": after,
            "time/progress": time.perf_counter() - tick}

    def answer_beliefs(self, state: TrainState, trajectories: list[Trajectory], steps,
                       limit: int) -> tuple[np.ndarray, dict[str, float]]:
        """IGPO's `[B, T]` beliefs b_t in each trajectory's answer after each step's prompt,
        under the policy that sampled the batch (`information_gain.answer_logprobs`), and
        metrics: the mean information gain over the steps it rewards, and the time."""
        tick = time.perf_counter()
        beliefs = information_gain.answer_logprobs(
            self.score, state.policy, trajectories, self.answer_prefix, self.parts.tokenizer,
            num_steps=limit, multiple=self.config.minibatch_rows)
        gain_mean = information_gain.gain_mean(beliefs, steps.mask, gain=self.estimator_config["gain"])
        return beliefs, {"igpo/gain_mean": gain_mean,
                         "time/information_gain": time.perf_counter() - tick}

    # ------------------------------------------------------------------- credit
    def prepare(self, state: TrainState, trajectories: list[Trajectory],
                limit: int) -> tuple[TrainState, Prepared]:
        """Scores, credits and packs one batch (the PRM, if any, learns here)."""
        config = self.config
        num_tokens = limit * config.rollout.action_length
        steps, tokens, _ = collate(trajectories, max_steps=limit, max_tokens=num_tokens,
                                   with_observations=False)
        shape = tokens.tokens.shape
        rows, index = build_rows(trajectories, num_steps=limit, row_length=self.row_length,
                                 pad_id=self.parts.tokenizer.special.pad,
                                 multiple=config.minibatch_rows)
        tick = time.perf_counter()
        old = jax.block_until_ready(self.score(state.policy, rows))
        metrics: dict[str, float] = {}
        # pi_old of the implicit rewards beta log(pi_prm / pi_old) is the policy this update
        # starts from, scored as the PRM is (verl's recomputed old_log_prob), so that a PRM
        # equal to it (iStar's start) gives rewards of exactly 0: the sampler's log-probs differ
        # from the scorer's by rounding, which the step baseline's std normalisation magnifies.
        old_logp = tokens_from_rows(old.logprobs, index, rows.action_mask, shape)
        prm_logp = None
        if self.parts.estimator.needs_prm:
            state, prm_logp, prm_metrics = self.update_prm(state, rows, index, tokens, steps,
                                                           shape, old_logp)
            metrics.update(prm_metrics)
        score_seconds = time.perf_counter() - tick
        progress_inputs = {}
        if self.parts.estimator.needs_progress:
            state, progress_inputs, progress_metrics = self.update_progress(
                state, rows, index, tokens, steps, trajectories)
            metrics.update(progress_metrics)
        answer_logp = None
        if self.parts.estimator.needs_information_gain:
            answer_logp, gain_metrics = self.answer_beliefs(state, trajectories, steps, limit)
            metrics.update(gain_metrics)

        tick = time.perf_counter()
        token_values = tokens_from_rows(old.values, index, rows.action_mask, shape)
        mc_values = (vine.mc_value_array(trajectories, limit)
                     if self.parts.estimator.needs_mc_values else None)
        credit = compiled_compute_advantages(
            steps, tokens, config.estimator, token_values=token_values, prm_logp=prm_logp,
            ref_logp=old_logp, mc_values=mc_values, answer_logp=answer_logp,
            **progress_inputs, **self.estimator_config)
        advantages = rows_from_tokens(credit.token_advantages, index, rows.action_mask)
        returns, value_mask = self._value_targets(credit, rows, index)
        jax.block_until_ready(advantages)
        credit_seconds = time.perf_counter() - tick

        ref_logp = (self.score(state.reference, rows).logprobs if state.reference is not None
                    else old.logprobs)
        warming_critic = int(state.iteration) < config.critic_warmup_iterations
        action_mask = jnp.asarray(rows.action_mask & rows.valid[:, None])
        data = update.Minibatch(
            tokens=jnp.asarray(rows.tokens), mask=jnp.asarray(rows.mask), action_mask=action_mask,
            advantages=jnp.zeros_like(advantages) if warming_critic else advantages,
            old_logp=old.logprobs, behav_logp=jnp.asarray(rows.behav_logp),
            ref_logp=ref_logp, old_values=old.values, returns=returns, value_mask=value_mask)
        valid_adv = np.asarray(advantages)[np.asarray(action_mask)]
        metrics.update({
            "advantage/mean": float(valid_adv.mean()) if valid_adv.size else 0.0,
            "advantage/std": float(valid_adv.std()) if valid_adv.size else 0.0,
            "advantage/abs_max": float(np.abs(valid_adv).max()) if valid_adv.size else 0.0,
            "batch/rows": float(rows.valid.sum()), "train/critic_warmup": float(warming_critic),
            "time/credit": credit_seconds, "time/score": score_seconds})
        return state, Prepared(data, metrics)

    def _value_targets(self, credit, rows: StepRowBatch, index: RowIndex):
        zeros = jnp.zeros(rows.tokens.shape, jnp.float32)
        none = jnp.zeros(rows.tokens.shape, bool)
        if not self.config.loss.value_coef or credit.returns is None:
            return zeros, none
        if credit.returns.ndim == 2 and credit.step_advantages is not None:
            # StepPO: the critic learns one V(s_t) per step, at the step's first action token.
            per_row = jnp.asarray(credit.returns)[rows.trajectory, rows.step]
            mask = jnp.asarray(rows.first_action & rows.valid[:, None])
            return jnp.where(mask, per_row[:, None], 0.0), mask
        mask = jnp.asarray(rows.action_mask & rows.valid[:, None])
        return rows_from_tokens(credit.returns, index, mask), mask

    # ------------------------------------------------------------------- update
    def update(self, state: TrainState, data: update.Minibatch) -> tuple[TrainState, dict]:
        """`epochs` passes of minibatch PPO steps (stopping early past the target KL)."""
        config = self.config
        iteration = int(state.iteration)
        rng = np.random.default_rng([config.seed, iteration, 7])
        dp = self.data_parallel
        learning_rate = learning_rate_at(
            iteration, base=config.learning_rate, schedule=config.learning_rate_schedule,
            iterations=config.iterations, final_fraction=config.final_learning_rate_fraction,
            warmup=config.learning_rate_warmup_iterations)
        opt = update.with_learning_rate(state.opt, learning_rate)
        policy, opt = dp.replicate((state.policy, opt))
        if self.multiprocess:  # as many minibatches on every process: pad with empty rows
            extra = max_over_processes(data.tokens.shape[0]) - data.tokens.shape[0]
            data = jax.tree.map(lambda x: jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1)),
                                data)
        # Minibatches are cut on the host: indexing device arrays would dispatch (and, at
        # each new width, compile) one gather per array and minibatch.
        data = jax.tree.map(np.asarray, data)
        lengths = data.mask.sum(1)
        schedule = [step for _ in range(config.epochs)
                    for step in self._minibatches(lengths, data.tokens.shape[1], rng)]
        history = []
        for chunk, width in schedule:
            batch = jax.tree.map(lambda x: x[chunk, :width], data)
            # Kinds of rows are found per minibatch; on a mesh every row runs on its device.
            shared = (self._shared(batch.tokens, batch.mask, batch.action_mask)
                      if dp.num_devices == 1 else None)
            # Processes compile one program together: their local label counts may differ.
            slots = None if self.multiprocess else self._label_slots(batch.tokens, batch.mask)
            policy, opt, metrics = update.train_step(
                policy, opt, dp.shard(batch), graphdef=self.parts.graphdef, tx=self.parts.tx,
                config=config.loss, shared=shared, label_slots=slots)
            history.append(metrics)
            # Every process sees the same global minibatch's KL, so all stop together.
            if (config.target_kl is not None and float(dp.gather(metrics["policy/approx_kl"]))
                    > 1.5 * config.target_kl):
                break
        policy, opt, history = dp.gather((policy, opt, history))
        means = {k: float(np.mean([float(h[k]) for h in history])) for k in history[0]}
        return state.replace(policy=policy, opt=opt), {
            **means, "optim/learning_rate": learning_rate,
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

    def learn(self, state: TrainState, trajectories: list[Trajectory],
              limit: int) -> tuple[TrainState, dict[str, float]]:
        """`prepare` then `update`: one batch's credit and updates."""
        state, prepared = self.prepare(state, trajectories, limit)
        tick = time.perf_counter()
        state, update_metrics = self.update(state, prepared.data)
        return state, {**prepared.metrics, **update_metrics,
                       "time/update": time.perf_counter() - tick}
