"""Training a chat-model policy on stepcredit environments with any critic-free estimator.

One iteration: for each of K tasks, `rollout.play_group` plays G episodes;
`compute_advantages` gives every step its advantage; each step becomes one row
`prompt_ids + action_ids` (token-exact, as sampled) whose action tokens carry
the step's advantage; `Learner.learn` takes `epochs` passes of AdamW steps over
minibatches of those rows on the trainer's policy loss
(`stepcredit.train.update.policy_loss`: PPO's clipped surrogate, or StepPO's
step ratio) against the log-probs stored at sampling, plus `kl_coef` times the
KL to a frozen copy of the initial model. Rows are right-padded to a power of
two; a short last minibatch is padded with empty rows (no action tokens), so
each row length compiles one update.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from stepcredit.advantages import registry
from stepcredit.batch import Trajectory, collate
from stepcredit.credit import compute_advantages
from stepcredit.envs.base import Env
from stepcredit.llm import checkpoint as checkpoints
from stepcredit.llm import rollout
from stepcredit.losses import kl_loss
from stepcredit.train.update import LossConfig, make_optimizer, policy_loss


@dataclasses.dataclass(frozen=True)
class LearnConfig:
    """Settings of `Learner` and `play_batch`.

    Attributes:
      estimator: a registered estimator that needs no critic, PRM or rollout
        trees (grpo, rloo, gigpo, grpo+empg, reinforce_pp, mt_grpo, ...); one
        that reads entropies gets the sampling policy's, re-scored before the
        update.
      estimator_config: (name, value) pairs overriding its defaults.
      iterations, tasks_per_iteration, group_size: K tasks x G episodes each.
      max_new_tokens, temperature, window: sampling and prompt settings.
      invalid_action_penalty: subtracted from the reward of an invalid action.
      learning_rate, weight_decay, grad_clip: AdamW and global-norm clipping.
      epochs: passes over each batch; minibatch_rows: rows per step (0: all).
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
    loss: LossConfig = LossConfig()
    seed: int = 0


