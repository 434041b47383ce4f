"""Losses against NumPy loops, rlax, hand-computed cases, properties, jit and 4-device sharding."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax
from hypothesis import given, settings
from jax.sharding import PartitionSpec as P

from stepcredit.losses import (AGG_MODES, KL_KINDS, agg_loss, decoupled_ppo_loss,
                               dynamic_sampling_mask, entropy_from_logits, kl_loss, kl_penalty,
                               masked_entropy, overlong_penalty, ppo_clip_loss,
                               step_importance_ratio, step_ppo_loss, value_loss)
from tests.reference import losses as ref

B, N, T, V = 8, 16, 4, 11
MAX_LEN = 32
TRUE, FALSE = True, False
few = settings(max_examples=8)
seeds = st.integers(0, 2**16)


def token_batch(seed, *, spread=0.3):
    """logp, old_logp, advantages, mask `[B, N]`: ragged rows, holes, an empty row, NaN padding."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, N + 1, size=B)
    lengths[0], lengths[1] = N, 0
    mask = (np.arange(N)[None] < lengths[:, None]) & (rng.random((B, N)) > 0.2)
    logp = -np.abs(rng.normal(1.0, 1.0, size=(B, N)))
    old_logp = logp + rng.normal(0.0, spread, size=(B, N))
    advantages = rng.normal(size=(B, N))
    nan = lambda x: np.where(mask, x, np.nan).astype(np.float32)  # noqa: E731
    return nan(logp), nan(old_logp), nan(advantages), mask


def step_view(seed, *, spread=0.3):
    """Token log-probs `[B, N]` with step_index runs, step advantages and step mask `[B, T]`."""
    rng = np.random.default_rng(seed)
    step_index = np.full((B, N), -1, np.int32)
    for b in range(B):
        position = 0
        for t in range(rng.integers(1, T + 1)):
            position += rng.integers(0, 3)
            width = rng.integers(1, 5)
            if position + width > N:
                break
            step_index[b, position:position + width] = t
            position += width
    step_index[1] = -1  # a trajectory without action tokens
    action = step_index >= 0
    logp = np.where(action, -np.abs(rng.normal(1.0, 1.0, (B, N))), np.nan).astype(np.float32)
    old_logp = np.where(action, logp + rng.normal(0, spread, (B, N)), np.nan).astype(np.float32)
    step_mask = rng.random((B, T)) > 0.15
    step_advantages = np.where(step_mask, rng.normal(size=(B, T)), np.nan).astype(np.float32)
    return logp, old_logp, step_advantages, step_index, step_mask


def assert_close(actual, expected, scale_tol=1e-5):
    expected = np.asarray(expected, np.float64)
    tol = scale_tol * max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=0, atol=tol)


def assert_metrics(actual, expected, scale_tol=1e-5):
    for name, value in expected.items():
        assert_close(actual[name], value, scale_tol), name


# ----------------------------------------------------------------------------- agg_loss

def test_agg_loss_docstring_example():
    loss_mat = jnp.array([[1.0, 2.0, jnp.nan], [3.0, jnp.nan, jnp.nan]])
    mask = jnp.array([[TRUE, TRUE, FALSE], [TRUE, FALSE, FALSE]])
    expected = {"token-mean": 2.0, "seq-mean-token-sum": 3.0, "seq-mean-token-mean": 2.25,
                "seq-mean-token-sum-norm": 1.0}
    for mode, value in expected.items():
        assert_close(agg_loss(loss_mat, mask, agg=mode, max_response_length=3), value)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_matches_reference(mode):
    _, _, values, mask = token_batch(0)
    expected = ref.agg(np.nan_to_num(values), mask, mode, MAX_LEN)
    assert_close(agg_loss(values, mask, agg=mode, max_response_length=MAX_LEN), expected)


def test_seq_modes_ignore_fully_masked_rows_and_norm_divides_by_the_constant():
    _, _, values, mask = token_batch(1)
    padded_values = np.concatenate([values, np.full((3, N), np.nan, np.float32)])
    padded_mask = np.concatenate([mask, np.zeros((3, N), bool)])
    for mode in AGG_MODES:
        assert_close(agg_loss(padded_values, padded_mask, agg=mode, max_response_length=MAX_LEN),
                     agg_loss(values, mask, agg=mode, max_response_length=MAX_LEN), 1e-6)
    # A constant divisor: doubling the padded width does not change seq-mean-token-sum-norm.
    wide = lambda x, v: np.pad(x, ((0, 0), (0, N)), constant_values=v)  # noqa: E731
    assert_close(agg_loss(wide(values, np.nan), wide(mask, False), agg="seq-mean-token-sum-norm",
                          max_response_length=MAX_LEN),
                 agg_loss(values, mask, agg="seq-mean-token-sum-norm", max_response_length=MAX_LEN),
                 1e-6)


# ----------------------------------------------------------------------------- PPO clip

def test_ppo_clip_loss_docstring_example():
    loss, metrics = ppo_clip_loss(jnp.log(jnp.array([[1.5, 0.5, 1.1, jnp.nan]])), jnp.zeros((1, 4)),
                                  jnp.array([[1.0, 1.0, -2.0, 5.0]]),
                                  jnp.array([[TRUE, TRUE, TRUE, FALSE]]))
    assert_close(loss, (-1.2 - 0.5 + 2.2) / 3)
    assert_close(metrics["clip_fraction"], 1 / 3)
    assert_close(metrics["ratio_max"], 1.5)
    assert_close(metrics["ratio_min"], 0.5)


