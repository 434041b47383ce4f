"""Pure, jit-compatible credit-assignment estimators.

This layer imports jax and its own modules only: copy one call into any
trainer. Estimators are also available by name through `get`, `names` and
`apply`, which binds an entry to the `CreditInputs` it reads; `register`
adds one.
"""

from stepcredit.advantages.gae import (
    AdvantagesAndReturns,
    discounted_returns,
    gae_method,
    lambda_returns,
    step_gae,
    token_gae,
)
from stepcredit.advantages.ecpo import ecpo
from stepcredit.advantages.empg import empg, grpo_empg
from stepcredit.advantages.gigpo import gigpo
from stepcredit.advantages.hgpo import hgpo
from stepcredit.advantages.igpo import igpo, information_gain
from stepcredit.advantages.group import (
    DenseGroupIds,
    GroupStats,
    dense_group_ids,
    grpo,
    group_stats,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
)
from stepcredit.advantages.istar import implicit_step_rewards, istar, trajectory_preference_loss
from stepcredit.advantages.maxrl import maxrl
from stepcredit.advantages.mt_grpo import mt_grpo
from stepcredit.advantages.optimal_baseline import optimal_token_baseline
from stepcredit.advantages.normalize import masked_mean, masked_whiten
from stepcredit.advantages.process import (
    add_process_advantage,
    merge_process_rewards,
    prime_advantages,
    prime_token_rewards,
)
from stepcredit.advantages.recurrence import recurrence_method, reverse_linear_recurrence
from stepcredit.advantages.spa import progress_loss, spa, spa_step_rewards
from stepcredit.advantages.inputs import CreditInputs
from stepcredit.advantages.registry import (
    Estimator,
    EstimatorOutput,
    Recipe,
    apply,
    get,
    names,
    register,
    unregister,
)
from stepcredit.advantages.tree_grpo import tree_grpo
from stepcredit.advantages.turn_returns import gtpo, kevin
from stepcredit.advantages.tokens import (
    broadcast_to_tokens,
    first_token_positions,
    step_rewards_from_tokens,
    step_values_from_tokens,
)

__all__ = [
    "AdvantagesAndReturns",
    "CreditInputs",
    "DenseGroupIds",
    "Estimator",
    "EstimatorOutput",
    "GroupStats",
    "add_process_advantage",
    "apply",
    "broadcast_to_tokens",
    "dense_group_ids",
    "discounted_returns",
    "ecpo",
    "empg",
    "first_token_positions",
    "gae_method",
    "get",
    "gigpo",
    "gtpo",
    "group_stats",
    "hgpo",
    "igpo",
    "grpo",
    "grpo_empg",
    "implicit_step_rewards",
    "information_gain",
    "istar",
    "kevin",
    "lambda_returns",
    "masked_mean",
    "masked_whiten",
    "maxrl",
    "merge_process_rewards",
    "mt_grpo",
    "names",
    "optimal_token_baseline",
    "prime_advantages",
    "prime_token_rewards",
    "progress_loss",
    "Recipe",
    "recurrence_method",
    "register",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "reverse_linear_recurrence",
    "rloo",
    "spa",
    "spa_step_rewards",
    "step_gae",
    "step_rewards_from_tokens",
    "step_values_from_tokens",
    "token_gae",
    "trajectory_preference_loss",
    "tree_grpo",
    "unregister",
]
