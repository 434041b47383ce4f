"""`diagnose`: every estimator's step credit graded against simulator ground truth.

For each simulator and seed, a behaviour policy of known skill plays
`tasks` tasks `group_size` times (`stepcredit.diagnose.sample`). Every
estimator then scores the same episodes (`stepcredit.diagnose.estimates`),
and each metric (`stepcredit.diagnose.metrics`) compares its step credit
with the oracle's progress labels and the Monte Carlo advantage A^pi. Each
score is the metric on all seeds' episodes pooled, with a 95% bootstrap
interval over (seed, task) groups, and the metric on each seed alone.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from stepcredit import advantages as adv
from stepcredit.diagnose import metrics
from stepcredit.diagnose.config import STEP_LIMITS, DiagnoseConfig
from stepcredit.diagnose.episodes import Episode, Stacked, stack
from stepcredit.diagnose.estimates import (REFERENCES, TokenView, bucket, prm_tokens,
                                           reference_credit, step_credit, word_tokens)
from stepcredit.diagnose.policies import parse_policy
from stepcredit.diagnose.result import METRICS, Diagnosis, Example, Score
from stepcredit.diagnose.sample import sample_episodes, sample_tasks, sample_trees
from stepcredit.diagnose.values import step_values
from stepcredit.envs import registry as envs
from stepcredit.envs.base import SnapshotEnv
from stepcredit.train.tree import TreeShape


def env_options(name: str, config: DiagnoseConfig) -> dict[str, Any]:
    """The simulator options of a diagnosis: split, difficulty and step limit."""
    options: dict[str, Any] = {"split": config.split}
    if config.difficulty is not None:
        options["difficulty"] = config.difficulty
    max_steps = STEP_LIMITS.get(name) if config.max_steps is None else config.max_steps
    if max_steps is not None:
        options["max_steps"] = max_steps
    return options


def diagnosable_env(name: str, config: DiagnoseConfig):
    """The simulator `name` with the diagnosis's options (`env_options`).

    Raises:
      ValueError: it has no oracle or no snapshots (TextWorld, an HTTP server).
    """
    options = env_options(name, config)
    env = envs.make(name, **options)
    if not isinstance(env, SnapshotEnv) or not all(
            callable(getattr(env, m, None)) for m in ("oracle_distance", "oracle_actions")):
        env.close()
        raise ValueError(f"diagnose: environment {name!r} cannot be diagnosed: only simulators "
                         "that know the right action (oracle_distance, oracle_actions) and can be "
                         "snapshotted (SnapshotEnv) can")
    return env


def _play(env_name: str, policy, config: DiagnoseConfig, names: Sequence[str],
          progress: bool) -> tuple[list[Episode], list[np.ndarray]]:
    """The diagnosed episodes of every seed and their values (`config.values`), with VinePPO's
    Monte Carlo values when an estimator of `names` reads them."""
    env = diagnosable_env(env_name, config)
    vine_rollouts = config.vine_rollouts if any(adv.get(n).needs_mc_values for n in names) else 0
    episodes, fitting = [], []
    total = len(config.seeds) * config.tasks * config.group_size
    try:
        with tqdm(total=total, desc=f"{env_name}: episodes", disable=not progress,
                  leave=False) as bar:
            for seed in config.seeds:
                tasks = sample_tasks(env.num_tasks, config.tasks, seed)
                episodes += sample_episodes(env, policy, tasks, group_size=config.group_size,
                                            seed=seed, continuations=config.continuations,
                                            progress=bar.update, vine_rollouts=vine_rollouts)
                if config.values == "table":
                    fitting += sample_episodes(env, policy, tasks, stream=1, seed=seed,
                                               group_size=config.group_size, continuations=0)
        values = step_values(episodes, config.values, fitting,
                             checkpoint=config.value_checkpoint, env=env)
    finally:
        env.close()
    return episodes, values


def _play_trees(env_name: str, policy, config: DiagnoseConfig,
                progress: bool) -> tuple[list[Episode], Stacked, TokenView]:
    """Every seed's tree-structured episodes (`sample_trees`: G leaves per task where the
    tree shape divides out, `TreeShape.for_group_size`), stacked, with their word tokens."""
    env = diagnosable_env(env_name, config)
    shape = TreeShape.for_group_size(config.group_size)
    episodes = []
    try:
        with tqdm(total=len(config.seeds) * config.tasks * shape.leaves_per_task,
                  desc=f"{env_name}: tree episodes", disable=not progress, leave=False) as bar:
            for seed in config.seeds:
                episodes += sample_trees(env, policy, sample_tasks(env.num_tasks, config.tasks,
                                                                   seed),
                                         shape=shape, seed=seed,
                                         continuations=config.continuations, progress=bar.update)
    finally:
        env.close()
    return episodes, stack(episodes), word_tokens(episodes)


def _tokens(episodes: list[Episode], env_name: str, config: DiagnoseConfig,
            names: Sequence[str], notes: list[str], progress: bool) -> TokenView:
    if not any(adv.get(n).needs_prm for n in names):
        return word_tokens(episodes)
    from stepcredit.diagnose.prm import fit_prm  # a model and its training: only when needed

    fitted = fit_prm(episodes, env_name=env_name, steps=config.prm_steps, seed=config.seeds[0],
                     env_kwargs=env_options(env_name, config), progress=progress)
    notes.append(f"{env_name}: {fitted.description}")
    return prm_tokens(fitted.step_index, fitted.prm_logp, fitted.ref_logp, episodes)


def _progress(episodes: list[Episode], env_name: str, config: DiagnoseConfig,
              names: Sequence[str], notes: list[str], progress: bool) -> dict[str, np.ndarray]:
    """SPA's inputs (`progress`, `grounding`) when an estimator of `names` reads them, fitted
    with the PRM's budget of `config.prm_steps` optimizer steps; else none."""
    if not any(adv.get(n).needs_progress for n in names):
        return {}
    from stepcredit.diagnose.progress import fit_progress  # a model: only when needed

    fitted = fit_progress(episodes, env_name=env_name, steps=config.prm_steps,
                          seed=config.seeds[0], env_kwargs=env_options(env_name, config),
                          progress=progress)
    notes.append(f"{env_name}: {fitted.description}")
    return {"progress": fitted.progress, "grounding": fitted.grounding}


