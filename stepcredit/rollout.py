"""Where a model meets an environment: step-level rollouts with exact tokens.

Each agent step is one transition (the Agent-R1 step MDP, arXiv 2511.14460):
the environment side builds the step's prompt from the task, a window of past
(observation, action) pairs and the current observation; the policy samples an
action with a KV cache; the decoded text goes to the environment, while the
trajectory keeps the sampled ids, their log-probs and entropies, and the value
V(s_t) at the step's start. Training therefore never re-tokenises.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from stepcredit.batch import StepRecord, Trajectory
from stepcredit.envs.base import Observation
from stepcredit.envs.pool import EnvPool
from stepcredit.keys import stable_key
from stepcredit.models.generate import generate
from stepcredit.models.sharing import shared_prompts
from stepcredit.models.tokenizer import Tokenizer
from stepcredit.models.transformer import label_slots, pack_rows, prompt_values
from stepcredit.prompts import build_step_prompt, prompt_metrics


class ActionParseError(ValueError):
    """The model's output holds no action in the expected format."""


def parse_text(output: str, admissible: Sequence[str] | None = None) -> str:
    """The whole output is the action (the default for the small policy)."""
    return output.strip()


def parse_tags(output: str, admissible: Sequence[str] | None = None) -> str:
    """The action between `<action>` and `</action>`, after an optional `<think>` block (verl-agent)."""
    match = re.search(r"<action>(.*?)</action>", output, flags=re.DOTALL)
    if match is None:
        raise ActionParseError(f"no <action>...</action> in the output {output[:80]!r}")
    return match.group(1).strip()


def parse_react(output: str, admissible: Sequence[str] | None = None) -> str:
    """The text after the last `Action:` line (ReAct)."""
    matches = re.findall(r"^\s*Action:\s*(.+?)\s*$", output, flags=re.MULTILINE)
    if not matches:
        raise ActionParseError(f"no 'Action:' line in the output {output[:80]!r}")
    return matches[-1]


def parse_choice(output: str, admissible: Sequence[str] | None = None) -> str:
    """The admissible action whose 1-based number the output names.

    A small policy trained from scratch learns to pick from the numbered list
    far sooner than to spell actions out; the environment still receives the
    action's text.
    """
    if not admissible:
        raise ActionParseError("the environment lists no admissible actions to choose from")
    text = output.strip()
    if not text.isdigit() or not 1 <= int(text) <= len(admissible):
        raise ActionParseError(f"{text[:20]!r} is not a number in [1, {len(admissible)}]")
    return admissible[int(text) - 1]


ACTION_PARSERS: dict[str, Callable[[str, Sequence[str] | None], str]] = {
    "text": parse_text, "tags": parse_tags, "react": parse_react, "choice": parse_choice}


def render_action(action: str, admissible: Sequence[str] | None, action_format: str) -> str:
    """The output that `ACTION_PARSERS[action_format]` parses back to `action` (for demonstrations)."""
    if action_format == "choice":
        if not admissible or action not in admissible:
            raise ValueError(f"render_action: {action!r} is not among the admissible actions")
        return str(list(admissible).index(action) + 1)
    if action_format == "tags":
        return f"<action>{action}</action>"
    if action_format == "react":
        return f"Action: {action}"
    return action


