"""Tree-GRPO's forests for a chat model: branches played on from snapshots of earlier episodes."""

import pytest

pytest.importorskip("tunix", reason="the llm tests need the tunix extra")

from stepcredit.envs import registry  # noqa: E402
from stepcredit.llm import checkpoint, tree  # noqa: E402
from stepcredit.train.tree import TreeShape  # noqa: E402
from tests.llm.checkpoints import write  # noqa: E402

SETTINGS = dict(max_new_tokens=6, temperature=1.0, window=1, invalid_action_penalty=0.1)


def test_each_branch_shares_its_parents_steps_and_plays_only_its_continuation(tmp_path):
    write(tmp_path / "model", "qwen3", seed=2)
    qwen = checkpoint.load(tmp_path / "model")

    def make_env():
        return registry.make("hotpotqa", max_steps=4)

    shape = TreeShape(trees=2, branches=2, rounds=1)
    leaves, metrics = tree.collect_trees(qwen, make_env, [3, 5], shape, seed=7, **SETTINGS)
    assert len(leaves) == 2 * shape.leaves_per_task == 12
    assert [t.group_id for t in leaves] == [0] * 6 + [1] * 6 and all(t.answer for t in leaves)
    assert [t.tree_id for t in leaves] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    shared = 0
    for root in range(0, 12, 3):
        for branch in leaves[root + 1:root + 3]:
            common = 0  # a branch reuses its root's step records up to its node
            while (common < len(branch.steps) and common < len(leaves[root].steps)
                   and branch.steps[common] is leaves[root].steps[common]):
                common += 1
            assert common >= 1 and branch.score == pytest.approx(sum(s.reward for s in branch.steps))
            shared += common
    assert metrics["tree/chain_env_steps"] == sum(len(t.steps) for t in leaves)
    assert metrics["tree/env_steps"] == metrics["tree/chain_env_steps"] - shared
    with pytest.raises(ValueError, match="only 'random' branching"):
        tree.collect_trees(qwen, make_env, [3], TreeShape(1, 1, 1, "entropy"), seed=7, **SETTINGS)
