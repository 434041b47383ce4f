"""The train state: everything a checkpoint holds, as one typed pytree container."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Parameters, optimizer states, PRNG key and counters of a run.

    Attributes:
      policy: the policy's parameters (`nnx.State`; the value head included).
      opt: the policy optimizer's state.
      key: the run's PRNG key (rollout keys are split from it).
      iteration: the next iteration to run (int32 scalar).
      stage: the horizon curriculum's stage (int32 scalar).
      prm: iStar's / PRIME's implicit PRM parameters, for estimators that read
        PRM log-probs; None otherwise.
      prm_opt: the PRM optimizer's state, with `prm`.
      reference: the KL reference policy's parameters, when the KL term is on.
      progress: SPA's progress estimator's parameters, for estimators that read
        progress contributions; None otherwise.
      progress_opt: the progress estimator's optimizer state, with `progress`.
    """

    policy: Any
    opt: Any
    key: jax.Array
    iteration: jax.Array
    stage: jax.Array
    prm: Any = None
    prm_opt: Any = None
    reference: Any = None
    progress: Any = None
    progress_opt: Any = None

    def replace(self, **changes: Any) -> "TrainState":
        return dataclasses.replace(self, **changes)

    def as_tree(self) -> dict[str, Any]:
        """The checkpoint layout: a dict of the fields that are present."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if getattr(self, field.name) is not None}

    @classmethod
    def from_tree(cls, tree: dict[str, Any]) -> "TrainState":
        return cls(**tree)
