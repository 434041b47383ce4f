"""Step-level records and their collation into StepBatch / TokenBatch."""

import numpy as np
import pytest

from stepcredit import StepRecord, Trajectory, collate, step_gae, step_rewards_from_tokens


def make_step(obs, act, reward=0.0, *, value=None, done=False, truncated=False, anchor=None,
              entropy=True):
    return StepRecord(observation_ids=list(obs), action_ids=list(act),
                      action_logp=[-0.5] * len(act), reward=reward, done=done, truncated=truncated,
                      action_entropy=[0.25 * (i + 1) for i in range(len(act))] if entropy else None,
                      value=value, anchor=anchor)


def two_trajectories():
    first = Trajectory(steps=[make_step([1, 2], [10, 11], 0.0, value=0.5, anchor=2**63 + 5),
                              make_step([3], [12], 1.0, value=0.7, done=True, anchor=4)], group_id=7)
    second = Trajectory(steps=[make_step([4], [13, 14, 15], 0.5, value=0.2, truncated=True)],
                        group_id=9, score=2.0, bootstrap_value=0.4)
    return [first, second]


def test_collate_builds_padded_step_and_token_views():
    steps, tokens, stats = collate(two_trajectories())
    np.testing.assert_array_equal(steps.mask, [[True, True], [True, False]])
    np.testing.assert_allclose(steps.reward, [[0.0, 1.0], [0.5, 0.0]])
    np.testing.assert_allclose(steps.value, [[0.5, 0.7], [0.2, 0.0]])
    np.testing.assert_array_equal(steps.done, [[False, True], [False, False]])
    np.testing.assert_array_equal(steps.truncated, [[False, False], [True, False]])
    np.testing.assert_allclose(steps.logp, [[-1.0, -0.5], [-1.5, 0.0]])
    np.testing.assert_allclose(steps.entropy, [[0.375, 0.25], [0.5, 0.0]])
    np.testing.assert_array_equal(steps.anchor, [[1, 0], [-1, -1]])  # dense ids, ranked by key
    np.testing.assert_array_equal(steps.group_id, [7, 9])
    np.testing.assert_allclose(steps.score, [1.0, 2.0])
    np.testing.assert_allclose(steps.bootstrap_value, [0.0, 0.4])
    np.testing.assert_array_equal(tokens.tokens, [[1, 2, 10, 11, 3, 12], [4, 13, 14, 15, 0, 0]])
    np.testing.assert_array_equal(tokens.step_index, [[-1, -1, 0, 0, -1, 1], [-1, 0, 0, 0, -1, -1]])
    np.testing.assert_array_equal(tokens.action_mask, tokens.step_index >= 0)
    np.testing.assert_allclose(tokens.logp[0], [0, 0, -0.5, -0.5, 0, -0.5])
    assert stats.truncated_by_steps == stats.truncated_by_tokens == 0


def test_collate_without_observations_keeps_action_tokens_only():
    _, tokens, _ = collate(two_trajectories(), with_observations=False)
    np.testing.assert_array_equal(tokens.tokens, [[10, 11, 12], [13, 14, 15]])
    np.testing.assert_array_equal(tokens.step_index, [[0, 0, 1], [0, 0, 0]])


def test_views_feed_the_estimators_consistently():
    steps, tokens, _ = collate(two_trajectories())
    token_rewards = np.zeros(tokens.tokens.shape, np.float32)
    # The environment's reward sits on each step's last action token.
    for b, trajectory in enumerate(two_trajectories()):
        for t, record in enumerate(trajectory.steps):
            token_rewards[b, np.nonzero(tokens.step_index[b] == t)[0][-1]] = record.reward
    np.testing.assert_allclose(step_rewards_from_tokens(token_rewards, tokens.step_index, 2), steps.reward)
    out = step_gae(steps.reward, steps.value, steps.mask, bootstrap_value=steps.bootstrap_value)
    np.testing.assert_allclose(out.advantages, [[0.5, 0.3], [0.7, 0.0]], atol=1e-6)


def test_fixed_limits_pad_to_the_requested_shape():
    steps, tokens, _ = collate(two_trajectories(), max_steps=4, max_tokens=10)
    assert steps.reward.shape == (2, 4) and tokens.tokens.shape == (2, 10)
    assert steps.mask.sum() == 3 and tokens.action_mask.sum() == 6


