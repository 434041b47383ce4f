"""A trained run as a behaviour policy and as a value source for the diagnosis.

`load_run(logdir)` restores the newest intact checkpoint of a run that
`stepcredit train --logdir` wrote (the same `build` and
`Checkpointer.restore_intact` that `Trainer.restore` and `stepcredit eval`
use). On it:

  - `CheckpointPolicy`: the run's policy restricted to the admissible actions,
    a `Policy` the diagnosis can play and replay from snapshots. With
    log pi(a | s) = sum_n log pi(a_n | s, a_<n) the sequence log-probability
    of action a's ids (and `<eoa>`, where the policy must emit it) after the
    step prompt the rollout builds,

        pi_T(a | s) = exp(log pi(a | s) / T) / sum_{a' in A(s)} exp(log pi(a' | s) / T),

    A(s) the observation's admissible actions, T the temperature (default:
    the run's sampling temperature, 1 for a greedy run).
  - `checkpoint_values`: the run's value head V(s_t) at each step of
    diagnosis episodes, a third value source beside "zero" and "table".
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stepcredit.diagnose.episodes import Episode
from stepcredit.envs.base import Observation
from stepcredit.models.tokenizer import WordTokenizer
from stepcredit.models.transformer import forward, pack_rows
from stepcredit.rollout import PROMPT_WIDTH_QUANTUM, action_ids, history_action, step_prompt
from stepcredit.train.checkpoint import CheckpointError, Checkpointer
from stepcredit.train.config import TrainConfig
from stepcredit.train.update import score

VALUE_CHUNK = 32
"""The most prompts `checkpoint_values` scores in one call."""


class LoadedRun(NamedTuple):
    """A run restored from its log directory.

    Attributes:
      logdir: the run directory.
      config: its resolved `TrainConfig` (config.json).
      tokenizer: its tokenizer.
      graphdef: the policy's static graph.
      params: the policy's restored parameters (value head included).
      iteration: the next iteration the run would train (the checkpoint's step).
    """

    logdir: str
    config: TrainConfig
    tokenizer: WordTokenizer
    graphdef: nnx.GraphDef
    params: Any
    iteration: int


def load_run(logdir: str | os.PathLike, *, note: Callable[[str], None] = print) -> LoadedRun:
    """Restores the newest intact checkpoint of the run in `logdir`.

    Args:
      logdir: the `--logdir` of `stepcredit train` (config.json, tokenizer.json,
        checkpoints/).
      note: where a damaged checkpoint is reported (it is moved aside and the
        one before is used, `Checkpointer.restore_intact`).

    Raises:
      ValueError: no config.json in `logdir`, or its tokenizer.json differs
        from the one the environment gives now (the ids would be misread).
      CheckpointError (a ValueError): no checkpoint, or every one is damaged.
    """
    from stepcredit.train.build import build

    logdir = os.fspath(logdir)
    config_path = os.path.join(logdir, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"load_run: {config_path} not found; it takes the run directory that "
                         f"`stepcredit train --logdir` wrote")
    with open(config_path, encoding="utf-8") as f:
        parts, state = build(TrainConfig.from_json(f.read()))
    tokenizer_path = os.path.join(logdir, "tokenizer.json")
    if os.path.exists(tokenizer_path) and WordTokenizer.load(tokenizer_path) != parts.tokenizer:
        raise ValueError(f"load_run: {tokenizer_path} differs from the tokenizer of "
                         f"{parts.config.env!r} now; the checkpoint's token ids would be misread")
    directory = os.path.join(logdir, "checkpoints")
    if not os.path.isdir(directory):
        raise CheckpointError(f"no checkpoint in {directory}: the run saved none")
    checkpointer = Checkpointer(directory)
    try:
        step, tree = checkpointer.restore_intact(state.as_tree(), note=note)
    finally:
        checkpointer.close()
    return LoadedRun(logdir, parts.config, parts.tokenizer, parts.graphdef, tree["policy"],
                     int(step))


def _emitted_ids(run: LoadedRun, action: str, admissible: Sequence[str] | None) -> list[int]:
    """The ids the rollout samples to take `action`: its output ids, then `<eoa>`
    unless they fill the action budget (generation stops there and the output
    is parsed as it is). Longer outputs cannot be sampled: returned whole."""
    rollout = run.config.rollout
    ids = action_ids(run.tokenizer, action, admissible, rollout.action_format)
    return ids + [run.tokenizer.special.eoa] if len(ids) < rollout.action_length else ids


def _prompt_history(run: LoadedRun, history: Sequence[tuple[str, str]]) -> list[tuple[str, Any]]:
    """The diagnosis's (observation, action text) pairs as the rollout keeps them: the
    sampled ids of each action (the choice format: its text; `history_action`)."""
    rollout = run.config.rollout
    return [(text, history_action(rollout, action,
                                  _emitted_ids(run, action, None)[:rollout.action_length]
                                  if rollout.action_format != "choice" else ()))
            for text, action in history]


def _bucket(n: int, *, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    return 1 << (max(n, least) - 1).bit_length()


def _width(longest: int, budget: int) -> int:
    """`longest` rounded up to the prompt width quantum, at most `budget`."""
    return min(budget, -(-longest // PROMPT_WIDTH_QUANTUM) * PROMPT_WIDTH_QUANTUM)


def action_logprobs(run: LoadedRun, prompt_ids: Sequence[int],
                    actions: Sequence[Sequence[int]]) -> np.ndarray:
    """`[K]` sequence log-probabilities sum_n log pi(a_n | prompt, a_<n) at temperature 1.

    All K candidates go through one call of the learner's scoring function
    (`update.score`), padded to a power-of-two batch and a width quantum, so
    states of similar length share one compilation. A candidate longer than
    the action budget cannot be sampled: -inf.
    """
    rollout, loss = run.config.rollout, run.config.loss
    length = rollout.action_length
    fits = np.array([len(ids) <= length for ids in actions])
    candidates = [list(ids)[:length] for ids in actions]
    batch = _bucket(len(candidates), least=2)
    candidates += [candidates[0]] * (batch - len(candidates))
    width = _width(len(prompt_ids) + max(map(len, candidates)), rollout.max_prompt_tokens + length)
    packed = pack_rows([prompt_ids] * batch, candidates, length=width,
                       pad_id=run.tokenizer.special.pad)
    scores = score(run.params, jnp.asarray(packed.tokens), jnp.asarray(packed.mask),
                   jnp.asarray(packed.action_mask), jnp.float32(1.0), graphdef=run.graphdef,
                   choice_markers=loss.choice_markers, width=length)
    summed = np.asarray(jax.device_get(scores.logprobs), np.float64)[:len(actions)].sum(axis=1)
    return np.where(fits, summed, -np.inf)


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


class CheckpointPolicy:
    """A trained run's policy restricted to the admissible actions (module doc).

    The real policy may also emit text outside the admissible list (an invalid
    action, unless the run constrains choices); this one renormalises its
    probabilities over the list, so it always acts validly and its entropy is
    that of the restricted distribution. For single-token actions (the choice
    format) pi_T is the rollout's sampling distribution at temperature T; for
    multi-token actions the temperature divides the sequence log-probability
    (sequence-level tempering, not the per-token tempering of sampling; equal
    at T = 1).

    Each state's log-probabilities are cached by (prompt ids, admissible
    actions), so Monte Carlo replays that revisit a state cost no model call.
    Build it with `CheckpointPolicy.load(logdir)` or from a `LoadedRun`.
    """

    def __init__(self, run: LoadedRun, *, temperature: float | None = None):
        if temperature is None:
            temperature = run.config.loss.temperature  # the rollout's, 1 for a greedy run
        if not temperature > 0:
            raise ValueError(f"CheckpointPolicy: temperature must be > 0, got {temperature}")
        self.run = run
        self.temperature = float(temperature)
        self.label = f"checkpoint:{os.path.basename(os.path.normpath(run.logdir))}"
        self._cache: dict[tuple, np.ndarray] = {}

    @classmethod
    def load(cls, logdir: str | os.PathLike, *, temperature: float | None = None,
             note: Callable[[str], None] = print) -> "CheckpointPolicy":
        """The policy of the newest intact checkpoint in `logdir` (`load_run`)."""
        return cls(load_run(logdir, note=note), temperature=temperature)

    def deviation(self, env: Any, rng: np.random.Generator) -> int:
        return -1

    def logprobs(self, observation: Observation, history: Sequence[tuple[str, str]]) -> np.ndarray:
        """`[K]` log pi(a | s) at temperature 1 of the K admissible actions (cached)."""
        actions = tuple(observation.admissible_actions or ())
        if not actions:
            raise ValueError(f"CheckpointPolicy: the observation lists no admissible actions "
                             f"({observation.text[:60]!r}); this policy chooses among them")
        prompt = step_prompt(self.run.tokenizer, self.run.config.rollout, observation,
                             _prompt_history(self.run, history))
        key = (tuple(prompt.ids), actions)
        logp = self._cache.get(key)
        if logp is None:
            candidates = [_emitted_ids(self.run, a, actions) for a in actions]
            logp = self._cache[key] = action_logprobs(self.run, prompt.ids, candidates)
            if not np.isfinite(logp).any():
                raise ValueError(f"CheckpointPolicy: every admissible action is longer than the "
                                 f"run's {self.run.config.rollout.action_length}-token action "
                                 f"budget; the policy can sample none of {list(actions)[:3]}")
        return logp.copy()

    def distribution(self, env: Any, observation: Observation,
                     history: Sequence[tuple[str, str]], step: int,
                     deviation: int) -> tuple[tuple[str, ...], np.ndarray]:
        """The admissible actions and pi_T over them (float64, summing to 1)."""
        logp = self.logprobs(observation, history)
        return tuple(observation.admissible_actions), _softmax(logp / self.temperature)

    baseline = distribution


def _replayed(env: Any, episode: Episode, index: int) -> list[Observation]:
    """The observations of `episode` (admissible lists included) replayed on `env`."""
    observations = [env.reset(episode.task)]
    for action in episode.actions[:-1]:
        observations.append(env.step(action).observation)
    for t, (seen, recorded) in enumerate(zip(observations, episode.observations)):
        if seen.text != recorded:
            at = next((i for i, (a, b) in enumerate(zip(seen.text, recorded)) if a != b),
                      min(len(seen.text), len(recorded)))
            raise ValueError(f"checkpoint_values: episode {index} (task {episode.task}) replayed "
                             f"on {env.name!r} differs at step {t}, character {at}: "
                             f"{seen.text[at:at + 30]!r} where it recorded "
                             f"{recorded[at:at + 30]!r}; pass env=, the simulator it was "
                             f"played on")
    return observations


def _observations(run: LoadedRun, episodes: Sequence[Episode], env: Any) -> list[list]:
    """Each step's `Observation`: replayed when the prompts list admissible actions
    (an `Episode` does not record them), else from the recorded texts."""
    rollout = run.config.rollout
    if rollout.action_format != "choice" and not rollout.show_admissible:
        return [[Observation(text, None, None, e.task_text) for text in e.observations]
                for e in episodes]
    from stepcredit.envs import registry

    made: dict[str, Any] = {}
    try:
        out = []
        for i, e in enumerate(episodes):
            simulator = env
            if simulator is None:
                if e.env not in made:
                    made[e.env] = registry.make(e.env)
                simulator = made[e.env]
            out.append(_replayed(simulator, e, i))
        return out
    finally:
        for simulator in made.values():
            simulator.close()


def checkpoint_values(run: LoadedRun | CheckpointPolicy | str | os.PathLike,
                      episodes: Sequence[Episode], *, env: Any = None) -> list[np.ndarray]:
    """`[T]` float64 V(s_t) of each episode's steps from the run's value head.

    V(s_t) is the critic at the last token of step t's prompt (the value at
    the step's first action token, `stepcredit.advantages.inputs`), the
    prompt built as the rollout builds it from the task, the episode's
    earlier (observation, action) pairs and the current observation.

    Args:
      run: a `LoadedRun`, a `CheckpointPolicy` or a run directory.
      episodes: diagnosis episodes (`Episode`).
      env: the simulator the episodes were played on. An `Episode` does not
        record admissible lists; when the run's prompts show them, each
        episode is replayed (reset to its task, its actions taken) to recover
        them, on `env` or, when None, on the default simulator of the
        episode's env. Every replayed observation must equal the recorded one.

    Returns:
      One `[T]` float64 array per episode (as `step_values`).

    Raises:
      ValueError: a replay does not reproduce an episode's observations, or
        the run cannot be loaded (`load_run`).
    """
    if isinstance(run, CheckpointPolicy):
        run = run.run
    elif not isinstance(run, LoadedRun):
        run = load_run(run)
    if not episodes:
        return []
    observations = _observations(run, episodes, env)
    prompts = [step_prompt(run.tokenizer, run.config.rollout, obs[t],
                           _prompt_history(run, list(zip(e.observations[:t], e.actions[:t])))).ids
               for e, obs in zip(episodes, observations) for t in range(e.length)]
    values, budget = np.empty(len(prompts)), run.config.rollout.max_prompt_tokens
    for start in range(0, len(prompts), VALUE_CHUNK):
        chunk = prompts[start:start + VALUE_CHUNK]
        batch = _bucket(len(chunk))
        packed = pack_rows(chunk + [chunk[0]] * (batch - len(chunk)),
                           length=_width(max(map(len, chunk)), budget),
                           pad_id=run.tokenizer.special.pad, side="left")
        _, state_values = forward(run.graphdef, run.params, jnp.asarray(packed.tokens),
                                  jnp.asarray(packed.mask))
        values[start:start + len(chunk)] = np.asarray(state_values[:len(chunk), -1])
    ends = np.cumsum([e.length for e in episodes])[:-1]
    return [v.astype(np.float64) for v in np.split(values, ends)]
