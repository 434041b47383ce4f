"""Estimators by name: each entry binds its function to the credit inputs it reads.

An entry says which `CreditInputs` fields its function reads (and under which
argument names), its hyperparameters with their sources, how the caller
whitens its output (whitening is never inside an estimator) and the training
recipe it implies (a critic, an implicit PRM, clip-higher, dynamic sampling).
`apply` is the one place that calls an estimator by name: `compute_advantages`,
offline credit, the trainer and the framework adapters all go through it.

Adding an estimator is one function and one `register(Estimator(...))`.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Callable, Literal, Mapping, NamedTuple, Sequence

import jax.numpy as jnp

from stepcredit.advantages import _checks, gae, group
from stepcredit.advantages.ecpo import ecpo
from stepcredit.advantages.empg import empg, grpo_empg
from stepcredit.advantages.gigpo import gigpo
from stepcredit.advantages.hgpo import hgpo
from stepcredit.advantages.igpo import igpo
from stepcredit.advantages.inputs import CreditInputs, input_field, missing_fields, raw_fields
from stepcredit.advantages.istar import istar
from stepcredit.advantages.maxrl import maxrl
from stepcredit.advantages.mt_grpo import mt_grpo
from stepcredit.advantages.optimal_baseline import optimal_token_baseline
from stepcredit.advantages.process import prime_advantages
from stepcredit.advantages.spa import spa
from stepcredit.advantages.tree_grpo import tree_grpo
from stepcredit.advantages.turn_returns import gtpo, kevin

Level = Literal["trajectory", "step", "token"]
Whiten = Literal["none", "steps", "tokens"]

_TOKEN_FIELDS = {"step_index", "token_values", "prm_logp", "ref_logp", "action_mask",
                 "token_rewards", "prime_token_rewards"}
_STEP_FIELDS = {"mask", "step_rewards", "step_values", "entropy", "anchors", "progress",
                "grounding", "mc_values", "answer_logp"}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What an estimator asks of the trainer beyond its inputs.

    Attributes:
      clip_high: the PPO upper clip it comes with (DAPO's clip-higher 0.28),
        None for the loss's default.
      dynamic_sampling: drop groups whose scores are all equal and refill the
        batch (DAPO).
      rollout_trees: play each task's rollouts as trees that branch from
        snapshotted states of earlier rollouts (Tree-GRPO,
        `stepcredit.train.tree`) instead of independent episodes.
    """

    clip_high: float | None = None
    dynamic_sampling: bool = False
    rollout_trees: bool = False


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered estimator.

    Attributes:
      name: the registry key.
      fn: the pure function computing it. It returns `[B]`, `[B, T]` or
        `[B, N]` advantages (by `output_level`), or a NamedTuple with
        `advantages` and `returns` (critic targets).
      reads: which credit inputs it reads: `{argument name: field}`, each field
        a `CreditInputs` field (derived ones are computed when not given); a
        sequence of field names passes each under its own name.
      optional: arguments of `reads` passed as None when their field is absent
        (e.g. GAE's `bootstrap_value`: None means 0).
      defaults: its keyword hyperparameters and their default values (each from
        the paper or the authors' scripts named in `paper`).
      paper: title and arXiv id.
      output_level: the granularity of the advantages it returns.
      input_level: the granularity of the rewards it reads (None: the finest
        level among its fields).
      whiten: how the caller whitens the output: over valid steps ("steps"),
        over valid action tokens ("tokens"), or not at all.
      input_defaults: hyperparameters of the derived fields it reads (the
        implicit PRM's `beta`, `normalize`), with their defaults.
      options: keyword options of `fn` that change no number (static group
        counts, the recurrence's method), with their defaults.
      base: the estimator whose advantages fill `base_advantages` when the
        caller gives none.
      recipe: what it asks of the trainer (`Recipe`).
    """

    name: str
    fn: Callable[..., Any]
    reads: Mapping[str, str] | Sequence[str]
    defaults: Mapping[str, Any]
    paper: str
    output_level: Level
    input_level: Level | None = None
    whiten: Whiten = "none"
    input_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    optional: frozenset[str] = frozenset()
    base: str | None = None
    recipe: Recipe = Recipe()

    def __post_init__(self):
        reads = dict(self.reads) if isinstance(self.reads, Mapping) else {f: f for f in self.reads}
        object.__setattr__(self, "reads", types.MappingProxyType(reads))
        object.__setattr__(self, "optional", frozenset(self.optional))
        if not self.optional <= set(reads):
            raise ValueError(f"Estimator {self.name!r}: optional {sorted(self.optional)} are not "
                             f"all arguments of reads {sorted(reads)}")
        for attribute in ("defaults", "input_defaults", "options"):
            object.__setattr__(self, attribute,
                               types.MappingProxyType(dict(getattr(self, attribute))))
        for field in reads.values():
            raw_fields(field)  # raises naming the known fields
        clash = set(self.defaults) & set(self.input_defaults) | (
            set(self.defaults) | set(self.input_defaults)) & set(self.options)
        if clash:
            raise ValueError(f"Estimator {self.name!r}: {sorted(clash)} named twice among "
                             "defaults, input_defaults and options")
        if self.input_level is None:
            fields = self.fields
            level = ("token" if fields & _TOKEN_FIELDS else
                     "step" if fields & _STEP_FIELDS else "trajectory")
            object.__setattr__(self, "input_level", level)
        if self.whiten not in ("none", "steps", "tokens"):
            raise ValueError(f"Estimator {self.name!r}: whiten={self.whiten!r}; expected "
                             "'none', 'steps' or 'tokens'")

    @property
    def fields(self) -> frozenset[str]:
        """The `CreditInputs` fields it needs when derived fields are derived (base_advantages
        only when it has no base estimator)."""
        needed = {raw for field in self.reads.values() for raw in raw_fields(field)}
        if self.base is not None and "base_advantages" in needed:
            needed = needed - {"base_advantages"} | get(self.base).fields
        return frozenset(needed)

    @property
    def needs_critic(self) -> bool:
        return bool(self.fields & {"step_values", "token_values"})

    @property
    def needs_groups(self) -> bool:
        return "group_ids" in self.fields

    @property
    def needs_entropy(self) -> bool:
        return "entropy" in self.fields

    @property
    def needs_prm(self) -> bool:
        return "prm_logp" in self.fields

    @property
    def needs_information_gain(self) -> bool:
        """It reads the policy's belief in the ground-truth answer after each step (IGPO)."""
        return "answer_logp" in self.fields

    @property
    def needs_progress(self) -> bool:
        """It reads a progress estimator's step contributions (SPA)."""
        return "progress" in self.fields

    @property
    def needs_mc_values(self) -> bool:
        """It reads Monte Carlo state values from continuations of the batch's states
        (VinePPO: the trainer plays them, `stepcredit.train.vine`)."""
        return "mc_values" in self.fields

    @property
    def accepted(self) -> dict[str, Any]:
        """Every keyword it accepts, with its default."""
        return {**self.defaults, **self.input_defaults, **self.options}

    def resolve(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Its full configuration: the defaults with `overrides` checked and applied.

        A value must have its default's type (bool, number or string; a number
        given for a float default becomes a float, which must be finite); keys
        without a typed default (None) take any value.

        Raises:
          ValueError: an unknown key or a wrong type, naming the accepted keys.
        """
        accepted = self.accepted
        resolved = dict(accepted)
        for key, value in (overrides or {}).items():
            if key not in accepted:
                raise ValueError(f"estimator {self.name!r} has no hyperparameter {key!r}; it "
                                 f"takes {', '.join(sorted(accepted)) or 'none'}")
            resolved[key] = _typed(self.name, key, value, accepted[key])
        return resolved


def _typed(name: str, key: str, value: Any, default: Any) -> Any:
    if default is None:
        return value
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, (int, float)):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and isinstance(default, float):
            value = float(value)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ValueError(f"estimator {name!r}: {key}={value!r} is a {type(value).__name__}; "
                         f"it must be a {type(default).__name__} like its default {default!r}")
    # Checked here for every estimator: a NaN weight or coefficient turns every advantage
    # into NaN, and the error would come later, if at all, naming an input array.
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"estimator {name!r}: {key}={value}; it must be finite")
    return value


class EstimatorOutput(NamedTuple):
    """What `apply` returns.

    Attributes:
      advantages: `[B]`, `[B, T]` or `[B, N]` by `level`, before whitening.
      returns: critic targets of the same shape, or None.
      level: the entry's output level.
    """

    advantages: Any
    returns: Any
    level: Level


def apply(name: str | Estimator, inputs: CreditInputs,
          config: Mapping[str, Any] | None = None) -> EstimatorOutput:
    """Runs an estimator on the credit inputs it reads.

    Args:
      name: a registry name or an `Estimator`.
      inputs: the `CreditInputs`; only the fields the entry reads are used.
      config: hyperparameters and options overriding the entry's defaults
        (`Estimator.resolve`).

    Returns:
      `EstimatorOutput(advantages, returns, level)`.

    Raises:
      ValueError: an unknown hyperparameter, or a field the entry reads is None.
      TypeError: inputs that are not `CreditInputs`, or a config that is not a mapping.
    """
    entry = name if isinstance(name, Estimator) else get(name)
    if not isinstance(inputs, CreditInputs):
        raise TypeError(f"apply: inputs is a {type(inputs).__name__}; it must be CreditInputs "
                        "(from a dict d: CreditInputs(**d))")
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"apply: config is a {type(config).__name__}; it must be a mapping of "
                        "hyperparameter names to values, or None")
    resolved = entry.resolve(config)
    # Without a mask the base cannot be broadcast: the check below names the missing mask.
    if entry.base is not None and inputs.base_advantages is None and inputs.mask is not None:
        inputs = inputs._replace(base_advantages=_base_advantages(entry.name, entry.base,
                                                                  inputs))
    absent = {argument for argument in entry.optional
              if getattr(inputs, entry.reads[argument]) is None}
    missing = sorted({m for argument, field in entry.reads.items() if argument not in absent
                      for m in missing_fields(inputs, field)})
    if missing:
        raise ValueError(f"estimator {entry.name!r} needs {', '.join(missing)}; not given")
    input_params = {k: resolved[k] for k in entry.input_defaults}
    arrays = {argument: None if argument in absent else input_field(inputs, field, input_params)
              for argument, field in entry.reads.items()}
    keywords = {k: v for k, v in resolved.items() if k not in entry.input_defaults}
    out = entry.fn(**arrays, **keywords)
    if hasattr(out, "returns"):
        return EstimatorOutput(out.advantages, out.returns, entry.output_level)
    return EstimatorOutput(out, None, entry.output_level)


def _base_advantages(name: str, base: str, inputs: CreditInputs):
    """The base estimator's advantages at its defaults, as `[B, T]` over valid steps (for
    estimator `name`, named in errors)."""
    out = apply(base, inputs)
    if out.level == "trajectory":
        mask = _checks.bool_array(name, "mask", inputs.mask, rank=2)
        if mask.shape[0] != out.advantages.shape[0]:
            raise ValueError(f"{name}: mask has shape {tuple(mask.shape)}; it must be [B, T] "
                             f"with B = {out.advantages.shape[0]} trajectories")
        return jnp.where(mask, out.advantages[:, None], 0.0)
    return out.advantages


_REGISTRY: dict[str, Estimator] = {}


def register(entry: Estimator, *, replace: bool = False) -> Estimator:
    """Adds `entry` under `entry.name`; returns it.

    Raises:
      ValueError: the name is taken (unless `replace`), or its base is unknown.
    """
    if entry.name in _REGISTRY and not replace:
        raise ValueError(f"estimator {entry.name!r} is already registered; pass replace=True")
    if entry.base is not None and entry.base not in _REGISTRY:
        raise ValueError(f"estimator {entry.name!r}: base {entry.base!r} is not registered")
    _REGISTRY[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Removes the estimator registered as `name`."""
    get(name)
    del _REGISTRY[name]


def get(name: str) -> Estimator:
    """Returns the estimator registered as `name`, or raises naming the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown estimator {name!r}; registered: {', '.join(names())}") from None


def names() -> tuple[str, ...]:
    """The registered estimator names, sorted."""
    return tuple(sorted(_REGISTRY))


# ---------------------------------------------------------------------- the entries

_STEPPO = "Step-Aligned Policy Optimization for Agentic RL (StepPO), arXiv 2604.18401"
_EMPG = ("Harnessing Uncertainty: Entropy-Modulated Policy Gradients (EMPG), arXiv 2509.09265; "
         "k 1 from the paper, k_future 1 and zeta 0.05 from ARLArena's grid (arXiv 2602.21534)")
_EMPG_DEFAULTS = {"k": 1.0, "k_future": 1.0, "zeta": 0.05, "eps": 1e-8, "center": True}
_ISTAR = ("Agentic RL with Implicit Step Rewards (iStar), arXiv 2509.19199; alpha 1 "
          "(step_advantage_w) and RLOO episodes (istar_rloo) from the authors' scripts; step "
          "rewards from implicit_step_rewards with beta 0.05")
_ISTAR_DEFAULTS = {"alpha": 1.0, "episode": "rloo", "step_baseline": "all_steps",
                   "std": "unbiased", "eps": 1e-6}
# The implicit PRM's beta (0.05, iStar's and PRIME's scripts) scales its rewards and, in the
# trainer, its preference loss: one number for both.
_PRM_INPUTS = {"beta": 0.05, "normalize": None}
_GROUPS = {"num_groups": None}
_MT_GRPO = ("Reinforcing Multi-Turn Reasoning in LLM Agents via Turn-Level Credit Assignment "
            "(MT-GRPO), arXiv 2505.11821; A^T + lam A^O at every turn before the last, A^O at "
            "the last (the paper's two-turn rule, generalised); lam 1 is the authors' "
            "turn_advantage_coef default; unbiased std and eps 1e-6 as GRPO's")
_MT_GRPO_READS = {"step_rewards": "step_rewards", "scores": "scores", "group_ids": "group_ids",
                  "mask": "mask"}
_MT_GRPO_DEFAULTS = {"lam": 1.0, "final_turn": "outcome", "std": "unbiased", "eps": 1e-6}
_METHOD = {"method": "auto"}
# GAE's default: the compiled CPU kernel wherever it applies (`gae.gae_method`).
_GAE_METHOD = {"method": "auto"}

_TOKEN_GAE_READS = {"rewards": "token_rewards", "values": "token_values", "mask": "action_mask",
                    "bootstrap_value": "bootstrap_value"}
_STEP_GAE_READS = {"rewards": "step_rewards", "values": "step_values", "mask": "mask",
                   "bootstrap_value": "bootstrap_value"}
_SCORES = {"scores": "scores", "group_ids": "group_ids"}
_GRPO_EMPG_READS = {**_SCORES, "entropy": "entropy", "mask": "mask"}
_ISTAR_READS = {**_SCORES, "step_rewards": "implicit_step_rewards", "mask": "mask"}

for _entry in (
    Estimator("token_gae", gae.token_gae, _TOKEN_GAE_READS, {"gamma": 1.0, "lam": 1.0}, _STEPPO,
              output_level="token", whiten="tokens", optional={"bootstrap_value"},
              options=_GAE_METHOD),
    Estimator("step_gae", gae.step_gae, _STEP_GAE_READS, {"gamma": 1.0, "lam": 1.0}, _STEPPO,
              output_level="step", whiten="steps", optional={"bootstrap_value"}, options=_GAE_METHOD),
    # Group-relative family: one score per trajectory, broadcast to its steps and tokens.
    Estimator("grpo", group.grpo, _SCORES, {"std": "unbiased", "eps": 1e-6, "singleton": "zero"},
              "DeepSeekMath (GRPO), arXiv 2402.03300; unbiased std and eps 1e-6 as in verl",
              output_level="trajectory", options=_GROUPS),
    Estimator("drgrpo", group.grpo, _SCORES, {"std": "none", "singleton": "zero"},
              "Understanding R1-Zero-Like Training (Dr. GRPO), arXiv 2503.20783; no std "
              "division, and the loss divides token sums by a constant "
              "(agg='seq-mean-token-sum-norm')",
              output_level="trajectory", options=_GROUPS),
    Estimator("rloo", group.rloo, _SCORES, {"singleton": "zero"},
              "Back to Basics: Revisiting REINFORCE Style Optimization (RLOO), arXiv 2402.14740",
              output_level="trajectory", options=_GROUPS),
    Estimator("reinforce_pp", group.reinforce_pp,
              {"token_rewards": "token_rewards", "mask": "action_mask"},
              {"gamma": 1.0, "masked": "carry"},
              "REINFORCE++, arXiv 2501.03262; gamma 1 is verl's default, and the return "
              "carries across observation tokens (verl since its pull request 7300)",
              output_level="token", whiten="tokens", options=_METHOD),
    Estimator("reinforce_pp_baseline", group.reinforce_pp_baseline, _SCORES,
              {"singleton": "zero"}, "REINFORCE++(-baseline), arXiv 2501.03262",
              output_level="trajectory", whiten="tokens", options=_GROUPS),
    # The episode score is the masked sum of step rewards (invalid-action penalties included).
    Estimator("gigpo", gigpo, {"step_rewards": "step_rewards", "anchors": "anchors",
                               "group_ids": "group_ids", "mask": "mask"},
              {"gamma": 0.95, "omega": 1.0, "std": "unbiased", "eps": 1e-6, "singleton": "zero"},
              "Group-in-Group Policy Optimization (GiGPO), arXiv 2505.10978; gamma 0.95, "
              "omega 1 and std 'unbiased' from the authors' ALFWorld script "
              "(mode=mean_std_norm); their WebShop script uses std 'none' (mode=mean_norm)",
              output_level="step", options={**_GROUPS, **_METHOD}),
    # EMPG modulates a given advantage by step entropy: GRPO's unless the caller gives one.
    Estimator("empg", empg, {"advantages": "base_advantages", "entropy": "entropy",
                             "mask": "mask"}, _EMPG_DEFAULTS,
              _EMPG + "; its base advantages are GRPO's (DeepSeekMath, arXiv 2402.03300) "
              "unless given", output_level="step", input_level="step", base="grpo"),
    Estimator("grpo+empg", grpo_empg, _GRPO_EMPG_READS,
              {"std": "unbiased", "grpo_eps": 1e-6, **_EMPG_DEFAULTS},
              _EMPG + "; GRPO (DeepSeekMath, arXiv 2402.03300) episode advantages",
              output_level="step", input_level="trajectory", options=_GROUPS),
    Estimator("dapo+empg", grpo_empg, _GRPO_EMPG_READS,
              {"std": "unbiased", "grpo_eps": 1e-6, **_EMPG_DEFAULTS},
              _EMPG + "; DAPO (arXiv 2503.14476) uses GRPO's advantages: its loss settings "
              "clip_low 0.2, clip_high 0.28, agg='token-mean', and dynamic sampling and the "
              "overlong penalty in the trainer",
              output_level="step", input_level="trajectory", options=_GROUPS,
              recipe=Recipe(clip_high=0.28, dynamic_sampling=True)),
    # iStar: episode RLOO/GRPO plus the group-normalised implicit step reward of a DPO PRM.
    Estimator("istar", istar, _ISTAR_READS, _ISTAR_DEFAULTS, _ISTAR, output_level="step",
              input_level="step", input_defaults=_PRM_INPUTS, options=_GROUPS),
    Estimator("rloo+istar", istar, _ISTAR_READS, _ISTAR_DEFAULTS, _ISTAR, output_level="step",
              input_level="step", input_defaults=_PRM_INPUTS, options=_GROUPS),
    Estimator("grpo+istar", istar, _ISTAR_READS, {**_ISTAR_DEFAULTS, "episode": "grpo"},
              _ISTAR + "; the paper's A^E and A^S divide by the std (the code's istar_grpo "
              "default mean_norm is std='none')",
              output_level="step", input_level="step", input_defaults=_PRM_INPUTS,
              options=_GROUPS),
    # Turn-PPO's credit is step GAE (`gae.step_gae`) with a turn-level critic: a turn is a step.
    Estimator("turn_ppo", gae.step_gae, _STEP_GAE_READS, {"gamma": 0.99, "lam": 0.9},
              "Turn-PPO: Turn-Level Advantage Estimation with PPO for Improved Multi-Turn RL in "
              "Agentic LLMs, arXiv 2512.17008; its turn-level GAE over a turn-level critic is "
              "step GAE (step_gae), one reward, one V(s_h) and one advantage per turn; gamma 0.99 "
              "and lam 0.9 are the values its GAE ablation recommends (as reported by summaries of "
              "the paper; its equations were not read here); whitened over valid turns like "
              "step_gae; its turn-level clipping is a loss matter (step_ppo_loss)",
              output_level="step", whiten="steps", optional={"bootstrap_value"}, options=_GAE_METHOD),
    # ECPO: GiGPO with each anchor group's step term shrunk by its evidence n / (n + kappa).
    Estimator("ecpo", ecpo, {"step_rewards": "step_rewards", "anchors": "anchors",
                             "group_ids": "group_ids", "mask": "mask"},
              {"gamma": 0.95, "omega": 1.0, "kappa": 1.0, "std": "unbiased", "eps": 1e-6,
               "singleton": "zero"},
              "When Denser Credit Is Not Enough: Evidence-Calibrated Policy Optimization (ECPO), "
              "arXiv 2606.05885; gamma, omega, std and eps are GiGPO's (arXiv 2505.10978, its "
              "ALFWorld script); the evidence weight n / (n + kappa) and kappa 1 are this "
              "library's reading of the paper's shrinkage (its equations were not read here)",
              output_level="step", options={**_GROUPS, **_METHOD}),
    # Discounted per-turn returns compared within the group (GTPO: same turn index, mean/std;
    # Kevin: all turns of the group, mean only).
    Estimator("gtpo", gtpo, {"step_rewards": "step_rewards", "group_ids": "group_ids",
                             "mask": "mask"},
              {"gamma": 0.9, "baseline": "same_turn", "std": "unbiased", "eps": 1e-6,
               "singleton": "zero"},
              "Empowering Multi-Turn Tool-Integrated Reasoning with Group Turn Policy "
              "Optimization (GTPO), arXiv 2511.14846; normalised discounted turn returns "
              "from the abstract; gamma 0.9, the same-turn comparison set and the unbiased "
              "std are this library's reading, unchecked against the paper's equations",
              output_level="step", options={**_GROUPS, **_METHOD}),
    Estimator("kevin", kevin, {"step_rewards": "step_rewards", "group_ids": "group_ids",
                               "mask": "mask"},
              {"gamma": 0.4, "baseline": "all_turns", "std": "none", "eps": 1e-8,
               "singleton": "zero"},
              "Kevin: Multi-Turn RL for Generating CUDA Kernels, arXiv 2507.11948; gamma 0.4 "
              "and the discounted sum from its reward-formulation ablation; the mean over all "
              "turns of the group without std as stated (verifiers pull request 536 divides "
              "by the population std: std='biased', eps 1e-8)",
              output_level="step", options={**_GROUPS, **_METHOD}),
    # MT-GRPO: group-normalised turn rewards at the turns that earn them, plus the outcome's.
    Estimator("mt_grpo", mt_grpo, _MT_GRPO_READS,
              {**_MT_GRPO_DEFAULTS, "turn_baseline": "per_turn"},
              _MT_GRPO + "; A^T normalised per turn index over the trajectories that reach it "
              "(the paper's)", output_level="step", options=_GROUPS),
    Estimator("mt_grpo_pooled", mt_grpo, _MT_GRPO_READS,
              {**_MT_GRPO_DEFAULTS, "turn_baseline": "pooled"},
              _MT_GRPO + "; A^T normalised over all credited turns of the group, whose baseline "
              "does not depend on when a trajectory stops (verl issue 7244)",
              output_level="step", options=_GROUPS),
    Estimator("maxrl", maxrl, _SCORES, {"eps": 0.0, "divide_by_group_size": False},
              "Maximum Likelihood Reinforcement Learning (MaxRL), arXiv 2602.02710; "
              "(s - mean) / mean, 0 when the mean is 0, as in the paper (the authors' "
              "p_normalization adds eps 1e-6 and divides by the group size)",
              output_level="trajectory", options=_GROUPS),
    # verl's optimal token baseline: the return minus a score-norm-weighted group mean per token.
    Estimator("optimal_token_baseline", optimal_token_baseline,
              {"scores": "scores", "group_ids": "group_ids", "action_mask": "action_mask",
               "ref_logp": "ref_logp"},
              {"eps": 1e-8, "align": "position", "handle_zero_tail": False, "singleton": "raw"},
              "verl 0.9 optimal_token_baseline (core_algos.py "
              "compute_optimal_token_baseline_advantage; variance-minimising baseline of "
              "Weaver and Tao, arXiv 1301.2315): eps 1e-8, column alignment, no zero tail and a "
              "singleton keeping its return, all verl's defaults; sum pi^2 is estimated by the "
              "sampled token's pi (CreditInputs holds no full-vocabulary probabilities), w = 1 "
              "without ref_logp; align='action' with handle_zero_tail=True is verl's "
              "tir_optimal_token_baseline",
              output_level="token", optional={"ref_logp"}, options=_GROUPS),
    # HGPO: GiGPO's step groups nested by shared history, their advantages mixed by depth.
    Estimator("hgpo", hgpo, {"step_rewards": "step_rewards", "anchors": "anchors",
                             "group_ids": "group_ids", "mask": "mask"},
              {"gamma": 0.95, "omega": 1.0, "max_depth": 3, "min_depth": 1, "alpha": 1.0,
               "std": "unbiased", "eps": 1e-6, "singleton": "zero"},
              "Hierarchy-of-Groups Policy Optimization (HGPO), arXiv 2602.22817; gamma 0.95, "
              "omega 1, std 'unbiased' and eps 1e-6 from GiGPO's ALFWorld script (arXiv "
              "2505.10978), which HGPO builds on; the depth weights (d - min_depth + 1)^alpha "
              "over non-singleton groups, max_depth 3 and alpha 1 are as stated, not checked "
              "against the paper's formula or code",
              output_level="step", options={**_GROUPS, **_METHOD}),
    # Tree-GRPO: GRPO within each rollout tree plus GRPO over the task's trees; its recipe
    # plays the trees (stepcredit.train.tree) instead of independent rollouts.
    Estimator("tree_grpo", tree_grpo, {"scores": "scores", "group_ids": "group_ids",
                                       "tree_ids": "tree_ids"},
              {"std": "unbiased", "eps": 1e-6, "singleton": "zero"},
              "Tree Search for LLM Agent Reinforcement Learning (Tree-GRPO), arXiv 2509.21240; "
              "the sum of the intra-tree and inter-tree group-normalised leaf scores, read from "
              "the abstract and secondary summaries (the paper's equations and the authors' code "
              "were not read); unbiased std and eps 1e-6 are GRPO's as in verl; without tree_ids "
              "every trajectory is its own tree and it is GRPO",
              output_level="trajectory", optional={"tree_ids"},
              options={**_GROUPS, "num_trees": None}, recipe=Recipe(rollout_trees=True)),
    # SPA-RL: a progress estimator's step contributions plus a grounding bonus, through GAE.
    Estimator("spa", spa, {"progress": "progress", "grounding": "grounding", "mask": "mask",
                           "step_index": "step_index", "token_values": "token_values",
                           "bootstrap_value": "bootstrap_value"},
              {"alpha": 1.0, "beta": 0.5, "gamma": 0.99, "lam": 0.95},
              "SPA-RL: Reinforcing LLM Agents via Stepwise Progress Attribution, arXiv "
              "2505.20732; r_t = alpha c_t + beta g_t with alpha 1 and beta 0.5 (the grounding "
              "value 0.5 of the authors' prm/rl_data_org.py), token-level GAE with gamma 0.99 "
              "(their StepTool PPO config) and lam 0.95 (TRL's default), whitened over tokens "
              "as TRL's PPO; only the abstract and the authors' code were read, not the paper's "
              "equations",
              output_level="token", input_level="step", whiten="tokens",
              optional={"bootstrap_value"}, options=_GAE_METHOD),
    # VinePPO: one-step TD errors on Monte Carlo values, i.e. step GAE with lam 0 on V_MC.
    Estimator("vineppo", gae.step_gae, {"rewards": "step_rewards", "values": "mc_values",
                                        "mask": "mask"},
              {"gamma": 1.0, "lam": 0.0},
              "VinePPO: Refining Credit Assignment in RL Training of LLMs, arXiv 2410.01679; "
              "A_t = r_t + gamma V_MC(s_{t+1}) - V_MC(s_t) (step GAE with lam 0 on the mean "
              "return of K continuations from each state, K 9 in the authors' configs), gamma 1 "
              "and V_MC 0 after the last step as in the authors' code "
              "(math_episode_generator_with_mc_advantages.py); whitened over valid steps, where "
              "the authors' PPO trainer whitens over valid tokens (equal with one token per "
              "action)",
              output_level="step", whiten="steps", options=_GAE_METHOD),
    # IGPO: the information gain of each turn and the outcome at the last, group-normalised
    # and summed with discount from each turn on.
    Estimator("igpo", igpo, {"information_gain": "information_gain", "scores": "scores",
                             "group_ids": "group_ids", "mask": "mask"},
              {"gamma": 1.0, "normalize": "joint", "order": "normalize_first", "std": "biased",
               "eps": 1e-6},
              "Information Gain-based Policy Optimization (IGPO), arXiv 2510.14967; the "
              "probability gain exp(mean answer log-prob) of the paper, normalised over all turns "
              "of the group (normalize 'joint') before the discounted sum (order "
              "'normalize_first', the paper and the authors' code since their issue 5), gamma 1 "
              "from the authors' evaluation script, the biased std and eps 1e-6 of their code; "
              "training scripts of forks of their repository set normalize='separate' and "
              "gain='log_probability'; read from the abstract, secondary summaries and the "
              "code, not the paper's equations",
              output_level="step", input_defaults={"gain": "probability"},
              options={**_GROUPS, **_METHOD}),
    Estimator("prime", prime_advantages,
              {"token_rewards": "prime_token_rewards", "outcome_scores": "scores",
               "action_mask": "action_mask", "group_ids": "group_ids"},
              {"reward_dpo_coef": 5.0, "reward_gt_coef": 5.0},
              "Process Reinforcement through Implicit Rewards (PRIME), arXiv 2502.01456; "
              "coefficients 5 and 5 from the verl PRIME recipe; token rewards from "
              "prime_token_rewards with beta 0.05",
              output_level="token", whiten="tokens", input_defaults={"beta": 0.05},
              options=_GROUPS),
):
    register(_entry)
del _entry
