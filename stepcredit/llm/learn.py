"""Training a chat-model policy on stepcredit environments with any critic-free estimator.

One iteration: for each of K tasks, `rollout.play_group` plays G episodes;
`compute_advantages` gives every step its advantage; each step becomes one row
`prompt_ids + action_ids` (token-exact, as sampled) whose action tokens carry
the step's advantage; one Adam step on PPO's clipped surrogate
(`stepcredit.ppo_clip_loss`, token-mean) against the log-probs stored at
sampling. Rows are right-padded to a power of two, in one forward pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from stepcredit.batch import Trajectory, collate
from stepcredit.credit import compute_advantages
from stepcredit.envs.base import Env
from stepcredit.llm import checkpoint as checkpoints
from stepcredit.llm import rollout
from stepcredit.losses import ppo_clip_loss


@dataclasses.dataclass(frozen=True)
class LearnConfig:
    """Settings of `train`.

    Attributes:
      estimator: a registered estimator that needs no critic (grpo, rloo,
        gigpo, grpo+empg needs entropies: not recorded here).
      iterations, tasks_per_iteration, group_size: K tasks x G episodes each.
      max_new_tokens, temperature, window: sampling and prompt settings.
      learning_rate, clip: Adam's rate and PPO's clip.
      seed: the run's seed (task order and sampling).
    """

    estimator: str = "grpo"
    iterations: int = 1
    tasks_per_iteration: int = 2
    group_size: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    window: int = 4
    learning_rate: float = 1e-6
    clip: float = 0.2
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


def _update_fn(graphdef, rest, optimizer, clip: float):
    def loss_fn(params, rows):
        model = nnx.merge(graphdef, params, rest)
        positions, attention = checkpoints.attention_inputs(rows["mask"])
        logits, _ = model(rows["tokens"], positions, None, attention)
        logp_all = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        # the log-prob of token n comes from the logits at n - 1
        taken = jnp.take_along_axis(logp_all[:, :-1], rows["tokens"][:, 1:, None], axis=-1)[..., 0]
        logp = jnp.pad(taken, ((0, 0), (1, 0)))
        loss, _ = ppo_clip_loss(logp, rows["old_logp"], rows["advantages"], rows["action_mask"],
                                clip_low=clip, clip_high=clip)
        return loss

    @jax.jit
    def update(params, opt_state, rows):
        loss, grads = jax.value_and_grad(loss_fn)(params, rows)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return update


def train(qwen: checkpoints.Checkpoint, make_env: Callable[[], Env], tasks: Sequence[Any],
          config: LearnConfig = LearnConfig()) -> list[dict[str, float]]:
    """Trains `qwen.model` in place; returns each iteration's metrics.

    Returns:
      Per iteration: `loss`, `success` (the share of episodes won), `reward`
      (mean episode reward), `steps` (rows trained on).
    """
    if not tasks:
        raise ValueError("train: tasks is empty")
    graphdef, params, rest = nnx.split(qwen.model, nnx.Param, ...)
    optimizer = optax.adam(config.learning_rate)
    opt_state = optimizer.init(params)
    update = _update_fn(graphdef, rest, optimizer, config.clip)
    history = []
    for iteration in range(config.iterations):
        trajectories = []
        for k in range(config.tasks_per_iteration):
            task = tasks[(iteration * config.tasks_per_iteration + k) % len(tasks)]
            trajectories += rollout.play_group(
                qwen, make_env, task, group_size=config.group_size, group_id=k,
                seed=config.seed * 100_003 + iteration * config.tasks_per_iteration + k,
                max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                window=config.window)
        steps, tokens, _ = collate(trajectories, with_observations=False)
        credit = compute_advantages(steps, tokens, config.estimator)
        rows = {key: jnp.asarray(value) for key, value in step_rows(trajectories,
                                                                     credit.step_advantages).items()}
        with jax.set_mesh(qwen.mesh):
            params, opt_state, loss = update(params, opt_state, rows)
        nnx.update(qwen.model, params)
        won = [any(step.info.get("won", False) for step in t.steps) for t in trajectories]
        history.append({"loss": float(loss), "success": float(np.mean(won)),
                        "reward": float(np.mean([sum(s.reward for s in t.steps) for t in trajectories])),
                        "steps": float(rows["tokens"].shape[0])})
    return history


__all__: Sequence[str] = ("LearnConfig", "step_rows", "train")