def test_dual_clip_by_hand():
    # A = -1, r = 5: PPO loss max(5, 1.2) = 5; the dual clip c = 3 caps it at 3.
    args = (jnp.log(jnp.array([[5.0, 0.5]])), jnp.zeros((1, 2)), jnp.array([[-1.0, -1.0]]),
            jnp.ones((1, 2), bool))
    loss, metrics = ppo_clip_loss(*args, dual_clip=3.0)
    assert_close(loss, (3.0 + 0.8) / 2)
    assert_close(metrics["dual_clip_fraction"], 0.5)
    assert_close(ppo_clip_loss(*args)[0], (5.0 + 0.8) / 2)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("clip_high, dual_clip", [(0.2, None), (0.28, 3.0)])
def test_ppo_clip_loss_matches_reference(mode, clip_high, dual_clip):
    logp, old_logp, advantages, mask = token_batch(2, spread=0.5)
    loss, metrics = ppo_clip_loss(logp, old_logp, advantages, mask, clip_high=clip_high,
                                  dual_clip=dual_clip, agg=mode, max_response_length=MAX_LEN)
    expected, expected_metrics = ref.ppo_clip_loss(logp, old_logp, advantages, mask, 0.2, clip_high,
                                                   dual_clip, mode, MAX_LEN)
    assert_close(loss, expected)
    assert_metrics(metrics, expected_metrics)
    assert 0 < float(metrics["clip_fraction"]) < 1


def test_ppo_clip_loss_matches_rlax_without_padding():
    rng = np.random.default_rng(3)
    logp = rng.normal(size=(B, N)).astype(np.float32)
    old_logp = (logp + rng.normal(0, 0.4, (B, N))).astype(np.float32)
    advantages = rng.normal(size=(B, N)).astype(np.float32)
    loss, _ = ppo_clip_loss(logp, old_logp, advantages, np.ones((B, N), bool))
    expected = rlax.clipped_surrogate_pg_loss(jnp.exp(logp - old_logp).reshape(-1),
                                              advantages.reshape(-1), 0.2)
    assert_close(loss, expected)
    grad = jax.grad(lambda x: ppo_clip_loss(x, old_logp, advantages, np.ones((B, N), bool))[0])(logp)
    rlax_grad = jax.grad(lambda x: rlax.clipped_surrogate_pg_loss(
        jnp.exp(x - old_logp).reshape(-1), advantages.reshape(-1), 0.2))(logp)
    assert_close(grad, rlax_grad, 1e-6)


@few
@given(seed=seeds)
def test_on_policy_token_mean_is_minus_the_mean_advantage(seed):
    logp, _, advantages, mask = token_batch(seed)
    loss, metrics = ppo_clip_loss(logp, logp, advantages, mask)
    assert_close(loss, -np.mean(advantages[mask]))
    assert float(metrics["clip_fraction"]) == 0.0
    assert_close(metrics["approx_kl"], 0.0)
    assert_close(metrics["ratio_mean"], 1.0)


@few
@given(seed=seeds, clip_high=st.sampled_from([0.2, 0.28]))
def test_no_clipping_inside_the_clip_range(seed, clip_high):
    logp, _, advantages, mask = token_batch(seed)
    rng = np.random.default_rng(seed)
    log_ratio = rng.uniform(np.log(0.8) * 0.99, np.log(1 + clip_high) * 0.99, size=(B, N))
    old_logp = (logp - log_ratio).astype(np.float32)
    loss, metrics = ppo_clip_loss(logp, old_logp, advantages, mask, clip_high=clip_high)
    assert float(metrics["clip_fraction"]) == 0.0
    ratio = np.exp(logp.astype(np.float64) - old_logp)
    assert_close(loss, -np.mean((ratio * advantages)[mask]))


@few
@given(seed=seeds, fill=st.sampled_from([np.nan, np.inf, -1e30, 7.0]))
def test_masked_positions_change_neither_loss_nor_gradient(seed, fill):
    logp, old_logp, advantages, mask = token_batch(seed)
    filled = [np.where(mask, x, fill).astype(np.float32) for x in (logp, old_logp, advantages)]

    def loss_and_grad(lp, old, adv, loss_fn):
        return jax.value_and_grad(lambda x: loss_fn(x, old, adv)[0])(lp)

    fns = {
        "ppo": lambda lp, old, adv: ppo_clip_loss(lp, old, adv, mask, dual_clip=3.0,
                                                  agg="seq-mean-token-mean"),
        "decoupled": lambda lp, old, adv: decoupled_ppo_loss(lp, old, old - 0.1, adv, mask,
                                                             behav_weight_cap=2.0),
        "value": lambda lp, old, adv: value_loss(lp, old, adv, mask, clip=0.2),
        "kl": lambda lp, old, adv: kl_loss(lp, old, mask, kind="low_var_kl"),
    }
    clean = [np.where(mask, x, 0.0).astype(np.float32) for x in (logp, old_logp, advantages)]
    for name, fn in fns.items():
        base_loss, base_grad = loss_and_grad(*clean, fn)
        loss, grad = loss_and_grad(*filled, fn)
        assert np.isfinite(loss) and np.all(np.isfinite(grad)), name
        assert_close(loss, base_loss, 1e-6)
        assert_close(grad, base_grad, 1e-6)
        assert np.all(np.asarray(grad)[~mask] == 0), name


