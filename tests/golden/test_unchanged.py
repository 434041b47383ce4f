"""The estimator-binding refactor changed no number.

`outputs.npz` was written by `python -m tests.golden.capture` before the
registry took over the binding of estimator inputs (commit "tests: golden
outputs"); this test recomputes every array through today's code paths
(`compute_advantages`, offline credit, `stepcredit train`) and asks for
bit-identical results on every array it recorded (estimators registered since
then add arrays of their own, which it does not judge).
"""

import numpy as np

from tests.golden.capture import GOLDEN, compute_all, measures_time

# Arrays the refactor changed on purpose, with the reason; each must differ.
INTENDED = {
    "offline/gigpo/advantage": "offline GiGPO took the episode score from the log's `score` "
                               "column, the trainer and compute_advantages from the masked sum "
                               "of step rewards (the paper's R(tau)); one binding now serves "
                               "all three, with the sum",
}


def test_estimators_offline_credit_and_training_are_unchanged():
    expected = np.load(GOLDEN)
    keys = [key for key in expected.files if not measures_time(key)]
    actual = compute_all()
    # Estimators registered after the snapshot add arrays; every recorded one must remain.
    assert set(keys) <= set(actual), f"no longer computed: {sorted(set(keys) - set(actual))[:5]}"
    changed = {key for key in keys
               if not np.array_equal(actual[key], expected[key], equal_nan=True)}
    assert changed == set(INTENDED), (f"unintended: {sorted(changed - set(INTENDED))[:5]}; "
                                      f"intended but unchanged: {sorted(set(INTENDED) - changed)}")
