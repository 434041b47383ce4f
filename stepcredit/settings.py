"""`--set key=value` for every command: one parser, values as JSON literals.

`parse_settings(["gamma=0.9", "std=none", "center=false", "schedule=[5,10]"])`
gives `{"gamma": 0.9, "std": "none", "center": False, "schedule": [5, 10]}`:
a value that reads as JSON (true, false, null, numbers, strings in quotes,
lists) is that value; anything else is the bare string. Whether the key
exists and the value has the right type is the estimator's to say
(`stepcredit.advantages.Estimator.resolve`).
"""

from __future__ import annotations

import json
from typing import Any, Iterable


def parse_setting(text: str) -> tuple[str, Any]:
    """`"key=value"` -> `(key, value)`; raises ValueError naming the malformed pair."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"--set {text!r}: expected key=value")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_settings(pairs: Iterable[str] | None) -> dict[str, Any]:
    """Several `key=value` pairs as a dict; a later pair overrides an earlier one."""
    return dict(parse_setting(pair) for pair in pairs or ())
