"""verl 0.9.x: its `core_algos` advantage functions, computed by stepcredit, and its registry.

Two things for a verl user:

  - Drop-in replacements for verl 0.9's own `compute_*` functions with verl's
    argument names, defaults and rules (including `config=` and `**kwargs`,
    which verl's trainer passes), returning `(advantages, returns)` of shape
    `(bs, response_length)`.
  - stepcredit's step-level estimators as verl estimators on verl's own rows:
    `register()` (run automatically by verl's plugin discovery once stepcredit
    is installed) adds them to verl's `ADV_ESTIMATOR_REGISTRY` as
    `stepcredit_<name>`, so `algorithm.adv_estimator=stepcredit_gigpo` selects
    one. `compute_advantage(data, ...)` is a drop-in for verl's
    `ray_trainer.compute_advantage` that also hands them the batch keys they
    read beyond verl's (`values`, `entropys`, `rm_scores`, `anchor_obs`).

verl's conventions, followed here:
  - A row is one response: in multi-turn agent loops, the whole conversation
    after the prompt, with `response_mask` 1 on the model's tokens and 0 on
    tool or environment tokens. A response's score is the sum of
    `token_level_rewards` over ALL its tokens (verl does not mask the sum).
  - Group statistics: the unbiased std (`torch.std`), `epsilon` added to the
    std, a singleton group keeping its raw score (mean 0, std 1).
  - Inputs are NumPy arrays or torch tensors (float32, float16 or bfloat16);
    outputs have the rewards' type, dtype and device.

Turns (the step-level estimators): each run of `response_mask` 1 is one turn, its
reward the rewards from its first token to the next turn's (`stepcredit.compat._turns`
states the whole rule); each turn's advantage is written on its tokens.

References: verl 0.9.1 `verl/trainer/ppo/core_algos.py` and
`ray_trainer.compute_advantage`.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any, Mapping, Sequence

from stepcredit.advantages import normalize, registry
from stepcredit.advantages.inputs import CreditInputs
from stepcredit.compat._arrays import (
    broadcast,
    dense,
    like,
    number,
    read,
    row_sums,
    setting,
    token_matrix,
    token_rows,
)
from stepcredit.compat._turns import TURN_INPUTS, turn_estimator, turn_estimators

PREFIX = "stepcredit_"


# ---------------------------------------------------------------- verl's own functions


def _grouped(name, rewards, index, size, **config):
    return registry.apply(name, CreditInputs(scores=rewards, group_ids=dense(index, "index", size)),
                          config).advantages


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma=1.0, lam=1.0):
    """verl's token-level GAE, whitened over valid tokens (`stepcredit.token_gae`).

        delta_n = r_n + gamma V_{next(n)} - V_n,   A_n = delta_n + gamma lam A_{next(n)}

    with next(n) the next token where `response_mask` is 1 (observation tokens
    do not advance the recursion), V after the last one 0. Returns R = A + V
    (before whitening) on the mask and 0 off it (verl's carry A + V onto
    observation tokens, which its losses mask out); advantages are
    `masked_whiten`ed over the mask.

    Args:
      token_level_rewards, values, response_mask: `(bs, response_length)`.
      gamma, lam: discount and GAE lambda.

    Returns:
      `(advantages, returns)`, `(bs, response_length)`.
    """
    fn = "compute_gae_advantage_return"
    gamma = number(fn, "gamma", gamma)
    lam = number(fn, "lam", lam)
    rewards, mask = token_rows(token_level_rewards, response_mask, fn)
    inputs = CreditInputs(token_rewards=rewards, action_mask=mask,
                          token_values=token_matrix(values, "values", rewards.shape, fn))
    out = registry.apply("token_gae", inputs, {"gamma": gamma, "lam": lam})
    advantages = normalize.masked_whiten(out.advantages, mask)
    return like(advantages, token_level_rewards), like(out.returns, token_level_rewards)


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True, config=None):
    """GRPO: (s - mean_g) / (std_g + epsilon) per `index` group, s a row's reward sum.

    A singleton group gives s / (1 + epsilon) (mean 0, std 1), or s without
    the std (`norm_adv_by_std_in_grpo=False`, Dr. GRPO, arXiv 2503.20783).
    The advantage is written to every token where `response_mask` is 1.

    Args:
      token_level_rewards, response_mask: `(bs, response_length)`.
      index: `(bs,)` group uids (verl's `uid`).
      epsilon, norm_adv_by_std_in_grpo: as verl; config: unused (verl's signature).

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.

    References:
      Shao et al., arXiv 2402.03300.
    """
    fn = "compute_grpo_outcome_advantage"
    epsilon = number(fn, "epsilon", epsilon)
    rewards, mask = token_rows(token_level_rewards, response_mask, fn)
    advantages = _grouped("grpo", row_sums(rewards, None), index, rewards.shape[0],
                          eps=epsilon, singleton="raw",
                          std="unbiased" if norm_adv_by_std_in_grpo else "none")
    out = like(broadcast(advantages, mask), token_level_rewards)
    return out, out


def compute_grpo_vectorized_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                              norm_adv_by_std_in_grpo=True, config=None):
    """verl's vectorised GRPO: the same numbers as `compute_grpo_outcome_advantage`."""
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon,
                                          norm_adv_by_std_in_grpo, config)


def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   config=None, **kwargs):
    """RLOO: N/(N-1) (s - mean_g) per `index` group; a singleton keeps its raw score s.

    Args:
      token_level_rewards, response_mask: `(bs, response_length)`.
      index: `(bs,)` group uids. epsilon, config, kwargs: unused (verl's signature).

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.

    References:
      Ahmadian et al., arXiv 2402.14740.
    """
    rewards, mask = token_rows(token_level_rewards, response_mask, "compute_rloo_outcome_advantage")
    advantages = _grouped("rloo", row_sums(rewards, None), index, rewards.shape[0], singleton="raw")
    out = like(broadcast(advantages, mask), token_level_rewards)
    return out, out


