"""stepcredit.keys: stable keys across processes, dense ids in either order."""

import os
import subprocess
import sys

import numpy as np
import pytest

from stepcredit import keys

KITCHEN_KEY = 3991932235397279594  # stable_key("You are in the kitchen.") in every process


def test_key_is_stable_across_processes_and_hash_seeds():
    assert keys.stable_key("You are in the kitchen.") == KITCHEN_KEY
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('a', sys.argv[1])\n"
            "m = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(m)\n"
            "print(m.stable_key('You are in the kitchen.'),\n"
            "      m.stable_key({'b': (1, 2.5), 'a': None}))")
    outputs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run([sys.executable, "-c", code, keys.__file__], env=env,
                                capture_output=True, text=True, check=True)
        outputs.add(result.stdout.strip())
    expected = f"{KITCHEN_KEY} {keys.stable_key({'a': None, 'b': [1, 2.5]})}"
    assert outputs == {expected}


def test_keys_distinguish_types_and_follow_the_canonical_encoding():
    key = keys.stable_key
    distinct = ["1", 1, 1.0, True, b"1", None, (1,), ["1"], np.array([1]), np.array([1.0]),
                np.array([[1]]), "", b"", (), {}, ("a", "b"), ("ab",)]
    assert len({key(x) for x in distinct}) == len(distinct)
    assert key([1, "a"]) == key((1, "a"))
    assert key({"x": 1, "y": 2}) == key({"y": 2, "x": 1})
    assert key({3, 1, 2}) == key(frozenset([2, 3, 1]))
    assert key(np.int64(3)) == key(3) and key(np.float32(0.5)) == key(0.5)
    assert key(np.arange(6).reshape(2, 3)) != key(np.arange(6).reshape(3, 2))
    assert key(np.arange(4, dtype=">i4")) == key(np.arange(4, dtype="<i4"))
    assert key(np.arange(6).reshape(2, 3).T) == key(np.ascontiguousarray(np.arange(6).reshape(2, 3).T))
    assert 0 <= key("x") < 2**64
    with pytest.raises(TypeError, match="cannot encode an object of type object"):
        key(object())


def test_stable_keys_is_stable_key_of_each_value():
    values = np.empty(4, dtype=object)
    for i, value in enumerate(["a", (1, 2), np.arange(3), None]):
        values[i] = value
    out = keys.stable_keys(values)
    assert out.dtype == np.uint64 and out.shape == (4,)
    assert out.tolist() == [keys.stable_key(v) for v in values]
    assert keys.stable_keys([]).shape == (0,)


def test_dense_ids_sorted_ranks_values():
    ids, count = keys.dense_ids(["b", "a", "b", "c"])
    np.testing.assert_array_equal(ids, [1, 0, 1, 2])
    assert ids.dtype == np.int32 and count == 3
    # uint64 keys above 2**63 rank as unsigned numbers
    ids, count = keys.dense_ids(np.array([9, 2**63, 9, 5], np.uint64))
    np.testing.assert_array_equal(ids, [1, 2, 1, 0])
    assert count == 3
    shuffled, _ = keys.dense_ids(np.array(["c", "b", "a", "b"], dtype=object))
    np.testing.assert_array_equal(shuffled, [2, 1, 0, 1])


def test_dense_ids_first_numbers_in_order_of_first_appearance():
    ids, count = keys.dense_ids(["b", "a", "b", "c"], order="first")
    np.testing.assert_array_equal(ids, [0, 1, 0, 2])
    assert ids.dtype == np.int32 and count == 3
    ids, _ = keys.dense_ids(np.array([7, 3, 7, -1, 3]), order="first")
    np.testing.assert_array_equal(ids, [0, 1, 0, 2, 1])


def test_dense_ids_edge_cases():
    for order in ("sorted", "first"):
        ids, count = keys.dense_ids(np.zeros(0, np.int64), order=order)
        assert ids.shape == (0,) and ids.dtype == np.int32 and count == 0
        ids, count = keys.dense_ids([4, 4, 4], order=order)
        assert ids.tolist() == [0, 0, 0] and count == 1
    with pytest.raises(ValueError, match="dense_ids: order='random'"):
        keys.dense_ids([1], order="random")
    with pytest.raises(ValueError, match=r"dense_ids: values has shape \(2, 2\)"):
        keys.dense_ids(np.zeros((2, 2)))
