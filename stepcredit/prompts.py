"""Step-level prompts: the Agent-R1 step MDP (arXiv 2511.14460), text to token ids.

Every step of an episode is its own prompt, built afresh by the environment side
of the loop from the task, the actions of the `action_window` steps before the
window (without their observations), a window of the last `window`
(observation, action) pairs, the current observation and, where the environment
gives them, the admissible actions. The layout, with the tokenizer's special ids::

    <bos> <task> TASK
      <act> ACTION_{t-k-j} <eoa> ... <act> ACTION_{t-k-1} <eoa>   (j = actions kept)
      <obs> OBS_{t-k} <act> ACTION_{t-k} <eoa>      (k = number of history pairs kept)
      ...
      <obs> OBS_{t-1} <act> ACTION_{t-1} <eoa>
    <obs> OBS_t [<adm> A_1 <sep> A_2 <sep> ... A_n <sep>] <act>

The policy continues the prompt with its action tokens and `<eoa>`, exactly the
shape of a history pair, so a step row is `prompt ids + action ids`.

Length policy (never silent): when the prompt exceeds `max_tokens`, the oldest
history entries (earlier actions, then pairs) are dropped first, one at a time;
if the prompt without history is still too long, the admissible-action list
is dropped as a whole (a partial list would misstate what is allowed).
`StepPrompt` counts what was dropped. If even the minimal prompt (task, current
observation, markers) does not fit, `PromptTooLongError` says by how much.

Token exactness: a history action may be given as the exact ids the policy
sampled (what the rollout stores) instead of its text, so the history shows the
model its own tokens and nothing is re-tokenized. A choice label is the
exception: its list is not shown again, so the rollout gives the chosen
action's text instead.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from stepcredit.models.tokenizer import Tokenizer, count_unknown

Action = str | Sequence[int]
"""An action as text, or as token ids (the sampled ids, with or without the final `<eoa>`)."""


class PromptTooLongError(ValueError):
    """Even the minimal prompt (task and current observation) exceeds the maximum length."""


class StepPrompt(NamedTuple):
    """One step's prompt and what the length policy did to it.

    Attributes:
      ids: the prompt's token ids, ending with the `<act>` marker.
      history_used: the history entries in the prompt ((observation, action)
        pairs and earlier actions shown alone).
      history_dropped: entries of the two windows dropped to fit `max_tokens`.
      admissible_dropped: the admissible-action list was given but dropped to fit.
      num_unknown: `<unk>` ids in the prompt (words the tokenizer does not cover).
    """

    ids: list[int]
    history_used: int
    history_dropped: int
    admissible_dropped: bool
    num_unknown: int


def _action_ids(tokenizer: Tokenizer, action: Action) -> list[int]:
    """An action's ids followed by exactly one `<eoa>`."""
    eoa = tokenizer.special.eoa
    if isinstance(action, str):
        ids = tokenizer.encode(action)
    else:
        ids = [int(i) for i in action]
        bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
        if bad:
            raise ValueError(f"build_step_prompt: action ids {bad[:5]} out of range "
                             f"[0, {tokenizer.vocab_size})")
    return ids if ids and ids[-1] == eoa else ids + [eoa]


