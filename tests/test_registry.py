"""The estimator registry."""

import inspect
import re

import numpy as np
import pytest

import stepcredit
from stepcredit import advantages


def test_every_entry_is_callable_with_its_defaults_and_documented():
    assert {"token_gae", "step_gae"} <= set(advantages.names())
    for name in advantages.names():
        entry = advantages.get(name)
        assert entry.name == name
        assert "arXiv" in entry.paper
        parameters = inspect.signature(entry.fn).parameters
        for key in entry.defaults:
            assert key in parameters, f"{name}: default {key!r} is not a parameter of {entry.fn}"
        assert entry.whiten in ("none", "steps", "tokens")
        assert entry.fn.__doc__ and "References" in entry.fn.__doc__


def test_gae_entries_carry_their_whitening_and_needs():
    assert advantages.get("step_gae").whiten == "steps"
    assert advantages.get("token_gae").whiten == "tokens"
    assert advantages.get("step_gae").needs_critic and advantages.get("step_gae").input_level == "step"


@pytest.mark.parametrize("field, level", [
    ("mc_values", "step"), ("progress", "step"), ("grounding", "step"), ("answer_logp", "step"),
    ("step_rewards", "step"), ("prm_logp", "token"), ("scores", "trajectory")])
def test_the_input_level_is_inferred_from_the_finest_field_read(field, level):
    entry = advantages.Estimator("reads_one", lambda **kwargs: None, {field: field}, {},
                                 "arXiv 0000.00000", output_level="step")
    assert entry.input_level == level


def test_defaults_are_read_only():
    with pytest.raises(TypeError):
        advantages.get("step_gae").defaults["gamma"] = 0.5


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_float_hyperparameter_that_is_not_finite_is_named(bad):
    """Checked once for every estimator: some read a NaN weight without a word and gave
    every step a NaN advantage (EMPG's k, MT-GRPO's lam, PRIME's coefficients)."""
    checked = 0
    for name in advantages.names():
        entry = advantages.get(name)
        for key, default in entry.accepted.items():
            if isinstance(default, float):
                with pytest.raises(ValueError, match=f"estimator '{re.escape(name)}': {key}="
                                                     f"{re.escape(str(bad))}; it must be finite"):
                    entry.resolve({key: bad})
                checked += 1
    assert checked >= 30
    ok = advantages.get("grpo+empg").resolve({"k": 2})
    assert ok["k"] == 2.0 and isinstance(ok["k"], float)


def test_apply_names_inputs_and_config_of_the_wrong_kind():
    scores = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
    groups = np.array([0, 0, 1, 1], np.int32)
    with pytest.raises(TypeError, match="apply: inputs is a dict; it must be CreditInputs"):
        advantages.apply("grpo", {"scores": scores, "group_ids": groups})
    inputs = advantages.CreditInputs(scores=scores, group_ids=groups)
    with pytest.raises(TypeError, match="apply: config is a list; it must be a mapping"):
        advantages.apply("grpo", inputs, [("eps", 1e-3)])
    # EMPG's GRPO base broadcasts over the mask: a transposed one is named, not broadcast.
    entropy = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match=re.escape("empg: mask has shape (3, 4); it must be [B, "
                                                   "T] with B = 4 trajectories")):
        advantages.apply("empg", inputs._replace(mask=np.ones((3, 4), bool), entropy=entropy))


def test_unknown_names_list_the_known_ones():
    with pytest.raises(KeyError, match="unknown estimator 'ppo'; registered: .*step_gae"):
        advantages.get("ppo")


def test_public_api_is_exported():
    for name in stepcredit.__all__:
        assert hasattr(stepcredit, name), name
