"""MT-GRPO (per-turn and pooled turn baselines) against its NumPy loop reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import stepcredit
from stepcredit.advantages import group, registry
from stepcredit.advantages.istar import istar
from stepcredit.advantages.mt_grpo import mt_grpo
from tests.reference import mt_grpo as ref

B, T = 12, 5

_mt = jax.jit(mt_grpo, static_argnames=("turn_baseline", "final_turn", "std",
                                                 "num_groups", "axis_name"))


def _close(actual, expected, tol=1e-5):
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol * scale)


def _batch(seed, *, equal_lengths=False):
    """Prefix masks of random length (an all-masked row, a singleton group, an all-equal group)."""
    rng = np.random.default_rng(seed)
    lengths = np.full(B, T) if equal_lengths else rng.integers(1, T + 1, size=B)
    if not equal_lengths:
        lengths[4] = 0                                   # all masked
    mask = np.arange(T)[None, :] < lengths[:, None]
    ids = rng.choice(np.array([7, -3, 1000], np.int32), size=B)
    ids[-1] = 99                                         # singleton
    ids[:3] = 5                                          # all-equal group
    rewards = rng.integers(0, 3, size=(B, T)).astype(np.float32) * 0.5
    rewards[:3] = 1.0
    rewards[~mask] = np.nan
    scores = rng.integers(0, 2, size=B).astype(np.float32)
    scores[:3] = 1.0
    return rewards, scores, ids, mask


@pytest.mark.parametrize("turn_baseline", ["per_turn", "pooled"])
@pytest.mark.parametrize("final_turn", ["outcome", "both"])
@pytest.mark.parametrize("std", ["unbiased", "none"])
def test_matches_reference(turn_baseline, final_turn, std):
    for seed in range(3):
        rewards, scores, ids, mask = _batch(seed)
        expected = ref.mt_grpo(rewards, scores, ids, mask, 0.7, turn_baseline, final_turn, std)
        kwargs = dict(lam=0.7, turn_baseline=turn_baseline, final_turn=final_turn, std=std)
        if seed == 0:
            _close(mt_grpo(rewards, scores, ids, mask, **kwargs), expected)
        out = _mt(rewards, scores, ids, mask, **kwargs)
        _close(out, expected)
        assert np.all(np.isfinite(np.asarray(out))) and not np.asarray(out)[~mask].any()
        assert not np.asarray(out)[:3].any()             # all-equal group
        if turn_baseline == "per_turn":                  # a singleton group: nothing to compare
            assert not np.asarray(out)[-1].any()


def test_docstring_example():
    rewards = np.array([[1, 0], [0, 0], [1, np.nan]], np.float32)
    scores, ids = np.array([1.0, 0.0, 0.0], np.float32), np.array([0, 0, 0])
    mask = np.array([[1, 1], [1, 1], [1, 0]], bool)
    expected = [[1.8618, 1.1547], [-1.2845, -0.5774], [-0.5774, 0.0]]
    for turn_baseline in ("per_turn", "pooled"):
        _close(_mt(rewards, scores, ids, mask, turn_baseline=turn_baseline), expected, 1e-4)


def test_per_turn_and_pooled_differ_when_a_trajectory_stops_early():
    # Trajectory 1 stops after one turn; the others reach turn 2. Per turn index, turn 1 is
    # compared with turn-1 rewards only; pooled, with every credited turn of the group.
    rewards = np.array([[0, 1, 0], [1, 0, 0], [0, 0, 0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1]], bool)
    scores, ids = np.zeros(3, np.float32), np.zeros(3, np.int32)
    per_turn = np.asarray(_mt(rewards, scores, ids, mask))
    pooled = np.asarray(_mt(rewards, scores, ids, mask, turn_baseline="pooled"))
    # turn 1 of rows 0 and 2 (row 1's turn 1 is its last): rewards 1 and 0, ±0.7071 per turn.
    _close(per_turn[[0, 2], 1], [0.70711, -0.70711], 1e-4)
    # pooled: credited rewards [0, 1 | 1 | 0, 0], mean 0.4, std 0.5477.
    _close(pooled[0, :2], [-0.4 / 0.54772, 0.6 / 0.54772], 1e-4)
    assert not np.allclose(per_turn, pooled)


# --- reductions to existing estimators ----------------------------------------------------------

@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_one_turn_trajectories_reduce_to_grpo(seed):
    """Every trajectory a single turn: both variants are GRPO of the scores at that turn."""
    rewards, scores, ids, _ = _batch(seed)
    mask = np.zeros((B, T), bool)
    mask[:, 0] = True
    expected = np.asarray(group.grpo(scores, ids))
    for turn_baseline in ("per_turn", "pooled"):
        out = np.asarray(_mt(rewards, scores, ids, mask, turn_baseline=turn_baseline, lam=0.3))
        _close(out[:, 0], expected)
        assert not out[:, 1:].any()


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lam=st.sampled_from([1.0, 0.5, 2.0]))
def test_pooled_with_every_turn_credited_is_istar_grpo(seed, lam):
    """final_turn="both", pooled: lam times iStar(episode="grpo", alpha=1/lam)."""
    rewards, scores, ids, mask = _batch(seed)
    out = _mt(rewards, scores, ids, mask, lam=lam, turn_baseline="pooled", final_turn="both")
    expected = lam * np.asarray(istar(scores, rewards, ids, mask, alpha=1.0 / lam,
                                            episode="grpo"))
    _close(out, expected, 1e-4)


def test_equal_lengths_and_both_make_per_turn_a_per_index_grpo():
    """All trajectories of equal length, final_turn="both": A^T at turn t is GRPO of column t."""
    rewards, scores, ids, mask = _batch(3, equal_lengths=True)
    out = np.asarray(_mt(rewards, scores, ids, mask, final_turn="both"))
    outcome = np.asarray(group.grpo(scores, ids))
    for t in range(T):
        _close(out[:, t], np.asarray(group.grpo(rewards[:, t], ids)) + outcome)


# --- jit, vmap, shard_map ---------------------------------------------------------------------

def test_vmap_equals_loop():
    batches = [_batch(seed) for seed in range(3)]
    stacked = [np.stack([b[k] for b in batches]) for k in range(4)]
    out = jax.jit(jax.vmap(lambda r, s, g, m: mt_grpo(r, s, g, m,
                                                              turn_baseline="per_turn")))(*stacked)
    for k, b in enumerate(batches):
        _close(out[k], _mt(*b))


@pytest.mark.parametrize("turn_baseline", ["per_turn", "pooled"])
def test_shard_map_with_groups_spanning_devices(mesh4, turn_baseline):
    rewards, scores, _, mask = _batch(6)
    ids = np.arange(B, dtype=np.int32) % 3
    sharded = jax.jit(jax.shard_map(
        lambda r, s, g, m: mt_grpo(r, s, g, m, turn_baseline=turn_baseline, num_groups=3,
                                           axis_name="data"),
        mesh=mesh4, in_specs=P("data"), out_specs=P("data")))
    _close(sharded(rewards, scores, ids, mask),
           _mt(rewards, scores, ids, mask, turn_baseline=turn_baseline, num_groups=3))


# --- bad input and the registry -----------------------------------------------------------------

def test_bad_input_gives_clear_errors():
    rewards, scores, ids, mask = (jnp.zeros((2, 3)), jnp.zeros(2), jnp.zeros(2, jnp.int32),
                                  jnp.ones((2, 3), bool))
    with pytest.raises(ValueError, match=r"mt_grpo: step_rewards has shape \(2, 4\) but mask"):
        mt_grpo(jnp.zeros((2, 4)), scores, ids, mask)
    with pytest.raises(ValueError, match=r"mt_grpo: scores has shape \(3,\); it must be \[B\]"):
        mt_grpo(rewards, jnp.zeros(3), ids, mask)
    with pytest.raises(ValueError, match=r"mt_grpo: step_rewards is not finite at index \(0, 1\)"):
        mt_grpo(rewards.at[0, 1].set(jnp.nan), scores, ids, mask)
    with pytest.raises(ValueError, match="mt_grpo: turn_baseline='per_index'"):
        mt_grpo(rewards, scores, ids, mask, turn_baseline="per_index")
    with pytest.raises(ValueError, match="mt_grpo: final_turn='turn'"):
        mt_grpo(rewards, scores, ids, mask, final_turn="turn")
    with pytest.raises(TypeError, match="mt_grpo: group_ids has dtype float32"):
        mt_grpo(rewards, scores, jnp.zeros(2), mask)
    with pytest.raises(ValueError, match="mt_grpo: eps=-1.0"):
        mt_grpo(rewards, scores, ids, mask, eps=-1.0)
    with pytest.raises(ValueError) as raised:
        mt_grpo(rewards, scores, ids, mask[:, :2])
    assert "\n" not in str(raised.value)                 # one line


def test_registry_entries_and_exports():
    rewards, scores, ids, mask = _batch(8)
    inputs = registry.CreditInputs(mask=mask, step_rewards=rewards, scores=scores, group_ids=ids)
    for name, turn_baseline in (("mt_grpo", "per_turn"), ("mt_grpo_pooled", "pooled")):
        entry = registry.get(name)
        assert entry.output_level == "step" and entry.whiten == "none"
        assert dict(entry.defaults) == {"lam": 1.0, "final_turn": "outcome", "std": "unbiased",
                                        "eps": 1e-6, "turn_baseline": turn_baseline}
        assert "arXiv 2505.11821" in entry.paper
        _close(registry.apply(name, inputs).advantages,
               ref.mt_grpo(rewards, scores, ids, mask, turn_baseline=turn_baseline))
    assert stepcredit.advantages.mt_grpo is mt_grpo
