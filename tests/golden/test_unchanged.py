"""The estimator-binding refactor changed no number.

`outputs.npz` was written by `python -m tests.golden.capture` before the
registry took over the binding of estimator inputs (commit "tests: golden
outputs"); this test recomputes every array through today's code paths
(`compute_advantages`, offline credit, `stepcredit train`) and asks for
bit-identical results.
"""

import numpy as np

from tests.golden.capture import GOLDEN, compute_all


def test_estimators_offline_credit_and_training_are_unchanged():
    expected = np.load(GOLDEN)
    actual = compute_all()
    assert sorted(actual) == sorted(expected.files)
    changed = [key for key in expected.files
               if not np.array_equal(actual[key], expected[key], equal_nan=True)]
    assert not changed, f"{len(changed)} arrays changed, e.g. {changed[:5]}"
