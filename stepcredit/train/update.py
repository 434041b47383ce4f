"""The compiled learner: one optax step of policy, critic and KL losses on step rows.

Everything here is a pure function of (parameters, optimizer state, a
minibatch of step rows) compiled with `jax.jit` over the split NNX state.
Inputs may be sharded over a mesh's batch axis with the parameters
replicated: XLA then averages the gradients across devices (data parallel).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from stepcredit import losses
from stepcredit.models.sharing import SharedRows
from stepcredit.models.transformer import RowScores, score_actions, score_rows


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """What the learner optimises (hashable: it is a static argument of the jitted step).

    Attributes:
      clip_low, clip_high: PPO clip range (DAPO's clip-higher: 0.2 / 0.28); clip_high
        None is clip_low, unless the trainer's estimator recipe sets it
        (`stepcredit.train.build.resolve`).
      agg: token aggregation of the policy loss (see `stepcredit.losses.agg_loss`).
      max_response_length: the constant of agg="seq-mean-token-sum-norm".
      step_level_ratio: StepPO's length-normalised step ratio (GSPO) instead of
        per-token ratios; its clip range is step_clip_low / step_clip_high.
      decoupled: AReaL's decoupled PPO (stale rollouts), capping the
        behaviour weight at behav_weight_cap.
      value_coef: weight of the critic loss (0: no critic; the trainer sets
        `build.DEFAULT_VALUE_COEF` for an estimator with a critic when it is 0).
      value_clip: PPO value clipping, or None.
      kl_coef, kl_kind: KL penalty to the reference policy (0: none).
      entropy_coef: entropy bonus weight.
      temperature: the sampling temperature the log-probs refer to.
      choice_markers: the policy points at the labels that these markers
        follow in each row (the rollout's constrained "choice" format; see
        `TransformerPolicy.choice_logits`); () leaves it unconstrained.
      action_width: the most action tokens in a row; when given, the
        language-model head runs on the action tokens only
        (`stepcredit.models.score_actions`); None scores every position.
    """

    clip_low: float = 0.2
    clip_high: float | None = None
    agg: str = "token-mean"
    max_response_length: int | None = None
    step_level_ratio: bool = False
    step_clip_low: float = 3e-4
    step_clip_high: float = 4e-4
    decoupled: bool = False
    behav_weight_cap: float | None = None
    value_coef: float = 0.0
    value_clip: float | None = None
    kl_coef: float = 0.0
    kl_kind: str = "low_var_kl"
    entropy_coef: float = 0.0
    temperature: float = 1.0
    choice_markers: tuple[int, ...] = ()
    action_width: int | None = None

    def __post_init__(self):
        # A static jit argument must hash: a list read back from JSON becomes a tuple.
        object.__setattr__(self, "choice_markers", tuple(self.choice_markers))
        # Checked here, before any rollout: inside the update a NaN weight trains on NaN.
        optional = ("clip_high", "behav_weight_cap", "value_clip")
        for name in ("clip_low", "step_clip_low", "step_clip_high", "value_coef", "kl_coef",
                     "entropy_coef", "temperature", *optional):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            finite = (isinstance(value, (int, float)) and not isinstance(value, bool)
                      and math.isfinite(value))
            if not finite:
                raise ValueError(f"LossConfig: {name}={value!r}; it must be a finite number")
        for name in ("value_coef", "kl_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"LossConfig: {name}={getattr(self, name)}; it must be >= 0")
        if not self.temperature > 0:
            raise ValueError(f"LossConfig: temperature={self.temperature}; it must be > 0 (the "
                             "sampling temperature of the scored log-probs)")


class Minibatch(NamedTuple):
    """`[M, L]` step rows with what the losses read (see `StepRowBatch`)."""

    tokens: jax.Array
    mask: jax.Array
    action_mask: jax.Array
    advantages: jax.Array
    old_logp: jax.Array
    behav_logp: jax.Array
    ref_logp: jax.Array
    old_values: jax.Array
    returns: jax.Array
    value_mask: jax.Array


def _row_scores(graphdef, state, tokens, mask, action_mask, temperature, *,
                choice_markers: tuple[int, ...], width: int | None,
                shared: SharedRows | None = None, label_slots: int | None = None) -> RowScores:
    if width:
        return score_actions(graphdef, state, tokens, mask, action_mask, temperature, width=width,
                             choice_markers=choice_markers, shared=shared,
                             label_slots=label_slots)
    return score_rows(graphdef, state, tokens, mask, temperature, choice_markers=choice_markers)


def policy_loss(config: LossConfig, logp, old_logp, advantages, action_mask, behav_logp=None):
    """The policy term of `config` on `[R, L]` step rows (one step per row).

    PPO's clipped surrogate (`losses.ppo_clip_loss`), AReaL's decoupled form
    against `behav_logp` (`losses.decoupled_ppo_loss`), or StepPO's
    length-normalised step ratio (`losses.step_ppo_loss`) over each row's action
    tokens.

    Args:
      logp, old_logp, advantages: `[R, L]` float32; action_mask: `[R, L]` bool;
      behav_logp: `[R, L]` the behaviour policy's log-probs (decoupled only).

    Returns:
      `(loss, metrics)`.
    """
    if config.step_level_ratio:
        step_index = jnp.where(action_mask, 0, -1)
        # A row is one step: its step advantage is the mean over its action tokens
        # (the broadcast value itself for step-level estimators).
        count = jnp.sum(action_mask, axis=1, keepdims=True)
        step_advantages = jnp.sum(jnp.where(action_mask, advantages, 0.0), axis=1,
                                  keepdims=True) / jnp.maximum(count, 1)
        has_action = count > 0
        return losses.step_ppo_loss(logp, old_logp, jnp.where(has_action, step_advantages, 0.0),
                                    step_index, has_action, clip_low=config.step_clip_low,
                                    clip_high=config.step_clip_high)
    clip_high = config.clip_low if config.clip_high is None else config.clip_high
    if config.decoupled:
        return losses.decoupled_ppo_loss(logp, old_logp, behav_logp, advantages,
                                         action_mask, clip_low=config.clip_low,
                                         clip_high=clip_high,
                                         behav_weight_cap=config.behav_weight_cap, agg=config.agg,
                                         max_response_length=config.max_response_length)
    return losses.ppo_clip_loss(logp, old_logp, advantages, action_mask,
                                clip_low=config.clip_low, clip_high=clip_high,
                                agg=config.agg, max_response_length=config.max_response_length)


def total_loss(state: nnx.State, graphdef: nnx.GraphDef, config: LossConfig,
               batch: Minibatch, shared: SharedRows | None = None,
               label_slots: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Policy loss + value_coef * value loss + kl_coef * KL - entropy_coef * entropy.

    With `config.action_width`: `shared`, the model runs once per kind of row
    (`stepcredit.models.sharing.shared_rows`), each row keeping its own terms;
    `label_slots`, the most labels a row holds (`score_actions`).
    """
    scores = _row_scores(graphdef, state, batch.tokens, batch.mask, batch.action_mask,
                         config.temperature, choice_markers=config.choice_markers,
                         width=config.action_width, shared=shared, label_slots=label_slots)
    loss, metrics = policy_loss(config, scores.logprobs, batch.old_logp, batch.advantages,
                                batch.action_mask, batch.behav_logp)
    metrics = {f"policy/{k}": v for k, v in metrics.items()}
    metrics["loss/policy"] = loss
    if config.value_coef:
        v_loss, v_metrics = losses.value_loss(scores.values, batch.old_values, batch.returns,
                                              batch.value_mask, clip=config.value_clip)
        loss = loss + config.value_coef * v_loss
        metrics["loss/value"] = v_loss
    if config.kl_coef:
        kl, _ = losses.kl_loss(scores.logprobs, batch.ref_logp, batch.action_mask,
                               kind=config.kl_kind)
        loss = loss + config.kl_coef * kl
        metrics["loss/kl"] = kl
    count = jnp.maximum(jnp.sum(batch.action_mask), 1)
    entropy = jnp.sum(jnp.where(batch.action_mask, scores.entropies, 0.0)) / count
    loss = loss - config.entropy_coef * entropy
    metrics["policy/entropy"] = entropy
    metrics["loss/total"] = loss
    return loss, metrics


@functools.partial(jax.jit, static_argnames=("graphdef", "tx", "config", "label_slots"),
                   donate_argnums=(0, 1))
def train_step(state: nnx.State, opt_state: Any, batch: Minibatch, *, graphdef: nnx.GraphDef,
               tx: optax.GradientTransformation, config: LossConfig,
               shared: SharedRows | None = None, label_slots: int | None = None):
    """One optimizer step on a minibatch (`shared`, `label_slots`: see `total_loss`);
    returns (state, opt_state, metrics)."""
    grads, metrics = jax.grad(total_loss, has_aux=True)(state, graphdef, config, batch, shared,
                                                        label_slots)
    metrics["optim/grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, metrics


@functools.partial(jax.jit, static_argnames=("graphdef", "choice_markers", "width",
                                             "label_slots"))
def score(state: nnx.State, tokens: jax.Array, mask: jax.Array, action_mask: jax.Array,
          temperature: jax.Array, *, graphdef: nnx.GraphDef,
          choice_markers: tuple[int, ...] = (), width: int | None = None,
          shared: SharedRows | None = None, label_slots: int | None = None) -> RowScores:
    """Log-probs, entropies and values of step rows under `state` (no gradient);
    with `width`, log-probs and entropies at the action tokens only (0 elsewhere), the
    model run once per kind of row given `shared` (`score_actions`)."""
    return _row_scores(graphdef, state, tokens, mask, action_mask, temperature,
                       choice_markers=choice_markers, width=width, shared=shared,
                       label_slots=label_slots)


@functools.partial(jax.jit, static_argnames=("graphdef", "choice_markers", "width",
                                             "label_slots"))
def weighted_logprob_gradient(state: nnx.State, tokens: jax.Array, mask: jax.Array,
                              action_mask: jax.Array, weights: jax.Array, temperature: jax.Array,
                              *, graphdef: nnx.GraphDef, choice_markers: tuple[int, ...] = (),
                              width: int | None = None, shared: SharedRows | None = None,
                              label_slots: int | None = None) -> nnx.State:
    """The gradient in `state` of sum_{r, l} w_{r, l} log pi(y_{r, l}) over the `[R, L]`
    rows' action tokens (weights `[R, L]`, 0 elsewhere), scored as `score` scores them.

    With w the gradient of a loss in the rows' log-probs, this is the loss's gradient
    (the chain rule), so a loss over the whole batch (iStar's preference loss ties a
    group's trajectories together) is differentiated a chunk of rows at a time and the
    chunks' gradients summed, exactly, without the whole batch's activations at once."""
    def weighted(state):
        logp = _row_scores(graphdef, state, tokens, mask, action_mask, temperature,
                           choice_markers=choice_markers, width=width, shared=shared,
                           label_slots=label_slots).logprobs
        return jnp.sum(jnp.where(action_mask, weights * logp, 0.0))

    return jax.grad(weighted)(state)


@functools.lru_cache(maxsize=None)
def make_optimizer(*, learning_rate: float, weight_decay: float,
                   grad_clip: float) -> optax.GradientTransformation:
    """AdamW with global-norm gradient clipping.

    The learning rate lives in the optimizer state (`optax.inject_hyperparams`),
    so a schedule sets it between updates (`with_learning_rate`) without a new
    optimizer or a recompile. Cached: equal settings return the same object, so
    the jitted steps that take it as a static argument compile once per process,
    not once per trainer.
    """
    return optax.chain(optax.clip_by_global_norm(grad_clip),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=learning_rate,
                                                             weight_decay=weight_decay))


def with_learning_rate(opt_state, learning_rate: float):
    """A `make_optimizer` state whose next updates use `learning_rate` (a new state)."""
    clip_state, adamw_state = opt_state
    current = adamw_state.hyperparams["learning_rate"]
    hyperparams = {**adamw_state.hyperparams,
                   "learning_rate": jnp.asarray(learning_rate, current.dtype)}
    return type(opt_state)((clip_state, adamw_state._replace(hyperparams=hyperparams)))


def supervised_loss(state: nnx.State, graphdef: nnx.GraphDef, tokens, mask, action_mask,
                    choice_markers: tuple[int, ...] = (), width: int | None = None):
    """Mean negative log-likelihood of the action tokens (the expert warm start)."""
    scores = _row_scores(graphdef, state, tokens, mask, action_mask, 1.0,
                         choice_markers=choice_markers, width=width)
    count = jnp.maximum(jnp.sum(action_mask), 1)
    return -jnp.sum(jnp.where(action_mask, scores.logprobs, 0.0)) / count


@functools.partial(jax.jit, static_argnames=("graphdef", "tx", "choice_markers", "width"),
                   donate_argnums=(0, 1))
def supervised_step(state, opt_state, tokens, mask, action_mask, *, graphdef, tx,
                    choice_markers: tuple[int, ...] = (), width: int | None = None):
    """One optimizer step of `supervised_loss`; returns (state, opt_state, loss)."""
    loss, grads = jax.value_and_grad(supervised_loss)(state, graphdef, tokens, mask, action_mask,
                                                      choice_markers, width)
    updates, opt_state = tx.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, loss
