"""The AgentGym server dialects: what differs between environment servers.

AgentGym (WooooDyy/AgentGym) runs each environment as its own HTTP server that
hosts many instances keyed by an integer. The endpoints are the same
(`/create`, `/reset`, `/step`, `/observation`, `/close`) but field names and
response shapes are not: one family keys instances by `id` (ALFWorld, BabyAI,
SciWorld, TextCraft), the other by `env_idx` (WebShop, SQLGym, SearchQA), whose
`/create` returns a bare integer and whose `/step` answers with `state`. One
`ServerSchema` per server records those differences, so that one client
(`stepcredit.envs.http_client.HttpEnv`) speaks to all of them.

The `stepcredit` and `stepcredit-env_idx` entries describe the servers that
`stepcredit serve` runs by default: the same two dialects plus extra response
keys (`anchor`, `task`, `truncated`, `info`) that the AgentGym clients ignore.
The `alfworld`, `webshop` and `searchqa` entries also speak to `stepcredit serve
--dialect alfworld|webshop|searchqa`, which imitate those servers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

Family = Literal["id", "env_idx"]
ResetShape = Literal["dict", "pair", "text"]
ActionsFormat = Literal["list", "webshop"]

FAMILIES: tuple[str, ...] = ("id", "env_idx")


@dataclasses.dataclass(frozen=True)
class ServerSchema:
    """How one AgentGym-style server names its fields and shapes its answers.

    Attributes:
      name: the environment's name (also the `HttpEnv.name` default).
      family: "id" (instance key `id`, `/create` answers `{"id": int}`) or
        "env_idx" (instance key `env_idx`, `/create` answers a bare int).
      reset_task_field: the `/reset` body field that carries the task.
      reset_extra: fixed fields added to every `/reset` body (ALFWorld's
        `world_type`).
      create_body: the JSON body of `/create`.
      reset_shape: what `/reset` answers: "dict" (an object with an
        `observation` key), "pair" (`[observation, info]`) or "text" (a bare
        observation string).
      step_observation_key: the `/step` response key of the next observation
        ("observation", or "state" in WebShop and SQLGym).
      actions_key: the reset/step response key listing admissible actions, or
        None.
      actions_path: a GET endpoint listing admissible actions, or None; used
        only when `actions_key` is None.
      actions_format: "list" (a list of strings) or "webshop" (an object
        `{"has_search_bar": bool, "clickables": [...]}`).
      task_path: a GET endpoint answering the task instruction text, or None.
      reward_from: "reward" (the response's per-step reward) or
        "score_delta" (the change of a cumulative `score`, so that step rewards
        sum to the final score).
      score_scale: divides the server's score so that 1.0 means solved (100
        for SciWorld's 0-100 score).
      won_at: the normalised score from which a finished episode counts as won.
      stepcredit_extras: the server is `stepcredit serve`, whose answers carry
        `anchor`, `task`, `truncated` and `info`, and which has `/info`.
      max_steps: the client-side step limit used when the caller gives none
        (AgentGym servers enforce none; AgentGym-RL sets `max_rounds`).
      id_key: overrides the instance key named by `family`, for servers that
        rename it (the AgentGym-RL ports key instances by `env_id` and tasks by
        `task_id`); `/create` may then answer `{id_key: int}`.
    """

    name: str
    family: Family
    reset_task_field: str
    reset_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    create_body: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    reset_shape: ResetShape = "dict"
    step_observation_key: str = "observation"
    actions_key: str | None = None
    actions_path: str | None = None
    actions_format: ActionsFormat = "list"
    task_path: str | None = None
    reward_from: Literal["reward", "score_delta"] = "reward"
    score_scale: float = 1.0
    won_at: float = 1.0
    stepcredit_extras: bool = False
    max_steps: int = 50
    id_key: str | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"ServerSchema {self.name!r}: family must be one of {FAMILIES}, "
                             f"got {self.family!r}")
        if self.score_scale <= 0:
            raise ValueError(f"ServerSchema {self.name!r}: score_scale must be > 0, "
                             f"got {self.score_scale}")
        if self.max_steps < 1:
            raise ValueError(f"ServerSchema {self.name!r}: max_steps must be >= 1, "
                             f"got {self.max_steps}")

    @property
    def id_field(self) -> str:
        """The request field (and GET query parameter) naming the instance."""
        return self.id_key or self.family


# Field names and quirks from the AgentGym servers (agentenv-*/agentenv_*/server.py
# and environment.py) and clients (agentenv/envs/*.py); see
# shared/agentgym-protocol.md. Step limits follow GiGPO's settings for ALFWorld
# (50) and WebShop (15); the others are modest round limits (pass `max_steps` to
# HttpEnv to match an evaluation protocol).
SCHEMAS: dict[str, ServerSchema] = {
    s.name: s for s in (
        ServerSchema("alfworld", "id", "game", reset_extra={"world_type": "Text"},
                     actions_key="available_actions", max_steps=50),
        # BabyAI lists the available actions inside the observation text and pays
        # 1 - 0.9 t/T on success, 0 otherwise: any positive final score is a win.
        ServerSchema("babyai", "id", "data_idx", won_at=1e-9, max_steps=20),
        ServerSchema("sciworld", "id", "data_idx", task_path="/task_description",
                     reward_from="score_delta", score_scale=100.0, max_steps=30),
        ServerSchema("textcraft", "id", "data_idx", task_path="/goal", max_steps=20),
        ServerSchema("webshop", "env_idx", "session_id", reset_shape="pair",
                     step_observation_key="state", actions_path="/available_actions",
                     actions_format="webshop", task_path="/instruction_text",
                     max_steps=15),
        ServerSchema("sqlgym", "env_idx", "item_id", reset_shape="pair",
                     step_observation_key="state", max_steps=10),
        ServerSchema("searchqa", "env_idx", "id", create_body={"id": 0}, reset_shape="text",
                     max_steps=10),
        ServerSchema("stepcredit", "id", "data_idx", actions_key="available_actions",
                     stepcredit_extras=True),
        ServerSchema("stepcredit-env_idx", "env_idx", "session_id", reset_shape="pair",
                     step_observation_key="state", actions_key="available_actions",
                     stepcredit_extras=True),
    )
}


def get_schema(schema: str | ServerSchema) -> ServerSchema:
    """Returns the schema named `schema` (or `schema` itself when it is one).

    Args:
      schema: a key of `SCHEMAS` or a `ServerSchema`.

    Returns:
      The `ServerSchema`.

    Raises:
      ValueError: `schema` names no known server.
    """
    if isinstance(schema, ServerSchema):
        return schema
    if schema not in SCHEMAS:
        raise ValueError(f"schema must be one of {sorted(SCHEMAS)} or a ServerSchema, "
                         f"got {schema!r}")
    return SCHEMAS[schema]


def webshop_actions(available: Mapping[str, Any]) -> tuple[str, ...]:
    """Turns WebShop's `/available_actions` answer into action strings.

    WebShop answers `{"has_search_bar": bool, "clickables": [...]}`. A search
    query cannot be enumerated, so the search bar becomes the placeholder
    `search[<your query>]`, as in verl-agent's WebShop prompt.

    Args:
      available: the decoded JSON object.

    Returns:
      The admissible actions, search first.
    """
    search = ("search[<your query>]",) if available.get("has_search_bar") else ()
    return search + tuple(f"click[{c}]" for c in available.get("clickables", ()))
