"""Tree-GRPO in `stepcredit diagnose`: tree-structured episodes with their truth, a graded row."""

import numpy as np

from stepcredit.diagnose.config import DiagnoseConfig
from stepcredit.diagnose.episodes import stack
from stepcredit.diagnose.estimates import step_credit, trajectories, word_tokens
from stepcredit.diagnose.policies import EpsilonExpert
from stepcredit.diagnose.result import METRICS
from stepcredit.diagnose.run import diagnose
from stepcredit.diagnose.sample import sample_trees
from stepcredit.envs import registry
from stepcredit.train.tree import TreeShape

SHAPE = TreeShape(trees=2, branches=2, rounds=1)


def test_tree_grpo_gets_a_finite_row():
    diagnosis = diagnose(DiagnoseConfig(envs=("hotpotqa",), estimators=("tree_grpo", "grpo"),
                                        tasks=2, group_size=4, seeds=(0,), continuations=2,
                                        bootstrap=5), progress=False)
    for metric in ("auc", "spearman", "sign_agreement"):
        score = diagnosis.score("hotpotqa", "tree_grpo", metric)
        assert np.isfinite(score.estimate) and score.n > 0, metric
    assert set(METRICS) <= {s.metric for s in diagnosis.scores if s.estimator == "tree_grpo"}
    assert any("tree_grpo: graded on episodes of their own, each task's 4 leaves" in note
               for note in diagnosis.notes)
    assert not any("not run" in note for note in diagnosis.notes)


def test_branches_keep_their_parents_prefix_and_truth_and_replay_exactly():
    env = registry.make("alfworld", max_steps=8)
    episodes = sample_trees(env, EpsilonExpert(0.5), [3, 5], shape=SHAPE, seed=1,
                            continuations=2)
    assert len(episodes) == 2 * SHAPE.leaves_per_task
    assert [e.tree for e in episodes] == [t for t in range(4) for _ in range(3)]
    for tree in range(4):
        root, *branches = [e for e in episodes if e.tree == tree]
        for branch in branches:
            shared = next((t for t in range(min(root.length, branch.length))
                           if root.actions[t] != branch.actions[t]), root.length)
            assert shared >= 1  # every root is longer than one step here
            np.testing.assert_array_equal(branch.advantage[:shared], root.advantage[:shared])
            assert branch.observations[:shared] == root.observations[:shared]
            assert branch.deviation == root.deviation
    # Every episode replays on a fresh simulator with the recorded rewards.
    for e in episodes:
        fresh = registry.make("alfworld", max_steps=8)
        fresh.reset(e.task)
        np.testing.assert_allclose([fresh.step(a).reward for a in e.actions], e.rewards)
        assert not fresh.running
    # As trainer records: one tree id per (seed, tree), and tree_grpo's credit is finite.
    records = trajectories(episodes, [np.zeros(e.length) for e in episodes],
                           word_tokens(episodes), stack(episodes).group_ids)
    assert [r.tree_id for r in records] == [e.tree for e in episodes]
    credit, failures = step_credit(["tree_grpo"], episodes, stack(episodes),
                                   [np.zeros(e.length) for e in episodes], word_tokens(episodes))
    assert failures == {} and np.isfinite(credit["tree_grpo"]).all()

