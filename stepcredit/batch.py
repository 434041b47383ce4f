"""Step-level trajectories on the host, and their padded array views.

A `Trajectory` keeps every agent step as its own `StepRecord` with the exact
token ids that were sampled (the Agent-R1 step MDP, arXiv 2511.14460), so that
training never re-tokenises. `collate` pads a list of ragged trajectories into

- a `StepBatch` of `[B, T]` step arrays (plus `[B]` per-trajectory arrays), and
- a `TokenBatch` of `[B, N]` token arrays, N running along each trajectory's
  observation and action tokens in order, with `step_index` naming each action
  token's step (-1 on observation and padding tokens).

Cutting a trajectory that is too long happens only at step boundaries, only
when asked for, and is always counted.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from stepcredit.anchors import dense_anchor_ids


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One agent step, as sampled.

    Attributes:
      observation_ids: token ids of what the environment showed before this
        step's action (for the token view; the step's full prompt, history
        included, belongs to the model's step rows).
      action_ids: the sampled action token ids, exactly as generated.
      action_logp: per-token log-probabilities of `action_ids` under the
        sampling policy, same length.
      reward: the environment's reward for this step.
      done: the episode terminated at this step (no bootstrap).
      truncated: a limit ended the episode at this step (bootstrap from the
        value of the next state).
      action_entropy: optional per-token entropies of the sampling policy.
      value: optional critic value V(s_t) at the step's start.
      anchor: optional integer key of the raw environment state for GiGPO,
        e.g. `stepcredit.keys.stable_key(observation.anchor)` (any
        size: `collate` maps keys to dense int32 ids per batch).
      info: free metadata (validity of the action, environment info...).
      prompt_ids: optional full prompt the policy saw at this step (task,
        history window, observation), so the step's training row is exactly
        `prompt_ids + action_ids` without re-tokenising.
    """

    observation_ids: Sequence[int]
    action_ids: Sequence[int]
    action_logp: Sequence[float]
    reward: float
    done: bool = False
    truncated: bool = False
    action_entropy: Sequence[float] | None = None
    value: float | None = None
    anchor: int | None = None
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    prompt_ids: Sequence[int] | None = None


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One episode: its steps, its group (the task it shares with G - 1 others).

    Attributes:
      steps: the steps in order.
      group_id: integer id of the group of rollouts of the same task.
      score: the trajectory score used by group estimators; None means the
        sum of step rewards.
      bootstrap_value: V(s_next) after the last step when it was truncated;
        ignored (0) when the episode terminated.
      tree_id: the rollout tree it is a leaf of (Tree-GRPO's branching
        rollouts, `stepcredit.train.tree`: the leaves of a tree share their
        steps up to their branch points), an int >= 0 unique to the tree
        within the batch; None makes it a tree of its own.
      answer: the task's ground-truth answer, for information-gain credit
        (IGPO, `stepcredit.train.information_gain`): the trainer fills it from
        the environment's `reference_answer()`; the policy never sees it.
        None where the task has none.
    """

    steps: Sequence[StepRecord]
    group_id: int = 0
    score: float | None = None
    bootstrap_value: float = 0.0
    tree_id: int | None = None
    answer: str | None = None


class StepBatch(NamedTuple):
    """Padded step view; a pytree of arrays. `[B, T]` unless noted.

    Attributes:
      reward: step rewards.
      mask: True on real steps.
      done: true termination at this step.
      truncated: a limit ended the episode at this step.
      value: V(s_t) at each step's start (0 where unknown).
      entropy: mean token entropy of each step's action (0 where unknown).
      logp: sum of the action's token log-probs, log pi(a_t | s_t).
      anchor: dense int32 anchor id of each step's state in this batch (equal
        keys, equal ids; see `stepcredit.anchors.dense_anchor_ids`), -1 where
        the step has no anchor.
      group_id: `[B]` group of each trajectory.
      score: `[B]` trajectory score.
      bootstrap_value: `[B]` value after the last step (0 unless truncated).
      tree_id: `[B]` rollout tree of each trajectory (`Trajectory.tree_id`;
        a trajectory without one gets an id of its own, -1 - its index).
    """

    reward: np.ndarray
    mask: np.ndarray
    done: np.ndarray
    truncated: np.ndarray
    value: np.ndarray
    entropy: np.ndarray
    logp: np.ndarray
    anchor: np.ndarray
    group_id: np.ndarray
    score: np.ndarray
    bootstrap_value: np.ndarray
    tree_id: np.ndarray | None = None


class TokenBatch(NamedTuple):
    """Padded token view; a pytree of `[B, N]` arrays.

    Attributes:
      tokens: token ids (0 on padding).
      action_mask: True on sampled action tokens.
      step_index: the step of each action token; -1 on observation and padding.
      logp: sampling log-prob of each action token (0 elsewhere).
      entropy: sampling entropy of each action token (0 elsewhere or unknown).
    """

    tokens: np.ndarray
    action_mask: np.ndarray
    step_index: np.ndarray
    logp: np.ndarray
    entropy: np.ndarray


class CollateStats(NamedTuple):
    """What `collate` had to cut: trajectories shortened by each limit."""

    truncated_by_steps: int
    truncated_by_tokens: int


def _finite_in(dtype: Any, x: float) -> bool:
    """Whether `x` is finite in `dtype`: not NaN and of magnitude at most the dtype's largest."""
    return bool(abs(float(x)) <= float(np.finfo(dtype).max))