def step_rows(trajectories: Sequence[Trajectory], step_advantages) -> dict[str, np.ndarray]:
    """Padded step rows: `tokens`, `mask`, `action_mask`, `old_logp` and `advantages`, `[R, L]`.

    Row r is step t of trajectory b, `prompt_ids + action_ids`, right-padded to
    the next power of two of the longest row; the advantage
    `step_advantages[b, t]` sits on its action tokens, and `old_logp[r, n]` is
    the stored log-prob of the token at position n.
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
    longest = max(len(step.prompt_ids) + len(step.action_ids) for _, _, step in records)
    shape = (len(records), 1 << (longest - 1).bit_length())  # a power of two: few compiled shapes
    out = {"tokens": np.zeros(shape, np.int32), "mask": np.zeros(shape, bool),
           "action_mask": np.zeros(shape, bool), "old_logp": np.zeros(shape, np.float32),
           "advantages": np.zeros(shape, np.float32)}
    for r, (b, t, step) in enumerate(records):
        prompt, action = len(step.prompt_ids), len(step.action_ids)
        out["tokens"][r, :prompt + action] = list(step.prompt_ids) + list(step.action_ids)
        out["mask"][r, :prompt + action] = True
        out["action_mask"][r, prompt:prompt + action] = True
        out["old_logp"][r, prompt:prompt + action] = step.action_logp
        out["advantages"][r, prompt:prompt + action] = advantages[b, t]
    return out


def _token_scores(graphdef, params, rest, rows, temperature: float) -> tuple[jax.Array, jax.Array]:
    """`[R, L]` log-prob of each token given the ones before it, and the entropy
    H_n = -sum_v p_n(v) log p_n(v) of the distribution it was drawn from (0 at position 0)."""
    model = nnx.merge(graphdef, params, rest)
    positions, attention = checkpoints.attention_inputs(rows["mask"])
    logits, _ = model(rows["tokens"], positions, None, attention)
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)[:, :-1]
    # token n is drawn from the logits at n - 1
    taken = jnp.take_along_axis(logp_all, rows["tokens"][:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return jnp.pad(taken, ((0, 0), (1, 0))), jnp.pad(entropy, ((0, 0), (1, 0)))


class Learner:
    """The learning side of a chat-model policy: its optimizer state, the KL reference, updates.

    Args:
      qwen: the loaded policy; `learn` updates `qwen.model` in place (tunix's
        sampler holds the same variables, so the next rollout samples from it).
      config: the settings.
    """

    def __init__(self, qwen: checkpoints.Checkpoint, config: LearnConfig):
        self.qwen, self.config = qwen, config
        self.graphdef, self.params, self.rest = nnx.split(qwen.model, nnx.Param, ...)
        self.tx = make_optimizer(learning_rate=config.learning_rate,
                                 weight_decay=config.weight_decay, grad_clip=config.grad_clip)
        self.opt_state = self.tx.init(self.params)
        self.reference = jax.tree.map(jnp.copy, self.params) if config.loss.kl_coef else None
        self.estimator_config = dict(config.estimator_config)
        self._step = jax.jit(self._train_step)
        self._score = jax.jit(self._scores)
        self.needs_entropy = registry.get(config.estimator).needs_entropy

    def _scores(self, params, rows):
        return _token_scores(self.graphdef, params, self.rest, rows, self._temperature)

    @property
    def _temperature(self) -> float:
        return self.config.temperature if self.config.temperature > 0 else 1.0

    def _train_step(self, params, opt_state, rows):
        loss_config = self.config.loss

        def loss_fn(params):
            logp, _ = _token_scores(self.graphdef, params, self.rest, rows, self._temperature)
            loss, _ = policy_loss(loss_config, logp, rows["old_logp"], rows["advantages"],
                                  rows["action_mask"])
            metrics = {"loss/policy": loss}
            if loss_config.kl_coef:
                kl, _ = kl_loss(logp, rows["ref_logp"], rows["action_mask"], kind=loss_config.kl_kind)
                loss = loss + loss_config.kl_coef * kl
                metrics["loss/kl"] = kl
            metrics["loss/total"] = loss
            return loss, metrics

        grads, metrics = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    def learn(self, trajectories: Sequence[Trajectory], *, iteration: int) -> dict[str, float]:
        """Credit, step rows and `epochs` passes of updates on iteration `iteration`'s batch
        (its minibatch order is a fixed function of the seed and `iteration`, so a resumed
        run shuffles as an uninterrupted one).

        Returns:
          `loss/policy`, `loss/total` (and `loss/kl`), each the mean over the
          batch's optimizer steps, and `rows`, the step rows trained on.
        """
        longest = max(len(t.steps) for t in trajectories)
        rows = step_rows(trajectories, np.zeros((len(trajectories), longest), np.float32))
        with jax.set_mesh(self.qwen.mesh):
            if self.needs_entropy:  # EMPG: the sampling policy's entropies, re-scored before the update
                trajectories = with_entropies(trajectories, rows,
                                              np.asarray(self._score(self.params, rows)[1]))
            if self.reference is not None:
                rows["ref_logp"] = np.asarray(self._score(self.reference, rows)[0])
        steps, tokens, _ = collate(trajectories, with_observations=False)
        credit = compute_advantages(steps, tokens, self.config.estimator, **self.estimator_config)
        rows["advantages"] = step_rows(trajectories, credit.step_advantages)["advantages"]
        count = rows["tokens"].shape[0]
        size = self.config.minibatch_rows or count
        with jax.set_mesh(self.qwen.mesh):
            order = np.random.default_rng([self.config.seed, iteration])
            history = []
            for _ in range(self.config.epochs):
                shuffled = order.permutation(count)
                for begin in range(0, count, size):
                    chunk = _padded_rows(rows, shuffled[begin:begin + size], size)
                    self.params, self.opt_state, metrics = self._step(self.params, self.opt_state, chunk)
                    history.append(metrics)
        nnx.update(self.qwen.model, self.params)
        out = {key: float(np.mean([float(m[key]) for m in history])) for key in history[0]}
        out["rows"] = float(count)
        return out

    def as_tree(self) -> dict[str, Any]:
        """The checkpoint layout: parameters, optimizer state and the reference (when kept)."""
        tree = {"params": self.params, "opt": self.opt_state}
        if self.reference is not None:
            tree["reference"] = self.reference
        return tree

    def load(self, tree: dict[str, Any]) -> None:
        """Takes the state of `as_tree` (a restored checkpoint) into the learner and the model.

        Each restored array is placed as the learner's own: parameters keep their
        sharding over the model's mesh; the rest (optimizer counts and moments
        of unsharded leaves) is replicated over it, as jit under the mesh expects.
        """
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
        nnx.update(self.qwen.model, self.params)


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


def _padded_rows(rows: dict[str, np.ndarray], index: np.ndarray, size: int) -> dict[str, jax.Array]:
    """Rows `index`, with empty rows (all False masks) appended up to `size`."""
    out = {}
    for key, value in rows.items():
        chunk = value[index]
        if len(index) < size:
            chunk = np.concatenate([chunk, np.zeros((size - len(index),) + value.shape[1:], value.dtype)])
        out[key] = jnp.asarray(chunk)
    return out


def play_batch(qwen: checkpoints.Checkpoint, make_env: Callable[[], Env], tasks: Sequence[Any],
               config: LearnConfig, *, iteration: int, max_steps: int | None = None) -> list[Trajectory]:
    """The batch of an iteration: G episodes of each task (`rollout.play_group`), group k = task k."""
    trajectories = []
    for k, task in enumerate(tasks):
        trajectories += rollout.play_group(
            qwen, make_env, task, group_size=config.group_size, group_id=k,
            seed=config.seed * 100_003 + iteration * len(tasks) + k,
            max_new_tokens=config.max_new_tokens, temperature=config.temperature,
            window=config.window, max_steps=max_steps,
            invalid_action_penalty=config.invalid_action_penalty)
    return trajectories


__all__: Sequence[str] = ("LearnConfig", "Learner", "play_batch", "step_rows", "with_entropies")
