"""Tree-GRPO against its NumPy loop reference and tied to GRPO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import stepcredit
from stepcredit.advantages import group, registry
from stepcredit.advantages.tree_grpo import tree_grpo
from stepcredit.batch import StepRecord, Trajectory, collate
from stepcredit.credit import compute_advantages
from tests.reference import tree_grpo as ref
from tests.test_gigpo import _close

B = 16

_tree_grpo = jax.jit(tree_grpo, static_argnames=("std", "singleton", "num_groups", "num_trees",
                                                 "axis_name"))


def _forest(seed):
    """Four tasks of trees of 1 to 4 leaves (a singleton tree, an all-equal tree), arbitrary ids."""
    rng = np.random.default_rng(seed)
    tasks = rng.choice(np.array([7, 1000, -3, 42], np.int32), size=B)
    tasks.sort()
    trees = np.empty(B, np.int32)
    tree, start = 500, 0
    while start < B:
        size = int(rng.integers(1, 5))
        stop = min(start + size, B)
        for k in range(start, stop):  # a tree never spans two tasks
            trees[k] = tree if tasks[k] == tasks[start] else tree + 1
        tree, start = tree + 2, stop
    scores = (rng.random(B) < 0.5).astype(np.float32) + rng.normal(size=B).astype(np.float32) * (
        seed % 2)
    order = rng.permutation(B)  # leaves of a tree need not be adjacent
    return scores[order], tasks[order], trees[order]


@pytest.mark.parametrize("std,singleton", [("unbiased", "zero"), ("biased", "raw"),
                                           ("none", "zero")])
def test_matches_reference(std, singleton):
    for seed in range(3):
        scores, tasks, trees = _forest(seed)
        expected = ref.tree_grpo(scores, tasks, trees, std=std, singleton=singleton)
        if seed == 0:
            _close(tree_grpo(scores, tasks, trees, std=std, singleton=singleton), expected)
        out = _tree_grpo(scores, tasks, trees, std=std, singleton=singleton)
        _close(out, expected)
        assert np.all(np.isfinite(np.asarray(out)))


def test_docstring_example():
    scores = jnp.array([1.0, 0, 0, 1, 1, 1])
    tasks = jnp.zeros(6, jnp.int32)
    trees = jnp.array([0, 0, 0, 1, 1, 1])
    intra = np.array([2 / np.sqrt(3), -1 / np.sqrt(3), -1 / np.sqrt(3), 0, 0, 0])
    spread = np.sqrt(np.sum((np.array([1, 0, 0, 1, 1, 1]) - 2 / 3) ** 2) / 5)
    inter = (np.array([1, 0, 0, 1, 1, 1]) - 2 / 3) / spread
    _close(_tree_grpo(scores, tasks, trees), intra + inter, 1e-4)
    _close(_tree_grpo(scores, tasks, trees), [1.8002, -1.8684, -1.8684, 0.6455, 0.6455, 0.6455],
           1e-4)
    _close(_tree_grpo(scores, tasks, trees, num_groups=1, num_trees=2), intra + inter, 1e-4)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_reduces_to_grpo_with_one_leaf_per_tree_and_to_twice_grpo_with_one_tree_per_task(seed):
    scores, tasks, _ = _forest(seed)
    grpo = np.asarray(group.grpo(scores, tasks))
    _close(_tree_grpo(scores, tasks, np.arange(B, dtype=np.int32)), grpo)
    _close(tree_grpo(scores, tasks), grpo)  # no tree ids: chain rollouts
    _close(_tree_grpo(scores, tasks, tasks + 3), 2.0 * grpo)


def test_vmap_and_shard_map_equal_eager(mesh4):
    forests = [_forest(seed) for seed in range(3)]
    scores, tasks, trees = (np.stack(x) for x in zip(*forests))
    out = jax.jit(jax.vmap(tree_grpo))(scores, tasks, trees)
    for k in range(3):
        _close(out[k], tree_grpo(scores[k], tasks[k], trees[k]))
    flat = scores[0]
    spread_tasks = np.arange(B, dtype=np.int32) % 2  # every task and tree spans devices
    spread_trees = np.arange(B, dtype=np.int32) % 6
    sharded = jax.jit(jax.shard_map(
        lambda s, g, t: tree_grpo(s, g, t, num_groups=2, num_trees=6, axis_name="data"),
        mesh=mesh4, in_specs=P("data"), out_specs=P("data")))
    _close(sharded(flat, spread_tasks, spread_trees), ref.tree_grpo(flat, spread_tasks, spread_trees))


def test_bad_input_gives_clear_errors():
    scores, tasks = jnp.ones(4), jnp.zeros(4, jnp.int32)
    with pytest.raises(ValueError, match=r"tree_grpo: tree_ids has shape \(3,\); it must be \[B\]"):
        tree_grpo(scores, tasks, jnp.array([0, 1, 2]))
    with pytest.raises(TypeError, match="tree_grpo: tree_ids has dtype float32"):
        tree_grpo(scores, tasks, jnp.zeros(4))
    with pytest.raises(ValueError, match=r"tree_grpo: tree 5 has leaves in the tasks \[0, 1\]"):
        tree_grpo(scores, jnp.array([0, 0, 1, 1]), jnp.array([5, 5, 5, 6]))
    with pytest.raises(ValueError, match=r"tree_grpo: tree_ids holds ids outside \[0, num_trees=2\)"):
        tree_grpo(scores, tasks, jnp.array([0, 1, 2, 0]), num_trees=2)
    with pytest.raises(ValueError, match=r"tree_grpo: std='x'") as raised:
        tree_grpo(scores, tasks, tasks, std="x")
    assert "\n" not in str(raised.value)


def test_registry_entry_collate_and_compute_advantages():
    entry = registry.get("tree_grpo")
    assert entry.output_level == "trajectory" and entry.whiten == "none"
    assert entry.recipe.rollout_trees and entry.needs_groups
    assert dict(entry.defaults) == {"std": "unbiased", "eps": 1e-6, "singleton": "zero"}
    assert "arXiv 2509.21240" in entry.paper and stepcredit.advantages.tree_grpo is tree_grpo
    step = StepRecord(observation_ids=[1], action_ids=[4, 5], action_logp=[-1.0, -1.0], reward=0.0)
    rewards, trees = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0], [0, 0, 0, 1, 1, None]
    trajectories = [Trajectory([step, StepRecord((1,), (4,), (-1.0,), r, done=True)], group_id=3,
                               tree_id=t) for r, t in zip(rewards, trees)]
    steps, tokens, _ = collate(trajectories, with_observations=False)
    np.testing.assert_array_equal(steps.tree_id, [0, 0, 0, 1, 1, -6])
    expected = ref.tree_grpo(rewards, [3] * 6, steps.tree_id)
    credit = compute_advantages(steps, tokens, "tree_grpo")
    _close(np.asarray(credit.step_advantages)[:, 0], expected)
    assert np.all(np.asarray(credit.token_advantages)[~tokens.action_mask] == 0)