def _not_finite(where: str, name: str, x: float, dtype: Any) -> str:
    return f"{where}: {name} is {float(x)!r}; it is not finite in {np.dtype(dtype).name}"


def _check_step(i: int, t: int, step: StepRecord, dtype: Any) -> None:
    where = f"collate: trajectories[{i}].steps[{t}]"
    if len(step.action_ids) == 0:
        raise ValueError(f"{where}: action_ids is empty; every step has at least one action token")
    if len(step.action_logp) != len(step.action_ids):
        raise ValueError(f"{where}: action_logp has length {len(step.action_logp)} but action_ids "
                         f"has length {len(step.action_ids)}")
    if step.action_entropy is not None and len(step.action_entropy) != len(step.action_ids):
        raise ValueError(f"{where}: action_entropy has length {len(step.action_entropy)} but "
                         f"action_ids has length {len(step.action_ids)}")
    if step.reward is None:
        raise ValueError(f"{where}: reward is None; every step has a reward (0.0 for none)")
    for name in ("reward", "value"):
        x = getattr(step, name)
        if x is not None and not _finite_in(dtype, x):
            raise ValueError(_not_finite(where, name, x, dtype))
    for name in ("action_logp", "action_entropy"):
        values = getattr(step, name)
        if values is None:
            continue
        finite = np.abs(np.asarray(values, np.float64)) <= float(np.finfo(dtype).max)
        if not finite.all():
            j = int(np.flatnonzero(~finite)[0])
            raise ValueError(_not_finite(where, f"{name}[{j}]", values[j], dtype))
    if step.anchor is not None and not _is_int(step.anchor):
        raise ValueError(f"{where}: anchor is {step.anchor!r} ({type(step.anchor).__name__}); it "
                         "must be an int key (stepcredit.keys.stable_key(text) gives one)")
    if step.done and step.truncated:
        raise ValueError(f"{where}: done and truncated are both set; a step ends an episode one way")


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_ids(i: int, trajectory: Trajectory) -> None:
    """A group id is an int; a tree id an int >= 0 or None (the ids of trajectories without
    one are negative, so a negative id could join one of them)."""
    where = f"collate: trajectories[{i}]"
    for name in ("group_id", "tree_id"):
        x = getattr(trajectory, name)
        if x is None and name == "tree_id":
            continue
        if not _is_int(x):
            raise ValueError(f"{where}.{name} is {x!r} ({type(x).__name__}); it must be an int "
                             "(stepcredit.keys.dense_ids numbers any ids from 0)")
        if not -2**31 <= x < 2**31:
            raise ValueError(f"{where}.{name} is {x}; ids must fit int32 "
                             "(stepcredit.keys.dense_ids numbers any ids from 0)")
        if name == "tree_id" and x < 0:
            raise ValueError(f"{where}.tree_id is {x}; it must be >= 0 (None: a tree of its "
                             "own)")


