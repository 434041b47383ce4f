"""`--set key=value`: one parser for every command, JSON literals first."""

import pytest

from stepcredit import advantages as adv
from stepcredit.settings import parse_setting, parse_settings


def test_values_read_as_json_literals_else_as_strings():
    assert parse_settings(["std=none", "center=false", "k=2", "zeta=0.5", "num_groups=null",
                           "schedule=[5, 10]", "name=\"a b\"", "k=3"]) == {
        "std": "none", "center": False, "k": 3, "zeta": 0.5, "num_groups": None,
        "schedule": [5, 10], "name": "a b"}


def test_a_pair_without_equals_sign_is_named():
    with pytest.raises(ValueError, match="--set 'lam': expected key=value"):
        parse_setting("lam")


def test_the_estimator_checks_keys_and_types():
    empg = adv.get("grpo+empg")
    assert empg.resolve(parse_settings(["center=false", "k=2"]))["center"] is False
    assert empg.resolve({"k": 2})["k"] == 2.0 and isinstance(empg.resolve({"k": 2})["k"], float)
    with pytest.raises(ValueError, match=r"center='False' is a str; it must be a bool"):
        empg.resolve(parse_settings(["center=False"]))
    with pytest.raises(ValueError, match="'grpo' has no hyperparameter 'lam'; it takes eps, "
                                         "num_groups, singleton, std"):
        adv.get("grpo").resolve({"lam": 0.9})
    with pytest.raises(ValueError, match="zeta=True is a bool; it must be a float"):
        empg.resolve({"zeta": True})