def test_all_false_mask_gives_zero_loss_metrics_and_gradient():
    logp, old_logp, advantages, _ = token_batch(4)
    mask = np.zeros((B, N), bool)
    for mode in AGG_MODES:
        fn = lambda x: ppo_clip_loss(x, old_logp, advantages, mask, agg=mode,  # noqa: E731
                                     max_response_length=MAX_LEN)
        (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(logp)
        assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0)
        assert all(float(v) == 0.0 for v in metrics.values())
    assert float(value_loss(logp, None, advantages, mask)[0]) == 0.0
    assert float(kl_loss(logp, old_logp, mask)[0]) == 0.0
    step_logp, step_old, step_adv, step_index, _ = step_view(4)
    loss, metrics = step_ppo_loss(step_logp, step_old, step_adv, step_index, np.zeros((B, T), bool))
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())


# ----------------------------------------------------------------------------- decoupled PPO

def test_decoupled_docstring_example():
    args = (jnp.log(jnp.array([[1.1, 1.1]])), jnp.zeros((1, 2)), jnp.log(jnp.array([[0.5, 2.0]])),
            jnp.ones((1, 2)), jnp.ones((1, 2), bool))
    loss, metrics = decoupled_ppo_loss(*args, behav_weight_cap=1.5)
    assert_close(loss, -0.275)
    assert_close(metrics["behav_capped_fraction"], 0.5)
    assert_close(decoupled_ppo_loss(*args)[0], -1.375)


@pytest.mark.parametrize("cap, dual_clip, mode", [(None, None, "token-mean"),
                                                  (1.3, 3.0, "token-mean"),
                                                  (1.3, None, "seq-mean-token-mean")])
def test_decoupled_matches_reference(cap, dual_clip, mode):
    logp, prox, advantages, mask = token_batch(5, spread=0.4)
    behav = np.where(mask, prox + np.random.default_rng(5).normal(0, 0.3, (B, N)),
                     np.nan).astype(np.float32)
    loss, metrics = decoupled_ppo_loss(logp, prox, behav, advantages, mask, dual_clip=dual_clip,
                                       behav_weight_cap=cap, agg=mode)
    expected, expected_metrics = ref.decoupled_ppo_loss(logp, prox, behav, advantages, mask,
                                                        dual_clip=dual_clip, behav_weight_cap=cap,
                                                        agg_mode=mode)
    assert_close(loss, expected)
    assert_metrics(metrics, expected_metrics)
    if cap is not None:
        assert 0 < float(metrics["behav_capped_fraction"]) < 1


@few
@given(seed=seeds, mode=st.sampled_from(AGG_MODES), cap=st.sampled_from([None, 1.5]))
def test_decoupled_with_prox_equal_to_behav_is_ppo(seed, mode, cap):
    logp, old_logp, advantages, mask = token_batch(seed)
    kwargs = dict(clip_high=0.28, agg=mode, max_response_length=MAX_LEN)
    loss, metrics = decoupled_ppo_loss(logp, old_logp, old_logp, advantages, mask,
                                       behav_weight_cap=cap, **kwargs)
    ppo, ppo_metrics = ppo_clip_loss(logp, old_logp, advantages, mask, **kwargs)
    assert_close(loss, ppo, 1e-6)
    assert_metrics(metrics, ppo_metrics, 1e-6)
    grad = jax.grad(lambda x: decoupled_ppo_loss(x, old_logp, old_logp, advantages, mask,
                                                 **kwargs)[0])(logp)
    assert_close(grad, jax.grad(lambda x: ppo_clip_loss(x, old_logp, advantages, mask,
                                                        **kwargs)[0])(logp), 1e-6)


@few
@given(seed=seeds)
def test_the_cap_masks_out_exactly_the_tokens_over_it(seed):
    logp, _, advantages, mask = token_batch(seed)
    prox = logp  # ratio 1: no token is clipped, so every token under the cap has a gradient
    rng = np.random.default_rng(seed)
    log_weight = rng.uniform(-0.5, 0.5, (B, N))
    behav = (prox - log_weight).astype(np.float32)
    cap = 1.2
    over = mask & (np.exp(log_weight) > cap)
    fn = lambda x, adv: decoupled_ppo_loss(x, prox, behav, adv, mask, behav_weight_cap=cap)  # noqa
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(logp, advantages)
    # Capped tokens contribute nothing: the same as zeroing their advantages without a cap.
    zeroed = np.where(over, 0.0, advantages).astype(np.float32)
    uncapped = lambda x: decoupled_ppo_loss(x, prox, behav, zeroed, mask)[0]  # noqa: E731
    assert_close(loss, uncapped(logp), 1e-6)
    assert np.all(np.asarray(grad)[over] == 0)
    assert np.all(np.asarray(grad)[mask & ~over] != 0)
    assert_close(metrics["behav_capped_fraction"], over.sum() / mask.sum())


# ----------------------------------------------------------------------------- StepPO step ratio