def _truth_note(label: str, continuations: int) -> str:
    if continuations == 0:
        return (f"behaviour policy {label}; no Monte Carlo A^pi (K=0): the mc_advantage row, "
                "Spearman and sign agreement are left out")
    return (f"behaviour policy {label}; A^pi from K={continuations} paired Monte Carlo rollouts "
            "per action and per state (common random numbers)")


def grade(env_name: str, name: str, credit: np.ndarray, stacked: Stacked, *,
          seeds: Sequence[int], bootstrap: int) -> list[Score]:
    """Every metric of one estimator's `[B, T]` credit against the truth in `stacked`:
    pooled over seeds, with a bootstrap interval over (seed, task) groups, and per seed."""
    truth = dict(mask=stacked.mask, good=stacked.good, advantage=stacked.advantage,
                 advantage_se=stacked.advantage_se, failed=~stacked.won)

    def evaluate(rows) -> dict:
        return metrics.evaluate(credit[rows], **{k: v[rows] for k, v in truth.items()})

    pooled = evaluate(np.arange(len(credit)))
    per_seed = [evaluate(np.flatnonzero(stacked.seeds == s)) for s in seeds]
    low, high = metrics.bootstrap_interval(
        lambda rows: np.array([m.value for m in evaluate(rows).values()]), stacked.group_ids,
        num_resamples=bootstrap, seed=0)
    return [Score(env_name, name, metric, float(pooled[metric].value), float(low[k]),
                  float(high[k]), int(pooled[metric].n),
                  tuple(float(s[metric].value) for s in per_seed))
            for k, metric in enumerate(METRICS)]


