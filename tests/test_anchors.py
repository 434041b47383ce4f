"""Host-side anchors: dense per-batch ids of observation keys, similarity clusters."""

import numpy as np
import pytest

from stepcredit import anchors

def test_dense_ids_are_int32_order_independent_and_minus_one_at_padding():
    ids = anchors.dense_anchor_ids(np.array([[9, 2**63], [9, 5]], np.uint64), np.ones((2, 2), bool))
    np.testing.assert_array_equal(ids, [[1, 2], [1, 0]])
    assert ids.dtype == np.int32
    example = anchors.anchor_ids([["kitchen", "hall"], ["kitchen"]])
    np.testing.assert_array_equal(example.ids, [[1, 0], [1, -1]])
    observations = [["kitchen", "hall"], ["kitchen"], ["hall", "garden", "kitchen"]]
    result = anchors.anchor_ids(observations)
    assert sorted(np.unique(result.ids)) == [-1, 0, 1, 2]
    np.testing.assert_array_equal(result.mask, [[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    assert result.ids[0, 2] == -1 and result.ids[2, 2] == result.ids[0, 0]
    reordered = anchors.anchor_ids(observations[::-1])
    np.testing.assert_array_equal(reordered.ids, result.ids[::-1])
    assert anchors.anchor_ids(observations, num_steps=5).ids.shape == (3, 5)
    with pytest.raises(ValueError, match="observation_keys: a trajectory has 3 steps but num_steps=2"):
        anchors.anchor_ids(observations, num_steps=2)
    with pytest.raises(ValueError, match=r"dense_anchor_ids: keys has shape \(2,\) but mask has shape"):
        anchors.dense_anchor_ids(np.zeros(2, np.uint64), np.ones(3, bool))
    assert (anchors.dense_anchor_ids(np.zeros((2, 2)), np.zeros((2, 2), bool)) == -1).all()


def test_array_observations_hash_by_content():
    grid = np.zeros((3, 3), np.int8)
    moved = grid.copy()
    moved[1, 1] = 1
    result = anchors.anchor_ids([[grid, moved], [grid.copy()]])
    assert result.ids[0, 0] == result.ids[1, 0] != result.ids[0, 1]


def test_similarity_anchors():
    result = anchors.similarity_anchor_ids([["the cat sat", "x"], ["the cat sat."]], [0, 0])
    np.testing.assert_array_equal(result.ids, [[0, 1], [0, -1]])
    # Other groups never share an id, even for identical observations.
    other = anchors.similarity_anchor_ids([["the cat sat"], ["the cat sat"]], [4, 9])
    assert other.ids[0, 0] != other.ids[1, 0]
    # Below the threshold: separate clusters; threshold 1 is exact match.
    strict = anchors.similarity_anchor_ids([["the cat sat"], ["the cat sat."]], [0, 0], threshold=0.97)
    assert strict.ids[0, 0] != strict.ids[1, 0]
    texts = [["a b c d e f", "q"], ["a b c d e f", "q "], ["zz", "q"]]
    exact = anchors.similarity_anchor_ids(texts, [1, 1, 1], threshold=1.0)
    by_hash = anchors.anchor_ids(texts)
    same = exact.ids[:, :, None, None] == exact.ids[None, None]
    np.testing.assert_array_equal(same, by_hash.ids[:, :, None, None] == by_hash.ids[None, None])


def test_similarity_is_greedy_against_the_first_member():
    # "abcdefghij" ~ "abcdefghik" (0.9) and "abcdefghik" ~ "abcdefghkk" (0.9), but the first
    # and the last differ twice (0.8): the last starts its own cluster at threshold 0.85.
    result = anchors.similarity_anchor_ids([["abcdefghij"], ["abcdefghik"], ["abcdefghkk"]],
                                           [0, 0, 0], threshold=0.85)
    np.testing.assert_array_equal(result.ids[:, 0], [0, 0, 1])


def test_similarity_bad_input():
    with pytest.raises(ValueError, match="threshold=0.0"):
        anchors.similarity_anchor_ids([["a"]], [0], threshold=0.0)
    with pytest.raises(ValueError, match="group_ids has length 2 but there are 1 trajectories"):
        anchors.similarity_anchor_ids([["a"]], [0, 1])
    with pytest.raises(TypeError, match="trajectory 0 step 1 has a int"):
        anchors.similarity_anchor_ids([["a", 3]], [0])
    with pytest.raises(TypeError, match="sequence of B sequences"):
        anchors.anchor_ids("abc")