def test_step_ratio_and_loss_docstring_examples():
    logp = jnp.array([[jnp.nan, 0.1, 0.3, jnp.nan, -0.5]])
    step_index = jnp.array([[-1, 0, 0, -1, 1]])
    assert_close(step_importance_ratio(logp, jnp.zeros((1, 5)), step_index, 2),
                 [[np.exp(0.2), np.exp(-0.5)]])
    loss, metrics = step_ppo_loss(logp, jnp.zeros((1, 5)), jnp.array([[1.0, -1.0]]), step_index,
                                  jnp.array([[TRUE, TRUE]]), clip_low=0.2, clip_high=0.2)
    assert_close(loss, -0.2)
    assert_close(metrics["clip_fraction"], 1.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_step_ratio_and_loss_match_reference(seed):
    logp, old_logp, step_adv, step_index, step_mask = step_view(seed, spread=0.02)
    assert_close(step_importance_ratio(logp, old_logp, step_index, T),
                 ref.step_importance_ratio(logp, old_logp, step_index, T))
    for kwargs in ({}, {"clip_low": 0.005, "clip_high": 0.008, "dual_clip": 1.5}):
        loss, metrics = step_ppo_loss(logp, old_logp, step_adv, step_index, step_mask, **kwargs)
        expected, expected_metrics = ref.step_ppo_loss(logp, old_logp, step_adv, step_index,
                                                       step_mask, **kwargs)
        assert_close(loss, expected)
        assert_metrics(metrics, expected_metrics)
    assert 0 < float(step_ppo_loss(logp, old_logp, step_adv, step_index,
                                   step_mask)[1]["clip_fraction"]) < 1



def test_a_masked_steps_tokens_may_hold_anything():
    logp, old_logp, step_adv, step_index, step_mask = step_view(0, spread=0.02)
    masked_tokens = ~np.asarray(step_mask)[np.arange(B)[:, None], np.maximum(step_index, 0)] & (
        np.asarray(step_index) >= 0)
    assert masked_tokens.any()
    clean = step_ppo_loss(logp, old_logp, step_adv, step_index, step_mask)
    noisy_logp, noisy_old = (jnp.where(masked_tokens, jnp.nan, x) for x in (logp, old_logp))
    noisy = step_ppo_loss(noisy_logp, noisy_old, step_adv, step_index, step_mask)
    assert_close(noisy[0], clean[0])
    assert_metrics(noisy[1], clean[1])
    grad = jax.grad(lambda x: step_ppo_loss(x, noisy_old, step_adv, step_index, step_mask)[0])
    assert np.isfinite(np.asarray(grad(noisy_logp))).all()
    with pytest.raises(ValueError, match="step_ppo_loss: logp is not finite"):  # a valid step's
        step_ppo_loss(jnp.where(~masked_tokens & (np.asarray(step_index) >= 0), jnp.nan, logp),
                      old_logp, step_adv, step_index, step_mask)

def _verl_gspo_token_form(logp, old_logp, step_adv, step_index, step_mask, clip_low, clip_high):
    """verl's GSPO per token: s_n = sg[w_t] pi(y_n) / sg[pi(y_n)], seq-mean-token-mean over steps."""
    action = step_index >= 0
    token_log_ratio = jnp.where(action, logp, 0.0) - jnp.where(action, old_logp, 0.0)
    sums = jax.ops.segment_sum(token_log_ratio.reshape(-1),
                               (np.arange(B)[:, None] * (T + 1)
                                + np.where(action, step_index, T)).reshape(-1), B * (T + 1))
    counts = np.zeros((B, T + 1))
    np.add.at(counts, (np.repeat(np.arange(B), N), np.where(action, step_index, T).reshape(-1)), 1)
    counts = counts[:, :T]
    step_log = (sums.reshape(B, T + 1)[:, :T]) / np.maximum(counts, 1)
    token_step = np.maximum(step_index, 0)
    rows = np.arange(B)[:, None]
    clean_logp = jnp.where(action, logp, 0.0)
    log_s = (jax.lax.stop_gradient(step_log)[rows, token_step] + clean_logp
             - jax.lax.stop_gradient(clean_logp))
    s = jnp.exp(jnp.minimum(log_s, 10.0))
    adv = jnp.where(action, jnp.nan_to_num(step_adv)[rows, token_step], 0.0)
    token_loss = jnp.maximum(-adv * s, -adv * jnp.clip(s, 1 - clip_low, 1 + clip_high))
    valid_step = step_mask & (counts > 0)
    token_valid = action & valid_step[rows, token_step]
    per_step = jax.ops.segment_sum(jnp.where(token_valid, token_loss, 0.0).reshape(-1),
                                   (rows * T + token_step).reshape(-1), B * T).reshape(B, T)
    per_step = per_step / np.maximum(counts, 1)
    return jnp.sum(jnp.where(valid_step, per_step, 0.0)) / valid_step.sum()


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.02, 0.03)])
def test_verl_token_level_sg_form_has_the_same_loss_and_gradient(clip):
    logp, old_logp, step_adv, step_index, step_mask = step_view(6, spread=0.03)
    ours = lambda x: step_ppo_loss(x, old_logp, step_adv, step_index, step_mask,  # noqa: E731
                                   clip_low=clip[0], clip_high=clip[1])[0]
    verl = lambda x: _verl_gspo_token_form(x, old_logp, step_adv, step_index,  # noqa: E731
                                           step_mask, *clip)
    assert_close(ours(logp), verl(logp))
    grad, verl_grad = jax.grad(ours)(logp), jax.grad(verl)(logp)
    assert_close(grad, verl_grad, 1e-5)
    assert np.all(np.isfinite(grad)) and np.any(np.asarray(grad) != 0)