def compute_rloo_vectorized_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                              config=None, **kwargs):
    """verl's vectorised RLOO: as `compute_rloo_outcome_advantage`, but a singleton gives 0."""
    rewards, mask = token_rows(token_level_rewards, response_mask,
                               "compute_rloo_vectorized_outcome_advantage")
    advantages = _grouped("rloo", row_sums(rewards, None), index, rewards.shape[0], singleton="zero")
    out = like(broadcast(advantages, mask), token_level_rewards)
    return out, out


def observation_span_rule() -> str:
    """How REINFORCE++'s return crosses `response_mask == 0` spans under the installed verl.

    "carry" (verl 0.9 and later, and when verl is not installed): the return
    passes through observation tokens undiscounted and their rewards are
    dropped; "reset" (verl before 0.9): the return restarts after each span.
    """
    try:
        version = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return "carry"
    release = re.match(r"(\d+)(?:\.(\d+))?", version)  # "0.9rc1" and "0.10.dev0" are releases 0.9, 0.10
    if release is None:
        raise ValueError(f"observation_span_rule: cannot read a release from verl's version {version!r}")
    major, minor = int(release.group(1)), int(release.group(2) or 0)
    return "carry" if (major, minor) >= (0, 9) else "reset"


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, config=None,
                                                  observation_spans=None, **kwargs):
    """REINFORCE++: token returns G_n = r_n + gamma G_{next(n)}, whitened over valid tokens.

    gamma is `config.gamma` (verl reads it there). Across observation spans
    the return follows `observation_spans` ("carry" or "reset"; None follows
    the installed verl, `observation_span_rule`).

    Args:
      token_level_rewards, response_mask: `(bs, response_length)`.
      config: verl's AlgoConfig (or any object or dict with `gamma`).
      observation_spans: None, "carry" or "reset".

    Returns:
      `(advantages, returns)`: whitened G (0 off the mask) and G.

    References:
      Hu, arXiv 2501.03262; verl pull request 7300 (the carry rule).
    """
    fn = "compute_reinforce_plus_plus_outcome_advantage"
    if observation_spans not in (None, "carry", "reset"):
        raise ValueError(f"{fn}: observation_spans={observation_spans!r}; it must be None, "
                         "'carry' or 'reset'")
    gamma = setting(config, "gamma")
    if gamma is None:
        raise ValueError(f"{fn}: config has no gamma; pass verl's AlgoConfig (or {{'gamma': ...}})")
    rewards, mask = token_rows(token_level_rewards, response_mask, fn)
    returns = registry.apply("reinforce_pp", CreditInputs(token_rewards=rewards, action_mask=mask),
                             {"gamma": number(fn, "gamma", gamma),
                              "masked": observation_spans or observation_span_rule()}).advantages
    advantages = normalize.masked_whiten(returns, mask)
    return like(advantages, token_level_rewards), like(returns, token_level_rewards)


