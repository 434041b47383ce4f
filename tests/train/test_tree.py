"""Tree rollouts: branches resume the exact state and prefix, leaf counts, keys, refusals."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from stepcredit.batch import StepRecord, Trajectory
from stepcredit.envs import registry, require_snapshots
from stepcredit.keys import stable_key
from stepcredit.models.transformer import TransformerConfig, TransformerPolicy
from stepcredit.rollout import RolloutConfig
from stepcredit.train.build import build, build_tokenizer, resolve
from stepcredit.train.collection import Collector
from stepcredit.train.config import TrainConfig
from stepcredit.train.tree import (BRANCHES_NEED, TreeShape, choose_nodes, collect_trees,
                                   step_entropies)

TASKS = [0, 3]
CONFIG = RolloutConfig(max_prompt_tokens=192, action_format="choice")  # every action is valid
SHAPE = TreeShape(trees=1, branches=2, rounds=2)


def _make():
    return registry.make("alfworld", difficulty=0, max_steps=4)


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_tokenizer("alfworld")
    model = TransformerPolicy(TransformerConfig(vocab_size=tokenizer.vocab_size, d_model=32,
                                                num_layers=1, num_heads=2, mlp_dim=64),
                              rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    return graphdef, state, tokenizer


@pytest.fixture(scope="module")
def forest(policy):
    graphdef, state, tokenizer = policy
    return collect_trees(graphdef, state, _make, TASKS, SHAPE, tokenizer, jax.random.key(3),
                         CONFIG)


def _same_step(a: StepRecord, b: StepRecord) -> bool:
    return (list(a.prompt_ids) == list(b.prompt_ids) and list(a.action_ids) == list(b.action_ids)
            and list(a.action_logp) == list(b.action_logp) and a.value == b.value
            and a.reward == b.reward and a.anchor == b.anchor)


def test_leaf_counts_groups_and_trees_are_as_configured(forest):
    leaves = forest.trajectories
    assert SHAPE.leaves_per_task == 1 * (1 + 2 * 2)
    assert len(leaves) == len(TASKS) * SHAPE.leaves_per_task
    assert forest.metrics["tree/leaves"] == SHAPE.leaves_per_task
    for tree in range(len(TASKS) * SHAPE.trees):
        members = [t for t in leaves if t.tree_id == tree]
        assert len(members) == SHAPE.leaves_per_tree
        assert {t.group_id for t in members} == {tree // SHAPE.trees}
    chain = sum(len(t.steps) for t in leaves)
    assert forest.metrics["tree/chain_env_steps"] == chain
    assert 0 < forest.metrics["tree/env_steps"] < chain  # the prefixes are not played again
    assert forest.metrics["tree/env_step_saving"] == pytest.approx(
        1 - forest.metrics["tree/env_steps"] / chain)
    assert forest.metrics["time/tree"] > 0 and 0 <= forest.metrics["rollout/success"] <= 1


def test_branches_share_their_parents_prefix_token_for_token(forest):
    leaves = forest.trajectories
    for tree in range(len(TASKS) * SHAPE.trees):
        members = [t for t in leaves if t.tree_id == tree]
        root = members[0]
        for k, branch in enumerate(members[1:], start=1):
            # Each branch shares a prefix (at least one step, when its tree had a step to expand)
            # with an earlier leaf of its tree, record for record.
            shared = max(next((t for t in range(min(len(branch.steps), len(other.steps)))
                               if not _same_step(branch.steps[t], other.steps[t])),
                              min(len(branch.steps), len(other.steps)))
                         for other in members[:k])
            assert shared >= 1 or len(root.steps) == 1
            assert branch.score == pytest.approx(sum(s.reward for s in branch.steps))


def test_branches_continue_from_the_restored_state(forest):
    """Replaying a leaf's actions on a fresh simulator reproduces every recorded answer."""
    for leaf in forest.trajectories:
        env = _make()
        observation = env.reset(TASKS[leaf.group_id])
        for step in leaf.steps:
            assert stable_key(observation.anchor) == step.anchor
            result = env.step(step.info["action"])
            assert result.reward == pytest.approx(step.reward) and result.done == step.done
            assert result.truncated == step.truncated
            observation = result.observation
        assert not env.running
        env.close()


def test_the_forest_is_a_function_of_the_key(policy, forest):
    graphdef, state, tokenizer = policy
    again = collect_trees(graphdef, state, _make, TASKS, SHAPE, tokenizer, jax.random.key(3),
                          CONFIG)
    ids = lambda r: [[tuple(s.action_ids) for s in t.steps] for t in r.trajectories]
    assert ids(again) == ids(forest)
    other = collect_trees(graphdef, state, _make, TASKS, SHAPE, tokenizer, jax.random.key(4),
                          CONFIG)
    assert ids(other) != ids(forest)


def test_node_choice_rules_and_the_group_size_mapping():
    root, branch = [0.1, 0.9, 0.5, 2.0], [0.1, 0.9, 0.7, 1.5]
    rng = np.random.default_rng(0)
    # Expandable (leaf, prefix): the root's steps before its last, and the branch's own steps
    # (from its step 2) before its last; a node's entropy is that of the step it samples again.
    assert choose_nodes([root, branch], [0, 2], 2, "entropy", rng) == [(0, 3), (1, 3)]
    assert sorted(choose_nodes([root, branch], [0, 2], 4, "random", rng)) == [
        (0, 1), (0, 2), (0, 3), (1, 3)]
    assert len(set(choose_nodes([root, branch], [0, 2], 6, "random", rng))) == 4
    assert choose_nodes([[1.0]], [0], 2, "random", rng) == [None, None]  # branches at the root
    steps = [StepRecord((), (1, 2), (0.0, 0.0), 0.0, action_entropy=(0.5, 1.5)),
             StepRecord((), (1,), (0.0,), 0.0)]
    assert step_entropies(Trajectory(steps)) == [1.0, 0.0]
    assert dataclasses.astuple(TreeShape.for_group_size(8)) == (2, 3, 1, "random")
    assert TreeShape.for_group_size(2).leaves_per_task == 2
    assert TreeShape.for_group_size(16, rounds=3).leaves_per_task == 16


def test_environments_without_snapshots_are_refused_in_one_line():
    class Plain:
        name, max_steps = "plainenv", 3

    with pytest.raises(ValueError, match="environment 'plainenv' has no snapshot") as raised:
        require_snapshots(Plain(), BRANCHES_NEED)
    assert "\n" not in str(raised.value)


def test_the_trainer_collects_forests_for_estimators_whose_recipe_plays_trees():
    config = TrainConfig(env="alfworld", estimator="tree_grpo", tasks_per_iteration=2,
                         group_size=2, max_steps=3, d_model=32, num_layers=1,
                         rollout=RolloutConfig(max_prompt_tokens=96, max_action_tokens=6))
    parts, state = build(config)
    # The derived forest is written out: G = 2 leaves per task, one tree with one branch.
    assert (parts.config.tree_count, parts.config.tree_branches, parts.config.tree_rounds) == (
        1, 1, 1)
    rollout, _ = Collector(parts).batch(state.policy, 0, jax.random.key(0), 3)
    assert len(rollout.trajectories) == 2 * 2
    assert [t.tree_id for t in rollout.trajectories] == [0, 0, 1, 1]
    assert rollout.metrics["tree/leaves"] == 2 and rollout.metrics["tree/env_steps"] > 0
    assert rollout.metrics["time/tree"] > 0
    with pytest.raises(ValueError, match="dynamic sampling refills groups"):
        resolve(dataclasses.replace(config, dynamic_sampling=True))
