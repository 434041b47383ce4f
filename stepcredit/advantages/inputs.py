"""The one container of credit inputs that every registered estimator reads from.

A trainer, offline credit or a framework adapter fills the fields it has; a
registry entry (`stepcredit.advantages.registry`) names the fields its
function reads, and `input_field` hands them over. The derived fields
(`DERIVED`: action mask, token rewards, implicit PRM rewards) are computed
from the others when they are not given, so a caller that already holds
them (verl's token rewards, a PRM's step rewards) passes them directly.

Conventions, for every field:
  - Step arrays are `[B, T]` (B trajectories, T steps, padded); `mask` is
    True on real steps. Token arrays are `[B, N]`: one trajectory's action
    tokens in order, with `step_index` naming each token's step (-1 on
    observation, prompt and padding tokens).
  - A value at a token is the critic's estimate of the state *before* that
    token (the critic output at the preceding position, verl's shifted
    slice), so the value at a step's first action token is V(s_t).
  - `bootstrap_value[b]` is the value after trajectory b's last valid step:
    V(s_next) when a limit truncated it, 0 after a true termination.
  - A step's reward sits on its last action token in the token view.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import _checks
from stepcredit.advantages.igpo import information_gain
from stepcredit.advantages.istar import implicit_step_rewards
from stepcredit.advantages.process import prime_token_rewards
from stepcredit.advantages.tokens import last_action_tokens  # noqa: F401 (stepcredit.credit's)
from stepcredit.advantages.tokens import token_rewards_from_steps


class CreditInputs(NamedTuple):
    """Every array an estimator may read; a pytree (None where absent).

    Attributes:
      mask: `[B, T]` bool, True on real steps.
      step_rewards: `[B, T]` reward of each step.
      step_values: `[B, T]` V(s_t), the critic at each step's start.
      bootstrap_value: `[B]` value after the last valid step (see module doc).
      entropy: `[B, T]` mean token entropy of each step's action.
      anchors: `[B, T]` int anchor-state id of each step (GiGPO), -1 for none.
      group_ids: `[B]` int group (task) of each trajectory.
      scores: `[B]` trajectory (episode) score.
      step_index: `[B, N]` int step of each action token, -1 elsewhere.
      token_values: `[B, N]` critic value before each action token.
      prm_logp: `[B, N]` action-token log-probs under an implicit PRM.
      ref_logp: `[B, N]` action-token log-probs under the policy that
        sampled the batch (iStar's rolling old policy; PRIME's reference).
      base_advantages: `[B]` or `[B, T]` advantages that an estimator
        reweights (plain EMPG); None lets the entry's base estimator supply them.
      action_mask: `[B, N]` bool, True on action tokens (derived:
        `step_index >= 0`).
      token_rewards: `[B, N]` reward of each action token (derived: each
        step's reward on its last action token).
      implicit_step_rewards: `[B, T]` iStar's implicit step rewards (derived:
        `implicit_step_rewards` of the PRM and old-policy log-probs).
      prime_token_rewards: `[B, N]` PRIME's implicit token rewards (derived:
        `prime_token_rewards` of the PRM and reference log-probs).
      tree_ids: `[B]` int rollout tree of each trajectory (Tree-GRPO: the
        leaves of one tree share their prefix up to their branch points).
      progress: `[B, T]` SPA's progress contributions c_t of each step (a
        progress estimator trained so that a trajectory's sum to its outcome).
      grounding: `[B, T]` bool, SPA's grounding signal: True where the
        environment executed the step's action, False where it was invalid.
      mc_values: `[B, T]` Monte Carlo values V_MC(s_t): the mean return of K
        continuations played by the sampling policy from each step's start
        state (VinePPO); no value is read after the last valid step, where
        none remain.
      answer_logp: `[B, T]` the sampling policy's mean per-token log-prob of
        the ground-truth answer teacher-forced after each step's prompt
        (IGPO's belief before the step; 0 where the task has no answer).
      information_gain: `[B, T]` IGPO's gain of each step before the last
        (derived: `information_gain` of `answer_logp`).
    """

    mask: Any = None
    step_rewards: Any = None
    step_values: Any = None
    bootstrap_value: Any = None
    entropy: Any = None
    anchors: Any = None
    group_ids: Any = None
    scores: Any = None
    step_index: Any = None
    token_values: Any = None
    prm_logp: Any = None
    ref_logp: Any = None
    base_advantages: Any = None
    action_mask: Any = None
    token_rewards: Any = None
    implicit_step_rewards: Any = None
    prime_token_rewards: Any = None
    tree_ids: Any = None
    progress: Any = None
    grounding: Any = None
    mc_values: Any = None
    answer_logp: Any = None
    information_gain: Any = None


class Derived(NamedTuple):
    """A field computed from others: `compute(*fields, **params)`."""

    compute: Callable[..., jax.Array]
    fields: tuple[str, ...]
    params: tuple[str, ...]


def _implicit_step_rewards(prm_logp, ref_logp, step_index, mask, **params):
    """iStar's step rewards on the mask's T steps (named in errors as the iStar family's)."""
    fn = "istar"
    mask = _checks.bool_array(fn, "mask", mask, rank=2)
    step_index = _checks.int_array(fn, "step_index", step_index, rank=2)
    if mask.shape[0] != step_index.shape[0]:
        raise ValueError(f"{fn}: mask has shape {tuple(mask.shape)} but step_index has shape "
                         f"{tuple(step_index.shape)}; both hold one row per trajectory")
    if _checks.is_concrete(step_index, mask) and step_index.size:
        index, valid = np.asarray(step_index), np.asarray(mask)
        last = int(index.max())
        if last >= mask.shape[1]:
            raise ValueError(f"{fn}: step_index holds step {last} but mask has "
                             f"{mask.shape[1]} steps ([B, T])")
        # Every step has an action token: a valid step without one means that the mask and
        # the tokens describe different steps (a mask one column too wide, say).
        has_tokens = np.zeros(valid.shape, bool)
        rows, columns = np.nonzero(index >= 0)
        has_tokens[rows, index[rows, columns]] = True
        if (valid & ~has_tokens).any():
            b, t = (int(i[0]) for i in np.nonzero(valid & ~has_tokens))
            raise ValueError(f"{fn}: mask marks step {t} of row {b} valid but step_index gives it "
                             "no action token")
    return implicit_step_rewards(prm_logp, ref_logp, step_index, mask.shape[1], **params)


def _prime_token_rewards(prm_logp, ref_logp, step_index, **params):
    return prime_token_rewards(prm_logp, ref_logp, jnp.asarray(step_index) >= 0, **params)


DERIVED: Mapping[str, Derived] = {
    "action_mask": Derived(lambda step_index: jnp.asarray(step_index) >= 0, ("step_index",), ()),
    "token_rewards": Derived(token_rewards_from_steps, ("step_rewards", "step_index"), ()),
    # iStar: r_t = beta sum over step t's tokens of (log pi_prm - log pi_old).
    "implicit_step_rewards": Derived(_implicit_step_rewards,
                                     ("prm_logp", "ref_logp", "step_index", "mask"),
                                     ("beta", "normalize")),
    # PRIME: r_n = beta (log pi_prm - log pi_ref) at each action token.
    "prime_token_rewards": Derived(_prime_token_rewards, ("prm_logp", "ref_logp", "step_index"),
                                   ("beta",)),
    # IGPO: IG_t = exp(b_{t+1}) - exp(b_t) (or b_{t+1} - b_t) of the answer beliefs b.
    "information_gain": Derived(information_gain, ("answer_logp", "mask"), ("gain",)),
}


def raw_fields(field: str) -> tuple[str, ...]:
    """The fields that `field` needs when it is not given: itself, or what derives it."""
    if field not in CreditInputs._fields:
        raise KeyError(f"unknown credit input {field!r}; known: "
                       f"{', '.join(sorted(CreditInputs._fields))}")
    if field not in DERIVED:
        return (field,)
    return tuple(dict.fromkeys(raw for f in DERIVED[field].fields for raw in raw_fields(f)))


def missing_fields(inputs: CreditInputs, field: str) -> tuple[str, ...]:
    """The fields that are absent although `field` needs them (empty: it can be read)."""
    if getattr(inputs, field) is not None:
        return ()
    if field not in DERIVED:
        return (field,)
    return tuple(dict.fromkeys(m for f in DERIVED[field].fields
                               for m in missing_fields(inputs, f)))


def input_field(inputs: CreditInputs, field: str, params: Mapping[str, Any]) -> jax.Array:
    """The array `field` of `inputs`, or derived from its fields with `params` when absent."""
    value = getattr(inputs, field)
    if value is not None or field not in DERIVED:
        return value
    derived = DERIVED[field]
    args = [input_field(inputs, f, params) for f in derived.fields]
    return derived.compute(*args, **{k: params[k] for k in derived.params if k in params})
