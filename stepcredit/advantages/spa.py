"""SPA-RL: stepwise progress attribution, dense step rewards fed to PPO's GAE.

A progress estimator gives each step a contribution c_t = E(s_t, a_t),
trained so that a trajectory's contributions sum to its outcome
(`progress_loss`). The step reward fuses the contribution with a grounding
signal g_t (1 when the environment executed the action, 0 when it refused
it), r_t = alpha c_t + beta g_t (`spa_step_rewards`), and PPO learns from these
dense rewards: token-level GAE over a critic, each step's reward on its last
action token (`spa`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks
from stepcredit.advantages.gae import AdvantagesAndReturns, GaeMethod, token_gae
from stepcredit.advantages.inputs import token_rewards_from_steps


def _grounding(fn: str, grounding) -> jax.Array:
    grounding = jnp.asarray(grounding)
    if grounding.dtype == jnp.bool_:
        return grounding.astype(jnp.float32)
    return _checks.float_array(fn, "grounding", grounding, rank=2)


def spa_step_rewards(progress, grounding, mask, *, alpha: float = 1.0,
                     beta: float = 0.5) -> jax.Array:
    """SPA's fused step rewards: r_t = alpha c_t + beta g_t on valid steps, 0 elsewhere.

    With beta = 0 and alpha = 1 the rewards are the contributions, which the
    progress estimator trains to sum to the outcome R (sum_t r_t ~ R); beta
    adds beta per executed action.

    Args:
      progress: `[B, T]` float, the progress estimator's contribution c_t of
        each step; masked entries may hold anything (NaN included).
      grounding: `[B, T]` bool or float, g_t: 1 (True) where the environment
        executed the action, 0 where it refused it as invalid.
      mask: `[B, T]` bool, True on real steps.
      alpha: weight of the contribution (1.0).
      beta: weight of the grounding signal (0.5, the authors' data script).

    Returns:
      `[B, T]` float rewards, 0 at masked steps.

    Raises:
      ValueError / TypeError: wrong rank, shape or dtype (naming the
        argument); called eagerly, a non-finite contribution at a valid step.

    References:
      Wang et al., "SPA-RL: Reinforcing LLM Agents via Stepwise Progress
      Attribution", arXiv 2505.20732.

    Example: progress [[0.2, 0.3, 0.5]], grounding [[1, 0, 1]] give
    [[0.7, 0.3, 1.0]] (alpha 1, beta 0.5).
    """
    fn = "spa_step_rewards"
    _checks.finite_scalars(fn, alpha=alpha, beta=beta)
    progress = _checks.float_array(fn, "progress", progress, rank=2)
    grounding = _grounding(fn, grounding)
    mask = _checks.bool_array(fn, "mask", mask, rank=2)
    _checks.same_shape(fn, "[B, T]", progress=progress, grounding=grounding, mask=mask)
    _checks.finite_where(fn, "progress", progress, mask)
    _checks.finite_where(fn, "grounding", grounding, mask)
    fused = alpha * progress + beta * grounding.astype(progress.dtype)
    return jnp.where(mask, fused, 0.0)


def spa(progress, grounding, mask, step_index, token_values, bootstrap_value=None, *,
        alpha: float = 1.0, beta: float = 0.5, gamma: float = 0.99, lam: float = 0.95,
        method: GaeMethod = "auto") -> AdvantagesAndReturns:
    """SPA's PPO advantages: token-level GAE on the fused step rewards.

        r_t = alpha c_t + beta g_t                     (`spa_step_rewards`)
        r_n = r_t at the last action token n of step t, 0 at its other tokens
        A_n = delta_n + gamma lam A_{n+1},  delta_n = r_n + gamma V_{n+1} - V_n

    along each trajectory's action tokens (`token_gae`; observation, prompt
    and padding tokens are skipped). With beta = 0 and contributions equal to
    the environment's step rewards it is `token_gae` on those rewards; with
    gamma = lam = 1 and V = 0 the advantage of step t is the sum of the
    contributions from t on, so the first step's is the predicted outcome
    sum_t c_t (~ R), and uniform contributions R / T give R (T - t) / T.

    Args:
      progress: `[B, T]` float contributions c_t; masked entries may hold anything.
      grounding: `[B, T]` bool or float g_t, 1 on executed (valid) actions.
      mask: `[B, T]` bool, True on real steps.
      step_index: `[B, N]` int, the step of each action token, -1 elsewhere.
      token_values: `[B, N]` float, the critic's value before each action token.
      bootstrap_value: optional `[B]` value after the last valid step (None: 0).
      alpha, beta: the reward weights (1.0 and 0.5).
      gamma: discount along tokens (0.99, the authors' PPO config).
      lam: GAE lambda (0.95, TRL's PPOConfig default, which the authors keep).
      method: how `token_gae` runs ("auto": the compiled CPU kernel where it
        applies, else the sequential scan; `gae.gae_method`).

    Returns:
      `AdvantagesAndReturns` of `[B, N]` arrays, 0 off action tokens.

    Raises:
      ValueError / TypeError: wrong rank, shape or dtype (naming the argument);
        gamma or lam outside [0, 1]; called eagerly, non-finite values at valid
        positions.

    References:
      Wang et al., "SPA-RL: Reinforcing LLM Agents via Stepwise Progress
      Attribution", arXiv 2505.20732; the PPO is StepTool's step-grained
      trainer (Yu et al., arXiv 2410.07745) over TRL's PPOTrainer.

    Notes:
      Only the abstract of the paper could be read here; the rule and its
      defaults follow the authors' code (github.com/WangHanLinHenry/SPA-RL-Agent):
      `prm/rl_data_org.py` adds a grounding value 0.5 to each step whose next
      observation is not "Nothing happens" (and to the last step, which has
      none), i.e. alpha 1, beta 0.5; `ppo/train_ppo.sh` runs StepTool's
      `StepPPOTrainer` with gamma 0.99 and TRL's default lam 0.95, which
      whitens the advantages (the registry's `whiten="tokens"`). Here the last
      step's g_t is its own validity, known to the trainer. Three details of
      that code are not reproduced: StepTool's `compute_rewards` multiplies
      step k's reward (of K) by K - k - 1 (the last step's by 0); TRL adds a
      per-token KL penalty to the rewards (the trainer's KL term is a loss);
      and the stored version of `rl_data_org.py` overwrites every turn value
      with the outcome minus the other rollouts' mean outcome (an RLOO
      baseline) before adding the grounding value, discarding the progress
      estimator's contributions.

    Example (alpha 1, beta 0.5, gamma = lam = 1, V = 0; step 0 has two tokens):

      >>> spa(jnp.array([[0.2, 0.3, 0.5]]), jnp.array([[True, False, True]]),
      ...     jnp.ones((1, 3), bool), jnp.array([[0, 0, 1, 2]]), jnp.zeros((1, 4)),
      ...     gamma=1.0, lam=1.0).advantages
      [[2.0, 2.0, 1.3, 1.0]]

    Fused rewards [0.7, 0.3, 1.0] sit on tokens 1, 2 and 3; each token's
    advantage is the sum of the rewards from it on.
    """
    fn = "spa"
    step_index = _checks.int_array(fn, "step_index", step_index, rank=2)
    if step_index.shape[0] != jnp.shape(mask)[0]:
        raise ValueError(f"{fn}: step_index has shape {tuple(step_index.shape)} but mask has "
                         f"shape {tuple(jnp.shape(mask))}; both must have B rows")
    rewards = spa_step_rewards(progress, grounding, mask, alpha=alpha, beta=beta)
    return token_gae(token_rewards_from_steps(rewards, step_index), token_values,
                     step_index >= 0, gamma=gamma, lam=lam, bootstrap_value=bootstrap_value,
                     method=method)


def progress_loss(progress, mask, outcomes) -> jax.Array:
    """SPA's progress-estimator loss: the contributions of a trajectory sum to its outcome.

        L = mean over trajectories b with a valid step of (sum_{valid t} c_t^b - R^b)^2

    Args:
      progress: `[B, T]` float predicted contributions c_t; masked entries may
        hold anything (NaN included).
      mask: `[B, T]` bool, True on real steps.
      outcomes: `[B]` float, each trajectory's outcome R (its score).

    Returns:
      The scalar loss; 0 (with zero gradient) when no trajectory has a valid step.

    Raises:
      ValueError / TypeError: wrong rank, shape or dtype (naming the argument).

    References:
      Wang et al., SPA-RL, arXiv 2505.20732; the authors'
      `prm/train_our_progress_model.py` (MSE between the summed turn values
      and `agent_final_reward`).

    Example: progress [[0.2, 0.3], [0.5, 0.0]], mask [[1, 1], [1, 0]],
    outcomes [1, 0] give ((0.5 - 1)^2 + (0.5 - 0)^2) / 2 = 0.25.
    """
    fn = "progress_loss"
    progress = _checks.float_array(fn, "progress", progress, rank=2)
    mask = _checks.bool_array(fn, "mask", mask, rank=2)
    outcomes = _checks.float_array(fn, "outcomes", outcomes, rank=1)
    _checks.same_shape(fn, "[B, T]", progress=progress, mask=mask)
    _checks.leading_dim(fn, progress.shape[0], outcomes=outcomes)
    totals = jnp.sum(jnp.where(mask, progress, 0.0), axis=1)
    has_steps = jnp.any(mask, axis=1)
    errors = jnp.where(has_steps, (totals - outcomes.astype(totals.dtype)) ** 2, 0.0)
    return jnp.sum(errors) / jnp.maximum(jnp.sum(has_steps), 1)
