"""The implicit PRM of a diagnosis: iStar's and PRIME's process reward model, fitted to episodes.

iStar (`istar`, `rloo+istar`, `grpo+istar`) and PRIME (`prime`) read the
action-token log-probs of an implicit PRM pi_prm and of the policy that
sampled the batch. A diagnosis has no trained policy, so `fit_prm` runs the
trainer's procedure on the sampled episodes: each step is tokenised exactly
as `stepcredit train` would tokenise it for that environment (its word
tokenizer, `step_prompt` under the default `RolloutConfig` with the fitted
prompt budget, the action's ids and `<eoa>`); the reference is the small
transformer initialised from `seed`; the PRM starts as its copy and takes
`steps` optimizer steps on the trainer's trajectory preference loss
(`trajectory_preference_loss`, through the trainer's `update.score`, `build`
and `prm_optimizer`); both are then scored on every action token.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from stepcredit import advantages as adv
from stepcredit.batch import StepRecord, Trajectory, collate
from stepcredit.diagnose.episodes import Episode, stack
from stepcredit.envs import registry as env_registry
from stepcredit.envs.base import Observation
from stepcredit.models.transformer import count_params
from stepcredit.prompts import PromptTooLongError, build_step_prompt
from stepcredit.rollout import RolloutConfig, action_ids, history_action, step_prompt
from stepcredit.train import update
from stepcredit.train.build import Parts, build, with_fitted_prompt_budget
from stepcredit.train.config import TrainConfig
from stepcredit.train.state import TrainState
from stepcredit.train.rows import (ROW_WIDTH_QUANTUM, RowIndex, StepRowBatch, build_rows,
                                   tokens_from_rows)

# Smaller than the trainer's model (d_model 256, 2 layers), whose full-batch gradient step on
# 256 ALFWorld trajectories takes about 30 s on 2 CPU cores (see `fit_prm`'s docstring).
D_MODEL, NUM_LAYERS, NUM_HEADS = 64, 1, 4
LEARNING_RATE = 1e-3
TRAJECTORIES_PER_STEP = 16
ROWS_QUANTUM = 64  # step rows of a minibatch are padded to a multiple of this
TOKENS_QUANTUM = 32  # the token view's N is padded to a multiple of this


class PRMInputs(NamedTuple):
    """What iStar and PRIME read from an implicit PRM, one row per episode.

    Attributes:
      step_index: `[B, N]` int32, the step of each action token, -1 on padding.
        Row b holds episode b's action tokens, step 0's first, then step 1's...
      prm_logp: `[B, N]` float32 action-token log-probs under the trained PRM (0 on padding).
      ref_logp: `[B, N]` float32, under the reference (the behaviour model; 0 on padding).
      seconds: wall-clock cost of tokenising, training and scoring.
      description: one line for the report (model, optimizer, data, loss, time).
      losses: the preference loss of each optimizer step's minibatch, before that step.
    """

    step_index: np.ndarray
    prm_logp: np.ndarray
    ref_logp: np.ndarray
    seconds: float
    description: str
    losses: tuple[float, ...] = ()


class _Arrays(NamedTuple):
    """One minibatch of whole groups: `[R, L]` step rows and their `[M, N]` token view."""

    tokens: jax.Array
    mask: jax.Array
    row_action_mask: jax.Array
    index_b: jax.Array
    index_n: jax.Array
    action_mask: jax.Array
    step_index: jax.Array
    success: jax.Array
    group_ids: jax.Array


def fit_prm(episodes: Sequence[Episode], *, env_name: str, steps: int = 20, seed: int = 0,
            beta: float = 0.05, learning_rate: float = LEARNING_RATE,
            trajectories_per_step: int | None = TRAJECTORIES_PER_STEP, d_model: int = D_MODEL,
            num_layers: int = NUM_LAYERS, num_heads: int = NUM_HEADS,
            env_kwargs: Mapping[str, Any] | None = None,
            rollout: RolloutConfig | None = None, progress: bool = False) -> PRMInputs:
    """Trains an implicit PRM on the episodes' trajectory preferences and scores their actions.

        pi_prm <- pi_ref;   `steps` times: pi_prm <- Adam step on
        loss(pi_prm) = mean over same-group (won i, lost j) pairs of -log sigmoid(Q_i - Q_j),
        Q(tau) = beta sum_{action tokens n of tau} (log pi_prm(y_n) - log pi_ref(y_n))

    the trainer's `Learner.update_prm` (iStar's trajectory DPO). A trajectory
    succeeds when its score is above 0 (the trainer's and iStar's rule);
    groups are the episodes' (seed, group). steps = 0 gives prm_logp equal to
    ref_logp. `implicit_step_rewards(prm_logp, ref_logp, step_index, T)` then
    gives iStar's step rewards and `prime_token_rewards` PRIME's.

    Each minibatch holds whole groups (at least `trajectories_per_step`
    trajectories' worth when groups allow, never a split group, so every pair
    stays in it); the minibatches cycle in a seeded order. All minibatches are
    padded to one shape, so the gradient step and the scoring compile once.

    Cost (2 shared CPU cores): the gradient step dominates, a backward pass
    over the prompt tokens of every step row of its minibatch, with about 10 s
    to compile it once. At the trainer's model (d_model 256, 2 layers) it costs
    about 0.1 ms a token, so one full-batch step on 256 ALFWorld trajectories
    of 8 steps (2,000 rows of about 130 tokens) takes about 30 s and 20 steps
    ten minutes; hence the smaller defaults, d_model 64, 1 layer, 4 heads, and
    16 trajectories (2 groups of 8) per step. Measured for 20 steps on the 128
    episodes of a default diagnosis (eps = 0.3): WebShop (prompts up to 736
    tokens) 21 s, final loss 0.09 (32 per step: 35 s, 0.06); ALFWorld 13 s,
    0.14 (32 per step: 20 s, 0.11).

    Args:
      episodes: B episodes of `env_name`, each with at least one step.
      env_name: the registered environment they were played on (its tokenizer
        and prompt budget are the trainer's).
      steps: optimizer steps (0: the PRM stays the reference).
      seed: initialises the reference model and orders the minibatches.
      beta: the implicit reward's scale in the loss (iStar `beta_train` 0.05);
        pass the same to the estimators.
      learning_rate: Adam's rate (the trainer's optimizer: AdamW without
        weight decay, global-norm clip 10); the trainer's `prm_learning_rate`
        is 1e-4, for a PRM that takes one step per iteration.
      trajectories_per_step: trajectories per optimizer step (rounded to whole
        groups); None: all of them (the trainer's full-batch step).
      d_model, num_layers, num_heads: the reference model's size (MLP 4 d_model).
      env_kwargs: the environment settings the episodes were sampled with
        (`split`, `difficulty`, `seed`); the episodes are replayed with them to
        recover the admissible actions every prompt lists. None: the defaults.
      rollout: the prompt settings; None: `RolloutConfig()` with the prompt
        budget `stepcredit train` fits to the environment.
      progress: show a progress bar over the optimizer steps.

    Returns:
      `PRMInputs`, `[B, N]` with N the most action tokens of an episode.

    Raises:
      ValueError: `episodes` is empty, an episode has no steps or belongs to
        another environment, an argument is out of range, or an episode does
        not replay under `env_kwargs` (its observations differ).

    References:
      Liu et al., "Agentic RL with Implicit Step Rewards" (iStar), arXiv
      2509.19199, §3; Cui et al., "Process Reinforcement through Implicit
      Rewards" (PRIME), arXiv 2502.01456.

    Notes:
      PRIME trains its PRM with a cross-entropy on each trajectory's outcome;
      here one PRM, the trainer's (iStar's pairwise loss), serves both. Its
      reference is the behaviour model, so iStar's rolling old policy and
      PRIME's reference coincide. An action longer than the rollout's
      `max_action_tokens` is kept whole (a sampling policy would have been cut).

    Example: `fit_prm(episodes, env_name="alfworld", steps=0)` returns
    prm_logp == ref_logp; each step's tokens are contiguous in step order,
    e.g. step_index [[0, 0, 0, 1, 1, -1], [0, 0, 1, 1, 1, 1]].
    """
    tick = time.perf_counter()
    _check_arguments(episodes, env_name, steps, beta, learning_rate, trajectories_per_step)
    config = TrainConfig(env=env_name, estimator="istar", estimator_config=(("beta", beta),),
                         seed=seed, d_model=d_model, num_layers=num_layers, num_heads=num_heads,
                         prm_learning_rate=learning_rate, rollout=rollout or RolloutConfig())
    fitting = prepare_fitting(episodes, config, env_kwargs=env_kwargs,
                              fit_budget=rollout is None,
                              trajectories_per_step=trajectories_per_step)
    parts, state, step_index = fitting.parts, fitting.state, fitting.step_index
    success = np.array([e.score > 0 for e in episodes])
    loss = parts.config.loss
    width = max(loss.action_width or 1, max(len(s.action_ids) for t in fitting.trajectories
                                            for s in t.steps))
    static = dict(graphdef=parts.graphdef, width=width, choice_markers=loss.choice_markers)
    temperature = jnp.float32(loss.temperature)

    ref = [_logprobs(state.policy, b, temperature, **static) for b in fitting.batches]
    prm, opt_state, losses = state.prm, state.prm_opt, []
    for k in tqdm(step_schedule(len(fitting.batches), steps, seed),
                  desc=f"{env_name}: PRM steps", disable=not progress, leave=False):
        prm, opt_state, step_loss = _prm_step(prm, opt_state, fitting.batches[k], ref[k],
                                              jnp.float32(beta), temperature, tx=parts.prm_tx,
                                              **static)
        losses.append(step_loss)
    scored = ([_logprobs(prm, b, temperature, **static) for b in fitting.batches] if steps
              else ref)
    prm_logp = _gather(scored, fitting.members, step_index.shape)
    ref_logp = _gather(ref, fitting.members, step_index.shape)
    losses = [float(x) for x in jax.device_get(losses)]
    final, metrics = adv.trajectory_preference_loss(
        prm_logp, ref_logp, step_index >= 0, step_index, success, fitting.group_ids, beta=beta)
    seconds = time.perf_counter() - tick
    description = (
        f"PRM: {describe_fitting(fitting, steps=steps, learning_rate=learning_rate)}, beta "
        f"{beta:g}; success: score > 0; preference loss {np.log(2):.3f} -> {float(final):.3f} "
        f"over {int(metrics['num_pairs'])} pairs (accuracy {float(metrics['accuracy']):.2f}); "
        f"{seconds:.1f} s")
    return PRMInputs(step_index.astype(np.int32), prm_logp, ref_logp, seconds, description,
                     tuple(losses))


class Fitting(NamedTuple):
    """Episodes made ready for a model fitted on them (the PRM, SPA's progress estimator).

    Attributes:
      parts, state: the run `build` makes of the fitting's `TrainConfig`.
      trajectories: the episodes as trainer records (the trainer's prompt and
        action ids), and `overlong` how many prompts exceeded the budget.
      group_ids: `[B]` the episodes' groups.
      step_index: `[B, N]` the step of each action token of the token view
        (step after step), -1 on padding.
      batches: minibatches of whole groups, all of one shape (`_Arrays`).
      members: the episodes each minibatch holds, in its row order.
    """

    parts: Parts
    state: TrainState
    trajectories: list[Trajectory]
    overlong: int
    group_ids: np.ndarray
    step_index: np.ndarray
    batches: list[_Arrays]
    members: list[np.ndarray]


def prepare_fitting(episodes: Sequence[Episode], config: TrainConfig, *,
                    env_kwargs: Mapping[str, Any] | None, fit_budget: bool,
                    trajectories_per_step: int | None) -> Fitting:
    """Builds `config`'s run (with the trainer's fitted prompt budget when `fit_budget`),
    tokenises the episodes as it would and cuts them into minibatches of whole groups
    (about `trajectories_per_step` trajectories each, None: one), ordered by `config.seed`."""
    if fit_budget:
        config = with_fitted_prompt_budget(config)
    parts, state = build(config)
    rollout = parts.config.rollout
    admissible = _admissible_actions(episodes, config.env, env_kwargs, rollout)
    trajectories, overlong = _trajectories(episodes, admissible, parts.tokenizer, rollout)
    group_ids = stack(episodes).group_ids
    success = np.array([e.score > 0 for e in episodes])
    _, view, _ = collate(trajectories, with_observations=False)
    members = _partition(group_ids, trajectories_per_step,
                         np.random.default_rng([config.seed, 17]))
    batches, members = _minibatches(trajectories, members, group_ids, success,
                                    parts.tokenizer.special.pad, view.step_index.shape[1])
    return Fitting(parts, state, trajectories, overlong, group_ids, view.step_index, batches,
                   members)


def step_schedule(num_batches: int, steps: int, seed: int) -> list[int]:
    """The minibatch of each of `steps` optimizer steps: seeded passes over all of them."""
    order, schedule = np.random.default_rng([seed, 19]), []
    while len(schedule) < steps:
        schedule += order.permutation(num_batches).tolist()
    return schedule[:steps]


def describe_fitting(fitting: Fitting, *, steps: int, learning_rate: float) -> str:
    """The model and data of a fitting in words, for the report."""
    config = fitting.parts.config
    rows = sum(len(t.steps) for t in fitting.trajectories)
    overlong = f", {fitting.overlong} over budget" if fitting.overlong else ""
    return (f"small transformer (d={config.d_model}, L={config.num_layers}, "
            f"{count_params(fitting.state.policy) / 1e3:.0f}k params), {steps} Adam steps at lr "
            f"{learning_rate:g} on {len(fitting.batches)} minibatch(es) of whole groups, on "
            f"{len(fitting.trajectories)} trajectories ({rows} step rows, prompts <= "
            f"{config.rollout.max_prompt_tokens} tokens{overlong})")


def check_episodes(fn: str, episodes: Sequence[Episode], env_name: str, *, steps: int,
                   learning_rate: float, trajectories_per_step: int | None) -> None:
    """Raises `ValueError`, naming `fn`, for episodes or fitting settings it cannot use."""
    if len(episodes) == 0:
        raise ValueError(f"{fn}: episodes is empty; need at least one episode")
    for i, e in enumerate(episodes):
        if e.length == 0:
            raise ValueError(f"{fn}: episodes[{i}] (task {e.task}) has no steps")
        if len(e.observations) != e.length:
            raise ValueError(f"{fn}: episodes[{i}] has {len(e.observations)} observations "
                             f"but {e.length} actions; they must match")
        if e.env != env_name:
            raise ValueError(f"{fn}: episodes[{i}] was played on {e.env!r}, not env_name "
                             f"{env_name!r}")
    if steps < 0:
        raise ValueError(f"{fn}: steps={steps}; it must be >= 0")
    if not learning_rate > 0:
        raise ValueError(f"{fn}: learning_rate={learning_rate}; it must be > 0")
    if trajectories_per_step is not None and trajectories_per_step < 1:
        raise ValueError(f"{fn}: trajectories_per_step={trajectories_per_step}; it must be "
                         ">= 1 or None")


def _check_arguments(episodes, env_name, steps, beta, learning_rate, trajectories_per_step):
    check_episodes("fit_prm", episodes, env_name, steps=steps, learning_rate=learning_rate,
                   trajectories_per_step=trajectories_per_step)
    if not beta > 0:
        raise ValueError(f"fit_prm: beta={beta}; it must be > 0")


def _admissible_actions(episodes, env_name, env_kwargs, rollout: RolloutConfig):
    """Each step's admissible actions, from replaying the episodes (None per step when the
    prompts show none)."""
    if not (rollout.show_admissible or rollout.action_format == "choice"):
        return [[None] * e.length for e in episodes]
    kwargs = dict(env_kwargs or {})
    kwargs["max_steps"] = max(kwargs.get("max_steps", 1), max(e.length for e in episodes))
    env = env_registry.make(env_name, **kwargs)
    out = []
    try:
        for i, e in enumerate(episodes):
            observation, lists = env.reset(e.task), []
            for t, action in enumerate(e.actions):
                if (observation.text, observation.task) != (e.observations[t], e.task_text):
                    raise ValueError(
                        f"fit_prm: episodes[{i}] (task {e.task}) does not replay on {env_name!r} "
                        f"with env_kwargs {dict(env_kwargs or {})}: the "
                        f"{'task' if observation.task != e.task_text else 'observation'} of step "
                        f"{t} differs; pass the env_kwargs the episodes were sampled with")
                lists.append(observation.admissible_actions)
                observation = env.step(action).observation
            out.append(lists)
    finally:
        env.close()
    return out


def _trajectories(episodes, admissible, tokenizer, rollout: RolloutConfig):
    """The episodes as trajectories of step records with the trainer's prompt and action ids,
    and how many prompts exceeded the budget even without history (shown minimal)."""
    trajectories, overlong = [], 0
    for e, lists in zip(episodes, admissible):
        history, records = [], []
        for t, action in enumerate(e.actions):
            observation = Observation(e.observations[t], lists[t], None, e.task_text)
            try:
                prompt = step_prompt(tokenizer, rollout, observation, history).ids
            except PromptTooLongError:  # what the budget would keep, were it large enough
                prompt = build_step_prompt(tokenizer, task=e.task_text,
                                           observation=observation.text, max_tokens=1 << 30).ids
                overlong += 1
            ids = action_ids(tokenizer, action, lists[t], rollout.action_format)
            ids = ids + [tokenizer.special.eoa]
            if rollout.constrained:
                ids = ids[:rollout.action_length]
            history.append((observation.text, history_action(rollout, action, ids)))
            records.append(StepRecord(observation_ids=(), action_ids=ids,
                                      action_logp=[0.0] * len(ids), reward=float(e.rewards[t]),
                                      prompt_ids=prompt))
        trajectories.append(Trajectory(records, score=float(e.score)))
    return trajectories, overlong


def _partition(group_ids: np.ndarray, size: int | None, rng: np.random.Generator):
    """Episode indices of each minibatch: whole groups, in seeded order, about `size` each."""
    if size is None or size >= len(group_ids):
        return [np.arange(len(group_ids))]
    out, current = [], []
    for g in rng.permutation(int(group_ids.max()) + 1):
        group = np.flatnonzero(group_ids == g).tolist()
        if current and len(current) + len(group) > size:
            out.append(np.array(current))
            current = []
        current += group
    return out + [np.array(current)]


def _minibatches(trajectories, members, group_ids, success, pad_id: int, num_tokens: int):
    """One `_Arrays` per minibatch, all of one shape, and for each the episodes it holds."""
    num_steps = max(len(t.steps) for t in trajectories)
    longest = max(len(s.prompt_ids) + len(s.action_ids) for t in trajectories for s in t.steps)
    length = -(-longest // ROW_WIDTH_QUANTUM) * ROW_WIDTH_QUANTUM
    count = max(sum(len(trajectories[i].steps) for i in m) for m in members)
    count = -(-count // ROWS_QUANTUM) * ROWS_QUANTUM
    width = -(-max(len(m) for m in members) // 8) * 8
    num_tokens = -(-num_tokens // TOKENS_QUANTUM) * TOKENS_QUANTUM
    batches = []
    for m in members:
        chosen = [trajectories[i] for i in m]
        rows, index = build_rows(chosen, num_steps=num_steps, row_length=length, pad_id=pad_id,
                                 multiple=count)
        rows, index = _pad_rows(rows, index, length, pad_id)
        _, view, _ = collate(chosen, max_steps=num_steps, max_tokens=num_tokens,
                             with_observations=False)
        extra = width - len(m)
        pad = lambda x, fill: np.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1),  # noqa: E731
                                     constant_values=fill)
        # Dense ids within the minibatch; padding trajectories have no tokens, so form no pair.
        _, dense = np.unique(group_ids[m], return_inverse=True)
        batches.append(_Arrays(
            tokens=rows.tokens, mask=rows.mask, row_action_mask=rows.action_mask,
            index_b=index.b, index_n=index.n, action_mask=pad(view.action_mask, False),
            step_index=pad(view.step_index, -1), success=pad(success[m], False),
            group_ids=pad(dense.astype(np.int32), 0)))
    return [jax.tree.map(jnp.asarray, b) for b in batches], members


def _pad_rows(rows: StepRowBatch, index: RowIndex, length: int, pad_id: int):
    extra = length - rows.tokens.shape[1]
    pad = lambda x, fill=0: np.pad(x, ((0, 0), (0, extra)), constant_values=fill)  # noqa: E731
    rows = rows._replace(tokens=pad(rows.tokens, pad_id), mask=pad(rows.mask),
                         action_mask=pad(rows.action_mask))
    return rows, RowIndex(pad(index.b), pad(index.n))


def _token_view(params, batch: _Arrays, temperature, *, graphdef, width, choice_markers):
    """`[M, N]` action-token log-probs of the minibatch under `params` (the trainer's scoring)."""
    scores = update.score(params, batch.tokens, batch.mask, batch.row_action_mask, temperature,
                          graphdef=graphdef, choice_markers=choice_markers, width=width)
    return tokens_from_rows(scores.logprobs, RowIndex(batch.index_b, batch.index_n),
                            batch.row_action_mask, batch.action_mask.shape)


_logprobs = jax.jit(_token_view, static_argnames=("graphdef", "width", "choice_markers"))


@functools.partial(jax.jit, static_argnames=("graphdef", "tx", "width", "choice_markers"))
def _prm_step(prm, opt_state, batch: _Arrays, ref_logp, beta, temperature, *, graphdef, tx,
              width, choice_markers):
    """One optimizer step of the trainer's preference loss; returns (prm, opt_state, loss)."""
    def loss_fn(params):
        view = _token_view(params, batch, temperature, graphdef=graphdef, width=width,
                           choice_markers=choice_markers)
        return adv.trajectory_preference_loss(view, ref_logp, batch.action_mask,
                                              batch.step_index, batch.success, batch.group_ids,
                                              beta=beta)

    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(prm)
    updates, opt_state = tx.update(grads, opt_state, prm)
    return optax.apply_updates(prm, updates), opt_state, loss


def _gather(views, members, shape) -> np.ndarray:
    """The minibatches' `[M, N']` views as one `[B, N]` array in episode order."""
    out = np.zeros(shape, np.float32)
    for view, m in zip(jax.device_get(views), members):
        out[m] = view[:len(m), :shape[1]]
    return out
