"""Training a chat-model policy on stepcredit environments with any registered estimator.

One iteration: for each of K tasks, `rollout.play_group` plays G episodes;
`compute_advantages` gives every step its advantage; each step becomes one row
`prompt_ids + action_ids` (token-exact, as sampled) whose action tokens carry
the step's advantage; `Learner.learn` takes `epochs` passes of AdamW steps over
minibatches of those rows on the trainer's policy loss
(`stepcredit.train.update.policy_loss`: PPO's clipped surrogate, or StepPO's
step ratio) against the log-probs stored at sampling, plus `kl_coef` times the
KL to a frozen copy of the initial model. Rows are right-padded to a power of
two; a short last minibatch is padded with empty rows (no action tokens), and a
batch of fewer rows than `minibatch_rows` to the next power of two, so a few
(row count, row length) shapes compile one update each.

An estimator that reads a critic (step GAE, StepPO's turn PPO, token GAE) gets
one: a copy of the model with a value head (`stepcredit.llm.critic`), scored on
the rows before the update (V(s_t) at each step's first action token, token
values on every action token, V(s_next) of an episode cut by a limit from the
prompt of the state it was cut in) and trained on the estimator's returns with
the value loss (`losses.value_loss`, `loss.value_clip`) by its own AdamW at
`critic_learning_rate`, one step per policy step on the same minibatch. SPA's
progress estimator is another value-head copy, read at each step's last action
token (the state after the action) and fitted, `progress_steps` AdamW steps per
iteration, so that a trajectory's contributions sum to its score.

An estimator that reads an implicit PRM (iStar, PRIME) gets one: a further copy
of the model, pi_prm, taking one AdamW step per iteration (`prm_learning_rate`,
global-norm clip 10, as iStar's authors) on iStar's trajectory preference loss
(`advantages.trajectory_preference_loss`) against pi_old, the policy before
this update re-scored. The gradient is accumulated over chunks of
`minibatch_rows` rows exactly: the loss depends on the PRM only through its
token log-probs l_n, so dL/dphi = sum_n (dL/dl_n) dl_n/dphi, with dL/dl_n taken
once on the whole batch and each chunk contributing the gradient of
sum_n (dL/dl_n) l_n(phi). The step rewards come from the PRM after the step
(`prm_rewards_from="post_update_prm"`, the paper) or before it
("pre_update_prm", the authors' code).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from stepcredit.advantages import progress_loss, registry, trajectory_preference_loss
from stepcredit.batch import StepRecord, Trajectory, collate
from stepcredit.credit import compute_advantages
from stepcredit.envs.base import Env
from stepcredit.llm import checkpoint as checkpoints
from stepcredit.llm import critic as critics
from stepcredit.llm import lora
from stepcredit.llm import rollout
from stepcredit.losses import kl_loss, value_loss
from stepcredit.train import information_gain
from stepcredit.train.progress import grounding_signal
from stepcredit.train.vine import mc_value_array
from stepcredit.train.update import LossConfig, make_optimizer, policy_loss


@dataclasses.dataclass(frozen=True)
class LearnConfig:
    """Settings of `Learner` and `play_batch`.

    Attributes:
      estimator: a registered estimator (grpo, rloo, gigpo, grpo+empg,
        step_gae, token_gae, rloo+istar, prime, igpo, spa, ...); one that reads
        entropies gets the sampling policy's, re-scored before the update, one
        that reads a critic the value-head copy of the model, one that reads a
        PRM the PRM copy, SPA its progress estimator. Monte Carlo values
        (VinePPO) and rollout trees (Tree-GRPO) come with the trajectories
        (`stepcredit.llm.vine`, `stepcredit.llm.tree`).
      estimator_config: (name, value) pairs overriding its defaults.
      iterations, tasks_per_iteration, group_size: K tasks x G episodes each.
      max_new_tokens, temperature, window: sampling and prompt settings.
      invalid_action_penalty: subtracted from the reward of an invalid action.
      learning_rate, weight_decay, grad_clip: AdamW and global-norm clipping.
      epochs: passes over each batch; minibatch_rows: rows per step (0: all);
        micro_rows: rows per forward and backward pass of a step, whose
        gradients are accumulated exactly (0: the whole minibatch at once):
        a pass holds its rows' logits, `[rows, length, vocabulary]`.
      critic_learning_rate: the critic's AdamW rate, for estimators that read
        one (1e-5, verl's PPO critic beside a 1e-6 actor).
      prm_learning_rate, prm_rewards_from: the implicit PRM's AdamW rate (1e-6,
        iStar's authors) and which of its two states gives the step rewards.
      progress_learning_rate, progress_steps: SPA's progress estimator: its
        AdamW rate (3e-6, the authors') and its optimizer steps per iteration.
      lora_rank, lora_alpha: 0 trains every weight; r > 0 trains rank-r LoRA
        adapters scaled by alpha / r (`stepcredit.llm.lora`) over frozen
        weights, and the critic and PRM copies are adapters over the same ones.
      loss: the policy loss and its KL term (`LossConfig`; `kl_coef` > 0
        keeps a frozen reference copy of the model).
      seed: the run's seed (task order and sampling).
    """

    estimator: str = "grpo"
    estimator_config: tuple[tuple[str, Any], ...] = ()
    iterations: int = 1
    tasks_per_iteration: int = 2
    group_size: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    window: int = 4
    invalid_action_penalty: float = 0.0
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    epochs: int = 1
    minibatch_rows: int = 0
    critic_learning_rate: float = 1e-5
    prm_learning_rate: float = 1e-6
    prm_rewards_from: str = "post_update_prm"
    lora_rank: int = 0
    lora_alpha: float = 32.0
    micro_rows: int = 0
    progress_learning_rate: float = 3e-6
    progress_steps: int = 1
    loss: LossConfig = LossConfig()
    seed: int = 0


def step_rows(trajectories: Sequence[Trajectory], step_advantages) -> dict[str, np.ndarray]:
    """Padded step rows: `tokens`, `mask`, `action_mask`, `old_logp` and `advantages`, `[R, L]`,
    and `trajectory`, `step` `[R]`.

    Row r is step t = `step[r]` of trajectory b = `trajectory[r]`,
    `prompt_ids + action_ids`, right-padded to the next power of two of the
    longest row; the advantage `step_advantages[b, t]` sits on its action
    tokens, and `old_logp[r, n]` is the stored log-prob of the token at position n.
    """
    records = [(b, t, step) for b, trajectory in enumerate(trajectories)
               for t, step in enumerate(trajectory.steps)]
    if not records:
        raise ValueError(f"step_rows: trajectories hold no steps ({len(trajectories)} trajectories)")
    advantages = np.asarray(step_advantages)
    needed = (len(trajectories), max(len(trajectory.steps) for trajectory in trajectories))
    if advantages.ndim != 2 or advantages.shape[0] != needed[0] or advantages.shape[1] < needed[1]:
        raise ValueError(f"step_rows: step_advantages has shape {advantages.shape}; it must be [B, T] with "
                         f"B = {needed[0]} trajectories and T >= their longest, {needed[1]} steps")
    # An empty action counts one token: the value after its prompt (position len(prompt)) exists.
    longest = max(len(step.prompt_ids) + max(len(step.action_ids), 1) for _, _, step in records)
    shape = (len(records), 1 << (longest - 1).bit_length())  # a power of two: few compiled shapes
    out = {"tokens": np.zeros(shape, np.int32), "mask": np.zeros(shape, bool),
           "action_mask": np.zeros(shape, bool), "old_logp": np.zeros(shape, np.float32),
           "advantages": np.zeros(shape, np.float32),
           "trajectory": np.array([b for b, _, _ in records], np.int32),
           "step": np.array([t for _, t, _ in records], np.int32)}
    for r, (b, t, step) in enumerate(records):
        prompt, action = len(step.prompt_ids), len(step.action_ids)
        out["tokens"][r, :prompt + action] = list(step.prompt_ids) + list(step.action_ids)
        out["mask"][r, :prompt + action] = True
        out["action_mask"][r, prompt:prompt + action] = True
        out["old_logp"][r, prompt:prompt + action] = step.action_logp
        out["advantages"][r, prompt:prompt + action] = advantages[b, t]
    return out


def _token_scores(graphdef, params, rest, rows, temperature: float, *,
                  with_entropy: bool = True) -> tuple[jax.Array, jax.Array | None]:
    """`[R, L]` log-prob of each token given the ones before it, and the entropy
    H_n = -sum_v p_n(v) log p_n(v) of the distribution it was drawn from (0 at position 0).

    With z the logits over temperature, log p(token) = z_token - logsumexp(z) and
    H = logsumexp(z) - sum_v softmax(z)_v z_v, so no `[R, L, vocab]` log-softmax is kept
    beside the logits; `entropy` is None unless `with_entropy`.
    """
    model = nnx.merge(graphdef, params, rest)
    positions, attention = checkpoints.attention_inputs(rows["mask"])
    logits, _ = model(rows["tokens"], positions, None, attention)
    logits = logits[:, :-1].astype(jnp.float32) / temperature  # token n is drawn from the logits at n - 1
    normaliser = jax.nn.logsumexp(logits, axis=-1)
    taken = jnp.take_along_axis(logits, rows["tokens"][:, 1:, None], axis=-1)[..., 0] - normaliser
    logp = jnp.pad(taken, ((0, 0), (1, 0)))
    if not with_entropy:
        return logp, None
    entropy = normaliser - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
    return logp, jnp.pad(entropy, ((0, 0), (1, 0)))


class Learner:
    """The learning side of a chat-model policy: its optimizer state, the KL reference, updates.

    The optimizer keeps float32 master parameters whatever the model's dtype: a
    bfloat16 weight near 1 moves in steps of 2^-8, so an AdamW update of size
    lr = 1e-6 would round to nothing. Each forward pass casts the masters to the
    model's dtypes, and after `learn` the model holds the cast of the new masters.
    The KL reference stays in the model's dtype (it is never updated). With
    `lora_rank` the trained tree is the adapters instead (`_weights` merges
    them into the frozen weights), and the reference, critic trunk and PRM are
    adapters too. Every re-scoring runs `minibatch_rows` rows at a time.

    Args:
      qwen: the loaded policy; `learn` updates `qwen.model` in place (tunix's
        sampler holds the same variables, so the next rollout samples from it).
      config: the settings.
    """

    def __init__(self, qwen: checkpoints.Checkpoint, config: LearnConfig):
        self.qwen, self.config = qwen, config
        self.graphdef, params, rest = nnx.split(qwen.model, nnx.Param, ...)
        self.model_dtypes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        if config.lora_rank:  # the pretrained weights stay frozen, in the model's dtype
            # A tree of its own (the same arrays): the split state shares the model's variables,
            # which `learn` sets to the merged weights.
            self.frozen = {"rest": rest, "base": jax.tree.map(lambda x: x, params)}
            self.params = lora.init(params, rank=config.lora_rank, hidden_size=qwen.model.config.embed_dim,
                                    key=jax.random.key(config.seed))
        else:
            self.frozen = {"rest": rest, "base": None}
            self.params = _compiled_map(_master, params)
        self.tx = make_optimizer(learning_rate=config.learning_rate,
                                 weight_decay=config.weight_decay, grad_clip=config.grad_clip)
        self.opt_state = jax.jit(self.tx.init)(self.params)
        # The reference is the initial model: its parameters, or the initial (B = 0) adapters.
        initial = self.params if config.lora_rank else params
        self.reference = _compiled_map(jnp.copy, initial) if config.loss.kl_coef else None
        entry = registry.get(config.estimator)
        self.estimator_config = entry.resolve(dict(config.estimator_config))
        self._score = jax.jit(self._scores, static_argnames="with_entropy")
        self.needs_entropy = entry.needs_entropy
        self.needs_information_gain = entry.needs_information_gain
        self.needs_mc_values = entry.needs_mc_values
        self.critic_level = ("step" if "step_values" in entry.fields else
                             "token" if "token_values" in entry.fields else None)
        self.critic = self.critic_opt_state = None
        if self.critic_level is not None:
            self.critic = {"trunk": _compiled_map(jnp.copy, self.params),
                           "head": critics.init_head(qwen.model.config.embed_dim)}
            self.critic_tx = make_optimizer(learning_rate=config.critic_learning_rate,
                                            weight_decay=config.weight_decay, grad_clip=config.grad_clip)
            self.critic_opt_state = jax.jit(self.critic_tx.init)(self.critic)
            self._values = jax.jit(self._critic_values)
        self.prm = self.prm_opt_state = None
        if entry.needs_prm:
            self.prm = _compiled_map(jnp.copy, self.params)
            self.prm_tx = make_optimizer(learning_rate=config.prm_learning_rate, weight_decay=0.0,
                                         grad_clip=10.0)
            self.prm_opt_state = jax.jit(self.prm_tx.init)(self.prm)
        self.progress = self.progress_opt_state = None
        if entry.needs_progress:  # SPA: a value-head copy of the model scoring each step's progress
            self.progress = {"trunk": _compiled_map(jnp.copy, self.params),
                             "head": critics.init_head(qwen.model.config.embed_dim)}
            self.progress_tx = make_optimizer(learning_rate=config.progress_learning_rate,
                                              weight_decay=0.0, grad_clip=10.0)
            self.progress_opt_state = jax.jit(self.progress_tx.init)(self.progress)
            self._contributions = jax.jit(self._row_contributions)
        self._adopt(self.as_tree())
        self._compile_updates(params)

    def _compile_updates(self, params) -> None:
        """The update functions, their outputs pinned to their inputs' placement: left to
        itself, sharding propagation over several devices shards some replicated leaves
        (norms, biases, counts), and the next call would compile again for the new layout."""
        replicated = jax.sharding.NamedSharding(self.qwen.mesh, jax.sharding.PartitionSpec())

        def placed(*trees):
            return tuple(jax.tree.map(lambda x: x.sharding, tree) for tree in trees)

        self._micro = jax.jit(self._micro_gradient, out_shardings=(placed(self.params)[0], replicated))
        self._apply = jax.jit(self._apply_update, out_shardings=placed(self.params, self.opt_state))
        self._merge = jax.jit(self._weights, out_shardings=placed(params)[0])
        if self.critic is not None:
            self._critic_step = jax.jit(self._train_critic_step, out_shardings=(
                *placed(self.critic, self.critic_opt_state), replicated))
        if self.prm is not None:
            self._prm_accumulate = jax.jit(self._prm_gradient, donate_argnums=3,
                                           out_shardings=placed(self.prm)[0])
            self._prm_step = jax.jit(self._prm_apply, out_shardings=placed(self.prm, self.prm_opt_state))
        if self.progress is not None:
            self._progress_accumulate = jax.jit(self._progress_gradient, donate_argnums=3,
                                                out_shardings=placed(self.progress)[0])
            self._progress_step = jax.jit(self._progress_apply,
                                          out_shardings=placed(self.progress, self.progress_opt_state))

    def _weights(self, trainable, frozen):
        """The model's parameters, in its dtypes, from the trained tree: the float32 masters, or
        the frozen weights with the LoRA adapters merged in."""
        full = trainable if frozen["base"] is None else lora.merged(
            frozen["base"], trainable, scale=self.config.lora_alpha / self.config.lora_rank)
        return jax.tree.map(lambda x, like: x.astype(like.dtype), full, self.model_dtypes)

    def _scores(self, params, frozen, rows, *, with_entropy: bool):
        return _token_scores(self.graphdef, self._weights(params, frozen), frozen["rest"], rows,
                             self._temperature, with_entropy=with_entropy)

    @property
    def _temperature(self) -> float:
        return self.config.temperature if self.config.temperature > 0 else 1.0

    def _rows_per_call(self, count: int) -> int:
        """Rows per compiled call: `minibatch_rows` (all rows when 0), or for fewer rows the next
        power of two, so that batches of varying size share a few compiled shapes."""
        fitted = 1 << (count - 1).bit_length()
        size = self.config.minibatch_rows or fitted
        return size if count >= size else min(size, fitted)

    def _per_chunk(self, rows: dict[str, np.ndarray], call: Callable[[dict], Any],
                   keys: Sequence[str] = ("tokens", "mask")) -> Any:
        """`call` on the `keys` of `rows`, `minibatch_rows` rows at a time (the last chunk
        padded), its outputs cut to the real rows and joined: the logits of a whole batch,
        `[R, L, vocab]`, would not fit a real model's memory."""
        count = rows["tokens"].shape[0]
        size = self._rows_per_call(count)
        outputs = []
        with jax.set_mesh(self.qwen.mesh):
            for begin in range(0, count, size):
                index = np.arange(begin, min(begin + size, count))
                chunk = _padded_rows({key: rows[key] for key in keys}, index, size)
                outputs.append(jax.tree.map(lambda x: np.asarray(x)[:len(index)], call(chunk)))
        return jax.tree.map(lambda *parts: np.concatenate(parts), *outputs)

    def score(self, params, rows: dict[str, np.ndarray], *, with_entropy: bool
              ) -> tuple[np.ndarray, np.ndarray | None]:
        """`_token_scores` of `rows` under `params` (the policy, the reference or the PRM)."""
        return self._per_chunk(rows, lambda chunk: self._score(params, self.frozen, chunk,
                                                               with_entropy=with_entropy))

    def _critic_values(self, critic, frozen, rows):
        return critics.values(self.graphdef, self._weights(critic["trunk"], frozen), frozen["rest"],
                              critic["head"], rows)

    def values(self, rows: dict[str, np.ndarray]) -> np.ndarray:
        """`[R, L]` critic values of `rows` (`critic.values`)."""
        return self._per_chunk(rows, lambda chunk: self._values(self.critic, self.frozen, chunk))

    def _train_critic_step(self, critic, opt_state, frozen, rows):
        def loss_fn(critic):
            predicted = self._critic_values(critic, frozen, rows)
            loss, _ = value_loss(predicted, rows["old_values"], rows["returns"], rows["value_mask"],
                                 clip=self.config.loss.value_clip)
            return loss

        loss, grads = jax.value_and_grad(loss_fn)(critic)
        updates, opt_state = self.critic_tx.update(grads, opt_state, critic)
        return optax.apply_updates(critic, updates), opt_state, loss

    def _prm_gradient(self, prm, frozen, rows, grads):
        def weighted_logp(prm):
            logp, _ = _token_scores(self.graphdef, self._weights(prm, frozen), frozen["rest"], rows,
                                    self._temperature, with_entropy=False)
            return jnp.sum(jnp.where(rows["action_mask"], rows["weight"] * logp, 0.0))

        return jax.tree.map(jnp.add, grads, jax.grad(weighted_logp)(prm))

    def _prm_apply(self, prm, opt_state, grads):
        updates, opt_state = self.prm_tx.update(grads, opt_state, prm)
        return optax.apply_updates(prm, updates), opt_state

    def update_prm(self, rows: dict[str, np.ndarray], tokens, steps, old_logp: np.ndarray
                   ) -> tuple[np.ndarray, dict[str, float]]:
        """One preference-loss step of the implicit PRM against pi_old's `[B, N]` token log-probs
        `old_logp`; returns the PRM's `[B, N]` log-probs (after or before the step, as
        `prm_rewards_from` says) and `prm/loss`, `prm/accuracy`, `prm/margin`, `prm/num_pairs`."""
        success = np.asarray(steps.score) > 0
        beta = self.estimator_config["beta"]
        num_groups = int(np.max(steps.group_id)) + 1

        def loss_fn(prm_logp):
            return trajectory_preference_loss(prm_logp, old_logp, tokens.action_mask, tokens.step_index,
                                              success, steps.group_id, beta=beta, num_groups=num_groups)

        before = _to_tokens(self.score(self.prm, rows, with_entropy=False)[0], rows, tokens)
        (loss, metrics), upstream = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(before))
        grads = self._weighted_gradient(self._prm_accumulate, self.prm, rows,
                                        _to_rows(np.asarray(upstream), rows, tokens))
        with jax.set_mesh(self.qwen.mesh):
            self.prm, self.prm_opt_state = self._prm_step(self.prm, self.prm_opt_state, grads)
        out = {"prm/loss": float(loss), **{f"prm/{key}": float(value) for key, value in metrics.items()}}
        if self.config.prm_rewards_from == "pre_update_prm":
            return before, out
        return _to_tokens(self.score(self.prm, rows, with_entropy=False)[0], rows, tokens), out

    def _weighted_gradient(self, accumulate, tree, rows: dict[str, np.ndarray], weights: np.ndarray):
        """The gradient in `tree` of sum(weights * the model's outputs), accumulated over chunks of
        `minibatch_rows` rows by `accumulate(tree, frozen, chunk, grads)` (the PRM's or the
        progress estimator's); with `weights` the loss's gradient in those outputs, this is the
        loss's gradient, exactly (the chain rule), without the whole batch in one pass."""
        count = rows["tokens"].shape[0]
        size = self._rows_per_call(count)
        with jax.set_mesh(self.qwen.mesh):  # compiled throughout: no op-by-op dispatch of the tree
            grads = _compiled_map(jnp.zeros_like, tree)
            for begin in range(0, count, size):
                chunk = _padded_rows({"tokens": rows["tokens"], "mask": rows["mask"],
                                      "action_mask": rows["action_mask"], "weight": weights},
                                     np.arange(begin, min(begin + size, count)), size)
                grads = accumulate(tree, self.frozen, chunk, grads)
        return grads

    def _row_contributions(self, progress, frozen, rows):
        """`[R]` c of each row: the head on the state after its last token, 0 without an action."""
        out = critics.head_outputs(self.graphdef, self._weights(progress["trunk"], frozen), frozen["rest"],
                                   progress["head"], rows)
        last = jnp.maximum(rows["mask"].sum(axis=1) - 1, 0)
        return jnp.where(rows["action_mask"].any(axis=1), out[jnp.arange(out.shape[0]), last], 0.0)

    def _progress_gradient(self, progress, frozen, rows, grads):
        def weighted(progress):
            return jnp.sum(rows["weight"] * self._row_contributions(progress, frozen, rows))

        return jax.tree.map(jnp.add, grads, jax.grad(weighted)(progress))

    def _progress_apply(self, progress, opt_state, grads):
        updates, opt_state = self.progress_tx.update(grads, opt_state, progress)
        return optax.apply_updates(progress, updates), opt_state

    def update_progress(self, rows: dict[str, np.ndarray], steps, trajectories: Sequence[Trajectory]
                        ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """`progress_steps` optimizer steps of SPA's progress estimator on the batch (arXiv
        2505.20732: the contributions c_t of a trajectory's steps fit its outcome, the score,
        `advantages.progress_loss`), each gradient accumulated exactly over row chunks as the
        PRM's; returns the credit inputs `progress` (`[B, T]` c_t after the steps) and
        `grounding` (`train.progress.grounding_signal`), and `progress/loss` (before the
        first step), `progress/loss_after`."""
        b, t = rows["trajectory"], rows["step"]
        mask, outcomes = np.asarray(steps.mask), np.asarray(steps.score)

        def step_view(per_row):
            view = np.zeros(mask.shape, np.float32)
            view[b, t] = per_row
            return view

        def contributions():
            return step_view(self._per_chunk(
                rows, lambda chunk: self._contributions(self.progress, self.frozen, chunk),
                keys=("tokens", "mask", "action_mask")))

        losses = []
        for _ in range(self.config.progress_steps):
            loss, upstream = jax.value_and_grad(progress_loss)(jnp.asarray(contributions()), mask, outcomes)
            losses.append(float(loss))
            grads = self._weighted_gradient(self._progress_accumulate, self.progress, rows,
                                            np.asarray(upstream)[b, t])
            with jax.set_mesh(self.qwen.mesh):
                self.progress, self.progress_opt_state = self._progress_step(
                    self.progress, self.progress_opt_state, grads)
        after = contributions()
        loss_after = float(progress_loss(jnp.asarray(after), mask, outcomes))
        return ({"progress": after, "grounding": grounding_signal(trajectories, mask.shape[1])},
                {"progress/loss": losses[0] if losses else loss_after, "progress/loss_after": loss_after})

    def _micro_gradient(self, params, frozen, rows, grads, shares):
        """`grads` plus the gradient of this micro-batch's share of its minibatch's loss, and
        those shares of the loss terms: a term aggregated over the minibatch's tokens (or rows)
        is the micro-batches' own aggregates weighted by their shares of those tokens (rows)."""
        loss_config = self.config.loss

        def loss_fn(params):
            logp, _ = _token_scores(self.graphdef, self._weights(params, frozen), frozen["rest"], rows,
                                    self._temperature, with_entropy=False)
            policy, _ = policy_loss(loss_config, logp, rows["old_logp"], rows["advantages"],
                                    rows["action_mask"])
            metrics = {"loss/policy": shares["policy"] * policy}
            loss = metrics["loss/policy"]
            if loss_config.kl_coef:
                kl, _ = kl_loss(logp, rows["ref_logp"], rows["action_mask"], kind=loss_config.kl_kind)
                metrics["loss/kl"] = shares["tokens"] * kl
                loss = loss + loss_config.kl_coef * metrics["loss/kl"]
            metrics["loss/total"] = loss
            return loss, metrics

        gradient, metrics = jax.grad(loss_fn, has_aux=True)(params)
        return jax.tree.map(jnp.add, grads, gradient), metrics

    def _apply_update(self, params, opt_state, grads):
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def _policy_update(self, chunk: dict[str, np.ndarray]) -> dict[str, float]:
        """One AdamW step on a minibatch, its gradient accumulated over `micro_rows`-row
        micro-batches (all at once when 0): exact, since each term's micro-batch aggregate is
        weighted by its share of the minibatch's tokens (token-mean) or of its rows with an
        action (the seq-mean aggregations and StepPO's step ratio)."""
        action_mask = chunk["action_mask"]
        loss_config = self.config.loss
        by_rows = loss_config.step_level_ratio or loss_config.agg != "token-mean"
        tokens, rows = action_mask.sum(axis=1), action_mask.any(axis=1)
        size = len(action_mask)
        micro = min(self.config.micro_rows or size, size)
        grads = _compiled_map(jnp.zeros_like, self.params)
        totals: dict[str, float] = {}
        for begin in range(0, size, micro):
            part = slice(begin, begin + micro)
            token_share = np.float32(tokens[part].sum() / max(tokens.sum(), 1))
            row_share = np.float32(rows[part].sum() / max(rows.sum(), 1))
            shares = {"tokens": token_share, "policy": row_share if by_rows else token_share}
            grads, metrics = self._micro(self.params, self.frozen,
                                         {key: jnp.asarray(value[part]) for key, value in chunk.items()},
                                         grads, shares)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        self.params, self.opt_state = self._apply(self.params, self.opt_state, grads)
        return totals

    def answer_beliefs(self, trajectories: Sequence[Trajectory], prefix: Sequence[int] | None
                       ) -> np.ndarray:
        """IGPO's `[B, T]` beliefs b_t (arXiv 2510.14967): the mean log-prob of trajectory b's
        `answer` teacher-forced after step t's prompt and `prefix` (the answer action's ids
        before the answer, e.g. those of `<action>finish[`) under the policy that sampled the
        batch; 0 where a trajectory has no answer or `prefix` is None."""
        longest = max(len(t.steps) for t in trajectories)
        beliefs = np.zeros((len(trajectories), longest), np.float32)
        if prefix is None or all(t.answer is None for t in trajectories):
            return beliefs
        forced = []
        for t in trajectories:
            ids = [] if t.answer is None else self.qwen.tokenizer.encode(t.answer, add_special_tokens=False)
            forced.append(Trajectory(steps=tuple(
                StepRecord(observation_ids=[], action_ids=ids, action_logp=[0.0] * len(ids), reward=0.0,
                           prompt_ids=[*step.prompt_ids, *prefix]) for step in t.steps) if ids else ()))
        rows = step_rows(forced, beliefs)
        logp, _ = self.score(self.params, rows, with_entropy=False)
        counts = rows["action_mask"].sum(axis=1)
        means = np.where(rows["action_mask"], logp, 0.0).sum(axis=1) / np.maximum(counts, 1)
        beliefs[rows["trajectory"], rows["step"]] = means
        return beliefs

    def learn(self, trajectories: Sequence[Trajectory], *, iteration: int,
              answer_prefix: Sequence[int] | None = None) -> dict[str, float]:
        """Credit, step rows and `epochs` passes of updates on iteration `iteration`'s batch
        (its minibatch order is a fixed function of the seed and `iteration`, so a resumed
        run shuffles as an uninterrupted one); `answer_prefix` is IGPO's (`answer_beliefs`).

        Returns:
          `loss/policy`, `loss/total` (and `loss/kl`, `loss/value` with a KL term
          or a critic), each the mean over the batch's optimizer steps, `rows`,
          the step rows trained on, and the PRM's, progress estimator's or IGPO's
          metrics (`prm/...`, `progress/...`, `igpo/gain_mean`) where they apply.
        """
        longest = max(len(t.steps) for t in trajectories)
        rows = step_rows(trajectories, np.zeros((len(trajectories), longest), np.float32))
        if self.needs_entropy:  # EMPG: the sampling policy's entropies, re-scored before the update
            trajectories = with_entropies(trajectories, rows,
                                          self.score(self.params, rows, with_entropy=True)[1])
        if self.reference is not None:
            rows["ref_logp"] = self.score(self.reference, rows, with_entropy=False)[0]
        token_values = None
        if self.critic is not None:
            rows["old_values"] = self.values(rows)
            trajectories = self._with_values(trajectories, rows)
        steps, tokens, _ = collate(trajectories, with_observations=False)
        if self.critic_level == "token":
            token_values = _to_tokens(rows["old_values"], rows, tokens)
        inputs, credit_metrics = {}, {}  # what the estimator reads beyond the batch, and its metrics
        if self.needs_information_gain:
            inputs["answer_logp"] = self.answer_beliefs(trajectories, answer_prefix)
            credit_metrics["igpo/gain_mean"] = information_gain.gain_mean(
                inputs["answer_logp"], steps.mask, gain=self.estimator_config["gain"])
        if self.needs_mc_values:  # VinePPO: `stepcredit.llm.vine.with_mc_values` put them in the infos
            inputs["mc_values"] = mc_value_array(trajectories, steps.mask.shape[1])
        if self.progress is not None:
            progress_inputs, progress_metrics = self.update_progress(rows, steps, trajectories)
            inputs.update(progress_inputs)
            credit_metrics.update(progress_metrics)
        if self.prm is not None:  # pi_old: this update's starting policy, scored as the PRM is
            inputs["ref_logp"] = _to_tokens(self.score(self.params, rows, with_entropy=False)[0], rows,
                                            tokens)
            inputs["prm_logp"], prm_metrics = self.update_prm(rows, tokens, steps, inputs["ref_logp"])
            credit_metrics.update(prm_metrics)
        credit = compute_advantages(steps, tokens, self.config.estimator, token_values=token_values,
                                    **inputs, **self.estimator_config)
        # token-level credit on the rows' action tokens (a step estimator's is its step's, broadcast)
        rows["advantages"] = _to_rows(np.asarray(credit.token_advantages), rows, tokens)
        if self.critic is not None:
            rows["returns"], rows["value_mask"] = self._value_targets(credit.returns, rows, tokens)
        count = rows["tokens"].shape[0]
        size = self._rows_per_call(count)
        with jax.set_mesh(self.qwen.mesh):
            order = np.random.default_rng([self.config.seed, iteration])
            history = []
            for _ in range(self.config.epochs):
                shuffled = order.permutation(count)
                for begin in range(0, count, size):
                    chunk = _padded_rows(rows, shuffled[begin:begin + size], size, on_device=False)
                    metrics = self._policy_update(chunk)
                    if self.critic is not None:
                        critic_rows = {key: jnp.asarray(value) for key, value in chunk.items()}
                        self.critic, self.critic_opt_state, metrics["loss/value"] = self._critic_step(
                            self.critic, self.critic_opt_state, self.frozen, critic_rows)
                    history.append(metrics)
        nnx.update(self.qwen.model, self._merge(self.params, self.frozen))
        out = {key: float(np.mean([float(m[key]) for m in history])) for key in history[0]}
        out["rows"] = float(count)
        return {**out, **credit_metrics}

    def _with_values(self, trajectories: Sequence[Trajectory], rows: dict[str, np.ndarray]
                     ) -> list[Trajectory]:
        """`trajectories` with each step's `value` V(s_t) (its row's value at the first action
        token) and, for an episode cut by a limit, `bootstrap_value` V(s_next) (the value after
        the prompt of the state it was cut in, `info["next_prompt_ids"]`)."""
        first = np.argmax(rows["action_mask"], axis=1)
        prompt_length = rows["mask"].sum(axis=1) - rows["action_mask"].sum(axis=1)
        at = np.where(rows["action_mask"].any(axis=1), first, prompt_length)
        state_values = rows["old_values"][np.arange(len(at)), at]
        cut = [b for b, t in enumerate(trajectories) if t.steps and t.steps[-1].truncated]
        bootstrap = {}
        if cut:
            prompts = [trajectories[b].steps[-1].info["next_prompt_ids"] for b in cut]
            end = max(len(prompt) for prompt in prompts) + 1
            width = 1 << (end - 1).bit_length()
            next_rows = {"tokens": np.zeros((len(cut), width), np.int32),
                         "mask": np.zeros((len(cut), width), bool)}
            for i, prompt in enumerate(prompts):  # V at position len(prompt) reads the prompt's last state
                next_rows["tokens"][i, :len(prompt)] = prompt
                next_rows["mask"][i, :len(prompt) + 1] = True
            next_values = self.values(next_rows)
            bootstrap = {b: float(next_values[i, len(prompts[i])]) for i, b in enumerate(cut)}
        out, r = [], 0
        for b, trajectory in enumerate(trajectories):
            valued = []
            for step in trajectory.steps:
                valued.append(dataclasses.replace(step, value=float(state_values[r])))
                r += 1
            out.append(dataclasses.replace(trajectory, steps=tuple(valued),
                                           bootstrap_value=bootstrap.get(b, trajectory.bootstrap_value)))
        return out

    def _value_targets(self, returns, rows: dict[str, np.ndarray], tokens) -> tuple[np.ndarray, np.ndarray]:
        """The critic's `[R, L]` targets and where they apply: a step critic learns V(s_t) at each
        row's first action token from `[B, T]` returns, a token critic every action token's
        value from `[B, N]` returns."""
        returns = np.asarray(returns, np.float32)
        if self.critic_level == "token":
            return _to_rows(returns, rows, tokens), rows["action_mask"].copy()
        first = np.argmax(rows["action_mask"], axis=1)
        mask = np.zeros_like(rows["action_mask"])
        has_action = rows["action_mask"].any(axis=1)
        mask[np.arange(len(first))[has_action], first[has_action]] = True
        targets = np.zeros(rows["action_mask"].shape, np.float32)
        b, t = rows["trajectory"], rows["step"]
        targets[np.arange(len(first)), first] = returns[b, t]
        return np.where(mask, targets, 0.0).astype(np.float32), mask

    def _adopt(self, tree: dict[str, Any]) -> None:
        """Takes `tree` (the layout of `as_tree`) as the learner's state, each array placed as
        the learner's own: parameters keep their sharding over the model's mesh; the rest
        (optimizer counts, heads, adapters, moments of unsharded leaves) is replicated over it,
        as jit under the mesh returns them (so the second update compiles nothing new)."""
        replicated = jax.sharding.NamedSharding(self.qwen.mesh, jax.sharding.PartitionSpec())

        def placed(restored, current):
            sharding = current.sharding
            if not isinstance(sharding, jax.sharding.NamedSharding):
                sharding = replicated
            return jax.device_put(restored, sharding)

        current = self.as_tree()
        tree = jax.tree.map(placed, {key: tree[key] for key in current}, current)
        self.params, self.opt_state = tree["params"], tree["opt"]
        self.reference = tree.get("reference", self.reference)
        self.critic = tree.get("critic", self.critic)
        self.critic_opt_state = tree.get("critic_opt", self.critic_opt_state)
        self.prm = tree.get("prm", self.prm)
        self.prm_opt_state = tree.get("prm_opt", self.prm_opt_state)
        self.progress = tree.get("progress", self.progress)
        self.progress_opt_state = tree.get("progress_opt", self.progress_opt_state)

    def as_tree(self) -> dict[str, Any]:
        """The checkpoint layout: the float32 master parameters, optimizer state, the
        reference, the critic, the PRM and SPA's progress estimator with their optimizer
        states (when kept)."""
        tree = {"params": self.params, "opt": self.opt_state}
        if self.reference is not None:
            tree["reference"] = self.reference
        if self.critic is not None:
            tree["critic"], tree["critic_opt"] = self.critic, self.critic_opt_state
        if self.prm is not None:
            tree["prm"], tree["prm_opt"] = self.prm, self.prm_opt_state
        if self.progress is not None:
            tree["progress"], tree["progress_opt"] = self.progress, self.progress_opt_state
        return tree

    def load(self, tree: dict[str, Any]) -> None:
        """Takes the state of `as_tree` (a restored checkpoint) into the learner and the model."""
        self._adopt(tree)
        nnx.update(self.qwen.model, self._merge(self.params, self.frozen))


def _token_positions(rows: dict[str, np.ndarray], tokens) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """For each row r: (b, its action positions in the row, the same tokens' positions in
    `tokens`, the collated `[B, N]` view, where step t's actions are those of step_index t)."""
    out = []
    for r, (b, t) in enumerate(zip(rows["trajectory"], rows["step"])):
        in_row = np.flatnonzero(rows["action_mask"][r])
        in_tokens = np.flatnonzero(tokens.step_index[b] == t)
        if len(in_row) != len(in_tokens):
            raise ValueError(f"step row {r} (trajectory {b}, step {t}) has {len(in_row)} action "
                             f"tokens, the collated batch {len(in_tokens)}")
        out.append((int(b), in_row, in_tokens))
    return out


def _to_tokens(row_values: np.ndarray, rows: dict[str, np.ndarray], tokens) -> np.ndarray:
    """`[R, L]` values on the rows' action tokens, laid out as the collated `[B, N]` batch."""
    out = np.zeros(tokens.tokens.shape, np.float32)
    for r, (b, in_row, in_tokens) in enumerate(_token_positions(rows, tokens)):
        out[b, in_tokens] = row_values[r, in_row]
    return out


def _to_rows(token_values: np.ndarray, rows: dict[str, np.ndarray], tokens) -> np.ndarray:
    """`[B, N]` values of the collated batch's action tokens, put back on the `[R, L]` rows."""
    out = np.zeros(rows["action_mask"].shape, np.float32)
    for r, (b, in_row, in_tokens) in enumerate(_token_positions(rows, tokens)):
        out[r, in_row] = token_values[b, in_tokens]
    return out


def _compiled_map(fn: Callable[[jax.Array], jax.Array], tree):
    """`jax.tree.map(fn, tree)` as one compiled call: a model's hundreds of leaves are not
    dispatched op by op (which has also aborted the process inside jaxlib on CPU under xdist)."""
    return _tree_mapper(fn)(tree)


@functools.lru_cache(maxsize=None)
def _tree_mapper(fn):
    return jax.jit(lambda tree: jax.tree.map(fn, tree))


def _master(leaf: jax.Array) -> jax.Array:
    """A floating parameter in float32 (the optimizer's copy); others as they are."""
    return leaf.astype(jnp.float32) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf


def with_entropies(trajectories: Sequence[Trajectory], rows: dict[str, np.ndarray],
                   entropy: np.ndarray) -> list[Trajectory]:
    """`trajectories` with each step's `action_entropy` read from `[R, L]` token entropies of its
    `step_rows` row (None for a step that sampled no token)."""
    out, r = [], 0
    for trajectory in trajectories:
        steps = []
        for step in trajectory.steps:
            span = rows["action_mask"][r]
            values = entropy[r][span].tolist()
            steps.append(dataclasses.replace(step, action_entropy=values or None))
            r += 1
        out.append(dataclasses.replace(trajectory, steps=tuple(steps)))
    return out


def _padded_rows(rows: dict[str, np.ndarray], index: np.ndarray, size: int, *,
                 on_device: bool = True) -> dict[str, Any]:
    """Rows `index`, with empty rows (all False masks) appended up to `size` (as device arrays,
    or host ones without `on_device`)."""
    out = {}
    for key, value in rows.items():
        chunk = value[index]
        if len(index) < size:
            chunk = np.concatenate([chunk, np.zeros((size - len(index),) + value.shape[1:], value.dtype)])
        out[key] = jnp.asarray(chunk) if on_device else chunk
    return out


def play_batch(qwen: checkpoints.Checkpoint, make_env: Callable[[], Env], tasks: Sequence[Any],
               config: LearnConfig, *, iteration: int, round_: int = 0,
               max_steps: int | None = None) -> list[Trajectory]:
    """The batch of an iteration: G episodes of each task (`rollout.play_group`), group k = task k;
    `round_` > 0 for the refills of dynamic sampling (their own sampling seeds)."""
    trajectories = []
    for k, task in enumerate(tasks):
        trajectories += rollout.play_group(
            qwen, make_env, task, group_size=config.group_size, group_id=k,
            seed=config.seed * 100_003 + iteration * len(tasks) + k + round_ * 1_000_003,
            max_new_tokens=config.max_new_tokens, temperature=config.temperature,
            window=config.window, max_steps=max_steps,
            invalid_action_penalty=config.invalid_action_penalty)
    return trajectories


__all__: Sequence[str] = ("LearnConfig", "Learner", "play_batch", "step_rows", "with_entropies")