def pick_examples(good: np.ndarray, mask: np.ndarray, won: np.ndarray, count: int) -> list[int]:
    """Rows worth plotting: failed trajectories of at least 3 steps whose only bad
    step the blame should find, then won ones with a mistake."""
    bad = (~good & mask).sum(1)
    single = np.flatnonzero(~won & (bad == 1) & (mask.sum(1) >= 3)).tolist()
    recovered = np.flatnonzero(won & (bad > 0)).tolist()
    return list(dict.fromkeys(single[:max(1, count - count // 2)] + recovered + single))[:count]


def _examples(env_name: str, episodes: list[Episode], stacked: Stacked,
              credit: dict[str, np.ndarray], count: int) -> list[Example]:
    return [Example(env_name, episodes[i].task, episodes[i].won, episodes[i].actions,
                    episodes[i].good, episodes[i].advantage, episodes[i].advantage_se,
                    {name: c[i, :episodes[i].length] for name, c in credit.items()})
            for i in pick_examples(stacked.good, stacked.mask, stacked.won, count)]


def _grade_trees(env_name: str, names: Sequence[str], episodes: list[Episode], stacked: Stacked,
                 tokens: TokenView, config: DiagnoseConfig, notes: list[str],
                 seconds: dict[str, float], **padding: int) -> list[Score]:
    """The tree estimators' scores on the tree-structured episodes (no critic values: V = 0)."""
    start = time.perf_counter()
    credit, failures = step_credit(names, episodes, stacked,
                                   [np.zeros(e.length) for e in episodes], tokens, **padding)
    notes += [f"{env_name}: {name} not run: {error}" for name, error in failures.items()]
    seconds["credit"] += time.perf_counter() - start
    start = time.perf_counter()
    scores = [score for name in credit
              for score in grade(env_name, name, credit[name], stacked, seeds=config.seeds,
                                 bootstrap=config.bootstrap)]
    seconds["score"] += time.perf_counter() - start
    return scores


def diagnose(config: DiagnoseConfig = DiagnoseConfig(), *, progress: bool = True,
             log: Callable[[str], None] | None = None) -> Diagnosis:
    """Grades every estimator's step credit against ground truth (module doc).

    Args:
      config: what to run (`DiagnoseConfig`).
      progress: show progress bars.
      log: called with a line at each phase (None: silent).

    Returns:
      The `Diagnosis`: scores of the estimators named in `config` and of the
      reference rows "mc_advantage" and "random", example trajectories, the
      seconds per phase and notes.
    """
    policy = parse_policy(config.policy)
    names = config.estimator_names
    seconds = {"sample": 0.0, "prm": 0.0, "credit": 0.0, "score": 0.0}
    notes = [_truth_note(policy.label, config.continuations),
             "values for step and token GAE: " + {
                 "zero": "V = 0",
                 "table": "per-anchor Monte Carlo table fitted on a separate batch of the same "
                          "tasks",
                 "checkpoint": f"the value head of {config.value_checkpoint}"}[config.values]]
    if any(adv.get(n).needs_mc_values for n in names):
        notes.append(f"VinePPO's V_MC: K={config.vine_rollouts} rollouts of the behaviour policy "
                     "per state, on a random stream independent of the A^pi rollouts")
    # Estimators that play rollout trees (Tree-GRPO) are graded on tree-structured episodes.
    tree_names = [n for n in names if adv.get(n).recipe.rollout_trees]
    if tree_names:
        notes.append(f"{', '.join(tree_names)}: graded on episodes of their own, each task's "
                     f"{TreeShape.for_group_size(config.group_size).leaves_per_task} leaves "
                     "branching from the nodes of rollout trees (stepcredit.diagnose.sample."
                     "sample_trees); the other rows on independent episodes")
    sampled, fitted, trees = {}, {}, {}
    for env_name in config.envs:
        start = time.perf_counter()
        episodes, values = _play(env_name, policy, config, names, progress)
        stacked = stack(episodes)
        seconds["sample"] += time.perf_counter() - start
        start = time.perf_counter()
        tokens = _tokens(episodes, env_name, config, names, notes, progress)
        fitted[env_name] = _progress(episodes, env_name, config, names, notes, progress)
        seconds["prm"] += time.perf_counter() - start
        sampled[env_name] = (episodes, stacked, values, tokens)
        if tree_names:
            start = time.perf_counter()
            trees[env_name] = _play_trees(env_name, policy, config, progress)
            seconds["sample"] += time.perf_counter() - start
        if log is not None:
            log(f"{env_name}: {len(episodes)} episodes, {int(stacked.mask.sum())} steps, "
                f"{stacked.won.mean():.0%} won")
    # One padded shape for every simulator, so each estimator compiles once.
    num_steps = bucket(max(s.mask.shape[1] for _, s, *_ in [*sampled.values(), *trees.values()]))
    num_tokens = bucket(max(v[-1].num_tokens for v in [*sampled.values(), *trees.values()]))
    scores: list[Score] = []
    examples: list[Example] = []
    for env_name, (episodes, stacked, values, tokens) in sampled.items():
        start = time.perf_counter()
        credit = reference_credit(stacked, config.seeds[0])
        estimated, failures = step_credit(
            tqdm([n for n in names if n not in tree_names], desc=f"{env_name}: credit",
                 disable=not progress, leave=False),
            episodes, stacked, values, tokens, num_steps=num_steps, num_tokens=num_tokens,
            **fitted[env_name])
        credit.update(estimated)
        notes += [f"{env_name}: {name} not run: {error}" for name, error in failures.items()]
        seconds["credit"] += time.perf_counter() - start
        start = time.perf_counter()
        for name in tqdm(list(credit), desc=f"{env_name}: scoring", disable=not progress,
                         leave=False):
            scores += grade(env_name, name, credit[name], stacked, seeds=config.seeds,
                            bootstrap=config.bootstrap)
        seconds["score"] += time.perf_counter() - start
        if tree_names:
            scores += _grade_trees(env_name, tree_names, *trees[env_name], config, notes,
                                   seconds, num_steps=num_steps, num_tokens=num_tokens)
        examples += _examples(env_name, episodes, stacked, credit, config.examples)
    settings = {**dataclasses.asdict(config), "estimators": list(names),
                "references": list(REFERENCES)}
    return Diagnosis(settings, tuple(scores), tuple(examples),
                     {k: round(v, 3) for k, v in seconds.items()}, tuple(notes))
