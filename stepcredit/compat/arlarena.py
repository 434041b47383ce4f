"""ARLArena: EMPG and its step-row GRPO, with ARLArena's names and rules.

ARLArena (arXiv 2602.21534) trains on verl-agent step rows (`uid`, `traj_uid`)
and ships EMPG as `compute_EMPG_advantage(batch, ...)`, which modulates the
advantages already in `batch.batch["advantages"]` (its trainer runs GRPO
first). Its GRPO differs from verl-agent's in one rule: with
`compute_mean_std_cross_steps=False` each trajectory's member score is the
MEAN of its step rows' scores (verl-agent: its first row's).

References: Wang et al., "Harnessing Uncertainty: Entropy-Modulated Policy
Gradients for Long-Horizon LLM Agents" (EMPG), arXiv 2509.09265; ARLArena
`recipe/*/ppo/core_algos.py`.
"""

from __future__ import annotations

import re
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import registry
from stepcredit.advantages.inputs import CreditInputs
from stepcredit.compat._arrays import (
    StepLayout,
    broadcast,
    dense,
    first_rows,
    host,
    like,
    normalize_by_members,
    number,
    read,
    row_sums,
    step_indices,
    token_matrix,
    token_rows,
    trajectory_pairs,
)

# ARLArena's prompts say how many steps came before; its EMPG reads the step from there.
_STEP_IN_PROMPT = re.compile(r"you have already taken (\d+) step\(s\)")


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, traj_index,
                                   epsilon=1e-6, norm_adv_by_std_in_grpo=True,
                                   compute_mean_std_cross_steps=True):
    """GRPO on step rows: (s_i - m_g) / (sd_g + epsilon) for every row i.

    Members of group g: every step row (cross steps, the default) or one per
    (uid, traj_uid) scored by the mean of that trajectory's row scores (False,
    ARLArena's "vanilla GRPO"). A group of one member has mean 0, std 1.

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.
    """
    fn = "compute_grpo_outcome_advantage"
    epsilon = number(fn, "epsilon", epsilon)
    rewards, mask = token_rows(token_level_rewards, response_mask, fn)
    size = rewards.shape[0]
    scores = row_sums(rewards, None)
    groups = dense(index, "index", size)
    rule = "std" if norm_adv_by_std_in_grpo else "mean"
    if compute_mean_std_cross_steps:
        advantages = normalize_by_members(scores, groups, np.arange(size), rule=rule, eps=epsilon)
    else:
        traj = dense(traj_index, "traj_index", size)
        pairs = trajectory_pairs(groups, traj)
        count = int(pairs.max(initial=-1)) + 1
        means = (jnp.zeros(count).at[pairs].add(scores)
                 / jnp.maximum(jnp.zeros(count).at[pairs].add(1.0), 1.0))
        first = first_rows(pairs)
        advantages = normalize_by_members(scores, groups, first, means, rule=rule, eps=epsilon)
    out = like(broadcast(advantages, mask), token_level_rewards)
    return out, out


def _steps(batch, size: int, fn: str) -> tuple[np.ndarray, str]:
    """Each row's step, and where it was read (named in StepLayout's errors)."""
    given = read(batch, "step_indices", fn, required=False)
    if given is not None:
        return step_indices(given, "step_indices", size, fn), "step_indices"
    prompts = read(batch, "raw_prompt", fn, required=False)
    if prompts is None:
        raise KeyError(f"{fn}: the batch has neither 'step_indices' nor 'raw_prompt' (ARLArena reads "
                       f"each row's step from its prompt's 'you have already taken N step(s)')")
    steps = np.zeros(size, np.int64)
    for row, messages in enumerate(host(prompts).reshape(-1)):
        try:
            content = messages[0]["content"]
        except (IndexError, KeyError, TypeError):
            raise ValueError(f"{fn}: raw_prompt[{row}] is {type(messages).__name__} "
                             f"{str(messages)[:60]!r}; it must be a list of chat messages "
                             "(dicts with 'content')") from None
        found = _STEP_IN_PROMPT.search(str(content))
        steps[row] = int(found.group(1)) if found else 0
    return steps, "the step read from raw_prompt ('you have already taken N step(s)'; 0 where absent)"


def compute_EMPG_advantage(batch, k=1.0, k_f=1.0, zeta=0.05):  # noqa: N802 (ARLArena's name)
    """EMPG: entropy-modulated step advantages of the GRPO advantages in `batch`.

    Per row i: H_i, the mean of `old_entropy` over its masked-in tokens;
    over the batch, H~ = (H - min) / (max - min + 1e-8);
    g = exp(-k H~) / mean(exp(-k H~)); A'_i = g_i A_i + zeta exp(-k_f H~_next)
    with H~_next of the same trajectory's next step (none on its last step);
    then A' minus its mean over rows, on the masked-in tokens.

    Reads `batch.batch["advantages"]` (a step-constant advantage, taken at each
    row's first token), `["old_entropy"]`, `["response_mask"]` and
    `batch.non_tensor_batch["traj_uid"]`; each row's step from
    `non_tensor_batch["step_indices"]` when present, else from the prompt, as
    ARLArena does (`raw_prompt[i][0]["content"]`, "you have already taken N
    step(s)", 0 when absent). ARLArena also writes `batch.batch["f_entropy"]`;
    this does not modify the batch.

    Args:
      batch: a verl `DataProto` (or an object with `batch` / `non_tensor_batch` mappings).
      k, k_f, zeta: EMPG's self-calibration and future-clarity strengths
        (ARLArena's defaults).

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.
    """
    fn = "compute_EMPG_advantage"
    k = number(fn, "k", k)
    k_f = number(fn, "k_f", k_f)
    zeta = number(fn, "zeta", zeta)
    advantages = read(batch, "advantages", fn)
    values, mask = token_rows(advantages, read(batch, "response_mask", fn), fn, name="advantages")
    size = values.shape[0]
    entropy = token_matrix(read(batch, "old_entropy", fn), "old_entropy", values.shape, fn)
    step_entropy = (jnp.sum(jnp.where(mask, entropy, 0.0), axis=1)
                    / jnp.maximum(jnp.sum(mask, axis=1), 1))
    steps, source = _steps(batch, size, fn)
    layout = StepLayout(read(batch, "traj_uid", fn), steps, size, fn, traj_name="traj_uid", step_name=source)
    first_token = jnp.argmax(mask, axis=1)
    base = values[jnp.arange(size), first_token]
    inputs = CreditInputs(base_advantages=layout.steps(base), entropy=layout.steps(step_entropy),
                          mask=layout.mask)
    modulated = registry.apply("empg", inputs, {"k": k, "k_future": k_f,
                                                "zeta": zeta}).advantages
    out = like(broadcast(layout.rows(modulated), mask), advantages)
    return out, out


__all__: Sequence[str] = ("compute_EMPG_advantage", "compute_grpo_outcome_advantage")