def test_over_long_trajectories_raise_unless_truncation_is_asked_for():
    long = Trajectory(steps=[make_step([1], [2], 0.1 * t, value=float(t)) for t in range(5)])
    with pytest.raises(ValueError, match=r"trajectories\[0\] has 5 steps, more than max_steps=3"):
        collate([long], max_steps=3)
    steps, _, stats = collate([long], max_steps=3, truncate=True)
    assert stats.truncated_by_steps == 1
    np.testing.assert_array_equal(steps.truncated, [[False, False, True]])
    np.testing.assert_allclose(steps.bootstrap_value, [3.0])  # the value of the first dropped step
    np.testing.assert_allclose(steps.score, [0.3])


def test_token_limit_cuts_only_at_step_boundaries():
    trajectory = Trajectory(steps=[make_step([1, 1], [2, 2], done=(t == 2)) for t in range(3)])
    with pytest.raises(ValueError, match="needs more than max_tokens=9"):
        collate([trajectory], max_tokens=9)
    steps, tokens, stats = collate([trajectory], max_tokens=9, truncate=True)
    assert stats.truncated_by_tokens == 1
    np.testing.assert_array_equal(steps.mask, [[True, True]])
    np.testing.assert_array_equal(steps.truncated, [[False, True]])
    assert tokens.tokens.shape == (1, 9) and tokens.action_mask.sum() == 4
    with pytest.raises(ValueError, match="first step alone does not fit"):
        collate([trajectory], max_tokens=3, truncate=True)


@pytest.mark.parametrize("step, message", [
    (StepRecord([1], [2, 3], [-0.1], 0.0), r"steps\[0\]: action_logp has length 1 but action_ids has length 2"),
    (StepRecord([1], [], [], 0.0), r"steps\[0\]: action_ids is empty"),
    (StepRecord([1], [2], [-0.1], float("nan")), r"steps\[0\]: reward is nan"),
    (StepRecord([1], [2], [-0.1], 0.0, action_entropy=[1.0, 2.0]), r"steps\[0\]: action_entropy has length 2"),
    (StepRecord([1], [2], [-0.1], 0.0, done=True, truncated=True), r"steps\[0\]: done and truncated are both set"),
    (StepRecord([1], [2], [-0.1], None), r"steps\[0\]: reward is None"),
    (StepRecord([1], [2, 3], [-0.1, float("nan")], 0.0), r"steps\[0\]: action_logp\[1\] is nan"),
    (StepRecord([1], [2], [-0.1], 0.0, action_entropy=[float("inf")]),
     r"steps\[0\]: action_entropy\[0\] is inf"),
    (StepRecord([1], [2], [-0.1], 0.0, anchor="room 1"),
     r"steps\[0\]: anchor is 'room 1' \(str\); it must be an int key"),
])
def test_malformed_records_are_named(step, message):
    good = Trajectory(steps=[make_step([1], [2])])
    with pytest.raises(ValueError, match=r"collate: trajectories\[1\]\." + message):
        collate([good, Trajectory(steps=[step])])


def test_an_id_beyond_int32_is_named():
    good = Trajectory(steps=[make_step([1], [2])])
    with pytest.raises(ValueError, match=r"collate: trajectories\[1\]\.group_id is 1099511627776"):
        collate([good, Trajectory(steps=[make_step([1], [2])], group_id=2**40)])


@pytest.mark.parametrize("ids, message", [
    (dict(group_id=1.5), r"group_id is 1.5 \(float\); it must be an int"),  # would join group 1
    (dict(group_id="task-7"), r"group_id is 'task-7' \(str\); it must be an int"),
    (dict(group_id=None), r"group_id is None \(NoneType\); it must be an int"),
    # Trajectory 0 has no tree id, so its tree is -1: a given -1 would join it.
    (dict(tree_id=-1), r"tree_id is -1; it must be >= 0"),
])
def test_ids_that_are_not_ints_are_named(ids, message):
    good = Trajectory(steps=[make_step([1], [2])])
    with pytest.raises(ValueError, match=r"collate: trajectories\[1\]\." + message):
        collate([good, Trajectory(steps=[make_step([1], [2])], **ids)])
    numpy_ids = Trajectory(steps=[make_step([1], [2], anchor=np.int64(3))], group_id=np.int32(4))
    steps, _, _ = collate([good, numpy_ids])
    assert steps.group_id.tolist() == [0, 4]


def test_empty_inputs_are_rejected():
    with pytest.raises(ValueError, match="trajectories is empty"):
        collate([])
    with pytest.raises(ValueError, match=r"trajectories\[0\] has no steps"):
        collate([Trajectory(steps=[])])
