"""`stepcredit train --policy qwen`: a Qwen2 / Qwen3 chat model in stepcredit's training run.

`QwenTrainer` is the run of `stepcredit.train.trainer.Trainer` (its log
directory rules, `--resume` and `--overwrite`, evaluation and checkpoint
schedule, time limit, metrics and progress lines) with the policy a tunix model
loaded from a Hugging Face folder (`stepcredit.llm.checkpoint.load`). An
iteration plays `tasks_per_iteration` training tasks (the word-level trainer's
choice, `collection.iteration_tasks`), G episodes each, as chats
(`stepcredit.llm.rollout.play_group`: token-exact step rows of what the model
saw and sampled), and learns from them (`stepcredit.llm.learn.Learner`: the
estimator's credit, then PPO or StepPO's step ratio with an optional KL to a
frozen copy of the model). Checkpoints hold `Learner.as_tree`: the trained
parameters (or LoRA adapters), the optimizer states, and the reference, critic,
PRM and progress estimator where the run keeps them.

The chat-model defaults (`DEFAULTS`) are what `stepcredit train --policy qwen`
fills in for flags left unset; a `TrainConfig` built in Python holds what it
says (the word model's defaults where it says nothing), so set those fields.

Settings of `TrainConfig` this path does not implement are refused in one
line naming them (`unsupported_settings`); every registered estimator runs.
SPA's progress estimator is a value-head copy of the model
(`Learner.update_progress`). Tree-GRPO's forests are played by `stepcredit.llm.tree`
(random branching). VinePPO's Monte Carlo values come from
`vine_rollouts` continuations of the chat model from every visited state
(`stepcredit.llm.vine`). IGPO's answer beliefs
are the chat model's mean log-prob of the task's answer teacher-forced as its
answer action after each step's prompt (`answer_prefix`, `Learner.answer_beliefs`).
DAPO's dynamic sampling (`dynamic_sampling`, or the estimator's recipe) refills
the batch with fresh tasks in place of groups whose scores are all equal
(`collection.informative_groups`, as the word-level run).
`lora_rank` > 0 trains LoRA adapters instead of every weight.
Critic estimators (step GAE, turn PPO, token GAE) train a value-head copy of
the model beside the policy (`stepcredit.llm.critic`), PRM estimators (iStar,
PRIME) a PRM copy (`stepcredit.llm.learn`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import jax.numpy as jnp
import numpy as np

from stepcredit import advantages as adv
from stepcredit.train import information_gain, vine
from stepcredit.train.build import check_snapshots, make_env
from stepcredit.train.checkpoint import Checkpointer
from stepcredit.train.collection import informative_groups, iteration_tasks
from stepcredit.train.config import TrainConfig
from stepcredit.train.evaluate import test_split
from stepcredit.train.trainer import Trainer, write_whole
from stepcredit.train.tree import BRANCHES_NEED, TreeShape

# What the Qwen path reads from a TrainConfig; any other field set away from its default is refused.
HONOURED = frozenset({
    "env", "difficulty", "estimator", "estimator_config", "iterations", "tasks_per_iteration",
    "group_size", "seed", "max_steps", "learning_rate", "weight_decay", "grad_clip", "epochs",
    "minibatch_rows", "eval_every", "eval_tasks", "eval_temperature", "checkpoint_every", "logdir",
    "time_limit_minutes", "policy", "model_dir", "param_dtype", "prm_learning_rate", "prm_rewards_from",
    "lora_rank", "lora_alpha", "micro_rows", "critic_learning_rate", "dynamic_sampling", "vine_rollouts",
    "tree_count", "tree_branches", "tree_rounds", "tree_branching", "progress_learning_rate",
    "progress_steps",
    "rollout.temperature", "rollout.max_action_tokens", "rollout.history_window",
    "rollout.invalid_action_penalty",
    "loss.clip_low", "loss.clip_high", "loss.agg", "loss.max_response_length", "loss.step_level_ratio",
    "loss.step_clip_low", "loss.step_clip_high", "loss.kl_coef", "loss.kl_kind", "loss.value_clip"})

# The defaults of `stepcredit train --policy qwen` where the word model's do not suit a
# pretrained chat model (its 3e-4 learning rate would wreck one, 12 tokens cut a reasoned
# answer short): GiGPO's ALFWorld recipe, arXiv 2505.10978 (learning rate 1e-6, one pass
# over minibatches of 256 rows, answers up to 512 tokens, the two latest turns shown).
DEFAULTS = {"learning_rate": 1e-6, "epochs": 1, "minibatch_rows": 256,
            "rollout.max_action_tokens": 512, "rollout.history_window": 2,
            "prm_learning_rate": 1e-6,  # iStar's PRM, arXiv 2509.19199
            "progress_learning_rate": 3e-6}  # SPA's progress estimator, arXiv 2505.20732


def unsupported_settings(config: TrainConfig) -> list[str]:
    """`"field: default -> given"` for each setting the Qwen path would ignore."""
    default = TrainConfig(policy="qwen", model_dir=config.model_dir)
    return [line for line in default.differences(config) if line.split(":")[0] not in HONOURED]


def check_config(config: TrainConfig) -> None:
    """Raises ValueError, in one line, for a setting or an estimator the Qwen path cannot run."""
    ignored = unsupported_settings(config)
    if ignored:
        raise ValueError(f"--policy qwen does not implement {'; '.join(ignored)} (default -> given); "
                         "leave them at their defaults")
    entry = adv.get(config.estimator)
    if entry.recipe.rollout_trees and config.tree_branching != "random":
        raise ValueError(f"--policy qwen: tree_branching={config.tree_branching!r}; the chat sampler "
                         "records no entropies, so its trees branch at random")
    if entry.recipe.rollout_trees and config.dynamic_sampling:
        raise ValueError(f"--policy qwen: dynamic_sampling=True refills groups of group_size rollouts; "
                         f"{config.estimator!r} plays trees, which it cannot refill")
    if entry.needs_groups and config.group_size < 2:
        raise ValueError(f"TrainConfig: group_size={config.group_size}, but {config.estimator!r} "
                         "compares the rollouts of a task; use group_size >= 2")


def resolve(config: TrainConfig) -> TrainConfig:
    """`config` with the estimator's full hyperparameters, the recipe's clip-higher and a forest's
    derived sizes (`TreeShape.for_group_size`) written out."""
    check_config(config)
    entry = adv.get(config.estimator)
    estimator_config = entry.resolve(dict(config.estimator_config))
    loss = config.loss
    if loss.clip_high is None:
        loss = dataclasses.replace(loss, clip_high=entry.recipe.clip_high
                                   if entry.recipe.clip_high is not None else loss.clip_low)
    trees = {}
    if entry.recipe.rollout_trees:
        shape = TreeShape.for_group_size(config.group_size, trees=config.tree_count,
                                         branches=config.tree_branches, rounds=config.tree_rounds)
        trees = {"tree_count": shape.trees, "tree_branches": shape.branches}
    return dataclasses.replace(config, estimator_config=tuple(sorted(estimator_config.items())),
                               loss=loss, **trees)


def answer_prefix(env, tokenizer) -> list[int] | None:
    """IGPO's teacher-forcing prefix: the ids of a chat answer up to the ground-truth answer
    (`<action>finish[` for HotpotQA's `finish[{}]`), or None when `env` gives no reference
    answer (WebShop, ALFWorld: IGPO then trains on its outcome-only form)."""
    template = getattr(env, "answer_action", None)
    if template is None or not callable(getattr(env, "reference_answer", None)):
        return None
    return tokenizer.encode("<action>" + template.partition("{}")[0], add_special_tokens=False)


def episode_metrics(trajectories) -> dict[str, float]:
    """success (won), score (the last step's), steps per episode, invalid-action and parse-error rates."""
    steps = [step for t in trajectories for step in t.steps]
    return {
        "success": float(np.mean([any(s.info.get("won", False) for s in t.steps) for t in trajectories])),
        "score": float(np.mean([t.steps[-1].info.get("score", 0.0) if t.steps else 0.0
                                for t in trajectories])),
        "steps_per_episode": len(steps) / len(trajectories),
        "invalid_action_rate": float(np.mean([not s.info.get("valid", True) for s in steps] or [0.0])),
        "parse_error_rate": float(np.mean([s.info.get("parse_error") is not None for s in steps]
                                          or [0.0]))}


class QwenTrainer(Trainer):
    """The training run with a Qwen chat model as the policy (see the module docstring).

    Args:
      config: a `TrainConfig` with `policy="qwen"` and `model_dir`.
      log: where progress lines go.
    """

    def __init__(self, config: TrainConfig, *, log: Callable[[str], None] = print):
        from stepcredit.llm import checkpoint, learn

        if config.policy != "qwen":
            raise ValueError(f"QwenTrainer: config.policy={config.policy!r}; it trains policy 'qwen'")
        self.config = resolve(config)
        self.process_index, self.multiprocess, self.primary = 0, False, True
        self.log = log
        self.qwen = checkpoint.load(config.model_dir, dtype=config.param_dtype)
        c = self.config
        self.learn_config = learn.LearnConfig(
            estimator=c.estimator, estimator_config=c.estimator_config, iterations=c.iterations,
            tasks_per_iteration=c.tasks_per_iteration, group_size=c.group_size,
            max_new_tokens=c.rollout.max_action_tokens, temperature=c.rollout.temperature,
            window=c.rollout.history_window, invalid_action_penalty=c.rollout.invalid_action_penalty,
            learning_rate=c.learning_rate, weight_decay=c.weight_decay, grad_clip=c.grad_clip,
            epochs=c.epochs, minibatch_rows=c.minibatch_rows, prm_learning_rate=c.prm_learning_rate,
            prm_rewards_from=c.prm_rewards_from, lora_rank=c.lora_rank, lora_alpha=c.lora_alpha,
            progress_learning_rate=c.progress_learning_rate, progress_steps=c.progress_steps,
            micro_rows=c.micro_rows, critic_learning_rate=c.critic_learning_rate,
            loss=c.loss, seed=c.seed)
        self.learner = learn.Learner(self.qwen, self.learn_config)
        entry = adv.get(c.estimator)
        self.dynamic_sampling = (entry.recipe.dynamic_sampling if c.dynamic_sampling is None
                                 else c.dynamic_sampling)
        probe = make_env(c, "train")
        self.num_train_tasks = probe.num_tasks
        self.answer_prefix = answer_prefix(probe, self.qwen.tokenizer)
        probe.close()
        if entry.needs_information_gain and self.answer_prefix is None:
            log(information_gain.no_answer_warning(c.env, c.estimator))
        self.needs_mc_values = entry.needs_mc_values
        if self.needs_mc_values:
            check_snapshots(c, vine.VALUES_NEED)
        self.trees = None  # Tree-GRPO: each task's rollouts are a forest
        if entry.recipe.rollout_trees:
            self.trees = TreeShape(c.tree_count, c.tree_branches, c.tree_rounds, c.tree_branching)
            check_snapshots(c, BRANCHES_NEED)
        self.next_iteration = 0
        self.checkpointer = Checkpointer(os.path.join(c.logdir, "checkpoints"))

    def iteration(self, iteration: int) -> dict[str, float]:
        """Plays one batch and learns from it; returns the iteration's metrics."""
        from stepcredit.llm import learn
        from stepcredit.llm import tree as llm_tree
        from stepcredit.llm import vine as llm_vine

        tick = time.perf_counter()

        c, extra = self.config, {}

        def play(round_: int):
            tasks = iteration_tasks(c, iteration, self.num_train_tasks, round_=round_)
            if self.trees is not None:
                trajectories, forest = llm_tree.collect_trees(
                    self.qwen, lambda: make_env(c, "train"), tasks, self.trees,
                    seed=c.seed * 100_003 + iteration * 1_009, max_new_tokens=c.rollout.max_action_tokens,
                    temperature=c.rollout.temperature, window=c.rollout.history_window,
                    invalid_action_penalty=c.rollout.invalid_action_penalty)
                extra.update(forest)
                return trajectories
            trajectories = learn.play_batch(self.qwen, lambda: make_env(c, "train"), tasks,
                                            self.learn_config, iteration=iteration, round_=round_)
            if not self.needs_mc_values:
                return trajectories
            trajectories, values = llm_vine.with_mc_values(  # VinePPO: each visited state valued
                self.qwen, lambda: make_env(c, "train"), tasks, trajectories, rollouts=c.vine_rollouts,
                seed=llm_vine.continuation_seed(c.seed, iteration, round_),
                max_new_tokens=c.rollout.max_action_tokens, temperature=c.rollout.temperature,
                window=c.rollout.history_window, invalid_action_penalty=c.rollout.invalid_action_penalty)
            for key, value in values.items():
                extra[key] = extra.get(key, 0.0) + value
            return trajectories

        trajectories = play(0)
        if self.dynamic_sampling:
            trajectories, dapo = informative_groups(trajectories, play, group_size=c.group_size,
                                                    wanted=c.tasks_per_iteration)
            extra.update(dapo)
        played = time.perf_counter()
        metrics = {f"rollout/{k}": v for k, v in episode_metrics(trajectories).items()}
        metrics.update(extra)
        metrics.update(self.learner.learn(trajectories, iteration=iteration,
                                          answer_prefix=self.answer_prefix))
        metrics["time/rollout"] = played - tick
        metrics["time/update"] = time.perf_counter() - played
        metrics["time/iteration"] = time.perf_counter() - tick
        self.next_iteration = iteration + 1
        return metrics

    def start_worker(self, iteration: int):
        raise ValueError("--policy qwen has no asynchronous rollouts")

    def _tree(self) -> dict:
        return {**self.learner.as_tree(), "iteration": jnp.int32(self.next_iteration)}

    def restore(self) -> int:
        """Restores the newest intact checkpoint, if any; returns the next iteration to run."""
        if self.checkpointer.latest_step() is None:
            return 0
        _, tree = self.checkpointer.restore_intact(self._tree(), note=self.log)
        self.learner.load(tree)
        self.next_iteration = int(tree["iteration"])
        return self.next_iteration

    def save(self) -> None:
        """Checkpoints the learner and writes the resolved configuration, each whole or not at all."""
        self.checkpointer.save(self.next_iteration, self._tree())
        write_whole(os.path.join(self.config.logdir, "config.json"), self.config.to_json())

    def evaluate(self) -> dict[str, float]:
        """Each of the first `eval_tasks` test tasks played once at `eval_temperature` (0: greedy)."""
        from stepcredit.llm import rollout

        c = self.config
        probe = make_env(c, "train")
        split = test_split(probe)
        probe.close()
        probe = make_env(c, split)
        count = min(c.eval_tasks, probe.num_tasks)
        probe.close()
        trajectories = []
        for task in range(count):
            trajectories += rollout.play_group(
                self.qwen, lambda: make_env(c, split), task, group_size=1, seed=c.seed * 7_919 + task,
                max_new_tokens=c.rollout.max_action_tokens, temperature=c.eval_temperature,
                window=c.rollout.history_window)
        return episode_metrics(trajectories)


__all__ = ("DEFAULTS", "HONOURED", "QwenTrainer", "answer_prefix", "check_config", "episode_metrics",
           "resolve",
           "unsupported_settings")
