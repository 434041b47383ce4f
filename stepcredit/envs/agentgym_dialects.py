"""What the original AgentGym servers show their clients, for `stepcredit serve`.

The AgentGym clients (`agentenv.envs.AlfWorldEnvClient`, `WebshopEnvClient`,
`SearchQAEnvClient`, AgentGym snapshot 3ef9235) show the agent only the
observation text (`observation`, `state`, or `GET /observation`) and ignore any
other key, so the goal must be in that text, worded as the original server
words it. The functions here turn a stepcredit `Observation` (whose `task`
holds the goal apart from the text) into those texts, and SearchQA's action
grammar into the HotpotQA simulator's actions. `http_server.create_app` uses
them for the `alfworld`, `webshop` and `searchqa` dialects.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from stepcredit.envs.base import Observation

# The dialects that answer as an original AgentGym server, and stepcredit's own.
AGENTGYM_DIALECTS: tuple[str, ...] = ("alfworld", "webshop", "searchqa")
NATIVE_DIALECTS: tuple[str, ...] = ("id", "env_idx")
DIALECTS: tuple[str, ...] = NATIVE_DIALECTS + AGENTGYM_DIALECTS

# The instance key of each dialect's requests.
ID_FIELD = {"id": "id", "env_idx": "env_idx", "alfworld": "id", "webshop": "env_idx",
            "searchqa": "env_idx"}

# ALFWorld's server refuses any other `world_type` at reset.
ALFWORLD_WORLD_TYPES = ("Text", "Embody", "Hybrid")

SEP = " [SEP] "


def alfworld_reset_text(obs: Observation) -> str:
    """ALFWorld's first observation: the room, then the goal paragraph on its own
    line ("Your task is to: put a mug in sink."), as the original server leaves
    TextWorld's reset text once it drops the welcome banner."""
    if not obs.task:
        return obs.text
    return f"{obs.text}\nYour task is to: {obs.task}"


def webshop_page(obs: Observation) -> str:
    """WebShop's page text with the instruction, as WebShop's text mode renders it.

    The search page reads `WebShop [SEP] Instruction: [SEP] <instruction> [SEP]
    Search`; results and item pages start with `Instruction: [SEP] <instruction>
    [SEP]`; the purchase page (which has no instruction) is left as it is.
    """
    text, task = obs.text, obs.task
    if not task:
        return text
    head = f"WebShop{SEP}"
    if text.startswith(head):
        return f"{head}Instruction:{SEP}{task}{SEP}{text[len(head):]}"
    if text.startswith("Thank you for shopping"):
        return text
    return f"Instruction:{SEP}{task}{SEP}{text}"


def webshop_available_actions(actions: Sequence[str] | None) -> dict[str, Any]:
    """WebShop's `/available_actions` answer, `{"has_search_bar", "clickables"}`,
    from the admissible actions: any `search[...]` means a search bar, and each
    `click[x]` is the clickable `x`."""
    has_search_bar, clickables = False, []
    for action in actions or ():
        verb, sep, rest = action.partition("[")
        if not sep or not rest.endswith("]"):
            continue
        if verb.strip() == "search":
            has_search_bar = True
        elif verb.strip() == "click":
            clickables.append(rest[:-1])
    return {"has_search_bar": has_search_bar, "clickables": clickables}


def searchqa_prompt(task: str) -> str:
    """The text SearchQA's reset and `/observation` answer: how to act, then
    `Question: <question>` (the original server's instructions are longer; the
    grammar and the question's place are the same)."""
    return ("Reason step by step. If you need knowledge you lack, issue one search as "
            "<search> query </search> and stop; its results come back between <information> "
            "and </information>. When you are confident, give the final answer as "
            "<answer> text </answer>, e.g. <answer> Beijing </answer>.\n\n"
            f" Question: {task.strip()}")


SEARCHQA_INVALID = ("Your previous action is invalid. If you want to search, you should put the "
                    "query between <search> and </search>. If you want to give the final answer, "
                    "you should put the answer between <answer> and </answer>. Please try again.")
SEARCHQA_CORRECT = "Congratulations! You have answered the question correctly."
SEARCHQA_WRONG = "Sorry, your answer is incorrect. Please try again."

_SEARCHQA_TAG = re.compile(r"<(search|lookup|answer)>(.*?)</\1>", re.DOTALL)
_SIMULATOR_VERB = {"search": "search", "lookup": "lookup", "answer": "finish"}


def searchqa_action(text: str) -> tuple[str, str] | None:
    """Maps a SearchQA action onto the HotpotQA simulator's grammar.

    The first `<search> q </search>`, `<answer> a </answer>` or (stepcredit's
    extension, for facts a search does not show) `<lookup> k </lookup>` in the
    text, as the original server takes the first tag, becomes `search[q]`,
    `finish[a]` or `lookup[k]`.

    Returns:
      (the tag, the simulator's action), or None when the text holds no tag.
    """
    match = _SEARCHQA_TAG.search(text)
    if match is None:
        return None
    tag, content = match.group(1), " ".join(match.group(2).split())
    return tag, f"{_SIMULATOR_VERB[tag]}[{content}]"


def searchqa_tagged(action: str) -> str:
    """The inverse of `searchqa_action`: a simulator action `verb[x]` as SearchQA's
    `<tag> x </tag>` (an action of another form as it is)."""
    for tag, verb in _SIMULATOR_VERB.items():
        if action.startswith(f"{verb}[") and action.endswith("]"):
            return f"<{tag}> {action[len(verb) + 1:-1]} </{tag}>"
    return action
