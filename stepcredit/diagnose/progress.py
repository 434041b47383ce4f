"""SPA's progress estimator of a diagnosis, fitted to the sampled episodes.

SPA (`spa`) reads each step's progress contribution c_t from an estimator
trained so that a trajectory's contributions sum to its outcome. A diagnosis
has no trained one, so `fit_progress` runs the trainer's: the episodes are
tokenised and cut into minibatches exactly as for the implicit PRM
(`stepcredit.diagnose.prm.prepare_fitting`), the estimator is the small
transformer initialised from `seed` (the trainer's `build` with the
estimator "spa": it starts as the policy, its value head at zero) and takes
`steps` optimizer steps on `progress_loss` (the trainer's
`stepcredit.train.progress.progress_step`, with the episodes' scores as
outcomes); then every step is scored.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from stepcredit import advantages as adv
from stepcredit.diagnose.episodes import Episode
from stepcredit.diagnose.prm import (D_MODEL, LEARNING_RATE, NUM_HEADS, NUM_LAYERS,
                                     TRAJECTORIES_PER_STEP, _Arrays, check_episodes,
                                     describe_fitting, prepare_fitting, step_schedule)
from stepcredit.rollout import RolloutConfig
from stepcredit.train import progress as estimator
from stepcredit.train.config import TrainConfig


class ProgressInputs(NamedTuple):
    """What SPA reads from a progress estimator, one row per episode.

    Attributes:
      progress: `[B, T]` float32 contributions c_t after training (0 on padding).
      grounding: `[B, T]` bool g_t, True on every real step: the diagnosis's
        behaviour policies act among the admissible actions, so every action
        is executed.
      seconds: wall-clock cost of tokenising, training and scoring.
      description: one line for the report (model, optimizer, data, loss, time).
      losses: the progress loss of each optimizer step's minibatch, before that step.
    """

    progress: np.ndarray
    grounding: np.ndarray
    seconds: float
    description: str
    losses: tuple[float, ...] = ()


def _progress_batch(batch: _Arrays, members: np.ndarray, episodes: Sequence[Episode],
                    num_steps: int) -> estimator.ProgressBatch:
    """A minibatch's rows with its episodes' step masks and scores (padding episodes: none)."""
    rows = batch.step_index.shape[0]
    mask = np.zeros((rows, num_steps), bool)
    outcomes = np.zeros(rows, np.float32)
    for i, e in enumerate(members):
        mask[i, :episodes[e].length] = True
        outcomes[i] = episodes[e].score
    return estimator.ProgressBatch(batch.tokens, batch.mask, batch.row_action_mask,
                                   batch.index_b, batch.index_n, batch.step_index,
                                   jnp.asarray(mask), jnp.asarray(outcomes))


def fit_progress(episodes: Sequence[Episode], *, env_name: str, steps: int = 20, seed: int = 0,
                 learning_rate: float = LEARNING_RATE,
                 trajectories_per_step: int | None = TRAJECTORIES_PER_STEP,
                 d_model: int = D_MODEL, num_layers: int = NUM_LAYERS,
                 num_heads: int = NUM_HEADS, env_kwargs: Mapping[str, Any] | None = None,
                 rollout: RolloutConfig | None = None, progress: bool = False) -> ProgressInputs:
    """Trains SPA's progress estimator on the episodes' outcomes and scores their steps.

        E <- the reference model;   `steps` times: E <- Adam step on
        L(E) = mean over the minibatch's episodes b of (sum_t c_t^b - R^b)^2,
        c_t = E's value head at the last action token of step t's row

    with R the episode's score. steps = 0 leaves every c_t at 0 (the value
    head starts at zero). Minibatches, their order, the model and the
    optimizer (AdamW without weight decay, global-norm clip 10) are the
    implicit PRM's (`fit_prm`), so the two cost about the same.

    Args:
      episodes: B episodes of `env_name`, each with at least one step.
      env_name: the registered environment they were played on.
      steps: optimizer steps (0: untrained).
      seed: initialises the model and orders the minibatches.
      learning_rate: Adam's rate (the trainer's `progress_learning_rate` is
        1e-4, for an estimator that takes one step per iteration).
      trajectories_per_step: trajectories per optimizer step (whole groups);
        None: all of them.
      d_model, num_layers, num_heads: the model's size (MLP 4 d_model).
      env_kwargs: the environment settings the episodes were sampled with.
      rollout: the prompt settings; None: the trainer's with its fitted budget.
      progress: show a progress bar over the optimizer steps.

    Returns:
      `ProgressInputs`, `[B, T]` with T the longest episode.

    Raises:
      ValueError: as `fit_prm` (no episodes, an empty or foreign episode, an
        argument out of range, an episode that does not replay).

    References:
      Wang et al., "SPA-RL: Reinforcing LLM Agents via Stepwise Progress
      Attribution", arXiv 2505.20732 (its progress estimator, trained offline
      on explored trajectories, as here).

    Example: `fit_progress(episodes, env_name="alfworld", steps=0).progress`
    is all zeros, `[B, T]`.
    """
    tick = time.perf_counter()
    check_episodes("fit_progress", episodes, env_name, steps=steps, learning_rate=learning_rate,
                   trajectories_per_step=trajectories_per_step)
    config = TrainConfig(env=env_name, estimator="spa", seed=seed, d_model=d_model,
                         num_layers=num_layers, num_heads=num_heads,
                         progress_learning_rate=learning_rate,
                         rollout=rollout or RolloutConfig())
    fitting = prepare_fitting(episodes, config, env_kwargs=env_kwargs,
                              fit_budget=rollout is None,
                              trajectories_per_step=trajectories_per_step)
    parts, state = fitting.parts, fitting.state
    num_steps = max(e.length for e in episodes)
    batches = [_progress_batch(b, m, episodes, num_steps)
               for b, m in zip(fitting.batches, fitting.members)]
    params, opt_state, losses = state.progress, state.progress_opt, []
    for k in tqdm(step_schedule(len(batches), steps, seed), desc=f"{env_name}: progress steps",
                  disable=not progress, leave=False):
        params, opt_state, loss = estimator.progress_step(params, opt_state, batches[k],
                                                          graphdef=parts.graphdef,
                                                          tx=parts.progress_tx)
        losses.append(loss)
    contributions = np.zeros((len(episodes), num_steps), np.float32)
    for batch, members in zip(batches, fitting.members):
        scored = estimator.contributions(params, batch, graphdef=parts.graphdef)
        contributions[members] = np.asarray(scored)[:len(members)]
    mask = np.arange(num_steps)[None, :] < np.array([e.length for e in episodes])[:, None]
    outcomes = np.array([e.score for e in episodes], np.float32)
    final = float(adv.progress_loss(contributions, mask, outcomes))
    initial = float(np.mean(outcomes ** 2))  # every c_t = 0 at the start
    losses = [float(x) for x in jax.device_get(losses)]
    seconds = time.perf_counter() - tick
    model = describe_fitting(fitting, steps=steps, learning_rate=learning_rate)
    description = (f"progress estimator (SPA): {model}; outcome: the score; sum-to-outcome "
                   f"loss {initial:.3f} -> {final:.3f}; grounding g_t = 1 on every step (the "
                   f"behaviour policy acts among the admissible actions); {seconds:.1f} s")
    return ProgressInputs(contributions, mask, seconds, description, tuple(losses))
