"""Evaluation on a fixed panel of test tasks, so numbers compare across runs."""

from __future__ import annotations

import dataclasses

import jax

from stepcredit.envs.pool import EnvPool
from stepcredit.rollout import collect
from stepcredit.train.build import make_env
from stepcredit.train.config import TrainConfig


def test_split(env) -> str:
    """The held-out split of an environment: "test", else its first non-train split, else
    "train" (an environment of one split, `stepcredit.envs.specs`, is evaluated on its tasks)."""
    splits = getattr(env, "splits", ("test",))
    return "test" if "test" in splits else next((s for s in splits if s != "train"), "train")


def evaluate(graphdef, state, tokenizer, config: TrainConfig, *, num_tasks: int,
             temperature: float = 0.0, split: str | None = None, seed: int = 0) -> dict[str, float]:
    """Plays test tasks 0..num_tasks-1 once each (greedy when temperature <= 0).

    Returns:
      success (won), score (the environment's score), steps per episode and
      invalid-action rate, plus `success/<task_type>` where the environment
      reports task types (ALFWorld).
    """
    probe = make_env(config, "train")
    split = split or test_split(probe)
    probe.close()
    probe = make_env(config, split)
    num_tasks = min(num_tasks, probe.num_tasks)
    probe.close()
    rollout_config = dataclasses.replace(config.rollout, temperature=temperature)
    envs = [make_env(config, split) for _ in range(num_tasks)]
    with EnvPool(envs) as pool:
        rollout = collect(graphdef, state, pool, list(range(num_tasks)), 1, tokenizer,
                          jax.random.key(seed), rollout_config,
                          share_prompts=config.share_contexts)
    results: dict[str, float] = {
        "success": rollout.metrics["rollout/success"], "score": rollout.metrics["rollout/score"],
        "steps_per_episode": rollout.metrics["rollout/steps_per_episode"],
        "invalid_action_rate": rollout.metrics["rollout/invalid_action_rate"]}
    by_type: dict[str, list[bool]] = {}
    for trajectory in rollout.trajectories:
        info = trajectory.steps[-1].info
        if "task_type" in info:
            by_type.setdefault(info["task_type"], []).append(bool(info.get("won")))
    for task_type, wins in sorted(by_type.items()):
        results[f"success/{task_type}"] = sum(wins) / len(wins)
    return results
