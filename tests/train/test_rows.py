"""Step rows and the bridge between rows and the token view."""

import numpy as np
import pytest

from stepcredit import StepRecord, Trajectory, collate
from stepcredit.train.rows import (ROW_WIDTH_QUANTUM, build_rows, length_groups, rows_from_tokens,
                                   tokens_from_rows)


def trajectories():
    def step(prompt, action):
        return StepRecord(observation_ids=[1], action_ids=action, action_logp=[-0.5] * len(action),
                          reward=0.0, prompt_ids=prompt)
    return [Trajectory(steps=[step([5, 6, 7], [10, 11]), step([5, 8], [12])]),
            Trajectory(steps=[step([9] * 40, [13, 14, 15])])]


def test_rows_hold_prompt_then_action_and_index_the_token_view():
    rows, index = build_rows(trajectories(), num_steps=2, row_length=96, pad_id=0, multiple=4)
    assert rows.tokens.shape == (4, 64)  # 43 tokens rounded up to 64; 3 rows padded to 4
    np.testing.assert_array_equal(rows.tokens[0, :5], [5, 6, 7, 10, 11])
    np.testing.assert_array_equal(rows.action_mask[0, :6], [0, 0, 0, 1, 1, 0])
    np.testing.assert_array_equal(rows.first_action[1, :3], [0, 0, 1])
    np.testing.assert_array_equal(rows.valid, [True, True, True, False])
    np.testing.assert_array_equal(rows.trajectory[:3], [0, 0, 1])
    np.testing.assert_array_equal(rows.step[:3], [0, 1, 0])
    _, tokens, _ = collate(trajectories(), max_steps=2, with_observations=False)
    # Gathering the token view's ids onto rows recovers the rows' action tokens.
    gathered = np.asarray(rows_from_tokens(tokens.tokens.astype(np.float32), index, rows.action_mask))
    np.testing.assert_array_equal(gathered[rows.action_mask], rows.tokens[rows.action_mask])
    scattered = tokens_from_rows(rows.tokens.astype(np.float32), index, rows.action_mask,
                                 tokens.tokens.shape)
    np.testing.assert_array_equal(np.asarray(scattered)[tokens.action_mask],
                                  tokens.tokens[tokens.action_mask])


def test_missing_prompt_ids_and_overlong_rows_are_named():
    bare = [Trajectory(steps=[StepRecord([1], [2], [-0.1], 0.0)])]
    with pytest.raises(ValueError, match=r"trajectories\[0\].steps\[0\] has no prompt_ids"):
        build_rows(bare, num_steps=1, row_length=8, pad_id=0, multiple=1)
    with pytest.raises(ValueError, match=r"needs 43 tokens > row_length 32"):
        build_rows(trajectories()[1:], num_steps=1, row_length=32, pad_id=0, multiple=1)


def test_length_groups_partition_rows_into_chunks_cut_to_their_longest_row():
    lengths = np.array([300, 5, 40, 0, 65, 200, 64, 31])
    fixed = length_groups(lengths, 2, limit=320)
    # Sorted by length: (0, 5), (31, 40), (64, 65), (200, 300); widths rounded up to 64.
    assert [sorted(lengths[c].tolist()) for c, _ in fixed] == [[0, 5], [31, 40], [64, 65],
                                                                [200, 300]]
    assert [w for _, w in fixed] == [64, 64, 128, 320]
    shuffled = length_groups(lengths, 2, limit=320, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(np.sort(np.concatenate([c for c, _ in shuffled])), np.arange(8))
    for chunk, width in shuffled:
        assert lengths[chunk].max() <= width <= 320 and width % ROW_WIDTH_QUANTUM == 0
    assert length_groups(lengths, 4, limit=256)[-1][1] == 256  # never wider than the rows
    with pytest.raises(ValueError, match="not a multiple of size 3"):
        length_groups(lengths, 3, limit=320)
