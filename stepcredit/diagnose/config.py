"""What `stepcredit.diagnose.diagnose` runs: `DiagnoseConfig`."""

from __future__ import annotations

import dataclasses

from stepcredit import advantages as adv
from stepcredit.diagnose.policies import parse_policy
from stepcredit.diagnose.values import VALUE_SOURCES

SIMULATORS = ("webshop", "alfworld", "hotpotqa")

# Step limits of a diagnosis where the simulator's own is too generous to grade
# blame: within ALFWorld's 50 steps a noisy expert recovers from every mistake,
# so no episode fails; 15 steps (about twice the expert's mean path) make
# mistakes cost. The others keep their limits (WebShop 15, HotpotQA 8).
STEP_LIMITS = {"alfworld": 15}


@dataclasses.dataclass(frozen=True)
class DiagnoseConfig:
    """What `diagnose` runs.

    Attributes:
      envs: simulators (each must offer `oracle_distance`, `oracle_actions` and
        snapshots).
      policy: the behaviour policy ("eps=0.3", "uniform", "deviation",
        "deviation@STEP", "checkpoint=LOGDIR";
        `stepcredit.diagnose.policies.parse_policy`).
      estimators: registered estimator names; empty for all of them.
      tasks: tasks per simulator and seed.
      group_size: G, episodes per task (the group of the group estimators).
      seeds: the seeds; each samples its own tasks and episodes.
      continuations: K, Monte Carlo rollouts per action and per state (0:
        no A^pi; else at least 2).
      values: the critic of step and token GAE: "zero", "table" or
        "checkpoint" (`stepcredit.diagnose.values`).
      value_checkpoint: the trained run whose value head "checkpoint" reads.
      prm_steps: optimizer steps of the implicit PRM of iStar and PRIME (10:
        on a default batch its preference loss falls from 0.69 to 0.15 on
        WebShop, 0.23 on ALFWorld and 0.44 on HotpotQA), and of SPA's progress
        estimator (`stepcredit.diagnose.progress`).
      bootstrap: bootstrap resamples of each interval.
      split: the task split.
      difficulty: the simulators' difficulty (None: each one's default).
      max_steps: the step limit (None: `STEP_LIMITS`, else each simulator's own).
      examples: example trajectories kept per simulator for plots.
      vine_rollouts: K', the rollouts of each state's Monte Carlo value for
        VinePPO (9, the authors' configs), on a random stream independent of
        the A^pi rollouts; played only when an estimator reads them.
    """

    envs: tuple[str, ...] = SIMULATORS
    policy: str = "eps=0.3"
    estimators: tuple[str, ...] = ()
    tasks: int = 8
    group_size: int = 8
    seeds: tuple[int, ...] = (0, 1)
    continuations: int = 8
    values: str = "table"
    value_checkpoint: str | None = None
    prm_steps: int = 10
    bootstrap: int = 200
    split: str = "train"
    difficulty: int | None = None
    max_steps: int | None = None
    examples: int = 2
    vine_rollouts: int = 9

    def __post_init__(self):
        for name in ("envs", "estimators", "seeds"):
            value, kind = getattr(self, name), int if name == "seeds" else str
            if not isinstance(value, (tuple, list)) or not all(
                    isinstance(v, kind) and not isinstance(v, bool) for v in value):
                raise ValueError(f"diagnose: {name}={value!r}; it must be a tuple of "
                                 f"{kind.__name__}s")
        for name in ("tasks", "group_size", "bootstrap", "vine_rollouts", "continuations",
                     "prm_steps", "examples", "max_steps", "difficulty"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"diagnose: {name}={value!r}; it must be an int")
        for name in ("tasks", "group_size", "bootstrap", "vine_rollouts"):
            if getattr(self, name) < 1:
                raise ValueError(f"diagnose: {name} must be >= 1, got {getattr(self, name)}")
        if self.continuations == 1:
            raise ValueError("diagnose: continuations must be 0 (no A^pi) or >= 2 (one rollout "
                             "gives no standard error)")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"diagnose: max_steps must be >= 1, got {self.max_steps}")
        for name in ("continuations", "prm_steps", "examples"):
            if getattr(self, name) < 0:
                raise ValueError(f"diagnose: {name} must be >= 0, got {getattr(self, name)}")
        if not self.envs:
            raise ValueError("diagnose: envs is empty")
        if not self.seeds:
            raise ValueError("diagnose: seeds is empty")
        if self.values not in VALUE_SOURCES:
            raise ValueError(f"diagnose: values {self.values!r} is not one of {VALUE_SOURCES}")
        unknown = sorted(set(self.estimators) - set(adv.names()))
        if unknown:
            raise ValueError(f"diagnose: unknown estimators {unknown}; registered: "
                             f"{', '.join(adv.names())}")
        if self.values == "checkpoint" and self.value_checkpoint is None:
            raise ValueError("diagnose: values 'checkpoint' needs value_checkpoint (--value-checkpoint)")
        parse_policy(self.policy, load=False)

    @property
    def estimator_names(self) -> tuple[str, ...]:
        return tuple(self.estimators) or adv.names()