@few
@given(seed=seeds)
def test_one_token_per_step_is_token_ppo(seed):
    logp, old_logp, advantages, mask = token_batch(seed)
    # Step rows: each valid token its own step (row), seq-mean-token-mean of token PPO.
    rows_logp, rows_old = logp.reshape(-1, 1), old_logp.reshape(-1, 1)
    rows_mask = mask.reshape(-1, 1)
    step_index = np.where(rows_mask, 0, -1).astype(np.int32)
    loss, _ = step_ppo_loss(rows_logp, rows_old, advantages.reshape(-1, 1), step_index, rows_mask,
                            clip_low=0.2, clip_high=0.28)
    expected, _ = ppo_clip_loss(logp, old_logp, advantages, mask, clip_high=0.28)
    assert_close(loss, expected, 1e-6)


# ----------------------------------------------------------------------------- value, KL, entropy

def test_value_loss_docstring_example():
    loss, metrics = value_loss(jnp.array([[1.0, 2.0]]), jnp.array([[0.5, 2.0]]),
                               jnp.array([[2.0, 1.0]]), jnp.ones((1, 2), bool), clip=0.2)
    assert_close(loss, 0.6725)
    assert_close(metrics["clip_fraction"], 0.5)


@pytest.mark.parametrize("clip, mode", [(None, "token-mean"), (0.2, "token-mean"),
                                        (0.2, "seq-mean-token-sum-norm")])
def test_value_loss_matches_reference(clip, mode):
    values, old_values, returns, mask = token_batch(7)
    loss, metrics = value_loss(values, old_values, returns, mask, clip=clip, agg=mode,
                               max_response_length=MAX_LEN)
    expected, expected_metrics = ref.value_loss(values, old_values, returns, mask, clip, mode,
                                                MAX_LEN)
    assert_close(loss, expected)
    assert_metrics(metrics, expected_metrics)


def test_kl_docstring_example():
    logp, ref_logp = jnp.log(0.5), jnp.log(0.25)
    expected = {"k1": np.log(2), "k2": 0.5 * np.log(2) ** 2, "k3": 0.5 - 1 + np.log(2),
                "low_var_kl": 0.5 - 1 + np.log(2)}
    for kind, value in expected.items():
        assert_close(kl_penalty(logp, ref_logp, kind=kind), value)
    loss, _ = kl_loss(jnp.array([[jnp.log(0.5), jnp.nan]]), jnp.array([[jnp.log(0.25), jnp.nan]]),
                      jnp.array([[TRUE, FALSE]]))
    assert_close(loss, 0.5 - 1 + np.log(2))


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_matches_reference(kind):
    logp, ref_logp, _, mask = token_batch(8, spread=1.0)
    clean = lambda x: np.where(mask, x, -1.0).astype(np.float32)  # noqa: E731
    penalty = kl_penalty(clean(logp), clean(ref_logp), kind=kind)
    expected = np.vectorize(ref.kl_penalty)(clean(logp), clean(ref_logp), kind)
    assert_close(penalty, expected)
    loss, metrics = kl_loss(logp, ref_logp, mask, kind=kind, agg="seq-mean-token-mean")
    assert_close(loss, ref.agg(np.where(mask, expected, 0), mask, "seq-mean-token-mean"))
    assert_close(metrics["kl_max"], expected[mask].max())
    if kind != "k1":
        assert np.all(np.asarray(penalty) >= 0)


def test_low_var_kl_clamps_where_k3_does_not():
    logp, ref_logp = jnp.array([-20.0]), jnp.array([-5.0])  # log r = 15: k3 = e^15 - 16
    assert_close(kl_penalty(logp, ref_logp, kind="low_var_kl"), [10.0])
    assert float(kl_penalty(logp, ref_logp, kind="k3")[0]) > 1e6


@pytest.mark.filterwarnings("ignore:Rlax softmax will be deprecated:PendingDeprecationWarning")
def test_entropy_matches_reference_and_rlax():
    rng = np.random.default_rng(9)
    logits = (rng.normal(size=(B, N, V)) * 3).astype(np.float32)
    logits[0, 0, :5] = -np.inf
    entropy = entropy_from_logits(logits)
    expected = np.array([[ref.entropy(z) for z in row] for row in logits])
    assert_close(entropy, expected)
    assert_close(entropy[1:], rlax.softmax().entropy(logits[1:]))
    assert_close(entropy_from_logits(jnp.array([[0.0, 0.0], [0.0, -jnp.inf], [1e3, 1e3]])),
                 [np.log(2), 0.0, np.log(2)])
    grad = jax.grad(lambda z: jnp.sum(entropy_from_logits(z)))(logits)
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[0, 0, :5] == 0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_masked_entropy_matches_reference(mode):
    rng = np.random.default_rng(10)
    _, _, _, mask = token_batch(10)
    logits = np.where(mask[..., None], rng.normal(size=(B, N, V)), np.nan).astype(np.float32)
    value, metrics = masked_entropy(logits, mask, agg=mode)
    per_token = np.array([[ref.entropy(z) if m else 0.0 for z, m in zip(row, row_mask)]
                          for row, row_mask in zip(logits, mask)])
    assert_close(value, ref.agg(per_token, mask, mode))
    assert_close(metrics["entropy_max"], per_token[mask].max())
    grad = jax.grad(lambda z: masked_entropy(z, mask, agg=mode)[0])(logits)
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[~mask] == 0)
    assert_close(masked_entropy(jnp.array([[[0.0, 0.0], [0.0, -jnp.inf]]]),
                                jnp.array([[TRUE, TRUE]]))[0], np.log(2) / 2)