def build_step_prompt(tokenizer: Tokenizer, *, task: str, observation: str,
                      history: Sequence[tuple[str, Action]] = (),
                      admissible_actions: Sequence[str] | None = None,
                      window: int = 2, action_window: int = 0, max_tokens: int = 512,
                      choice_labels: bool = False) -> StepPrompt:
    """Builds one step's prompt ids under a maximum length.

    Args:
      tokenizer: any `Tokenizer`.
      task: the task instruction, shown at every step.
      observation: the current observation text.
      history: the episode's previous (observation, action) pairs, oldest first;
        only the last `action_window + window` are considered. An action is
        its text or its token ids (the sampled ids; a trailing `<eoa>` is not
        repeated).
      admissible_actions: the actions the environment accepts now, or None to
        show no list.
      window: k, the most history pairs shown (0: none, the pure step MDP
        whose state is the current observation).
      action_window: j, the most earlier actions shown, without their
        observations, before the k pairs: a memory of what was done (places
        visited, steps already taken) at a few tokens an action, where a pair
        spends a whole observation.
      max_tokens: the maximum prompt length in tokens.
      choice_labels: label the k-th admissible action with the tokenizer's
        choice token `<k>`, placed after the action's text
        (`<adm> go to desk 1 <1> <sep> look <2> <sep>`), so a policy names any
        action with one token, and the label's hidden state, which attends to
        the text before it, can stand for the whole action (the pointer of
        `TransformerPolicy.choice_logits`).

    Returns:
      A `StepPrompt`.

    Raises:
      PromptTooLongError: the prompt without history and without the admissible
        list is longer than `max_tokens`.
    """
    if window < 0 or action_window < 0:
        raise ValueError(f"build_step_prompt: window and action_window must be >= 0, got "
                         f"{window} and {action_window}")
    sp = tokenizer.special
    prefix = [sp.bos, sp.task] + tokenizer.encode(task)
    current = [sp.obs] + tokenizer.encode(observation)
    suffix = [sp.act]
    first_pair = max(len(history) - window, 0)
    actions_only = [[sp.act] + _action_ids(tokenizer, action)
                    for _, action in history[max(first_pair - action_window, 0):first_pair]]
    entries = actions_only + [
        [sp.obs] + tokenizer.encode(obs) + [sp.act] + _action_ids(tokenizer, action)
        for obs, action in history[first_pair:]]
    admissible: list[int] = []
    if admissible_actions is not None:
        if choice_labels and len(admissible_actions) > len(sp.choices):
            raise ValueError(f"build_step_prompt: {len(admissible_actions)} admissible actions but "
                             f"the tokenizer has {len(sp.choices)} choice tokens to label them")
        admissible = [sp.adm]
        for i, action in enumerate(admissible_actions):
            label = [sp.choices[i]] if choice_labels else []
            admissible += tokenizer.encode(action) + label + [sp.sep]

    minimal = len(prefix) + len(current) + len(suffix)
    if minimal > max_tokens:
        raise PromptTooLongError(
            f"build_step_prompt: the minimal prompt has {minimal} tokens (task {len(prefix) - 2}, "
            f"observation {len(current) - 1}, 4 markers) > max_tokens {max_tokens}; raise "
            f"max_tokens or shorten the task/observation texts")
    history_tokens = sum(len(e) for e in entries)
    dropped = 0
    while dropped < len(entries) and minimal + len(admissible) + history_tokens > max_tokens:
        history_tokens -= len(entries[dropped])
        dropped += 1
    kept = entries[dropped:]
    admissible_dropped = (bool(admissible)
                          and minimal + len(admissible) + history_tokens > max_tokens)
    if admissible_dropped:
        admissible = []
    ids = prefix + [i for e in kept for i in e] + current + admissible + suffix
    return StepPrompt(ids, len(kept), dropped, admissible_dropped, count_unknown(tokenizer, ids))


def prompt_metrics(prompts: Sequence[StepPrompt]) -> Mapping[str, float]:
    """Aggregates the length policy's counts over a batch of prompts (for logging).

    Returns:
      `prompt/length_mean`, `prompt/length_max`, `prompt/history_used_mean`,
      `prompt/history_dropped` (total entries dropped), `prompt/admissible_dropped`
      (prompts whose list was dropped) and `prompt/unknown_tokens` (total).
    """
    n = max(len(prompts), 1)
    return {
        "prompt/length_mean": sum(len(p.ids) for p in prompts) / n,
        "prompt/length_max": float(max((len(p.ids) for p in prompts), default=0)),
        "prompt/history_used_mean": sum(p.history_used for p in prompts) / n,
        "prompt/history_dropped": float(sum(p.history_dropped for p in prompts)),
        "prompt/admissible_dropped": float(sum(p.admissible_dropped for p in prompts)),
        "prompt/unknown_tokens": float(sum(p.num_unknown for p in prompts)),
    }
