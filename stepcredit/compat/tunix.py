"""tunix 0.1.7: stepcredit's estimators in tunix's advantage registry and its agentic learner.

tunix (JAX, Flax NNX) calls an advantage estimator as
`estimator(rewards=[B], num_generations=G)` with the B rows in consecutive
groups of G, and its agentic GRPO learner computes one advantage per
trajectory from the sum of its steps' rewards. Two adapters:

  - `register()` adds stepcredit's trajectory-level estimators to tunix's
    registry as `stepcredit_<name>` (`GRPOConfig(advantage_estimator=
    "stepcredit_maxrl")`).
  - `turn_learner(estimator)` is tunix's agentic `GRPOLearner` with per-turn
    credit: its training examples carry `[B, completion_len]` advantages
    (tunix's loss takes them as they are) from any of stepcredit's step-level
    estimators, run on the turns of tunix's completions.

The completion of an agentic episode is the model's turns and the
environment's replies concatenated, `completion_mask` 1 on the model's tokens;
turns, their rewards and their advantages follow `stepcredit.compat._turns`.
Each step's reward (tunix's `Step.reward`) is placed on the last token of its
turn (on the token before it when the turn generated no token; on the last
completion token when the turn was cut off); the state a step acted in (GiGPO's
anchor) is the episode's first observation for step 0 and the previous step's
`Step.observation` after it; steps with no environment reply between them form
one turn of the mask, anchored at the state of its first step.

References: tunix `rl/algo_core.py`, `rl/agentic/agentic_grpo_learner.py`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import registry
from stepcredit.advantages.inputs import CreditInputs
from stepcredit.compat._turns import TURN_INPUTS, Turns, turn_estimator

PREFIX = "stepcredit_"


def trajectory_estimators() -> tuple[str, ...]:
    """stepcredit's estimators that tunix's `(rewards, num_generations)` call can feed."""
    return tuple(name for name in registry.names()
                 if (entry := registry.get(name)).output_level == "trajectory"
                 and set(entry.reads.values()) <= {"scores", "group_ids"} and entry.whiten == "none")


def trajectory_estimator(name: str, hyperparameters: Mapping[str, Any] | None = None):
    """stepcredit's `name` with tunix's estimator signature: `[B]` rewards in groups of G -> `[B]`."""
    entry = registry.get(name)
    if name not in trajectory_estimators():
        raise ValueError(f"trajectory_estimator: {name!r} reads {sorted(set(entry.reads.values()))}; "
                         f"tunix passes only rewards grouped by num_generations")
    fixed = dict(hyperparameters or {})
    entry.resolve(fixed)

    def estimate(rewards, num_generations: int, **kwargs):
        scores = jnp.asarray(rewards, jnp.float32).reshape(-1)
        if num_generations < 1 or scores.shape[0] % num_generations:
            raise ValueError(f"{PREFIX + name}: {scores.shape[0]} rewards do not form groups of "
                             f"num_generations={num_generations}")
        groups = jnp.arange(scores.shape[0]) // num_generations
        out = registry.apply(entry, CreditInputs(scores=scores, group_ids=groups), fixed).advantages
        return np.asarray(out) if isinstance(rewards, np.ndarray) else out

    estimate.__name__ = PREFIX + name
    return estimate


def register(names: Sequence[str] | None = None, *,
             hyperparameters: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[str, ...]:
    """Adds stepcredit's trajectory-level estimators to tunix's registry as `stepcredit_<name>`.

    Args:
      names: stepcredit estimator names; None means all of `trajectory_estimators()`.
      hyperparameters: `{name: {hyperparameter: value}}` fixed per estimator.

    Returns:
      The tunix names registered.
    """
    from tunix.rl import function_registry

    registered = []
    for name in names if names is not None else trajectory_estimators():
        key = PREFIX + name
        function_registry.register_advantage_estimator(key)(
            trajectory_estimator(name, (hyperparameters or {}).get(name)))
        registered.append(key)
    return tuple(registered)


def turn_inputs(records: Sequence[Mapping[str, Any]], completion_mask) -> dict[str, Any]:
    """Token rewards and per-turn anchor states of tunix completions, from their step records.

    Args:
      records: per row, `step_rewards`, `step_assistant_lens`, `step_env_lens`
        and `step_states` (what `turn_learner`'s engine records).
      completion_mask: `[B, L]` tunix's completion mask.

    Returns:
      `{"token_level_rewards": [B, L] float32, "anchor_obs": (B,) object array
      of per-turn state lists}`.
    """
    mask = np.asarray(completion_mask) > 0
    size, length = mask.shape
    if len(records) != size:
        raise ValueError(f"turn_inputs: {len(records)} records for {size} rows of completion_mask")
    rewards = np.zeros((size, length), np.float32)
    anchors = np.empty(size, dtype=object)
    turns = Turns(mask)
    for row, record in enumerate(records):
        start, states, separated = 0, [], True
        for reward, generated, replied, state in zip(record["step_rewards"],
                                                     record["step_assistant_lens"],
                                                     record["step_env_lens"], record["step_states"]):
            last = start + generated - 1 if generated else start - 1
            rewards[row, min(max(last, 0), length - 1)] += reward
            # A step whose tokens follow the previous step's with no reply between them continues
            # that turn of the mask: the turn's anchor stays the state its first step acted in.
            if generated and start < length and separated:
                states.append(state)
            if generated:
                separated = bool(replied)
            elif replied:
                separated = True
            start += generated + replied
        anchors[row] = states[:turns.count[row]]
    return {"token_level_rewards": rewards, "anchor_obs": anchors}


def turn_learner(estimator: str, hyperparameters: Mapping[str, Any] | None = None, *,
                 gamma: float = 1.0, base: type | None = None) -> type:
    """tunix's agentic GRPO learner with stepcredit's per-turn credit.

    The returned class records each step's reward, token lengths and state
    during the rollout (a `TrajectoryCollectEngine` subclass), and replaces
    the advantages of every training example by `[B, completion_len]` turn
    advantages of `estimator` (any of `stepcredit.compat.verl.turn_estimators()`
    that needs no critic, entropy or PRM: GiGPO, MT-GRPO, GTPO, Kevin, ...),
    grouped by the episodes' `group_id`, 0 off the model's tokens.

    Args:
      estimator: a stepcredit step-level estimator name.
      hyperparameters: fixed hyperparameters of the estimator.
      gamma: the discount passed to the estimator (where it has one).
      base: the learner class to extend (default tunix's agentic `GRPOLearner`).

    Returns:
      A `GRPOLearner` subclass, constructed with tunix's arguments.
    """
    from tunix.rl.agentic import agentic_grpo_learner
    from tunix.rl.agentic.trajectory import trajectory_collect_engine

    estimate = turn_estimator(estimator, hyperparameters, label=f"turn_learner({estimator!r})")
    unavailable = sorted(field for field in set(registry.get(estimator).reads.values())
                         if TURN_INPUTS.get(field) in ("values", "entropys", "rm_scores"))
    if unavailable:
        raise ValueError(f"turn_learner: estimator {estimator!r} reads {', '.join(unavailable)}, "
                         "which tunix's agentic learner does not record (no critic, entropy or "
                         "PRM); choose one that reads rewards, groups and states only")

    class StepRecordingEngine(trajectory_collect_engine.TrajectoryCollectEngine):
        async def collect(self, mode="Conversation"):
            out = await super().collect(mode)
            if mode == "Token":
                steps = self.agent.trajectory.steps
                first_state = out.get("original_input")
                out["step_rewards"] = [float(s.reward) for s in steps]
                out["step_assistant_lens"] = [0 if s.assistant_tokens is None else len(s.assistant_tokens)
                                              for s in steps]
                out["step_env_lens"] = [0 if s.env_tokens is None else len(s.env_tokens) for s in steps]
                out["step_states"] = [first_state] + [s.observation for s in steps[:-1]]
            return out

    parent = base or agentic_grpo_learner.GRPOLearner

    class TurnCreditLearner(parent):
        def _build_orchestrator(self):
            orchestrator = super()._build_orchestrator()
            orchestrator.engine_cls = StepRecordingEngine
            return orchestrator

        def _process_results(self, trajectories, *args, **kwargs):
            examples = super()._process_results(trajectories, *args, **kwargs)
            out, row = [], 0
            for example in examples:
                size = example.completion_mask.shape[0]
                items = trajectories[row:row + size]
                row += size
                inputs = turn_inputs([item.traj for item in items], example.completion_mask)
                groups = np.empty(size, dtype=object)
                groups[:] = [item.group_id for item in items]
                advantages, _ = estimate(response_mask=np.asarray(example.completion_mask),
                                         index=groups, config={"gamma": gamma}, **inputs)
                out.append(example.replace(advantages=jnp.asarray(advantages)))
            return out

    TurnCreditLearner.__name__ = TurnCreditLearner.__qualname__ = f"TurnCredit{parent.__name__}"
    return TurnCreditLearner


__all__: Sequence[str] = ("register", "trajectory_estimator", "trajectory_estimators", "turn_inputs",
                          "turn_learner")
