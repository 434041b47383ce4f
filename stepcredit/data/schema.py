"""The step-row schema of precomputed agent trajectories, as `datasets.Features`.

One row per agent step (the layout of Agent-R1 and verl-agent): the step's own
prompt token ids and sampled response token ids, so that nothing is ever
re-tokenised. Rows are keyed by `(trajectory_id, step_index)`; the trajectories
of one task share a `group_id`.

Fields (R: required in every record; O: optional, may be missing or null):

  trajectory_id      R  string   the episode; int ids are stored as their decimal string
  group_id           R  string   the task group (G rollouts of one task); ints as decimal strings
  step_index         R  int64    0, 1, ..., n-1 within the trajectory, each exactly once
  prompt_ids         R  [int32]  the step's prompt tokens (environment side, history included)
  response_ids       R  [int32]  the sampled action tokens, exactly as generated (at least one)
  response_logprobs  R  [float32] log-prob of each response token under the sampling policy
  reward             R  float64  the step's reward (an invalid-action penalty included)
  done               R  bool     the episode terminated at this step (no bootstrap)
  truncated          R  bool     a step or token limit ended the episode at this step
  entropy            O  float32  step entropy: mean token entropy of the response
  anchor             O  string   the environment state the step acted from (GiGPO); an
                                 int k is stored as str(k), e.g. 42 -> "42", -3 -> "-3";
                                 equal strings are the same state; null: no anchor
  value              O  float64  critic value V(s_t) at the step's start
  score              O  float64  the trajectory's score, equal on all of its rows;
                                 null means the sum of its step rewards
  metadata           O  string   free metadata, a JSON object encoded as a string
  response_entropies O  [float32] per-token entropies of the response
  response_values    O  [float32] per-token critic values (the value before each
                                 response token; token-level critics)
  bootstrap_value    O  float64  V(s_next) after a truncated last step (last row only)
  observation_ids    O  [int32]  the observation's own tokens when `prompt_ids` is a
                                 prompt built around it (task, history); null: the
                                 prompt is the observation

Done and truncated only on a trajectory's last row, never both.

Other columns are carried through `stepcredit credit` untouched. One of them
may be a per-step label, for instance a human annotation of each step: a
number or a bool on every row, > 0 (True) for a good step; `stepcredit
diagnose --input LOG --label-column NAME` grades the estimators' credit
against it (`stepcredit.diagnose.offline`).
"""

from __future__ import annotations

import datasets
import pyarrow as pa

REQUIRED = ("trajectory_id", "group_id", "step_index", "prompt_ids", "response_ids",
            "response_logprobs", "reward", "done", "truncated")
OPTIONAL = ("entropy", "anchor", "value", "score", "metadata", "response_entropies",
            "response_values", "bootstrap_value", "observation_ids")
FIELDS = REQUIRED + OPTIONAL

_INT_LIST = datasets.List(datasets.Value("int32"))
_FLOAT_LIST = datasets.List(datasets.Value("float32"))

FEATURES = datasets.Features({
    "trajectory_id": datasets.Value("string"),
    "group_id": datasets.Value("string"),
    "step_index": datasets.Value("int64"),
    "prompt_ids": _INT_LIST,
    "response_ids": _INT_LIST,
    "response_logprobs": _FLOAT_LIST,
    "reward": datasets.Value("float64"),
    "done": datasets.Value("bool"),
    "truncated": datasets.Value("bool"),
    "entropy": datasets.Value("float32"),
    "anchor": datasets.Value("string"),
    "value": datasets.Value("float64"),
    "score": datasets.Value("float64"),
    "metadata": datasets.Value("string"),
    "response_entropies": _FLOAT_LIST,
    "response_values": _FLOAT_LIST,
    "bootstrap_value": datasets.Value("float64"),
    "observation_ids": _INT_LIST,
})
"""The step-row schema; see the module docstring for each field."""

ARROW_SCHEMA: pa.Schema = pa.schema([FEATURES.arrow_schema.field(name) for name in FIELDS])
"""The same schema as a `pyarrow.Schema` (without the `datasets` metadata)."""

# Kinds of each field, for validating records whose types are not yet Arrow types.
KIND = {
    "trajectory_id": "id", "group_id": "id", "anchor": "id", "step_index": "int",
    "prompt_ids": "int_list", "observation_ids": "int_list", "response_ids": "int_list",
    "response_logprobs": "float_list",
    "response_entropies": "float_list", "response_values": "float_list",
    "reward": "float", "value": "float", "score": "float", "bootstrap_value": "float",
    "entropy": "float", "done": "bool", "truncated": "bool", "metadata": "json",
}

ID_FIELDS = tuple(name for name in FIELDS if KIND[name] == "id")
"""The fields that hold a string or an integer id (an integer is read as its decimal string)."""