def action_ids(tokenizer: Tokenizer, action: str, admissible: Sequence[str] | None,
               action_format: str) -> list[int]:
    """The ids a policy outputs to take `action` (without `<eoa>`), e.g. for demonstrations.

    Under "choice" that is the one choice token of the action's number (the
    prompt labels the admissible actions with them); otherwise the encoded
    `render_action` text.
    """
    text = render_action(action, admissible, action_format)
    if action_format == "choice":
        return [tokenizer.special.choices[int(text) - 1]]
    return tokenizer.encode(text)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How the policy acts.

    Attributes:
      max_prompt_tokens: P, the step prompt budget (oldest history dropped
        first, counted in the metrics).
      max_action_tokens: M, the most tokens sampled per action.
      history_window: k, the (observation, action) pairs shown in a prompt.
      action_window: j, the earlier actions shown before those pairs without
        their observations (`build_step_prompt`): a cheap memory of what was
        done, such as the receptacles already searched.
      show_admissible: list the admissible actions in the prompt when the
        environment gives them.
      temperature: sampling temperature (<= 0: greedy).
      action_format: "text", "tags" (`<action>...</action>`), "react" (an
        `Action:` line) or "choice" (the number of an admissible action; the
        prompt labels the k-th with the tokenizer's choice token `<k>`).
      constrain_choice: with "choice", the policy samples one token among the
        choice tokens on offer (action masking over the admissible actions, as
        text-game agents choose among valid commands), so no output is
        malformed, and points at the label it picks
        (`TransformerPolicy.choice_logits`); False lets it emit any tokens from
        its language-model head, and malformed outputs are invalid actions.
      invalid_action_penalty: subtracted from a step's reward when the
        environment marks its action invalid (0.1 in the GiGPO, iStar and
        StepPO scripts; set here, in the trainer, not in the environment).
      bootstrap_truncated: a trajectory cut by the step limit ends with the
        value of the next state, V(s_next) (the limit only stops
        the collection, so the return goes on past it); False ends it with 0,
        as a failure, for tasks
        whose step limit is part of the task and judged by it ("Time Limits
        in Reinforcement Learning", arXiv 1712.00378). Bootstrapping then
        values running out the clock at V(s_next), above a wrong answer's 0.
    """

    max_prompt_tokens: int = 160
    max_action_tokens: int = 12
    history_window: int = 1
    action_window: int = 0
    show_admissible: bool = True
    temperature: float = 1.0
    action_format: str = "text"
    constrain_choice: bool = True
    invalid_action_penalty: float = 0.1
    bootstrap_truncated: bool = True

    def __post_init__(self):
        if self.action_format not in ACTION_PARSERS:
            raise ValueError(f"RolloutConfig: action_format={self.action_format!r}; expected one "
                             f"of {tuple(ACTION_PARSERS)}")
        if self.history_window < 0 or self.action_window < 0:
            raise ValueError(f"RolloutConfig: history_window={self.history_window} and "
                             f"action_window={self.action_window} must be >= 0")
        if self.max_prompt_tokens < 4 or self.max_action_tokens < 1:
            raise ValueError(f"RolloutConfig: max_prompt_tokens={self.max_prompt_tokens} and "
                             f"max_action_tokens={self.max_action_tokens} are too small")
        for name in ("temperature", "invalid_action_penalty"):
            value = getattr(self, name)
            finite = (isinstance(value, (int, float)) and not isinstance(value, bool)
                      and math.isfinite(value))
            if not finite:
                raise ValueError(f"RolloutConfig: {name}={value!r}; it must be a finite number")

    @property
    def constrained(self) -> bool:
        """True when actions are single choice tokens drawn from those on offer."""
        return self.action_format == "choice" and self.constrain_choice

    @property
    def action_length(self) -> int:
        """The most tokens one action takes (1 under the choice constraint)."""
        return 1 if self.constrained else self.max_action_tokens


def choice_markers(tokenizer: Tokenizer, config: RolloutConfig) -> tuple[int, ...]:
    """The marker ids that follow choosable ids under `config` (() when unconstrained).

    The prompt lists admissible actions as "<adm> ... <1> <sep> ... <2> <sep>", so
    the ids before `<sep>` are the choice tokens on offer.
    """
    return (tokenizer.special.sep,) if config.constrained else ()


class Rollout(NamedTuple):
    """The trajectories of one collection and what happened while collecting."""

    trajectories: list[Trajectory]
    metrics: dict[str, float]


def history_action(config: RolloutConfig, action: str, ids: Sequence[int]) -> str | Sequence[int]:
    """How a taken action appears in later prompts: the sampled `ids` (no
    re-tokenization), except that a "choice" label becomes the chosen `action`'s
    text, since the list that gave the label its meaning is not shown again (a
    malformed output, with no action, stays as its ids)."""
    return action if config.action_format == "choice" and action else ids


def step_prompt(tokenizer: Tokenizer, config: RolloutConfig, observation: Observation,
                history: Sequence[tuple[str, str | Sequence[int]]]):
    """The step's prompt as the policy sees it under `config` (see `build_step_prompt`)."""
    choice = config.action_format == "choice"
    admissible = observation.admissible_actions
    if choice:
        admissible = admissible or ()
    elif not config.show_admissible:
        admissible = None
    return build_step_prompt(tokenizer, task=observation.task, observation=observation.text,
                             history=history, admissible_actions=admissible,
                             window=config.history_window, action_window=config.action_window,
                             max_tokens=config.max_prompt_tokens, choice_labels=choice)


PROMPT_WIDTH_QUANTUM = 64
"""Prompt batches are padded to the longest prompt rounded up to this (at most the
budget): short early-episode prompts skip most of the prefill, and a budget of P
tokens compiles at most P / 64 generation shapes."""


def _left_padded(tokenizer: Tokenizer, prompts: Sequence[Sequence[int] | None], budget: int):
    filler = [tokenizer.special.bos]  # finished rows still take part in the static-shape call
    longest = max((len(p) for p in prompts if p is not None), default=1)
    length = min(budget, -(-longest // PROMPT_WIDTH_QUANTUM) * PROMPT_WIDTH_QUANTUM)
    rows = pack_rows([p if p is not None else filler for p in prompts], length=length,
                     pad_id=tokenizer.special.pad, side="left")
    return rows.tokens, rows.mask


def _shared(tokens, mask, share: bool):
    # Host arrays: a one-token generation splits its passes on the host, and jit takes them.
    return shared_prompts(tokens, mask) if share else None


def collect(graphdef, state, pool: EnvPool, tasks: Sequence[Any], group_size: int,
            tokenizer: Tokenizer, key: jax.Array, config: RolloutConfig, *,
            history: Sequence[Sequence[tuple[str, str | Sequence[int]]]] | None = None,
            share_prompts: bool = True) -> Rollout:
    """Plays one episode per environment of `pool`, G per task, and records every step.

    Args:
      graphdef, state: the policy, from `nnx.split(model)`.
      pool: B = len(tasks) * group_size environments (its step limit applies).
      tasks: one task per group.
      group_size: G.
      tokenizer: turns prompts into ids and sampled ids into action text.
      key: PRNG key for sampling.
      config: a `RolloutConfig`.
      history: per environment, the (observation, action) pairs its episode
        already holds when its `reset` resumes one mid-way (continuations
        from a visited state, `stepcredit.train.vine`); None: fresh episodes.
      share_prompts: equal prompts of a step (a group's first step, the
        policy's repeated choices, finished episodes' filler) take one prompt
        pass (`stepcredit.models.sharing.shared_prompts`); each row still
        samples its own action.

    Returns:
      A `Rollout`: one `Trajectory` per environment (group id = task index in
      `tasks`; steps with prompt ids, sampled ids, log-probs, entropies,
      V(s_t), reward after the invalid-action penalty, done, truncated, anchor
      key and the environment's info, with the action text it received under
      "action") and metrics (success, score, steps per
      episode, invalid-action rate, action types, entropy, prompt policy
      counts, throughput).
    """
    parse = ACTION_PARSERS[config.action_format]
    special = tokenizer.special
    started = time.perf_counter()
    observations = pool.reset_groups(list(tasks), group_size)
    batch = len(observations)
    steps: list[list[StepRecord]] = [[] for _ in range(batch)]
    histories: list[list[tuple[str, str | list[int]]]] = (
        [[] for _ in range(batch)] if history is None else [list(h) for h in history])
    final_info: list[dict] = [{} for _ in range(batch)]
    all_prompts, generated_tokens, action_types = [], 0, {}
    model_seconds = 0.0
    while any(pool.running):
        running = pool.running
        prompts = [step_prompt(tokenizer, config, observations[i], histories[i]) if running[i] else None
                   for i in range(batch)]
        all_prompts += [p for p in prompts if p is not None]
        tokens, mask = _left_padded(tokenizer, [p.ids if p else None for p in prompts],
                                    config.max_prompt_tokens)
        key, sample_key = jax.random.split(key)
        tick = time.perf_counter()
        markers = choice_markers(tokenizer, config)
        out = jax.device_get(generate(graphdef, state, tokens, mask, sample_key,
                                      max_new_tokens=config.action_length, eoa_id=special.eoa,
                                      pad_id=special.pad, temperature=config.temperature,
                                      choice_markers=markers,
                                      shared=_shared(tokens, mask, share_prompts),
                                      label_slots=label_slots(tokens, mask, markers)
                                      if markers else None))
        model_seconds += time.perf_counter() - tick
        actions: list[str | None] = [None] * batch
        parse_errors: dict[int, str] = {}
        for i in range(batch):
            if not running[i]:
                continue
            ids = out.tokens[i, :out.lengths[i]].tolist()
            text_ids = ids[:-1] if out.finished[i] else ids
            try:
                actions[i] = parse(tokenizer.decode(text_ids, skip_special=True),
                                   observations[i].admissible_actions)
            except ActionParseError as error:
                actions[i], parse_errors[i] = "", str(error)  # no command is valid: an invalid step
            generated_tokens += len(ids)
        results = pool.step(actions)
        for i, result in enumerate(results):
            if result is None:
                continue
            ids = out.tokens[i, :out.lengths[i]].tolist()
            info = {**result.info, "action": actions[i]}  # the text the environment received
            if i in parse_errors:
                info["valid"], info["parse_error"] = False, parse_errors[i]
            # Only valid actions name a type: invalid outputs would make one key each.
            action_type = (actions[i].split("[")[0].split(" ")[0] if info.get("valid", True)
                           else "invalid")
            action_types[action_type] = action_types.get(action_type, 0) + 1
            penalty = 0.0 if info.get("valid", True) else config.invalid_action_penalty
            steps[i].append(StepRecord(
                observation_ids=tokenizer.encode(observations[i].text),
                action_ids=ids, action_logp=out.logprobs[i, :len(ids)].tolist(),
                action_entropy=out.entropies[i, :len(ids)].tolist(),
                reward=float(result.reward) - penalty, done=result.done,
                truncated=result.truncated and not result.done, value=float(out.values[i]),
                anchor=stable_key(observations[i].anchor), info=info,
                prompt_ids=prompts[i].ids))
            histories[i].append((observations[i].text, history_action(config, actions[i], ids)))
            observations[i] = result.observation
            final_info[i] = info
    bootstrap = _bootstrap_values(graphdef, state, tokenizer, config, steps, observations, histories,
                                  share_prompts)
    trajectories = [Trajectory(steps=steps[i], group_id=i // group_size,
                               score=float(sum(s.reward for s in steps[i])),
                               bootstrap_value=bootstrap[i]) for i in range(batch)]
    elapsed = time.perf_counter() - started
    return Rollout(trajectories, _metrics(trajectories, final_info, all_prompts, action_types,
                                          generated_tokens, elapsed, model_seconds))


def _bootstrap_values(graphdef, state, tokenizer, config, steps, observations, histories,
                      share_prompts):
    """V(s_next) after each truncated trajectory's last step (its bootstrap value); 0 elsewhere
    and, unless `config.bootstrap_truncated`, everywhere."""
    truncated = [i for i, s in enumerate(steps) if s and s[-1].truncated]
    values = [0.0] * len(steps)
    if not truncated or not config.bootstrap_truncated:
        return values
    prompts = [step_prompt(tokenizer, config, observations[i], histories[i]).ids
               if i in truncated else None for i in range(len(steps))]
    tokens, mask = _left_padded(tokenizer, prompts, config.max_prompt_tokens)
    state_values = np.asarray(prompt_values(graphdef, state, tokens, mask,
                                            _shared(tokens, mask, share_prompts)))
    for i in truncated:
        values[i] = float(state_values[i])
    return values


def _metrics(trajectories, final_info, prompts, action_types, generated_tokens, elapsed,
             model_seconds) -> dict[str, float]:
    n = len(trajectories)
    num_steps = sum(len(t.steps) for t in trajectories)
    invalid = sum(not s.info.get("valid", True) for t in trajectories for s in t.steps)
    entropies = [float(np.mean(s.action_entropy)) for t in trajectories for s in t.steps]
    metrics = {
        "rollout/success": sum(bool(info.get("won")) for info in final_info) / n,
        "rollout/score": sum(float(info.get("score", 0.0)) for info in final_info) / n,
        "rollout/return": sum(t.score for t in trajectories) / n,
        "rollout/steps_per_episode": num_steps / n,
        "rollout/invalid_action_rate": invalid / max(num_steps, 1),
        "rollout/truncated": sum(t.steps[-1].truncated for t in trajectories) / n,
        "rollout/step_entropy": float(np.mean(entropies)) if entropies else 0.0,
        "rollout/env_steps_per_second": num_steps / max(elapsed - model_seconds, 1e-9),
        "rollout/generated_tokens_per_second": generated_tokens / max(model_seconds, 1e-9),
        "time/rollout": elapsed,
        **prompt_metrics(prompts),
    }
    for action_type, count in action_types.items():
        metrics[f"actions/{action_type}"] = count / max(num_steps, 1)
    return metrics
