"""Published test success rates, for the columns beside a study's own.

Each source is one paper's table at one model size, on that paper's own
environment (real WebShop, ALFWorld and HotpotQA, language models of 1.5B to
7B parameters), so only the ordering of methods within a source compares with
a study on the embedded simulators, never the values. Values are success
fractions (the papers' percentages / 100): WebShop's "Succ", ALFWorld's
success, HotpotQA's accuracy. A method's `published` key in a study file
names its row; a column is (simulator, split), with split None where the
paper does not say which split it reports.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class Source:
    """One paper's reported numbers.

    Attributes:
      label: the column header (paper, model, arXiv id).
      values: method key -> {(simulator, split): success fraction}.
      note: what differs from the simulators (shown under the table).
    """

    label: str
    values: Mapping[str, Mapping[tuple[str, str | None], float]]
    note: str


def _steppo(hotpotqa, seen, unseen, webshop):
    return {("hotpotqa", None): hotpotqa, ("alfworld", "seen"): seen,
            ("alfworld", "unseen"): unseen, ("webshop", None): webshop}


def _alfworld_webshop(alfworld, webshop):
    return {("alfworld", None): alfworld, ("webshop", None): webshop}


SOURCES = (
    Source(
        label="StepPO paper, Qwen3-4B (arXiv 2604.18401)",
        values={"ppo": _steppo(.5675, .7643, .7239, .4600),
                "reinforce_pp": _steppo(.5594, .7286, .7164, .4720),
                "grpo": _steppo(.5661, .8143, .7463, .4420),
                "rloo": _steppo(.5631, .7571, .7090, .4260),
                "gigpo": _steppo(.5814, .8857, .7910, .5000),
                "steppo": _steppo(.6378, .9214, .8582, .5780)},
        note="ALFWorld with a 20-step limit; WebShop Succ; HotpotQA accuracy"),
    Source(
        label="GiGPO paper, Qwen2.5-1.5B (arXiv 2505.10978)",
        values={"ppo": _alfworld_webshop(.544, .515), "rloo": _alfworld_webshop(.697, .521),
                "grpo": _alfworld_webshop(.728, .568), "gigpo": _alfworld_webshop(.867, .650)},
        note="ALFWorld 'All' (50 steps, split not stated), WebShop Succ (15 steps); GiGPO "
             "with std normalisation; mean of 3 seeds"),
    Source(
        label="EMPG paper, Qwen2.5-1.5B (arXiv 2509.09265)",
        values={"grpo": _alfworld_webshop(.656, .582), "grpo+empg": _alfworld_webshop(.737, .608),
                "dapo": _alfworld_webshop(.808, .732), "dapo+empg": _alfworld_webshop(.881, .738)},
        note="EMPG's own reruns of GRPO and DAPO (its GRPO WebShop value is uncertain in the "
             "sources)"),
    Source(
        label="iStar paper, Qwen2.5-7B (arXiv 2509.19199)",
        values={key: {("webshop", None): value} for key, value in (
            ("ppo", .782), ("grpo", .801), ("rloo", .774), ("reinforce_pp", .770),
            ("prime", .815), ("gigpo", .841), ("rloo+istar", .865))},
        note="WebShop Succ with a 10-step limit, mean of its seeds"),
)


def published(key: str | None, simulator: str, split: str | None) -> dict[str, float]:
    """Source label -> the published success of method `key` on (simulator, split),
    for every source that reports it (a source silent on the split reports under None)."""
    if key is None:
        return {}
    found = {}
    for source in SOURCES:
        values = source.values.get(key, {})
        for column in ((simulator, split), (simulator, None)):
            if column in values:
                found[source.label] = values[column]
                break
    return found
