"""One call for trainers: any registered estimator on a collated batch.

`compute_advantages(steps, tokens, name, **config)` fills `CreditInputs` from
the step view (`StepBatch`) and the token view (`TokenBatch`), runs the named
estimator through its registry binding (`stepcredit.advantages.apply`: the
entry decides which inputs it reads), applies the entry's whitening, and
returns token-level advantages ready for the loss, plus critic targets where
the estimator defines them.

Whitening is never inside an estimator: each registry entry carries a default
applied here, over valid steps ("steps", StepPO), over valid action tokens
("tokens", token GAE, REINFORCE++, PRIME) or not at all (the group family),
as (x - mean) / sqrt(var + 1e-8) with the unbiased variance (`masked_whiten`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stepcredit import advantages as adv
from stepcredit.advantages.inputs import (CreditInputs, last_action_tokens,
                                          token_rewards_from_steps)
from stepcredit.batch import StepBatch, TokenBatch

__all__ = ["Credit", "compute_advantages", "compiled_compute_advantages", "credit_inputs",
           "last_action_tokens", "token_rewards_from_steps"]


class Credit(NamedTuple):
    """What `compute_advantages` returns.

    Attributes:
      token_advantages: `[B, N]` advantages at action tokens, 0 elsewhere.
      step_advantages: `[B, T]` advantages per step (after whitening), or None
        for token-level estimators.
      returns: critic targets: `[B, T]` per step for step GAE, `[B, N]` per
        token for token GAE; None for critic-free estimators.
    """

    token_advantages: jax.Array
    step_advantages: jax.Array | None
    returns: jax.Array | None


def credit_inputs(steps: StepBatch, tokens: TokenBatch, *, token_values=None, prm_logp=None,
                  ref_logp=None, base_advantages=None, mc_values=None, progress=None,
                  grounding=None, answer_logp=None) -> CreditInputs:
    """The `CreditInputs` of a collated batch and the arrays the trainer adds to it."""
    return CreditInputs(mask=steps.mask, step_rewards=steps.reward, step_values=steps.value,
                        bootstrap_value=steps.bootstrap_value, entropy=steps.entropy,
                        anchors=steps.anchor, group_ids=steps.group_id, scores=steps.score,
                        step_index=tokens.step_index, token_values=token_values,
                        prm_logp=prm_logp, ref_logp=ref_logp, base_advantages=base_advantages,
                        tree_ids=steps.tree_id, mc_values=mc_values, progress=progress,
                        grounding=grounding, answer_logp=answer_logp)


def compute_advantages(steps: StepBatch, tokens: TokenBatch, name: str, *, token_values=None,
                       prm_logp=None, ref_logp=None, base_advantages=None, mc_values=None,
                       progress=None, grounding=None, answer_logp=None,
                       whiten: bool | None = None, **config: Any) -> Credit:
    """Runs the estimator registered as `name` and returns token-level credit.

    Step rewards come from `steps.reward`; token-level estimators see each
    step's reward on its last action token. Trajectory-level outputs are
    broadcast over valid steps, step-level outputs over each step's action
    tokens (`broadcast_to_tokens`). Whitening follows the registry entry's
    `whiten` ("steps": over valid steps, "tokens": over action tokens), or is
    forced on or off by `whiten`.

    Args:
      steps: the `[B, T]` step view (reward, mask, value, entropy, anchor,
        group_id, score, bootstrap_value).
      tokens: the `[B, N]` token view (action tokens with `step_index`).
      name: a registry name (`stepcredit.advantages.names()`).
      token_values: `[B, N]` token-aligned critic values (token GAE).
      prm_logp, ref_logp: `[B, N]` action-token log-probs of the implicit PRM
        and of the policy that sampled the batch (iStar, PRIME).
      base_advantages: `[B]` or `[B, T]` advantages for plain "empg" (None:
        its base estimator's, GRPO).
      mc_values: `[B, T]` Monte Carlo state values V_MC(s_t) (VinePPO;
        `stepcredit.train.vine`).
      progress, grounding: `[B, T]` a progress estimator's step contributions
        and whether each step's action was executed (valid) (SPA;
        `stepcredit.train.progress`).
      answer_logp: `[B, T]` the policy's mean log-prob of the ground-truth
        answer after each step's prompt (IGPO; `stepcredit.train.information_gain`).
      whiten: override the registry's whitening (None keeps it).
      **config: the estimator's hyperparameters and options overriding its
        defaults (`stepcredit.advantages.get(name).accepted`), including the
        implicit PRM's `beta` and `normalize` for iStar and PRIME.

    Returns:
      A `Credit`.

    References:
      Each estimator's own paper (`stepcredit.advantages.get(name).paper`).
    """
    _check_whiten("compute_advantages", whiten)
    entry = adv.get(name)
    inputs = credit_inputs(steps, tokens, token_values=token_values, prm_logp=prm_logp,
                           ref_logp=ref_logp, base_advantages=base_advantages,
                           mc_values=mc_values, progress=progress, grounding=grounding,
                           answer_logp=answer_logp)
    out = adv.apply(entry, inputs, config)
    mask, step_index = jnp.asarray(steps.mask), jnp.asarray(tokens.step_index)
    step_level = token_level = None
    if out.level == "trajectory":
        step_level = jnp.where(mask, out.advantages[:, None], 0.0)
    elif out.level == "step":
        step_level = out.advantages
    else:
        token_level = out.advantages

    whiten_over = entry.whiten if whiten is None else ("steps" if step_level is not None
                                                         else "tokens") if whiten else "none"
    if step_level is not None:
        if whiten_over == "steps":
            step_level = adv.masked_whiten(step_level, mask)
        token_level = adv.broadcast_to_tokens(step_level, step_index)
    if whiten_over == "tokens":
        token_level = adv.masked_whiten(token_level, step_index >= 0)
    return Credit(token_level, step_level, out.returns)


def _check_whiten(fn: str, whiten) -> None:
    # A string such as "none" would be true: refused, not read as "whiten".
    if whiten is not None and not isinstance(whiten, (bool, np.bool_)):
        raise ValueError(f"{fn}: whiten={whiten!r}; it must be True, False or None (None "
                         "keeps the estimator's own whitening)")


@functools.lru_cache(maxsize=64)
def _compiled(name: str, whiten: bool | None, config_items: tuple[tuple[str, Any], ...]):
    return jax.jit(functools.partial(compute_advantages, name=name, whiten=whiten,
                                     **dict(config_items)))


def compiled_compute_advantages(steps: StepBatch, tokens: TokenBatch, name: str, *,
                                whiten: bool | None = None, token_values=None, prm_logp=None,
                                ref_logp=None, base_advantages=None, mc_values=None,
                                progress=None, grounding=None, answer_logp=None,
                                **config: Any) -> Credit:
    """`compute_advantages` compiled once per (name, whiten, config) and input shapes.

    The trainer's hot path: eager dispatch of the estimators' many small ops
    costs seconds per batch on CPU, the compiled call milliseconds. Value
    checks (NaN, out-of-range ids) are skipped under `jit`; shapes are still
    checked while tracing. Hyperparameters must be hashable.
    """
    _check_whiten("compiled_compute_advantages", whiten)
    compiled = _compiled(name, whiten, tuple(sorted(config.items())))
    return compiled(steps, tokens, token_values=token_values, prm_logp=prm_logp,
                    ref_logp=ref_logp, base_advantages=base_advantages, mc_values=mc_values,
                    progress=progress, grounding=grounding, answer_logp=answer_logp)
