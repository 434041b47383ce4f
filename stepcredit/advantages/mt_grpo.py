"""MT-GRPO: turn-level credit from group-normalised turn rewards plus the outcome advantage.

Each turn (step) t of trajectory i has a turn reward r_{i,t} (e.g. "the tool
call executed") and each trajectory an outcome score s_i (e.g. "the answer is
right"). Both are normalised within the task group as in GRPO; the turn-level
advantage A^T goes to the turn that earned it and the outcome advantage A^O to
every turn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks, native
from stepcredit.advantages import group as group_lib

TURN_BASELINES = ("per_turn", "pooled")
FINAL_TURNS = ("outcome", "both")


def _turn_segments(ids, num_groups, num_steps, turn_baseline):
    """`[B, T]` segment ids of the A^T statistics and their static count."""
    if turn_baseline == "pooled":
        return jnp.broadcast_to(ids[:, None], (ids.shape[0], num_steps)), num_groups
    turns = jnp.arange(num_steps, dtype=ids.dtype)[None, :]
    return ids[:, None] * num_steps + turns, num_groups * num_steps


def final_turns(mask) -> jax.Array:
    """`[B, T]` bool: True at each trajectory's last valid step (none in an all-masked row).

    On CPU, by the compiled kernel (`native.last_valid`, one pass) once it is built;
    elsewhere by an argmax.
    """
    return native.on_cpu(native.last_valid, _argmax_final_turns, mask)


def _argmax_final_turns(mask):
    num_steps = mask.shape[1]
    last = num_steps - 1 - jnp.argmax(mask[:, ::-1], axis=1)
    return mask & (jnp.arange(num_steps)[None, :] == last[:, None])


def mt_grpo(step_rewards, scores, group_ids, mask, *, lam: float = 1.0,
            turn_baseline: str = "per_turn", final_turn: str = "outcome",
            std: str = "unbiased", eps: float = 1e-6, num_groups: int | None = None,
            axis_name: str | None = None) -> jax.Array:
    """MT-GRPO's step advantage: the normalised turn reward plus lam times the outcome advantage.

        A^O_i     = (s_i - mean_g s) / (std_g s + eps)                      (GRPO)
        A^T_{i,t} = (r_{i,t} - mean R_{g,t}) / (std R_{g,t} + eps)
        A_{i,t}   = A^T_{i,t} + lam A^O_i     at a turn that earns turn credit
                  = A^O_i                     at the final turn (final_turn="outcome")

    The paper's two-turn agent (reason and call a tool, then answer) gives the
    first turn A^T + lam A^O and the final (answer) turn A^O. Generalised to T
    turns here: every valid turn before the trajectory's last one is a "turn
    that earns turn credit", and the last valid turn carries the outcome only
    (its reward is the outcome's); with final_turn="both" the last turn also
    gets A^T + lam A^O and enters the statistics. The turn statistics R_{g,t}:

      - turn_baseline="per_turn" (registered as `mt_grpo`, the paper's): the
        rewards at turn index t of the group's trajectories that have a
        credited turn t. A trajectory that stopped before t drops out of the
        later turn groups, so the set a turn is compared with depends on when
        each trajectory stopped.
      - turn_baseline="pooled" (`mt_grpo_pooled`): all credited turns of all
        the group's trajectories together, one mean and std per group.

    Reductions: when every trajectory has one turn, both variants give GRPO of
    the scores at that turn. With final_turn="both" and lam = 1 the pooled
    variant is iStar with episode="grpo" and alpha = 1 on these step rewards
    (in general lam times iStar with alpha = 1 / lam). A set of fewer than two
    values, or of all-equal values, gives 0 at that level (the conventions of
    `grpo`): a singleton group's A^O and per-turn A^T are 0, while pooled, the
    turns of its one trajectory are still compared with one another.

    Args:
      step_rewards: `[B, T]` turn rewards r_{i,t}; masked steps may hold NaN.
      scores: `[B]` outcome scores s_i.
      group_ids: `[B]` int task group (arbitrary unless `num_groups` is given).
      mask: `[B, T]` bool, True on valid turns.
      lam: weight of the outcome advantage at credited turns (1).
      turn_baseline: "per_turn" or "pooled", as above.
      final_turn: "outcome" (the paper: A^O only at the last turn) or "both".
      std: "unbiased" (verl's `torch.std`), "biased" or "none", at both levels.
      eps: added to the std (1e-6).
      num_groups: static number of groups, or None to remap ids.
      axis_name: mesh axis to combine group sums over inside `shard_map`. Without one, on
        CPU, for float32 arrays and lam and eps known when tracing, the whole computation
        runs as one compiled kernel (`native.turn_groups`: the same numbers bit for bit
        with the per-turn baseline, to float32 rounding pooled, whose sums it adds turn by
        turn).

    Returns:
      `[B, T]` advantages, 0 at masked steps.

    Raises:
      ValueError / TypeError: wrong rank, shape, dtype or option; called
        eagerly, NaN or inf in scores or at a valid step, or an id outside
        [0, num_groups).

    References:
      Zeng, Wei et al., "Reinforcing Multi-Turn Reasoning in LLM Agents via
      Turn-Level Credit Assignment" (MT-GRPO), arXiv 2505.11821, §4
      (turn-level advantage estimation). verl issue 7244, "[RFC] Per-turn
      reward support for multi-turn RL: a turn-level baseline that stays
      unbiased under variable turn counts".

    Notes:
      Which variant is unbiased (verl issue 7244): normalised per turn index,
      the baseline subtracted along a trajectory has as many terms as the
      trajectory has turns, a number the policy chooses when it decides to
      stop; the issue calls it an action-dependent baseline and shows the
      policy gradient is then biased, by the group mean of the accumulated
      intermediate rewards: a hidden bonus or penalty on every "take another
      turn" decision. The pooled variant subtracts one group constant at every
      turn, whatever the turn index or the stopping turn. Only the issue's
      summary was readable here, not its proposed fix, so `mt_grpo_pooled` is
      the pooled normalisation above, not necessarily the issue's exact fix.

      The authors' code (`MTGRPOEnvTrainer._assign_advantages`,
      advantage_est="aae") has one turn reward per trajectory, normalises it
      over the group, and gives the tokens before the tool result A^O +
      c A^T and the rest A^O, with c = turn_advantage_coef = 1 by default: the
      coefficient sits on A^T, not on A^O. With lam = 1 (the default here)
      both agree; a trajectory without a tool result gets the normalised sum
      of both rewards in the code, which has no counterpart here. The paper's
      value of lam was not found; lam = 1 is the code's default.

    Example: one group of three, scores [1, 0, 0]; turn rewards
    [[1, 0], [0, 0], [1, NaN]] with the NaN masked, so trajectories 0 and 1
    have two turns and trajectory 2 one. A^O = [1.1547, -0.5774, -0.5774].
    Only turn 0 of trajectories 0 and 1 earns turn credit (rewards 1 and 0),
    so per turn and pooled agree: A^T = [0.7071, -0.7071] and

      [[1.8618, 1.1547], [-1.2845, -0.5774], [-0.5774, 0]]
    """
    fn = "mt_grpo"
    _checks.finite_scalars(fn, lam=lam)
    _checks.one_of(fn, "turn_baseline", turn_baseline, TURN_BASELINES)
    _checks.one_of(fn, "final_turn", final_turn, FINAL_TURNS)
    _checks.one_of(fn, "std", std, group_lib.STDS)
    _checks.finite_nonnegative(fn, eps=eps)
    step_rewards, mask, scores, group_ids = _checks.step_and_group_arrays(
        fn, "step_rewards", step_rewards, mask, scores, group_ids)
    _checks.finite_where(fn, "step_rewards", step_rewards, mask)
    _checks.finite_where(fn, "scores", scores)
    dense = group_lib._dense_ids(fn, group_ids, num_groups, axis_name)

    def xla(step_rewards, scores, episode_ids, mask):
        outcome = group_lib.grpo(scores, episode_ids, num_groups=dense.num_groups, eps=eps,
                                 std=std, axis_name=axis_name)
        credited = mask if final_turn == "both" else mask & ~final_turns(mask)
        rewards = jnp.where(credited, step_rewards, 0.0)
        if turn_baseline == "per_turn" and axis_name is None:
            turn = group_lib._normalize_per_turn(rewards, episode_ids, credited,
                                                 dense.num_groups, std=std, eps=eps,
                                                 singleton="zero")
        else:
            segments, num_segments = _turn_segments(episode_ids, dense.num_groups,
                                                    mask.shape[1], turn_baseline)
            turn = group_lib._normalize(rewards, segments, credited, num_segments, std=std,
                                        eps=eps, singleton="zero", axis_name=axis_name)
        advantages = jnp.where(credited, turn + lam * outcome[:, None], outcome[:, None])
        return jnp.where(mask, advantages, 0.0).astype(step_rewards.dtype)

    arrays = (step_rewards, scores, dense.ids, mask)
    if (axis_name is not None or any(x.dtype != jnp.float32 for x in (step_rewards, scores))
            or not _checks.is_concrete(eps, lam)):
        return xla(*arrays)

    def kernel(step_rewards, scores, episode_ids, mask):
        return native.turn_groups(step_rewards, episode_ids, mask, std=std, eps=eps,
                                  singleton="zero", pooled=turn_baseline == "pooled",
                                  outcome_scores=scores, lam=lam,
                                  credit_final=final_turn == "both")

    return native.on_cpu(kernel, xla, *arrays)
