"""Environments: the text protocol, a batched pool, three embedded simulators
(WebShop-, ALFWorld- and HotpotQA-shaped) and a registry by name.

Environments speak text only; see `stepcredit.envs.base` for the protocol.
"""

from stepcredit.envs._text import words
from stepcredit.envs.alfworld import AlfWorldConfig, AlfWorldEnv
from stepcredit.envs.base import (Env, Observation, SnapshotEnv, StepResult, as_actions,
                                  require_snapshots, step_info)
from stepcredit.envs.hotpotqa import HotpotQAConfig, HotpotQAEnv
from stepcredit.envs.pool import EnvPool
from stepcredit.envs.registry import make, names, register
from stepcredit.envs.webshop import WebShopConfig, WebShopEnv

__all__ = [
    "AlfWorldConfig", "AlfWorldEnv", "Env", "EnvPool", "HotpotQAConfig", "HotpotQAEnv",
    "Observation", "SnapshotEnv", "StepResult", "WebShopConfig", "WebShopEnv", "as_actions",
    "make", "names", "register", "require_snapshots", "step_info", "words",
]
