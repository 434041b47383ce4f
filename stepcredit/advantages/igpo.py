"""IGPO: turn rewards from the policy's information gain about the ground truth.

Each turn before the last is rewarded by how much it raised the policy's
belief in the ground-truth answer (the probability it gives the answer when
teacher-forced after the turn); the last turn by the outcome. The rewards are
normalised within the task group and summed, discounted, from each turn on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import _checks, native
from stepcredit.advantages.gae import _next_valid, discounted_returns
from stepcredit.advantages.group import STDS, _dense_ids, _normalize
from stepcredit.advantages.mt_grpo import final_turns
from stepcredit.advantages.recurrence import Method

GAINS = ("probability", "log_probability")
NORMALIZE = ("joint", "separate")
ORDERS = ("normalize_first", "discount_first")


def information_gain(answer_logp, mask, *, gain: str = "probability") -> jax.Array:
    """IGPO's information gain of each turn: the rise of the belief in the answer it caused.

        b_t      = log pi(answer | context before turn t)   (mean over the answer's tokens)
        IG_t     = exp(b_t') - exp(b_t)           gain="probability" (the paper)
                 = b_t' - b_t                     gain="log_probability"

    for every valid turn t before the last valid one, t' the next valid turn
    (the context before turn t' is the one after turn t); the last valid
    turn's gain is 0 (IGPO rewards it by the outcome instead). exp(mean
    log-prob) is the per-token geometric mean probability of the answer.

    Args:
      answer_logp: `[B, T]` float, b_t: the policy's mean per-token log-prob
        of the ground-truth answer teacher-forced after turn t's prompt (b_0:
        after the initial prompt), at most 0; masked entries may hold anything.
      mask: `[B, T]` bool, True on valid turns.
      gain: "probability" or "log_probability".

    Returns:
      `[B, T]` gains, 0 at the last valid turn and at masked turns.

    Raises:
      ValueError / TypeError: wrong rank, shape, dtype or option; called
        eagerly, a non-finite or positive log-prob at a valid turn.

    References:
      Wang et al., "Information Gain-based Policy Optimization: A Simple and
      Effective Approach for Multi-Turn LLM Agents" (IGPO), arXiv 2510.14967.

    Notes:
      The authors' code (`info_gain_type`) offers both: "prob_diff", the
      paper's and their default, and "log_prob_diff", which training scripts
      of forks of their repository set.

      For float32 log-probs, CPU runs the compiled kernel
      (`native.information_gain`: two passes where XLA:CPU runs the next-valid
      recurrence, an argmax and the steps between), equal to the XLA
      computation to float32 rounding; otherwise XLA computations. The kernel
      has no derivative: the gains are rewards.

    Example: b = log [[0.1, 0.4, 0.5]] gives [[0.3, 0.1, 0]].
    """
    fn = "information_gain"
    _checks.one_of(fn, "gain", gain, GAINS)
    answer_logp = _checks.float_array(fn, "answer_logp", answer_logp, rank=2)
    mask = _checks.bool_array(fn, "mask", mask, rank=2)
    _checks.same_shape(fn, "[B, T]", answer_logp=answer_logp, mask=mask)
    _checks.finite_where(fn, "answer_logp", answer_logp, mask)
    if _checks.is_concrete(answer_logp, mask) and (np.asarray(answer_logp)[np.asarray(mask)]
                                                   > 0).any():
        raise ValueError(f"{fn}: answer_logp holds a positive value at a valid turn; it is a "
                         "mean log-probability, at most 0")
    xla = functools.partial(_xla_information_gain, gain=gain)
    if answer_logp.dtype != jnp.float32:
        return xla(answer_logp, mask)

    kernel = functools.partial(native.information_gain, gain=gain)
    return native.on_cpu(kernel, xla, answer_logp, mask)


def _xla_information_gain(answer_logp, mask, *, gain):
    belief = jnp.where(mask, answer_logp, 0.0)
    if gain == "probability":
        belief = jnp.exp(belief)
    ahead = _next_valid(belief, mask, jnp.zeros(mask.shape[:1], belief.dtype), "auto")
    return jnp.where(mask & ~final_turns(mask), ahead - belief, 0.0)


def igpo(information_gain, scores, group_ids, mask, *, gamma: float = 1.0,
         normalize: str = "joint", order: str = "normalize_first", std: str = "biased",
         eps: float = 1e-6, num_groups: int | None = None,
         method: Method = "auto") -> jax.Array:
    """IGPO's turn advantage: group-normalised turn rewards, summed with discount from each turn on.

        r_{i,t}  = IG_{i,t}   for the valid turns before trajectory i's last turn T_i
        r_{i,T_i} = s_i       (the outcome score)
        A_{i,t}  = (r_{i,t} - mean_S r) / (std_S r + eps)               (order="normalize_first")
        Ã_{i,t}  = sum_{k = t}^{T_i} gamma^{k - t} A_{i,k}

    with S every valid turn of the group's trajectories (normalize="joint"),
    or, with normalize="separate", the group's information-gain turns for an
    information-gain turn and the group's last turns for a last turn. With
    order="discount_first" the raw rewards are summed first,
    G_{i,t} = sum_k gamma^{k-t} r_{i,k}, and the G are normalised over S.

    Reductions: with one turn per trajectory it is GRPO on the scores
    (`grpo` with the same std and eps), for any gamma, normalize and order.
    With zero information gain and normalize="separate",
    Ã_{i,t} = gamma^{T_i - t} grpo(s)_i: the discounted group-normalised
    outcome (GRPO broadcast over the turns at gamma = 1). order="discount_first"
    with normalize="joint" is `gtpo` (baseline="all_turns") on the r. A set S
    with fewer than two valid members, or all equal, normalises to 0 (the
    conventions of `grpo`).

    Args:
      information_gain: `[B, T]` IG_{i,t}, the gain of each valid turn before
        the last (`information_gain`); its value at the last valid turn and
        at masked turns is ignored (may be NaN).
      scores: `[B]` outcome score s_i of each trajectory.
      group_ids: `[B]` int task group; arbitrary unless `num_groups` is given.
      mask: `[B, T]` bool, True on valid turns.
      gamma: turn discount in [0, 1] (1: the authors' scripts).
      normalize: "joint" (all turns together, the paper and the authors'
        default) or "separate".
      order: "normalize_first" (the paper, and the authors' code since
        IGPO issue 5) or "discount_first".
      std: "biased" (the authors' code), "unbiased" or "none".
      eps: added to the std (1e-6, the authors' code).
      num_groups: static number of groups, or None to remap ids.
      method: "auto", "sequential", "chunked" or "associative": how the sums are
        solved (`reverse_linear_recurrence`).

    Returns:
      `[B, T]` advantages, 0 at masked turns.

    Raises:
      ValueError / TypeError: wrong rank, shape, dtype or option; gamma
        outside [0, 1]; called eagerly, NaN or inf in scores or at a valid
        information-gain turn, or an id outside [0, num_groups).

    References:
      Wang et al., "Information Gain-based Policy Optimization: A Simple and
      Effective Approach for Multi-Turn LLM Agents" (IGPO), arXiv 2510.14967
      (ICLR 2026); code `GuoqingWang1/IGPO`,
      `verl/trainer/ppo/core_algos.py::compute_grpo_outcome_advantage`.
      IGPO issue 5, "Discrepancy in Advantage Estimation order between Paper
      and Implementation".

    Notes:
      Only the paper's abstract and secondary summaries could be read here;
      the formulas follow those summaries and the authors' code. The first
      public code discounted the raw rewards and then normalised the returns
      (against the statistics of each trajectory's whole return); in issue 5
      the authors called that an early experiment and replaced it with the
      paper's order (normalise, then discount): order="normalize_first".
      order="discount_first" normalises the returns over all valid turns of
      the group, the order the issue describes. The authors' code divides by
      sqrt(biased var + 1e-8) + eps, here std_biased + eps: equal but for
      that 1e-8; it also leaves an information-gain turn whose gain is
      exactly 0 out of the statistics (and merges its tokens into the next
      turn), which is not reproduced. Their evaluation script and their
      code's defaults are gamma 1, "joint" and the probability gain; the
      training scripts of forks of their repository (their own train.sh was
      not readable here) set gamma 1, normalize="separate"
      (`info_gain_norm_mode`) and gain="log_probability" (`info_gain_type`):
      `--set normalize=separate --set gain=log_probability` in the trainer.
      The paper's value of gamma was not found.

      For float32 arrays, normalize "joint", gamma and eps known when tracing and
      method "auto", CPU runs the compiled kernel (`native.turn_groups`: the
      rewards, their normalisation and the discounted sum, one episode group at a
      time, where XLA:CPU runs three kernels and six passes between them), equal
      to the XLA computation to float32 rounding (it adds the group's sums turn by
      turn, then over the turns); otherwise XLA computations.

    Example (gamma = 1; one group, trajectory 0 has two turns with IG 0.2
    then score 1, trajectory 1 three turns with IG 0.1, -0.1 then score 0):
    the five rewards [0.2, 1 | 0.1, -0.1, 0] have mean 0.24 and biased std
    0.39294, so A = [-0.1018, 1.9341 | -0.3563, -0.8653, -0.6108] and

      [[1.8323, 1.9341, 0], [-1.8323, -1.4761, -0.6108]]
    """
    fn = "igpo"
    _checks.one_of(fn, "normalize", normalize, NORMALIZE)
    _checks.one_of(fn, "order", order, ORDERS)
    _checks.one_of(fn, "std", std, STDS)
    _checks.finite_nonnegative(fn, eps=eps)
    _checks.unit_interval(fn, gamma=gamma)
    information_gain, mask, scores, group_ids = _checks.step_and_group_arrays(
        fn, "information_gain", information_gain, mask, scores, group_ids)
    if _checks.is_concrete(information_gain, mask):  # the gain at a last turn is ignored
        _checks.finite_where(fn, "information_gain", information_gain, mask & ~final_turns(mask))
    _checks.finite_where(fn, "scores", scores)
    dense = _dense_ids(fn, group_ids, num_groups, None)

    def xla(information_gain, scores, episode_ids, mask):
        last = final_turns(mask)
        rewards = jnp.where(last, scores[:, None].astype(information_gain.dtype),
                            jnp.where(mask, information_gain, 0.0))
        ids = jnp.broadcast_to(episode_ids[:, None], mask.shape)

        def normalized(values):
            if normalize == "joint":
                return _normalize(values, ids, mask, dense.num_groups, std=std, eps=eps,
                                  singleton="zero", axis_name=None)
            turns = _normalize(values, ids, mask & ~last, dense.num_groups, std=std, eps=eps,
                               singleton="zero", axis_name=None)
            outcome = _normalize(values, ids, last, dense.num_groups, std=std, eps=eps,
                                 singleton="zero", axis_name=None)
            return jnp.where(last, outcome, turns)

        if order == "normalize_first":
            advantages = discounted_returns(normalized(rewards), mask, gamma=gamma,
                                            method=method)
        else:
            advantages = normalized(discounted_returns(rewards, mask, gamma=gamma, method=method))
        return jnp.where(mask, advantages, 0.0).astype(information_gain.dtype)

    arrays = (information_gain, scores, dense.ids, mask)
    if (normalize != "joint" or method != "auto" or not _checks.is_concrete(gamma, eps)
            or any(x.dtype != jnp.float32 for x in (information_gain, scores))):
        return xla(*arrays)

    def kernel(information_gain, scores, episode_ids, mask):
        return native.turn_groups(information_gain, episode_ids, mask, std=std, eps=eps,
                                  singleton="zero", pooled=True, gamma=gamma,
                                  discount="after" if order == "normalize_first" else "before",
                                  final_scores=scores)

    return native.on_cpu(kernel, xla, *arrays)
