"""The trainer's configuration: one frozen dataclass, every default with its source."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from stepcredit.rollout import RolloutConfig
from stepcredit.train.curriculum import LEARNING_RATE_SCHEDULES
from stepcredit.train.update import LossConfig


# The policies a run can train: stepcredit's word-level transformer, or a Qwen chat model.
POLICIES = ("word", "qwen")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run.

    Attributes:
      env: a registered environment (`stepcredit.envs.registry.names()`).
      difficulty: the simulator's difficulty knob (0 is easiest).
      estimator: a registered estimator (`stepcredit.advantages.names()`).
      estimator_config: (name, value) pairs overriding the estimator's defaults.
      iterations: training iterations (one rollout batch and update each).
      tasks_per_iteration: tasks per batch; each is played `group_size` times.
      group_size: G rollouts per task (GiGPO, verl-agent: 8).
      seed: seeds the model, sampling and the task order.
      max_steps: episode step limit; None keeps the environment's default.
      horizon_schedule: ScalingInter-RL's step limits, switched every
        `horizon_switch_every` iterations (AgentGym-RL, arXiv 2509.08755).
      rollout: how the policy acts (prompts, sampling, invalid-action penalty).
      loss: the learner's losses (PPO clip, step ratio, critic, KL, entropy).
      d_model, num_layers, num_heads, mlp_dim: the transformer's size (mlp_dim None:
        4 * d_model, the usual ratio); the defaults give about 1.9M parameters
        with the simulators' vocabularies.
      learning_rate, weight_decay, grad_clip: AdamW with global-norm clipping.
      learning_rate_schedule, final_learning_rate_fraction: "constant", or a
        "cosine" or "linear" decay of the RL learning rate over `iterations` to
        `final_learning_rate_fraction` of it (`curriculum.learning_rate_at`);
        the warm start and the PRM keep their constant rates.
      learning_rate_warmup_iterations: RL iterations over which the rate rises
        linearly from 0 before the schedule runs (verl's `lr_warmup_steps`);
        it damps the fresh optimizer's first, sign-sized updates after a warm start.
      epochs: passes over each batch; minibatch_rows: step rows per update.
      target_kl: stop a batch's epochs early once a minibatch's approximate KL
        to the rollout policy (measured before that minibatch's own step, which
        is still taken) exceeds 1.5 x target_kl (None: never; the PPO safeguard
        of Spinning Up and Stable-Baselines3).
      critic_warmup_iterations: RL iterations at the start in which the
        policy-gradient advantages are zeroed, so only the critic (and the KL
        term) learns and the first policy updates see a trained baseline
        (verl's `trainer.critic_warmup`); estimators with a critic only. The
        critic shares the policy's trunk, so the policy still moves a little.
      prm_learning_rate, prm_rewards_from: iStar's implicit PRM: its learning
        rate and whether the step rewards come from the PRM after this
        iteration's update (the paper) or before it ("pre_update_prm", the
        authors' code). Its beta is the estimator's hyperparameter `beta`
        (0.05, the authors' scripts), which scales both the preference loss
        and the implicit rewards.
      progress_learning_rate, progress_steps: SPA's progress estimator
        (`stepcredit.train.progress`): its learning rate and the full-batch
        optimizer steps it takes on each iteration's trajectories before the
        credit is computed (the paper trains it offline once, before RL).
      dynamic_sampling: drop groups whose scores are all equal and refill the
        batch with new tasks (DAPO, arXiv 2503.14476); None follows the
        estimator's recipe (on for "dapo+empg").
      warm_start_steps: supervised minibatch steps on expert demonstrations
        before RL (the cold-start remedy), in passes over the demonstrations
        with rows grouped by length; warm_start_tasks: training tasks demonstrated.
      eval_every, eval_tasks, eval_temperature: evaluation on a fixed panel of
        test tasks (0 disables the periodic evaluation).
      checkpoint_every: iterations between orbax checkpoints.
      logdir: metrics, TensorBoard events and checkpoints go here.
      time_limit_minutes: stop after the iteration that crosses this wall time
        (counted from the start of the run, warm start included), then
        checkpoint (and evaluate, with eval_every set); None: no limit.
      async_mode, max_staleness: AReaL's asynchronous rollouts with the
        decoupled PPO loss and at most `max_staleness` policy versions of lag
        (arXiv 2505.24298): a background worker plays episodes with the latest
        published policy while the learner updates; a batch whose lag (the
        learner's version minus the version that played it; versions count
        iterations) exceeds `max_staleness` is dropped and counted.
      num_devices: devices of the data-parallel update (0: all local devices);
        `minibatch_rows` must be a multiple of it.
      vine_rollouts: K, the continuations played from every visited state for
        the Monte Carlo values of estimators that read them (VinePPO: 9, the
        authors' configs; `stepcredit.train.vine`).
      tree_count, tree_branches, tree_rounds, tree_branching: the rollout
        forest of estimators whose recipe plays trees (Tree-GRPO,
        `stepcredit.train.tree`): M trees per task, N nodes expanded per tree
        in each of L rounds (so M (1 + L N) leaves per task), chosen at random
        (the paper) or at the highest-entropy steps ("entropy", ARPO); 0 for M
        or N derives them from `group_size` (`TreeShape.for_group_size`: the
        leaves per task are G where that divides out; G = 8 gives M = 2,
        N = 3, L = 1).
      policy, model_dir, param_dtype: "word" (stepcredit's word-level
        transformer, sized by `d_model` and friends) or "qwen" (a Qwen2 /
        Qwen3 chat model loaded with tunix from the Hugging Face folder
        `model_dir`, in `param_dtype` "float32" or "bfloat16";
        `stepcredit.train.qwen`).
      lora_rank, lora_alpha: with policy "qwen", 0 trains every weight and
        r >= 1 trains rank-r LoRA adapters scaled by alpha / r over frozen
        weights (`stepcredit.llm.lora`; alpha 32 as in verl's examples).
      micro_rows: with policy "qwen", rows per forward and backward pass of
        an update, gradients accumulated over a minibatch (0: all at once).
      critic_learning_rate: with policy "qwen", the AdamW rate of the critic,
        a copy of the model of its own (1e-5, verl's PPO critic beside a 1e-6
        actor); the word model's critic shares its trunk and learning rate.
      share_contexts: the word model runs once per kind of step row that
        shares its context (equal prompts while sampling the training
        rollouts; equal rows but for the last action token in scoring, the
        PRM and the update: `stepcredit.models.sharing`), with results equal
        up to float rounding; False runs every row (to measure or check it).

    `stepcredit.train.build.resolve` writes out every value derived from
    these (the estimator's full hyperparameters, the loss's critic weight,
    clip-higher, temperature and choice constraint, dynamic sampling); the
    trainer runs and saves the resolved configuration.
    """

    env: str = "alfworld"
    difficulty: int = 0
    estimator: str = "grpo"
    estimator_config: tuple[tuple[str, Any], ...] = ()
    iterations: int = 100
    tasks_per_iteration: int = 8
    group_size: int = 8
    seed: int = 0
    max_steps: int | None = None
    horizon_schedule: tuple[int, ...] = ()
    horizon_switch_every: int = 50
    rollout: RolloutConfig = RolloutConfig()
    loss: LossConfig = LossConfig()
    d_model: int = 256
    num_layers: int = 2
    num_heads: int = 4
    mlp_dim: int | None = None
    learning_rate: float = 3e-4
    learning_rate_schedule: str = "constant"
    final_learning_rate_fraction: float = 0.1
    learning_rate_warmup_iterations: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    epochs: int = 2
    minibatch_rows: int = 64
    target_kl: float | None = None
    critic_warmup_iterations: int = 0
    prm_learning_rate: float = 1e-4
    prm_rewards_from: str = "post_update_prm"
    progress_learning_rate: float = 1e-4
    progress_steps: int = 1
    dynamic_sampling: bool | None = None
    warm_start_steps: int = 0
    warm_start_tasks: int = 64
    eval_every: int = 0
    eval_tasks: int = 32
    eval_temperature: float = 0.0
    checkpoint_every: int = 10
    logdir: str = "runs/default"
    async_mode: bool = False
    max_staleness: int = 1
    time_limit_minutes: float | None = None
    num_devices: int = 0
    vine_rollouts: int = 9
    tree_count: int = 0
    tree_branches: int = 0
    tree_rounds: int = 1
    tree_branching: str = "random"
    policy: str = "word"
    model_dir: str | None = None
    param_dtype: str = "float32"
    lora_rank: int = 0
    lora_alpha: float = 32.0
    micro_rows: int = 0
    critic_learning_rate: float = 1e-5
    share_contexts: bool = True

    def __post_init__(self):
        positive = {"iterations": self.iterations, "tasks_per_iteration": self.tasks_per_iteration,
                    "group_size": self.group_size, "epochs": self.epochs,
                    "minibatch_rows": self.minibatch_rows,
                    "checkpoint_every": self.checkpoint_every,
                    "vine_rollouts": self.vine_rollouts, "eval_tasks": self.eval_tasks,
                    "warm_start_tasks": self.warm_start_tasks,
                    "horizon_switch_every": self.horizon_switch_every}
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"TrainConfig: {name}={value}; it must be >= 1")
        for name in ("learning_rate", "grad_clip", "prm_learning_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainConfig: {name}={getattr(self, name)}; it must be > 0")
        for name in ("warm_start_steps", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig: {name}={getattr(self, name)}; it must be >= 0")
        if self.progress_steps < 0 or not self.progress_learning_rate > 0:
            raise ValueError(f"TrainConfig: progress_steps={self.progress_steps} must be >= 0 "
                             f"and progress_learning_rate={self.progress_learning_rate} > 0")
        if min(self.tree_count, self.tree_branches, self.tree_rounds) < 0 or (
                self.tree_branching not in ("random", "entropy")):
            raise ValueError(f"TrainConfig: tree_count={self.tree_count}, tree_branches="
                             f"{self.tree_branches} and tree_rounds={self.tree_rounds} must be "
                             f">= 0 and tree_branching={self.tree_branching!r} 'random' or "
                             "'entropy'")
        if self.target_kl is not None and not self.target_kl > 0:
            raise ValueError(f"TrainConfig: target_kl={self.target_kl}; it must be > 0 or None")
        if self.prm_rewards_from not in ("post_update_prm", "pre_update_prm"):
            raise ValueError(f"TrainConfig: prm_rewards_from={self.prm_rewards_from!r}; expected "
                             "'post_update_prm' (paper) or 'pre_update_prm' (authors' code)")
        if self.learning_rate_schedule not in LEARNING_RATE_SCHEDULES:
            raise ValueError(f"TrainConfig: learning_rate_schedule={self.learning_rate_schedule!r};"
                             f" expected one of {LEARNING_RATE_SCHEDULES}")
        if not 0 <= self.final_learning_rate_fraction <= 1:
            raise ValueError(f"TrainConfig: final_learning_rate_fraction="
                             f"{self.final_learning_rate_fraction}; it must be in [0, 1]")
        if self.learning_rate_warmup_iterations < 0:
            raise ValueError(f"TrainConfig: learning_rate_warmup_iterations="
                             f"{self.learning_rate_warmup_iterations}; it must be >= 0")
        if self.critic_warmup_iterations < 0:
            raise ValueError(f"TrainConfig: critic_warmup_iterations="
                             f"{self.critic_warmup_iterations}; it must be >= 0")
        if self.max_staleness < 0:
            raise ValueError(f"TrainConfig: max_staleness={self.max_staleness}; it must be >= 0")
        if self.policy not in POLICIES or (self.policy == "qwen") != (self.model_dir is not None):
            raise ValueError(f"TrainConfig: policy={self.policy!r} with model_dir={self.model_dir!r}; "
                             f"policy is one of {POLICIES}, and model_dir is given with 'qwen' only")
        if self.lora_rank < 0 or (self.lora_rank and self.policy != "qwen") or not self.lora_alpha > 0:
            raise ValueError(f"TrainConfig: lora_rank={self.lora_rank}, lora_alpha={self.lora_alpha} with "
                             f"policy={self.policy!r}; LoRA (rank >= 1, alpha > 0) adapts policy 'qwen' "
                             "only, and rank 0 trains every weight")
        if not self.critic_learning_rate > 0 or (self.critic_learning_rate != 1e-5 and self.policy != "qwen"):
            raise ValueError(f"TrainConfig: critic_learning_rate={self.critic_learning_rate} with "
                             f"policy={self.policy!r}; a separate critic's rate (> 0) is for policy 'qwen' "
                             "(the word model's critic learns at learning_rate)")
        if self.micro_rows < 0 or (self.micro_rows and self.policy != "qwen"):
            raise ValueError(f"TrainConfig: micro_rows={self.micro_rows} with policy={self.policy!r}; "
                             "micro-batches (>= 1) split the updates of policy 'qwen' only")
        if self.param_dtype not in ("float32", "bfloat16") or (
                self.param_dtype != "float32" and self.policy != "qwen"):
            raise ValueError(f"TrainConfig: param_dtype={self.param_dtype!r} with policy="
                             f"{self.policy!r}; 'float32' or 'bfloat16', and the latter for "
                             "policy 'qwen' only")
        if self.lora_alpha != 32.0 and self.policy != "qwen":
            raise ValueError(f"TrainConfig: lora_alpha={self.lora_alpha} with policy="
                             f"{self.policy!r}; LoRA adapts policy 'qwen' only")
        if self.num_devices < 0:
            raise ValueError(f"TrainConfig: num_devices={self.num_devices}; it must be >= 0 "
                             "(0: all local devices)")

    def differences(self, other: "TrainConfig", *, ignore=()) -> list[str]:
        """`"field: self -> other"` for every (nested, dotted) field that differs."""
        mine, theirs = _flat(dataclasses.asdict(self)), _flat(dataclasses.asdict(other))
        return [f"{key}: {_json(mine.get(key))} -> {_json(theirs.get(key))}"
                for key in sorted(set(mine) | set(theirs))
                if key not in ignore and _json(mine.get(key)) != _json(theirs.get(key))]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        raw = json.loads(text)
        raw["rollout"] = RolloutConfig(**raw["rollout"])
        raw["loss"] = LossConfig(**raw["loss"])
        raw["estimator_config"] = tuple(tuple(pair) for pair in raw["estimator_config"])
        raw["horizon_schedule"] = tuple(raw["horizon_schedule"])
        return cls(**raw)


# What a resumed run may change: how long it runs, how often it evaluates and checkpoints,
# and where its directory lives (a copied or moved run is the same run).
RESUMABLE_CHANGES = ("iterations", "time_limit_minutes", "eval_every", "eval_tasks",
                     "eval_temperature", "checkpoint_every", "logdir")


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)  # tuples and lists compare alike, as saved
