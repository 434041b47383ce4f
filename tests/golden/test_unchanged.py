"""The estimator-binding refactor changed no number.

`outputs.npz` was written by `python -m tests.golden.capture` before the
registry took over the binding of estimator inputs (commit "tests: golden
outputs"); this test recomputes every array through today's code paths
(`compute_advantages`, offline credit, `stepcredit train`) and asks for
bit-identical results on every array it recorded (estimators registered since
then add arrays of their own, which it does not judge), except those that a
later change moved by float32 rounding on purpose (`ROUNDED`) and the training
runs re-recorded after a change that moved them on purpose (`RERECORDED`).
"""

import numpy as np
import pytest

from tests.golden.capture import GOLDEN, PARTS, RUNS, compute_part, measures_time

# Arrays the refactor changed on purpose, with the reason; each must differ.
INTENDED = {
    "offline/gigpo/advantage": "offline GiGPO took the episode score from the log's `score` "
                               "column, the trainer and compute_advantages from the masked sum "
                               "of step rewards (the paper's R(tau)); one binding now serves "
                               "all three, with the sum",
}


# Training runs re-recorded since (`python -m tests.golden.capture --rerecord-run LABEL`), with
# the change that moved them on purpose.
RERECORDED = {
    "grpo+istar": "iStar's implicit rewards beta log(pi_prm / pi_old) take pi_old from the "
                  "trainer's scorer instead of the sampler: the PRM starts as a copy of the "
                  "policy, and the sampler's rounding differences, magnified by the step "
                  "baseline's std normalisation, gave advantages of up to 1.7 where every "
                  "reward is 0 (now exactly 0)",
}

# Arrays allowed to move by float32 rounding (within ROUNDING of their largest magnitude, at
# least 1), by key prefix, with the reason.
ROUNDED = {
    ("offline/step_gae/", "offline/token_gae/"):
        "GAE's default became the compiled CPU kernel (method='auto'), which adds in another "
        "order than the scan that recorded them",
    tuple(f"{part}/{name}/" for part in ("credit", "offline")
          for name in ("empg", "grpo+empg", "dapo+empg")):
        "EMPG's modulation became a compiled CPU kernel, whose exponential is a vector "
        "polynomial and whose sums run in another order",
    ("train/",):
        "XLA:CPU compiles for the CPU it runs on, so a transformer's sums are ordered by its "
        "vector width: on an AVX-512 EPYC, two iterations of training ended up to 3e-5 "
        "(relative) from the recorded runs with the recording's own code",
}
ROUNDING = 1e-4


def rounded(key: str) -> bool:
    return any(key.startswith(prefixes) for prefixes in ROUNDED)


def same(key: str, actual, expected) -> bool:
    if not rounded(key):
        return np.array_equal(actual, expected, equal_nan=True)
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(1.0, float(np.nanmax(np.abs(expected), initial=0.0)))
    return actual.shape == expected.shape and np.allclose(actual, expected, rtol=0,
                                                          atol=ROUNDING * scale, equal_nan=True)


def test_rerecorded_runs_are_recorded_runs():
    assert set(RERECORDED) <= set(RUNS), sorted(set(RERECORDED) - set(RUNS))


def test_every_recorded_array_belongs_to_a_part():
    stray = [key for key in np.load(GOLDEN).files if not key.startswith(tuple(p + "/" for p in PARTS))]
    assert not stray, stray[:5]


@pytest.mark.parametrize("part", PARTS)
def test_estimators_offline_credit_and_training_are_unchanged(part, tmp_path):
    expected = np.load(GOLDEN)
    keys = [key for key in expected.files if key.startswith(part + "/") and not measures_time(key)]
    actual = compute_part(part, str(tmp_path))
    # Estimators registered after the snapshot add arrays; every recorded one must remain.
    assert set(keys) <= set(actual), f"no longer computed: {sorted(set(keys) - set(actual))[:5]}"
    changed = {key for key in keys if not same(key, actual[key], expected[key])}
    intended = {key for key in INTENDED if key.startswith(part + "/")}
    assert changed == intended, (f"unintended: {sorted(changed - intended)[:5]}; "
                                 f"intended but unchanged: {sorted(intended - changed)}")