# ----------------------------------------------------------------------------- DAPO pieces

def test_overlong_penalty_matches_paper():
    lengths = np.array([0, 10, 16, 17, 18, 20, 25])
    out = overlong_penalty(lengths, max_length=20, cache_length=4)
    assert_close(out, [ref.overlong_penalty(x, 20, 4) for x in lengths])
    assert_close(np.asarray(out)[[1, 2, 4, 5, 6]], [0, 0, -0.5, -1, -1])
    code = overlong_penalty(lengths, max_length=20, cache_length=4, floor_at_max=False,
                            penalty_factor=0.5)
    assert_close(code, [0.5 * ref.overlong_penalty(x, 20, 4, False) for x in lengths])
    assert_close(code[-1], -1.125)
    dapo = overlong_penalty(np.array([16384, 18432, 20480]), max_length=20480, cache_length=4096)
    assert_close(dapo, [0.0, -0.5, -1.0])
    with pytest.raises(ValueError, match="overlong_penalty: max_length='20' is a str"):
        overlong_penalty(lengths, max_length="20", cache_length=4)


def test_dynamic_sampling_docstring_example_and_reference():
    scores, ids = jnp.array([1.0, 0.0, 1.0, 1.0, 0.5]), jnp.array([7, 7, 3, 3, 9])
    np.testing.assert_array_equal(dynamic_sampling_mask(scores, ids), [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(dynamic_sampling_mask(scores, ids, singleton="keep"),
                                  [1, 1, 0, 0, 1])
    rng = np.random.default_rng(11)
    scores = rng.integers(0, 2, size=B).astype(np.float32)
    ids = rng.choice([-5, 3, 1000], size=B)
    for singleton in ("drop", "keep"):
        np.testing.assert_array_equal(dynamic_sampling_mask(scores, ids, singleton=singleton),
                                      ref.dynamic_sampling_mask(scores, ids, singleton))
    dense = np.searchsorted(np.unique(ids), ids)
    np.testing.assert_array_equal(dynamic_sampling_mask(scores, dense, num_groups=3),
                                  ref.dynamic_sampling_mask(scores, ids))
    # Exact equality: three scores of 0.1 (whose np.std is not exactly 0) are all equal.
    assert not np.any(dynamic_sampling_mask(np.full(3, 0.1, np.float32), np.zeros(3, np.int32)))


@few
@given(seed=seeds)
def test_dynamic_sampling_permutes_with_the_batch(seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 3, size=B).astype(np.float32)
    ids = rng.integers(0, 3, size=B)
    perm = rng.permutation(B)
    np.testing.assert_array_equal(np.asarray(dynamic_sampling_mask(scores, ids))[perm],
                                  dynamic_sampling_mask(scores[perm], ids[perm]))


# ----------------------------------------------------------------------------- jit and sharding

_ppo = jax.jit(ppo_clip_loss, static_argnames=("clip_low", "clip_high", "dual_clip", "agg",
                                               "max_response_length", "axis_name"))
_step = jax.jit(step_ppo_loss, static_argnames=("clip_low", "clip_high", "dual_clip", "axis_name"))


def test_jit_equals_eager_and_gradients_are_finite():
    logp, old_logp, advantages, mask = token_batch(12)
    s_logp, s_old, s_adv, s_index, s_mask = step_view(12)
    cases = [
        (functools.partial(_ppo, agg="seq-mean-token-sum-norm", max_response_length=MAX_LEN,
                           dual_clip=3.0),
         functools.partial(ppo_clip_loss, agg="seq-mean-token-sum-norm",
                           max_response_length=MAX_LEN, dual_clip=3.0),
         (logp, old_logp, advantages, mask)),
        (_step, step_ppo_loss, (s_logp, s_old, s_adv, s_index, s_mask)),
        (jax.jit(functools.partial(decoupled_ppo_loss, behav_weight_cap=1.5)),
         functools.partial(decoupled_ppo_loss, behav_weight_cap=1.5),
         (logp, old_logp, old_logp - 0.2, advantages, mask)),
        (jax.jit(functools.partial(value_loss, clip=0.2)), functools.partial(value_loss, clip=0.2),
         (logp, old_logp, advantages, mask)),
        (jax.jit(kl_loss), kl_loss, (logp, old_logp, mask)),
    ]
    for jitted, eager, args in cases:
        (loss, metrics), grad = jax.value_and_grad(jitted, has_aux=True)(*args)
        eager_loss, eager_metrics = eager(*args)
        assert_close(loss, eager_loss, 1e-6)
        assert_metrics(metrics, eager_metrics, 1e-6)
        assert np.all(np.isfinite(grad)) and np.any(np.asarray(grad) != 0)
    np.testing.assert_array_equal(
        jax.jit(dynamic_sampling_mask)(np.arange(B, dtype=np.float32) % 3, np.arange(B) // 2),
        dynamic_sampling_mask(np.arange(B, dtype=np.float32) % 3, np.arange(B) // 2))


def test_vmap_over_minibatches_equals_separate_calls():
    first, second = token_batch(18), token_batch(19)
    stacked = [np.stack(pair) for pair in zip(first, second)]
    losses, metrics = jax.vmap(functools.partial(ppo_clip_loss, clip_high=0.28))(*stacked)
    for i, batch in enumerate((first, second)):
        loss, single_metrics = ppo_clip_loss(*batch, clip_high=0.28)
        assert_close(losses[i], loss, 1e-6)
        assert_metrics({k: v[i] for k, v in metrics.items()}, single_metrics, 1e-6)
    s_first, s_second = step_view(18), step_view(19)
    ratios = jax.vmap(step_importance_ratio, in_axes=(0, 0, 0, None))(
        *[np.stack(pair) for pair in zip(s_first[:2], s_second[:2])],
        np.stack([s_first[3], s_second[3]]), T)
    for i, view in enumerate((s_first, s_second)):
        assert_close(ratios[i], step_importance_ratio(view[0], view[1], view[3], T), 1e-6)


def _sharded(fn, mesh, n_in, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("data"),) * n_in, out_specs=out_specs))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_sharded_ppo_equals_single_device(mesh4, mode):
    logp, old_logp, advantages, mask = token_batch(13)
    kwargs = dict(agg=mode, max_response_length=MAX_LEN, dual_clip=3.0)
    single, single_metrics = ppo_clip_loss(logp, old_logp, advantages, mask, **kwargs)
    fn = lambda *a: ppo_clip_loss(*a, axis_name="data", **kwargs)  # noqa: E731
    loss, metrics = _sharded(fn, mesh4, 4, P())(logp, old_logp, advantages, mask)
    assert_close(loss, single)
    assert_metrics(metrics, single_metrics)


def test_sharded_gradient_of_token_mean_equals_single_device(mesh4):
    logp, old_logp, advantages, mask = token_batch(14)
    grad = jax.grad(lambda x: ppo_clip_loss(x, old_logp, advantages, mask)[0])(logp)

    def local_grad(x, old, adv, m):
        return jax.grad(lambda y: ppo_clip_loss(y, old, adv, m, axis_name="data")[0])(x)

    sharded = _sharded(local_grad, mesh4, 4, P("data"))(logp, old_logp, advantages, mask)
    assert_close(sharded, grad, 1e-6)


def test_sharded_other_losses_equal_single_device(mesh4):
    logp, old_logp, advantages, mask = token_batch(15)
    s_logp, s_old, s_adv, s_index, s_mask = step_view(15)
    logits = np.random.default_rng(15).normal(size=(B, N, V)).astype(np.float32)
    cases = [
        (lambda *a, **k: step_ppo_loss(*a, clip_low=0.01, clip_high=0.02, **k),
         (s_logp, s_old, s_adv, s_index, s_mask)),
        (lambda *a, **k: decoupled_ppo_loss(*a, behav_weight_cap=1.2, agg="seq-mean-token-sum",
                                            **k),
         (logp, old_logp, old_logp - 0.15, advantages, mask)),
        (lambda *a, **k: value_loss(*a, clip=0.2, **k), (logp, old_logp, advantages, mask)),
        (lambda *a, **k: kl_loss(*a, kind="k2", **k), (logp, old_logp, mask)),
        (masked_entropy, (logits, mask)),
        (lambda *a, **k: (agg_loss(*a, agg="seq-mean-token-mean", **k), {}), (advantages, mask)),
    ]
    for fn, args in cases:
        single, single_metrics = fn(*args)
        loss, metrics = _sharded(functools.partial(fn, axis_name="data"), mesh4, len(args),
                                 P())(*args)
        assert_close(loss, single)
        assert_metrics(metrics, single_metrics)


def test_sharded_dynamic_sampling_with_groups_spanning_devices(mesh4):
    scores = np.array([1, 0, 1, 1, 0, 0, 2, 5], np.float32)
    ids = np.array([4, 9, 9, 4, 4, 7, 9, 8])  # group 4 and 9 span devices; 8 is a singleton
    for num_groups, group_ids in ((None, ids), (10, ids)):
        for singleton in ("drop", "keep"):
            fn = functools.partial(dynamic_sampling_mask, num_groups=num_groups,
                                   singleton=singleton, axis_name="data")
            sharded = _sharded(fn, mesh4, 2, P("data"))(scores, group_ids)
            np.testing.assert_array_equal(sharded,
                                          ref.dynamic_sampling_mask(scores, ids, singleton))


# ----------------------------------------------------------------------------- bad input

def test_bad_input_errors_name_the_argument():
    logp, old_logp, advantages, mask = token_batch(16)
    with pytest.raises(ValueError, match=r"ppo_clip_loss: logp has shape \(8, 16\) but advantages "
                                         r"has shape \(8, 15\)"):
        ppo_clip_loss(logp, old_logp, advantages[:, 1:], mask)
    with pytest.raises(ValueError, match=r"ppo_clip_loss: mask has shape \(16,\) \(rank 1\)"):
        ppo_clip_loss(logp[0], old_logp[0], advantages[0], mask[0])
    with pytest.raises(ValueError, match=r"agg='mean' is not one of"):
        ppo_clip_loss(logp, old_logp, advantages, mask, agg="mean")
    with pytest.raises(ValueError, match=r"needs max_response_length"):
        ppo_clip_loss(logp, old_logp, advantages, mask, agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match=r"max_response_length=0"):
        agg_loss(advantages, mask, agg="seq-mean-token-sum-norm", max_response_length=0)
    with pytest.raises(ValueError, match=r"clip_low=1.5 is outside \[0, 1\]"):
        ppo_clip_loss(logp, old_logp, advantages, mask, clip_low=1.5)
    with pytest.raises(ValueError, match=r"clip_high=-0.1"):
        ppo_clip_loss(logp, old_logp, advantages, mask, clip_high=-0.1)
    with pytest.raises(ValueError, match=r"dual_clip=0.5; .* must be > 1"):
        ppo_clip_loss(logp, old_logp, advantages, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match=r"ppo_clip_loss: advantages is not finite at index"):
        ppo_clip_loss(logp, old_logp, np.where(mask, np.nan, advantages), mask)
    with pytest.raises(TypeError, match=r"ppo_clip_loss: mask has dtype float32"):
        ppo_clip_loss(logp, old_logp, advantages, mask.astype(np.float32))
    with pytest.raises(ValueError, match=r"decoupled_ppo_loss: behav_weight_cap=1.0"):
        decoupled_ppo_loss(logp, old_logp, old_logp, advantages, mask, behav_weight_cap=1.0)
    with pytest.raises(ValueError, match=r"decoupled_ppo_loss: logp has shape .* but behav_logp"):
        decoupled_ppo_loss(logp, old_logp, old_logp[:4], advantages, mask)
    with pytest.raises(ValueError, match=r"value_loss: clip=0.2 needs old_values"):
        value_loss(logp, None, advantages, mask, clip=0.2)
    with pytest.raises(ValueError, match=r"value_loss: clip=-1.0"):
        value_loss(logp, old_logp, advantages, mask, clip=-1.0)
    # A number given as a string (a config read as text) is named, not met inside JAX.
    with pytest.raises(ValueError, match=r"ppo_clip_loss: clip_low='0.2' is a str; it must be a "
                                         r"number"):
        ppo_clip_loss(logp, old_logp, advantages, mask, clip_low="0.2")
    with pytest.raises(ValueError, match=r"value_loss: clip='0.2' is a str"):
        value_loss(logp, old_logp, advantages, mask, clip="0.2")
    with pytest.raises(ValueError, match=r"kl_penalty: kind='k4'"):
        kl_penalty(logp, old_logp, kind="k4")
    with pytest.raises(ValueError, match=r"kl_loss: logp has shape .* but ref_logp"):
        kl_loss(logp, old_logp[:, :3], mask)
    with pytest.raises(ValueError, match=r"masked_entropy: logits has shape \(8, 16, 3\) but mask "
                                         r"has shape \(8, 15\)"):
        masked_entropy(np.zeros((B, N, 3), np.float32), mask[:, 1:])
    with pytest.raises(ValueError, match=r"masked_entropy: logits holds NaN"):
        masked_entropy(np.full((B, N, 3), np.nan, np.float32), mask)


def test_bad_step_and_dapo_inputs():
    s_logp, s_old, s_adv, s_index, s_mask = step_view(17)
    with pytest.raises(ValueError, match=r"step_ppo_loss: step_index holds \d but there are 1 steps"):
        step_ppo_loss(s_logp, s_old, s_adv[:, :1], s_index, s_mask[:, :1])
    with pytest.raises(ValueError, match=r"step_ppo_loss: step_advantages has shape \(8, 4\) but "
                                         r"step_mask has shape \(8, 3\)"):
        step_ppo_loss(s_logp, s_old, s_adv, s_index, s_mask[:, :3])
    with pytest.raises(ValueError, match=r"step_ppo_loss: step_index has shape \(4, 16\) but "
                                         r"step_advantages has shape \(8, 4\)"):
        step_ppo_loss(s_logp[:4], s_old[:4], s_adv, s_index[:4], s_mask)
    with pytest.raises(ValueError, match=r"step_importance_ratio: num_steps=0"):
        step_importance_ratio(s_logp, s_old, s_index, 0)
    with pytest.raises(ValueError, match=r"step_ppo_loss: clip_low=-0.1"):
        step_ppo_loss(s_logp, s_old, s_adv, s_index, s_mask, clip_low=-0.1)
    with pytest.raises(ValueError, match=r"cache_length=30 and max_length=20"):
        overlong_penalty(np.array([1, 2]), max_length=20, cache_length=30)
    with pytest.raises(ValueError, match=r"response_lengths holds -3.0"):
        overlong_penalty(np.array([1, -3]), max_length=20, cache_length=4)
    with pytest.raises(ValueError, match=r"dynamic_sampling_mask: group_ids holds 5 but "
                                         r"num_groups=3"):
        dynamic_sampling_mask(np.zeros(4, np.float32), np.array([0, 1, 5, 2]), num_groups=3)
    with pytest.raises(ValueError, match=r"dynamic_sampling_mask: group_ids has shape \(3,\)"):
        dynamic_sampling_mask(np.zeros(4, np.float32), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"dynamic_sampling_mask: scores is not finite"):
        dynamic_sampling_mask(np.array([0, np.nan], np.float32), np.array([0, 0]))
    with pytest.raises(ValueError, match=r"singleton='raw'"):
        dynamic_sampling_mask(np.zeros(2, np.float32), np.array([0, 0]), singleton="raw")
