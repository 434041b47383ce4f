"""iStar: implicit step rewards, the trajectory preference loss and the combined advantage."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from stepcredit import advantages as adv
from stepcredit.advantages import group, registry
from stepcredit.advantages.istar import implicit_step_rewards, istar, trajectory_preference_loss
from tests.reference import istar as ref

B, T, N = 8, 4, 16
IDS = np.array([5, 5, 5, -2, -2, 11, 11, 40])  # groups span devices; 40 is a singleton
_istar = jax.jit(istar, static_argnames=("episode", "step_baseline", "std", "num_groups",
                                         "axis_name"))
_loss = jax.jit(trajectory_preference_loss, static_argnames=("reduce", "num_groups", "num_steps",
                                                             "axis_name"))
_rewards = jax.jit(implicit_step_rewards, static_argnames=("num_steps", "normalize", "axis_name"))


def _token_view(seed):
    """Token log-probs with observation gaps; row 1 has no action token at all."""
    rng = np.random.default_rng(seed)
    step_index = np.full((B, N), -1, np.int32)
    for b in range(B):
        position = 0
        for t in range(0 if b == 1 else rng.integers(1, T + 1)):
            position += rng.integers(0, 2)
            width = rng.integers(1, 3)
            step_index[b, position:position + width] = t
            position += width
    action = step_index >= 0
    prm_logp = np.where(action, rng.uniform(-3.0, 0.0, (B, N)), np.nan).astype(np.float32)
    ref_logp = np.where(action, rng.uniform(-3.0, 0.0, (B, N)), np.nan).astype(np.float32)
    success = rng.random(B) < 0.5
    success[[0, 3]] = True, True
    success[[2, 4]] = False, False
    return prm_logp, ref_logp, action, step_index, success


def _step_batch(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    mask = np.arange(T)[None, :] < lengths[:, None]
    mask[2] = [False, True, False, True]  # the first valid step is not step 0
    rewards = np.where(mask, rng.normal(scale=0.3, size=(B, T)), np.nan).astype(np.float32)
    scores = rng.integers(0, 3, size=B).astype(np.float32)
    return scores, rewards, mask


def _close(actual, expected, rtol=1e-5):
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.asarray(actual), expected, atol=rtol * scale, rtol=0)


# --- implicit step rewards ------------------------------------------------------------------

@pytest.mark.parametrize("normalize", [None, "max_abs"])
def test_implicit_step_rewards_match_reference(normalize):
    for seed in range(3):
        prm_logp, ref_logp, _, step_index, _ = _token_view(seed)
        out = _rewards(prm_logp, ref_logp, step_index, num_steps=T, beta=0.05, normalize=normalize)
        _close(out, ref.implicit_step_rewards(prm_logp, ref_logp, step_index, T, 0.05, normalize))
    if normalize == "max_abs":
        assert float(jnp.max(jnp.abs(out))) == pytest.approx(1.0)


def test_implicit_step_rewards_docstring_example():
    args = (jnp.array([[-1.0, -1.0, 9.0, -2.0]]), jnp.array([[-2.0, -1.5, 0.0, -1.0]]),
            jnp.array([[0, 0, -1, 1]]), 2)
    np.testing.assert_allclose(implicit_step_rewards(*args, beta=0.5), [[0.75, -0.5]], atol=1e-6)
    np.testing.assert_allclose(implicit_step_rewards(*args, beta=0.5, normalize="max_abs"),
                               [[1.0, -2 / 3]], atol=1e-6)


def test_max_abs_guards_an_all_zero_batch():
    logp = np.full((2, 3), -1.0, np.float32)
    out = implicit_step_rewards(logp, logp, np.zeros((2, 3), np.int32), 2, normalize="max_abs")
    np.testing.assert_array_equal(out, np.zeros((2, 2)))


def test_implicit_step_rewards_sharded(mesh4):
    prm_logp, ref_logp, _, step_index, _ = _token_view(3)
    sharded = jax.jit(jax.shard_map(
        functools.partial(implicit_step_rewards, num_steps=T, normalize="max_abs",
                          axis_name="data"),
        mesh=mesh4, in_specs=P("data"), out_specs=P("data")))
    np.testing.assert_allclose(sharded(prm_logp, ref_logp, step_index),
                               _rewards(prm_logp, ref_logp, step_index, num_steps=T,
                                        normalize="max_abs"), atol=1e-6)


# --- trajectory preference loss -------------------------------------------------------------

@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_preference_loss_matches_reference(reduce):
    for seed in range(3):
        prm_logp, ref_logp, action, step_index, success = _token_view(seed)
        loss, metrics = _loss(prm_logp, ref_logp, action, step_index, success, IDS, beta=0.5,
                              reduce=reduce)
        expected, pairs, accuracy = ref.preference_loss(prm_logp, ref_logp, action, step_index,
                                                        success, IDS, 0.5, reduce)
        assert pairs > 0 and float(metrics["num_pairs"]) == pairs
        assert float(loss) == pytest.approx(expected, rel=1e-5)
        assert float(metrics["accuracy"]) == pytest.approx(accuracy)


def test_preference_loss_hand_computed_group():
    # Two successes and two failures with Q = [1, 0, 0, -1]: pair margins 1, 2, 0, 1.
    q = jnp.array([[1.0], [0.0], [0.0], [-1.0]])
    loss, metrics = trajectory_preference_loss(q, jnp.zeros_like(q), jnp.ones((4, 1), bool),
                                               jnp.zeros((4, 1), jnp.int32),
                                               jnp.array([True, True, False, False]),
                                               jnp.array([3, 3, 3, 3]), beta=1.0)
    expected = np.mean(np.log1p(np.exp(-np.array([1.0, 2.0, 0.0, 1.0]))))
    assert float(loss) == pytest.approx(expected, rel=1e-6) and expected == pytest.approx(0.36165,
                                                                                         abs=1e-5)
    assert float(metrics["num_pairs"]) == 4.0
    assert float(metrics["accuracy"]) == 0.75 and float(metrics["margin"]) == 1.0


def test_preference_loss_pairs_only_within_groups_and_over_all_pairs():
    # Group 0 has 1 x 1 pair, group 1 has 2 x 1 pairs: the batch mean weights pairs, not groups.
    q = jnp.array([[2.0], [0.0], [1.0], [1.0], [0.0], [9.0]])
    success = jnp.array([True, False, True, True, False, True])
    ids = jnp.array([0, 0, 1, 1, 1, 2])
    loss, metrics = trajectory_preference_loss(q, jnp.zeros_like(q), jnp.ones((6, 1), bool),
                                               jnp.zeros((6, 1), jnp.int32), success, ids, beta=1.0)
    expected = np.mean(np.log1p(np.exp(-np.array([2.0, 1.0, 1.0]))))
    assert float(metrics["num_pairs"]) == 3.0 and float(loss) == pytest.approx(expected, rel=1e-6)


def test_preference_loss_is_invariant_to_permuting_trajectories():
    prm_logp, ref_logp, action, step_index, success = _token_view(4)
    perm = np.random.default_rng(4).permutation(B)
    loss, metrics = _loss(prm_logp, ref_logp, action, step_index, success, IDS, reduce="mean")
    permuted, permuted_metrics = _loss(prm_logp[perm], ref_logp[perm], action[perm],
                                       step_index[perm], success[perm], IDS[perm], reduce="mean")
    assert float(permuted) == pytest.approx(float(loss), rel=1e-6)
    assert float(permuted_metrics["num_pairs"]) == float(metrics["num_pairs"])


def test_no_pair_gives_zero_loss_and_zero_gradient():
    prm_logp, ref_logp, action, step_index, _ = _token_view(0)
    success = np.ones(B, bool)
    grad_fn = jax.grad(lambda p: trajectory_preference_loss(p, ref_logp, action, step_index,
                                                            success, IDS)[0])
    loss, metrics = trajectory_preference_loss(prm_logp, ref_logp, action, step_index, success, IDS)
    grad = grad_fn(prm_logp)
    assert float(loss) == 0.0 and float(metrics["num_pairs"]) == 0.0
    assert float(metrics["accuracy"]) == 0.0
    np.testing.assert_array_equal(grad, np.zeros((B, N)))


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_gradient_step_raises_successful_implicit_rewards(reduce):
    prm_logp, ref_logp, action, step_index, success = _token_view(1)
    grad = jax.grad(lambda p: _loss(p, ref_logp, action, step_index, success, IDS,
                                    reduce=reduce)[0])(jnp.asarray(prm_logp))
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[~action] == 0.0)
    before = ref.trajectory_scores(prm_logp, ref_logp, action, step_index, 0.05, reduce)
    after = ref.trajectory_scores(prm_logp - 1.0 * np.asarray(grad), ref_logp, action, step_index,
                                  0.05, reduce)
    present = action.any(axis=1)
    paired = present & np.array([any(present[j] and success[j] != success[i] and IDS[j] == IDS[i]
                                     for j in range(B)) for i in range(B)])
    assert np.all(after[paired & success] > before[paired & success])
    assert np.all(after[paired & ~success] < before[paired & ~success])
    loss_before = _loss(prm_logp, ref_logp, action, step_index, success, IDS, reduce=reduce)[0]
    loss_after = _loss(prm_logp - np.asarray(grad), ref_logp, action, step_index, success, IDS,
                       reduce=reduce)[0]
    assert float(loss_after) < float(loss_before)


def test_preference_loss_sharded_values_and_gradient(mesh4):
    prm_logp, ref_logp, action, step_index, success = _token_view(2)

    def sharded(p):
        body = functools.partial(trajectory_preference_loss, axis_name="data")
        return jax.shard_map(body, mesh=mesh4, in_specs=P("data"), out_specs=P())(
            p, ref_logp, action, step_index, success, IDS)

    (loss, metrics), (expected, expected_metrics) = (jax.jit(sharded)(prm_logp),
                                                     _loss(prm_logp, ref_logp, action, step_index,
                                                           success, IDS))
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    for key in expected_metrics:
        assert float(metrics[key]) == pytest.approx(float(expected_metrics[key]), rel=1e-6)
    grad = jax.jit(jax.grad(lambda p: sharded(p)[0]))(prm_logp)
    expected_grad = jax.grad(lambda p: _loss(p, ref_logp, action, step_index, success, IDS)[0])(
        prm_logp)
    np.testing.assert_allclose(grad, expected_grad, atol=1e-7)


# --- the combined advantage -----------------------------------------------------------------

@pytest.mark.parametrize("episode,std", [("rloo", "unbiased"), ("grpo", "unbiased"),
                                         ("grpo", "none")])
@pytest.mark.parametrize("step_baseline", ["all_steps", "first_step"])
def test_istar_matches_reference(episode, std, step_baseline):
    for seed in range(2):
        scores, rewards, mask = _step_batch(seed)
        kwargs = dict(alpha=0.7, episode=episode, step_baseline=step_baseline, std=std)
        out = _istar(scores, rewards, IDS, mask, **kwargs)
        _close(out, ref.istar(scores, rewards, IDS, mask, **kwargs), 2e-5)
        assert np.all(np.asarray(out)[~mask] == 0.0)


ISTAR_FIXTURE = dict(
    scores=np.array([1.0, 1.0, 0.0, 0.0], np.float32),
    step_rewards=np.array([[0.3, 0.1], [0.2, np.nan], [-0.1, -0.3], [0.0, np.nan]], np.float32),
    group_ids=np.array([9, 9, 9, 9]),
    mask=np.array([[True, True], [True, False], [True, True], [True, False]]))


def test_istar_hand_computed_group():
    # A^E = 4/3 (s - 0.5); the 6 step rewards have mean 1/30, so A^S = 6/5 (r - 1/30).
    out = istar(**ISTAR_FIXTURE)
    expected = [[0.98667, 0.74667], [0.86667, 0.0], [-0.82667, -1.06667], [-0.70667, 0.0]]
    np.testing.assert_allclose(out, expected, atol=1e-5)
    # The authors' code: the baseline holds first steps only {0.3, 0.2, -0.1, 0} (mean 0.1, M = 4).
    first = istar(**ISTAR_FIXTURE, step_baseline="first_step")
    a_e = np.array([2, 2, -2, -2])[:, None] / 3
    expected = np.where(ISTAR_FIXTURE["mask"],
                        a_e + 4 / 3 * (np.nan_to_num(ISTAR_FIXTURE["step_rewards"]) - 0.1), 0.0)
    np.testing.assert_allclose(first, expected, atol=1e-5)


def test_istar_end_to_end_from_token_log_probs():
    # Step rewards from the PRM, then the combined advantage: successful steps up, failed down.
    prm_logp = jnp.array([[-0.5, -0.4, 0.0], [-0.6, 0.0, 0.0], [-2.0, -1.8, 0.0], [-1.5, 0.0, 0.0]])
    ref_logp = jnp.full((4, 3), -1.0)
    step_index = jnp.array([[0, 1, -1], [0, -1, -1], [0, 1, -1], [0, -1, -1]])
    rewards = implicit_step_rewards(prm_logp, ref_logp, step_index, 2, beta=1.0)
    mask = ISTAR_FIXTURE["mask"]  # the steps that have action tokens
    out = np.asarray(istar(ISTAR_FIXTURE["scores"], rewards, ISTAR_FIXTURE["group_ids"], mask))
    assert np.all(out[:2][mask[:2]] > 0) and np.all(out[2:][mask[2:]] < 0)


@settings(max_examples=8)
@given(seed=st.integers(0, 2**16), episode=st.sampled_from(["rloo", "grpo"]))
def test_alpha_zero_equals_the_episode_estimator(seed, episode):
    scores, rewards, mask = _step_batch(seed)
    out = _istar(scores, rewards, IDS, mask, alpha=0.0, episode=episode)
    base = (group.rloo if episode == "rloo" else group.grpo)(scores, IDS)
    np.testing.assert_allclose(out, np.where(mask, np.asarray(base)[:, None], 0.0), atol=1e-6)


@settings(max_examples=8)
@given(seed=st.integers(0, 2**16), step_baseline=st.sampled_from(["all_steps", "first_step"]))
def test_permuting_trajectories_permutes_outputs(seed, step_baseline):
    scores, rewards, mask = _step_batch(seed)
    perm = np.random.default_rng(seed).permutation(B)
    out = np.asarray(_istar(scores, rewards, IDS, mask, step_baseline=step_baseline))
    permuted = _istar(scores[perm], rewards[perm], IDS[perm], mask[perm],
                      step_baseline=step_baseline)
    np.testing.assert_allclose(permuted, out[perm], atol=1e-5)


@pytest.mark.parametrize("step_baseline", ["all_steps", "first_step"])
def test_istar_jit_vmap_and_shard_map_agree(mesh4, step_baseline):
    batches = [_step_batch(seed) for seed in range(2)]
    eager = [np.asarray(istar(s, r, IDS, m, step_baseline=step_baseline)) for s, r, m in batches]
    np.testing.assert_allclose(_istar(*batches[0][:2], IDS, batches[0][2],
                                      step_baseline=step_baseline), eager[0], atol=1e-6)
    scores, rewards, mask = (np.stack(parts) for parts in zip(*batches))
    vmapped = jax.vmap(functools.partial(istar, step_baseline=step_baseline),
                       in_axes=(0, 0, None, 0))(scores, rewards, IDS, mask)
    np.testing.assert_allclose(vmapped, np.stack(eager), atol=1e-6)
    sharded = jax.jit(jax.shard_map(
        functools.partial(istar, step_baseline=step_baseline, axis_name="data"),
        mesh=mesh4, in_specs=P("data"), out_specs=P("data")))
    np.testing.assert_allclose(sharded(*batches[0][:2], IDS, batches[0][2]), eager[0], atol=1e-6)


def test_singleton_and_all_equal_groups_give_the_episode_part_only():
    mask = np.array([[True, True], [True, True], [True, False]])
    rewards = np.array([[0.5, 0.5], [0.5, 0.5], [2.0, np.nan]], np.float32)
    out = istar(np.array([1.0, 0.0, 3.0], np.float32), rewards, np.array([0, 0, 1]), mask)
    np.testing.assert_allclose(out, [[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]], atol=1e-6)


def test_all_false_mask_gives_zeros():
    out = istar(np.ones(B, np.float32), np.full((B, T), np.nan, np.float32), IDS,
                np.zeros((B, T), bool))
    np.testing.assert_array_equal(out, np.zeros((B, T)))


def test_bad_inputs_raise_naming_the_argument():
    scores, rewards, mask = _step_batch(0)
    with pytest.raises(ValueError, match=r"istar: scores has shape \(7,\)"):
        istar(scores[:7], rewards, IDS, mask)
    with pytest.raises(ValueError, match=r"istar: group_ids has shape \(6,\)"):
        istar(scores, rewards, IDS[:6], mask)
    bad = scores.copy()
    bad[3] = np.nan
    with pytest.raises(ValueError, match=r"istar: scores is not finite at index \(3,\)"):
        istar(bad, rewards, IDS, mask)
    bad = rewards.copy()
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match=r"istar: step_rewards is not finite at index \(0, 0\)"):
        istar(scores, bad, IDS, mask)
    with pytest.raises(ValueError, match="group_ids holds -2 but num_groups=12"):
        istar(scores, rewards, IDS, mask, num_groups=12)
    with pytest.raises(ValueError, match=r"istar: step_rewards has shape \(8, 4\) but mask"):
        istar(scores, rewards, IDS, mask[:, :3])
    with pytest.raises(ValueError, match="istar: episode='ppo'"):
        istar(scores, rewards, IDS, mask, episode="ppo")
    prm_logp, ref_logp, action, step_index, success = _token_view(0)
    with pytest.raises(ValueError, match=r"trajectory_preference_loss: success has shape \(7,\)"):
        trajectory_preference_loss(prm_logp, ref_logp, action, step_index, success[:7], IDS)
    with pytest.raises(ValueError, match=r"trajectory_preference_loss: prm_logp has shape"):
        trajectory_preference_loss(prm_logp[:, :5], ref_logp, action, step_index, success, IDS)
    bad = prm_logp.copy()
    bad[0, np.argmax(action[0])] = np.nan
    with pytest.raises(ValueError, match="trajectory_preference_loss: prm_logp is not finite"):
        trajectory_preference_loss(bad, ref_logp, action, step_index, success, IDS)
    with pytest.raises(ValueError, match="step_index holds -1"):
        trajectory_preference_loss(prm_logp, ref_logp, np.ones((B, N), bool), step_index, success,
                                   IDS, reduce="mean")
    with pytest.raises(ValueError, match="reduce='max'"):
        trajectory_preference_loss(prm_logp, ref_logp, action, step_index, success, IDS,
                                   reduce="max")
    with pytest.raises(ValueError, match="implicit_step_rewards: normalize='batch_norm'"):
        implicit_step_rewards(prm_logp, ref_logp, step_index, T, normalize="batch_norm")


def test_registry_entries():
    for name, episode in (("istar", "rloo"), ("rloo+istar", "rloo"), ("grpo+istar", "grpo")):
        entry = registry.get(name)
        assert entry.fn is istar and entry.defaults["episode"] == episode
        assert entry.needs_prm and entry.needs_groups and entry.whiten == "none"
        assert entry.input_level == "step" and entry.output_level == "step"
    scores, rewards, mask = _step_batch(5)
    entry = registry.get("grpo+istar")
    _close(entry.fn(scores, rewards, IDS, mask, **entry.defaults),
           ref.istar(scores, rewards, IDS, mask, episode="grpo"), 2e-5)


@pytest.mark.parametrize("columns, said", [
    (None, "istar: mask has shape (4,) (rank 1); it must have rank 2"),
    (1, "istar: step_index holds step 2 but mask has 1 steps ([B, T])"),
    # One column too many: a valid step that no token belongs to.
    (4, "istar: mask marks step 3 of row 0 valid but step_index gives it no action token"),
])
def test_a_mask_that_does_not_fit_the_tokens_steps_is_named(columns, said):
    rng = np.random.default_rng(0)
    step_index = np.array([[0, 0, 1, 2, -1]] * 4, np.int32)
    logp = rng.normal(size=(4, 5)).astype(np.float32)
    inputs = adv.CreditInputs(scores=np.array([1.0, 0.0, 1.0, 0.0], np.float32),
                              group_ids=np.array([0, 0, 1, 1], np.int32), prm_logp=logp,
                              ref_logp=logp / 2, step_index=step_index)
    mask = np.ones(4, bool) if columns is None else np.ones((4, columns), bool)
    for name in ("istar", "rloo+istar"):
        with pytest.raises(ValueError, match=re.escape(said)):
            adv.apply(name, inputs._replace(mask=mask))
    fitting = inputs._replace(mask=np.ones((4, 3), bool))
    assert adv.apply("istar", fitting).advantages.shape == (4, 3)