def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index,
                                                           epsilon=1e-6, config=None, **kwargs):
    """REINFORCE++-baseline: s - mean_g on every valid token, whitened over all valid tokens.

    A singleton group keeps its raw score before whitening.

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.

    References:
      Hu, arXiv 2501.03262.
    """
    rewards, mask = token_rows(token_level_rewards, response_mask,
                               "compute_reinforce_plus_plus_baseline_outcome_advantage")
    centred = _grouped("reinforce_pp_baseline", row_sums(rewards, None), index, rewards.shape[0],
                       singleton="raw")
    out = like(normalize.masked_whiten(broadcast(centred, mask), mask), token_level_rewards)
    return out, out


# ---------------------------------------------------------------- stepcredit estimators in verl


def register(names: Sequence[str] | None = None, *,
             hyperparameters: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[str, ...]:
    """Adds stepcredit's turn estimators to verl's `ADV_ESTIMATOR_REGISTRY` as `stepcredit_<name>`.

    Runs on its own when verl is imported in an environment where stepcredit
    is installed (verl's "verl.plugins" entry points, `stepcredit.compat.verl_plugin`);
    call it again to register with other hyperparameters. Registering the
    same names twice replaces stepcredit's own entries.

    Args:
      names: stepcredit estimator names; None means all of `turn_estimators()`.
      hyperparameters: `{name: {hyperparameter: value}}` fixed per estimator.

    Returns:
      The verl names registered.
    """
    from verl.trainer.ppo import core_algos

    registered = []
    for name in names if names is not None else turn_estimators():
        key = PREFIX + name
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(key, None)
        core_algos.register_adv_est(key)(turn_estimator(name, (hyperparameters or {}).get(name),
                                                        label=key))
        registered.append(key)
    return tuple(registered)


def compute_advantage(data, adv_estimator, gamma=1.0, lam=1.0, num_repeat=1,
                      norm_adv_by_std_in_grpo=True, config=None):
    """verl's `ray_trainer.compute_advantage`, also feeding stepcredit's estimators their inputs.

    For a `stepcredit_<name>` estimator it calls the registered function with
    verl's arguments plus the batch keys the estimator reads (`values`,
    `entropys`, `rm_scores` from `data.batch`, `anchor_obs` from
    `data.non_tensor_batch`) and writes `data.batch["advantages"]` and
    `["returns"]`; any other estimator goes to verl's own function.

    Returns:
      `data`, as verl's.
    """
    name = getattr(adv_estimator, "value", adv_estimator)
    if not str(name).startswith(PREFIX):
        from verl.trainer.ppo import ray_trainer

        return ray_trainer.compute_advantage(data, adv_estimator, gamma, lam, num_repeat,
                                             norm_adv_by_std_in_grpo, config)
    from verl.trainer.ppo import core_algos

    fn = "compute_advantage"
    entry = registry.get(str(name)[len(PREFIX):])
    wanted = {TURN_INPUTS[field] for field in entry.reads.values()}
    extra = {key: read(data, key, fn) for key in ("values", "entropys", "rm_scores", "anchor_obs")
             if key in wanted}
    index = read(data, "uid", fn, required=False)
    advantages, returns = core_algos.get_adv_estimator_fn(name)(
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=data.batch["response_mask"], index=index,
        config=config if config is not None else {"gamma": gamma, "lam": lam}, **extra)
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    return data


__all__: Sequence[str] = (
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "observation_span_rule",
    "register",
    "turn_estimator",
    "turn_estimators",
)
