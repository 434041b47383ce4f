"""Episodes of a chat model in a stepcredit environment, as token-exact step records.

A group of G episodes of one task is played in lockstep: at each step every
live episode's chat (`chat.step_messages`: task, a window of the last
(observation, action) pairs, the observation, the admissible actions) is
rendered by the tokenizer's chat template, one `generate.sample` call draws
all their answers, and each answer's action (`chat.parse_action`) goes to its
environment; an unparseable answer is sent as it is, and the environment
answers it as an invalid action. Each step is stored as a `StepRecord` whose
`prompt_ids` and `action_ids` are exactly the ids the model was conditioned on
and sampled, with the sampler's log-probs: training rows need no re-tokenizing.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from stepcredit.batch import StepRecord, Trajectory
from stepcredit.envs.base import Env, Observation
from stepcredit.keys import stable_key
from stepcredit.llm import chat, generate
from stepcredit.llm.checkpoint import Checkpoint


def _text(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def play_group(checkpoint: Checkpoint, make_env: Callable[[], Env], task: Any, *, group_size: int,
               group_id: int = 0, seed: int, max_new_tokens: int = 64, temperature: float = 1.0,
               window: int = 4, max_steps: int | None = None,
               invalid_action_penalty: float = 0.0) -> list[Trajectory]:
    """Plays `group_size` episodes of `task`, one environment each, sampling every step in one call.

    Args:
      checkpoint: the policy (`checkpoint.load`).
      make_env: a new environment per episode.
      task: the task given to every episode's `reset`.
      group_size: G, the episodes of the group.
      group_id: the trajectories' group id.
      seed: the group's seed; step t samples with seed `seed * 1_000_003 + t`.
      max_new_tokens: the most tokens of one answer.
      temperature: the sampling temperature (0: greedy).
      window: history pairs shown in each prompt.
      max_steps: a step limit below the environment's own, or None.
      invalid_action_penalty: subtracted from a step's reward when the
        environment marks its action invalid (as the word-level rollout does).

    Returns:
      G `Trajectory`s (see `play`).
    """
    if group_size < 1:
        raise ValueError(f"play_group: group_size={group_size}; it must be >= 1")
    envs = [make_env() for _ in range(group_size)]
    try:
        observations = [env.reset(task) for env in envs]
        return play(checkpoint, envs, observations, [()] * group_size, group_ids=[group_id] * group_size,
                    seed=seed, max_new_tokens=max_new_tokens, temperature=temperature, window=window,
                    max_steps=max_steps, invalid_action_penalty=invalid_action_penalty)
    finally:
        for env in envs:
            env.close()


def play(checkpoint: Checkpoint, envs: Sequence[Env], observations: Sequence[Observation],
         histories: Sequence[Sequence[tuple[str, str]]], *, group_ids: Sequence[int], seed: int,
         max_new_tokens: int = 64, temperature: float = 1.0, window: int = 4,
         max_steps: int | None = None, invalid_action_penalty: float = 0.0) -> list[Trajectory]:
    """Plays one episode in each of `envs` from the state it is in, in lockstep (one sampling
    call per step for all live episodes); the caller owns and closes the environments.

    Args:
      envs, observations: the environments and what each shows now (after a
        `reset`, or a `restore` of a state reached mid-episode).
      histories: each episode's (observation, action) pairs so far, as its
        prompts show them (empty at an episode's start).
      group_ids: each trajectory's group id.
      seed, max_new_tokens, temperature, window, max_steps,
        invalid_action_penalty: as `play_group`'s.

    Returns:
      A `Trajectory` per environment, scored by the sum of its rewards (as
      the word-level rollout's), with the task's `answer` where the
      environment gives a `reference_answer()` (never shown to the model);
      each step's `info` holds the environment's info plus `text` (the
      model's answer), `action` (what the environment received: the parsed
      action, or the answer itself when it did not parse) and `parse_error`
      (None when it parsed), and the last step of an episode cut by a limit
      `next_prompt_ids`, the prompt of the state it was cut in (a critic's
      bootstrap V(s_next)).
    """
    tokenizer = checkpoint.tokenizer
    observations = list(observations)
    histories = [list(history) for history in histories]
    steps: list[list[StepRecord]] = [[] for _ in envs]
    live = list(range(len(envs)))
    limit = min(env.max_steps for env in envs) if max_steps is None else max_steps

    def prompt(observation: Observation, history) -> list[int]:
        return chat.prompt_ids(tokenizer, chat.step_messages(
            task=observation.task, observation=observation.text, history=history,
            admissible=observation.admissible_actions, window=window))

    for t in range(limit):
        if not live:
            break
        prompts = [prompt(observations[i], histories[i]) for i in live]
        samples = generate.sample(checkpoint, prompts, max_new_tokens=max_new_tokens,
                                  seed=seed * 1_000_003 + t, temperature=temperature,
                                  stop_ids=[tokenizer.eos_token_id])
        still = []
        for i, prompt_ids, ids, logprobs in zip(live, prompts, samples.ids, samples.logprobs):
            text = _text(tokenizer, ids)
            parsed = chat.parse_action(text, observations[i].admissible_actions)
            action = parsed.action if parsed.action is not None else text
            result = envs[i].step(action)
            steps[i].append(StepRecord(
                observation_ids=tokenizer.encode(observations[i].text, add_special_tokens=False),
                action_ids=[int(x) for x in ids], action_logp=[float(x) for x in logprobs],
                reward=float(result.reward) - (0.0 if result.info.get("valid", True)
                                               else invalid_action_penalty),
                done=result.done,
                truncated=result.truncated or (t == limit - 1 and not result.done),
                anchor=stable_key(observations[i].anchor), prompt_ids=list(prompt_ids),
                info={**result.info, "text": text, "action": action, "parse_error": parsed.error}))
            histories[i].append((observations[i].text, action))
            observations[i] = result.observation
            if steps[i][-1].truncated:  # a critic bootstraps from V(s_next): keep s_next's prompt
                steps[i][-1].info["next_prompt_ids"] = prompt(result.observation, histories[i])
            if not (result.done or result.truncated):
                still.append(i)
        live = still
    answers = [env.reference_answer() if callable(getattr(env, "reference_answer", None)) else None
               for env in envs]
    return [Trajectory(steps=tuple(episode), group_id=group_id, score=sum(s.reward for s in episode),
                       answer=answer) for episode, group_id, answer in zip(steps, group_ids, answers)]


__all__: Sequence[str] = ("play", "play_group")