def _tokens_in(step: StepRecord, with_observations: bool) -> int:
    return len(step.action_ids) + (len(step.observation_ids) if with_observations else 0)


def _steps_that_fit(steps: Sequence[StepRecord], max_tokens: int, with_observations: bool) -> int:
    used = 0
    for count, step in enumerate(steps):
        used += _tokens_in(step, with_observations)
        if used > max_tokens:
            return count
    return len(steps)


def collate(trajectories: Sequence[Trajectory], *, max_steps: int | None = None,
            max_tokens: int | None = None, truncate: bool = False,
            with_observations: bool = True,
            dtype: Any = np.float32) -> tuple[StepBatch, TokenBatch, CollateStats]:
    """Pads ragged trajectories into a `StepBatch` `[B, T]` and a `TokenBatch` `[B, N]`.

    T is `max_steps` (or the longest trajectory) and N is `max_tokens` (or the
    longest token sequence). A trajectory longer than a limit raises
    `ValueError`, unless `truncate=True`: then it keeps the longest prefix of
    whole steps that fits, its last kept step is marked `truncated`, its
    bootstrap value becomes the recorded value of the first dropped step (0 if
    none was recorded), its score becomes the sum of its kept rewards, and the
    cut is counted in the returned `CollateStats`.

    Rewards (never None), values, scores, bootstrap values and every action
    log-probability and entropy must be finite in `dtype` (for float32: NaN,
    infinities and magnitudes above about 3.4e38 raise); group ids and anchors
    are ints, tree ids ints >= 0 or None. A bad value is named by its trajectory
    and step.

    Args:
      trajectories: the episodes, each with at least one step.
      max_steps: T, or None for the longest trajectory.
      max_tokens: N, or None for the longest token sequence.
      truncate: cut over-long trajectories at a step boundary instead of raising.
      with_observations: put observation tokens in the token view (with
        step_index -1) before each step's action tokens; False keeps only the
        action tokens.
      dtype: floating dtype of the float arrays.

    Returns:
      `(StepBatch, TokenBatch, CollateStats)` of NumPy arrays.

    Example: two trajectories of 2 and 1 steps give `StepBatch.mask`
    [[True, True], [True, False]].
    """
    if len(trajectories) == 0:
        raise ValueError("collate: trajectories is empty; need at least one")
    kept: list[Sequence[StepRecord]] = []
    cut_steps = cut_tokens = 0
    for i, trajectory in enumerate(trajectories):
        steps = list(trajectory.steps)
        if not steps:
            raise ValueError(f"collate: trajectories[{i}] has no steps")
        for t, step in enumerate(steps):
            _check_step(i, t, step, dtype)
        for name in ("score", "bootstrap_value"):
            x = getattr(trajectory, name)
            if x is not None and not _finite_in(dtype, x):
                raise ValueError(_not_finite(f"collate: trajectories[{i}]", name, x, dtype))
        _check_ids(i, trajectory)
        length = len(steps)
        if max_steps is not None and length > max_steps:
            if not truncate:
                raise ValueError(f"collate: trajectories[{i}] has {length} steps, more than "
                                 f"max_steps={max_steps}; pass truncate=True to cut it (counted)")
            length, cut_steps = max_steps, cut_steps + 1
        if max_tokens is not None:
            fit = _steps_that_fit(steps[:length], max_tokens, with_observations)
            if fit < length:
                if not truncate or fit == 0:
                    raise ValueError(
                        f"collate: trajectories[{i}] needs more than max_tokens={max_tokens} tokens "
                        f"(only {fit} whole steps fit); "
                        + ("pass truncate=True to cut it at a step boundary (counted)" if fit
                           else "its first step alone does not fit, and steps are never split"))
                length, cut_tokens = fit, cut_tokens + 1
        kept.append(steps[:length])

    batch = len(trajectories)
    num_steps = max_steps or max(len(steps) for steps in kept)
    num_tokens = max_tokens or max(sum(_tokens_in(s, with_observations) for s in steps)
                                   for steps in kept)
    step_arrays = {name: np.zeros((batch, num_steps), dtype)
                   for name in ("reward", "value", "entropy", "logp")}
    step_flags = {name: np.zeros((batch, num_steps), bool) for name in ("mask", "done", "truncated")}
    anchor_keys = np.zeros((batch, num_steps), np.uint64)
    has_anchor = np.zeros((batch, num_steps), bool)
    tokens = np.zeros((batch, num_tokens), np.int32)
    step_index = np.full((batch, num_tokens), -1, np.int32)
    token_logp = np.zeros((batch, num_tokens), dtype)
    token_entropy = np.zeros((batch, num_tokens), dtype)
    group_id = np.asarray([t.group_id for t in trajectories], np.int32)
    tree_id = np.asarray([-1 - b if t.tree_id is None else t.tree_id
                          for b, t in enumerate(trajectories)], np.int32)
    score = np.zeros(batch, dtype)
    bootstrap = np.zeros(batch, dtype)

    for b, (trajectory, steps) in enumerate(zip(trajectories, kept)):
        was_cut = len(steps) < len(trajectory.steps)
        position = 0
        for t, step in enumerate(steps):
            step_arrays["reward"][b, t] = step.reward
            step_arrays["value"][b, t] = 0.0 if step.value is None else step.value
            step_arrays["logp"][b, t] = float(np.sum(step.action_logp))
            if step.action_entropy is not None:
                step_arrays["entropy"][b, t] = float(np.mean(step.action_entropy))
            step_flags["mask"][b, t] = True
            step_flags["done"][b, t] = step.done
            step_flags["truncated"][b, t] = step.truncated
            if step.anchor is not None:
                anchor_keys[b, t], has_anchor[b, t] = int(step.anchor) % 2**64, True
            if with_observations:
                n_obs = len(step.observation_ids)
                tokens[b, position:position + n_obs] = step.observation_ids
                position += n_obs
            n_act = len(step.action_ids)
            span = slice(position, position + n_act)
            tokens[b, span] = step.action_ids
            step_index[b, span] = t
            token_logp[b, span] = step.action_logp
            if step.action_entropy is not None:
                token_entropy[b, span] = step.action_entropy
            position += n_act
        last = len(steps) - 1
        if was_cut:
            step_flags["done"][b, last] = False
            step_flags["truncated"][b, last] = True
            first_dropped = trajectory.steps[len(steps)]
            bootstrap[b] = 0.0 if first_dropped.value is None else first_dropped.value
        elif steps[last].truncated:
            bootstrap[b] = trajectory.bootstrap_value
        score[b] = (step_arrays["reward"][b].sum() if trajectory.score is None or was_cut
                    else trajectory.score)

    step_batch = StepBatch(anchor=dense_anchor_ids(anchor_keys, has_anchor), group_id=group_id,
                           score=score, bootstrap_value=bootstrap, tree_id=tree_id, **step_arrays,
                           **step_flags)
    token_batch = TokenBatch(tokens=tokens, action_mask=step_index >= 0, step_index=step_index,
                             logp=token_logp, entropy=token_entropy)
    return step_batch, token_batch, CollateStats(cut_steps, cut_tokens)
