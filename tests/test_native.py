"""The compiled CPU kernels: their boundaries, the build cache, and the backends they lower for.

The GAE kernel's numbers are checked with every other method in test_kernels.py; the
recurrence and group-normalisation kernels must equal the XLA computations they replace
bit for bit.
"""

import functools
import importlib
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from stepcredit import advantages as adv
from stepcredit.advantages import gae_method, native, step_gae, token_gae
from tests.reference import gae as ref
from tests.test_kernels import assert_close, odd_batch

GAMMA, LAM = 0.99, 0.95


def native_advantages(rewards, values, mask, bootstrap):
    return step_gae(rewards, values, mask, gamma=GAMMA, lam=LAM, bootstrap_value=bootstrap,
                    method="native").advantages


def test_outputs_above_the_huge_page_threshold():
    # 4 MB outputs: the kernel advises huge pages on them before writing.
    batch, length = 1024, 1024
    rng = np.random.default_rng(0)
    mask = rng.random((batch, length)) > 0.2
    rewards = np.where(mask, rng.normal(size=(batch, length)), np.nan).astype(np.float32)
    values = np.where(mask, rng.normal(size=(batch, length)), np.nan).astype(np.float32)
    bootstrap = rng.normal(size=batch).astype(np.float32)
    out = token_gae(rewards, values, mask, gamma=GAMMA, lam=LAM, bootstrap_value=bootstrap,
                    method="native")
    expected_adv, expected_ret = ref.gae(rewards, values, mask, GAMMA, LAM, bootstrap)
    assert_close(out.advantages, expected_adv)
    assert_close(out.returns, expected_ret)


def lowered_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def test_traced_gamma_runs_the_scan():
    rewards, values, mask, bootstrap = odd_batch(1, 9)

    def traced(gamma, method):
        return step_gae(rewards, values, mask, gamma=gamma, lam=LAM, bootstrap_value=bootstrap,
                        method=method).advantages

    native_fn = functools.partial(traced, method="native")
    assert native._TARGET not in lowered_text(native_fn, 0.9)
    np.testing.assert_array_equal(jax.jit(native_fn)(0.9),
                                  jax.jit(functools.partial(traced, method="sequential"))(0.9))


def test_bfloat16_runs_the_scan_and_the_kernel_itself_refuses_it():
    rewards, values, mask, bootstrap = odd_batch(1, 9)
    low = [jnp.asarray(x, jnp.bfloat16) for x in (rewards, values, bootstrap)]
    out = {method: step_gae(low[0], low[1], mask, gamma=GAMMA, lam=LAM, bootstrap_value=low[2],
                            method=method).advantages for method in ("native", "sequential")}
    np.testing.assert_array_equal(np.asarray(out["native"], np.float32),
                                  np.asarray(out["sequential"], np.float32))
    with pytest.raises(TypeError, match="float32 arrays .got bfloat16"):
        native.masked_gae(low[0], low[1], jnp.asarray(mask), low[2], gamma=GAMMA, lam=LAM)


def test_a_failed_build_warns_and_runs_the_scan(monkeypatch):
    monkeypatch.setattr(native, "build_error", lambda: "no compiler here")
    rewards, values, mask, bootstrap = odd_batch(2, 9)
    with pytest.warns(UserWarning, match="step_gae: running the sequential scan instead: no comp"):
        out = native_advantages(rewards, values, mask, bootstrap)
    expected, _ = ref.gae(rewards, values, mask, GAMMA, LAM, bootstrap)
    assert_close(out, expected)


def test_the_default_call_runs_the_kernel_on_cpu():
    rewards, values, mask, bootstrap = odd_batch(1, 9)

    def default(rewards, values, mask, bootstrap):
        return step_gae(rewards, values, mask, gamma=GAMMA, lam=LAM,
                        bootstrap_value=bootstrap).advantages

    assert gae_method(rewards, values, bootstrap, gamma=GAMMA, lam=LAM) == "native"
    assert native._TARGET in lowered_text(default, rewards, values, mask, bootstrap)
    expected, _ = ref.gae(rewards, values, mask, GAMMA, LAM, bootstrap)
    assert_close(jax.jit(default)(rewards, values, mask, bootstrap), expected)
    # The registry's GAE entries, hence the trainer and offline credit, take the default.
    for name in ("step_gae", "token_gae", "turn_ppo"):
        assert adv.get(name).options["method"] == "auto"


def test_gae_method_says_when_the_scan_runs_instead(monkeypatch):
    rewards, values, _, bootstrap = odd_batch(1, 9)
    low = jnp.asarray(rewards, jnp.bfloat16)
    assert gae_method(low, low, gamma=GAMMA, lam=LAM) == "sequential"
    assert gae_method(rewards, values, bootstrap, gamma=GAMMA, lam=LAM,
                      backend="gpu") == "sequential"
    assert gae_method(rewards, values, gamma=GAMMA, lam=LAM, method="chunked") == "chunked"
    traced = jax.jit(lambda g: jnp.float32(gae_method(rewards, values, gamma=g, lam=LAM)
                                           == "native"))
    assert traced(0.9) == 0.0
    monkeypatch.setattr(native, "build_error", lambda: "no compiler here")
    assert gae_method(rewards, values, bootstrap, gamma=GAMMA, lam=LAM) == "sequential"


def test_without_a_kernel_the_default_runs_the_scan_silently(monkeypatch):
    monkeypatch.setattr(native, "build_error", lambda: "no compiler here")
    rewards, values, mask, bootstrap = odd_batch(2, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = step_gae(rewards, values, mask, gamma=GAMMA, lam=LAM, bootstrap_value=bootstrap)
    expected, _ = ref.gae(rewards, values, mask, GAMMA, LAM, bootstrap)
    assert_close(out.advantages, expected)


def test_odd_row_counts_and_empty_rows():
    rewards, values, mask, bootstrap = odd_batch(4, 75)
    odd = [x[:7] for x in (rewards, values, mask, bootstrap)]  # one row outside the row pairs
    expected, _ = ref.gae(*odd[:3], GAMMA, LAM, odd[3])
    assert_close(native_advantages(*odd), expected)
    empty = [x[:, :0] for x in (rewards, values, mask)]
    assert native_advantages(*empty, bootstrap).shape == (8, 0)


def test_shard_map_with_a_mask_made_inside(mesh4):
    # A mask built from constants inside shard_map varies over no mesh axis while
    # the sharded rewards do: the custom call needs its operands aligned.
    rewards, values, _, bootstrap = odd_batch(6, 75)
    mask = np.ones_like(rewards, bool)
    expected, _ = ref.gae(rewards, values, mask, GAMMA, LAM, bootstrap)

    def per_shard(r, v, b):
        return native_advantages(r, v, jnp.ones(r.shape, bool), b)

    sharded = jax.jit(jax.shard_map(per_shard, mesh=mesh4, in_specs=P("data"),
                                    out_specs=P("data")))
    assert_close(sharded(rewards, values, bootstrap), expected)


def test_unknown_method_names_the_function_and_the_choices():
    rewards, values, mask, _ = odd_batch(1, 9)
    with pytest.raises(ValueError, match=r"token_gae: method='fast'.*'native'"):
        token_gae(rewards, values, mask, gamma=GAMMA, lam=LAM, method="fast")


def test_other_backends_lower_to_the_scan_and_cpu_to_the_kernel():
    rewards, values, mask, bootstrap = odd_batch(1, 9)
    allow = [jax.export.DisabledSafetyCheck.custom_call(native._TARGET)]

    def lowered(platform):
        exported = jax.export.export(jax.jit(native_advantages), platforms=[platform],
                                     disabled_checks=allow)(rewards, values, mask, bootstrap)
        return exported.mlir_module()

    assert native._TARGET in lowered("cpu")
    assert native._TARGET not in lowered("cuda")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty kernel cache; the process's own cached path is restored afterwards."""
    monkeypatch.setenv("STEPCREDIT_NATIVE_CACHE", str(tmp_path))
    native.library_path.cache_clear()
    yield tmp_path
    native.library_path.cache_clear()


def test_build_is_cached_by_key_and_leaves_no_partial_file(fresh_cache, monkeypatch,
                                                           tmp_path_factory):
    # A stand-in compiler that writes its output (the last argument) and counts its calls:
    # the other tests here run the real build, in the process's own cache.
    folder = tmp_path_factory.mktemp("compiler")
    calls, compiler = folder / "calls", folder / "cxx"
    compiler.write_text(f"#!/bin/sh\necho >> '{calls}'\nfor a; do o=$a; done\necho > \"$o\"\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    path = native.library_path()
    assert os.path.dirname(path) == str(fresh_cache)
    assert os.listdir(fresh_cache) == [os.path.basename(path)]
    mtime = os.path.getmtime(path)
    native.library_path.cache_clear()
    assert native.library_path() == path and os.path.getmtime(path) == mtime
    assert calls.read_text().count("\n") == 1  # built once, then found by its key


def test_missing_compiler_is_a_clear_error(fresh_cache, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(native.NativeBuildError, match="no C.. compiler 'no-such-compiler-xyz'"):
        native.library_path()
    assert os.listdir(fresh_cache) == []


def test_failed_compile_reports_the_compiler_output_and_caches_nothing(fresh_cache, monkeypatch):
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(native.NativeBuildError, match="false failed to compile"):
        native.library_path()
    assert os.listdir(fresh_cache) == []


def test_unwritable_cache_is_a_clear_error(fresh_cache, monkeypatch):
    (fresh_cache / "a-file").write_text("")
    monkeypatch.setenv("STEPCREDIT_NATIVE_CACHE", str(fresh_cache / "a-file" / "native"))
    with pytest.raises(native.NativeBuildError, match="cannot write to the kernel cache"):
        native.library_path()


def same_partition(a, b) -> bool:
    """Whether two id arrays put the same positions together."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    return len(set(zip(a.tolist(), b.tolist()))) == len(set(a.tolist())) == len(set(b.tolist()))


def test_pair_ids_are_dense_and_group_exactly_the_equal_pairs():
    rng = np.random.default_rng(0)
    extremes = np.array([np.iinfo(np.int32).min, -1, 0, 1, np.iinfo(np.int32).max], np.int32)
    first = np.concatenate([rng.integers(0, 7, 3000), rng.choice(extremes, 500)]).astype(np.int32)
    second = np.concatenate([rng.integers(-3, 40, 3000), rng.choice(extremes, 500)]).astype(np.int32)
    ids = np.asarray(jax.jit(native.pair_ids)(first, second))
    _, expected = np.unique(np.stack([first, second], 1), axis=0, return_inverse=True)
    assert same_partition(ids, expected)
    assert sorted(set(ids.tolist())) == list(range(int(expected.max()) + 1))
    assert ids[0] == 0  # numbered by first occurrence
    batched = jax.vmap(native.pair_ids)(np.stack([first, second]), np.stack([second, first]))
    np.testing.assert_array_equal(batched[0], ids)
    assert jax.jit(native.pair_ids)(first[:0], second[:0]).shape == (0,)


def test_gigpo_step_groups_use_the_kernel_on_cpu_and_the_sort_elsewhere(monkeypatch):
    from stepcredit.advantages.gigpo import _pair_ids, _sorted_pair_ids

    rng = np.random.default_rng(1)
    first, second = (rng.integers(0, 5, 64).astype(np.int32) for _ in range(2))
    allow = [jax.export.DisabledSafetyCheck.custom_call(native._PAIR_TARGET)]

    def lowered(platform):
        return jax.export.export(jax.jit(_pair_ids), platforms=[platform],
                                 disabled_checks=allow)(first, second).mlir_module()

    assert native._PAIR_TARGET in lowered("cpu")
    assert native._PAIR_TARGET not in lowered("cuda")
    assert same_partition(jax.jit(_pair_ids)(first, second), _sorted_pair_ids(first, second))
    monkeypatch.setattr(native, "build_error", lambda: "no compiler here")
    retraced = lambda first, second: _pair_ids(first, second)  # noqa: E731 (a fresh trace)
    assert native._PAIR_TARGET not in lowered_text(retraced, first, second)
    assert same_partition(jax.jit(retraced)(first, second), _sorted_pair_ids(first, second))


def test_estimators_number_groups_by_the_kernel_on_cpu_and_the_public_ids_stay_ranked(
        monkeypatch):
    from stepcredit.advantages.group import _dense_ids, dense_group_ids

    rng = np.random.default_rng(2)
    group_ids = rng.choice(np.array([7, 1000, -3, np.iinfo(np.int32).min], np.int32), 256)
    internal = lambda ids: _dense_ids("grpo", ids, None, None).ids  # noqa: E731
    public = lambda ids: dense_group_ids(ids).ids  # noqa: E731
    assert native._PAIR_TARGET in exported_text(internal, "cpu", native._PAIR_TARGET, group_ids)
    assert native._PAIR_TARGET not in exported_text(internal, "cuda", native._PAIR_TARGET,
                                                    group_ids)
    assert native._PAIR_TARGET not in lowered_text(public, group_ids)
    ranked = np.unique(group_ids, return_inverse=True)[1]
    np.testing.assert_array_equal(jax.jit(public)(group_ids), ranked)
    numbered = np.asarray(jax.jit(internal)(group_ids))
    assert same_partition(numbered, ranked) and numbered[0] == 0
    assert sorted(set(numbered.tolist())) == [0, 1, 2, 3]
    monkeypatch.setattr(native, "build_error", lambda: "no compiler here")
    retraced = lambda ids: internal(ids)  # noqa: E731 (a fresh trace)
    assert native._PAIR_TARGET not in lowered_text(retraced, group_ids)
    np.testing.assert_array_equal(jax.jit(retraced)(group_ids), ranked)


def exported_text(fn, platform, target, *args) -> str:
    allow = [jax.export.DisabledSafetyCheck.custom_call(target)]
    return jax.export.export(jax.jit(fn), platforms=[platform],
                             disabled_checks=allow)(*args).mlir_module()


def recurrence_inputs(batch=37, length=19, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, length)).astype(np.float32)
    c = np.where(rng.random((batch, length)) < 0.8, 0.95, rng.choice([0.0, 1.0], (batch, length)))
    return x, c.astype(np.float32), rng.normal(size=batch).astype(np.float32)


# One part, and two threads' parts (B x T above 2^17 elements).
@pytest.mark.parametrize("batch, length", [(37, 19), (1027, 131)])
def test_the_recurrence_kernel_equals_the_scan_bit_for_bit(batch, length):
    from stepcredit.advantages.recurrence import reverse_linear_recurrence as solve

    x, c, y_init = recurrence_inputs(batch, length)
    scan = jax.jit(functools.partial(solve, method="sequential"))(x, c, y_init)
    np.testing.assert_array_equal(jax.jit(native.linear_recurrence)(x, c, y_init), scan)
    np.testing.assert_array_equal(jax.jit(solve)(x, c, y_init), scan)
    forward = jax.jit(functools.partial(native.linear_recurrence, reverse=False))(x, c, y_init)
    flipped = jax.jit(lambda x, c, y: solve(x[:, ::-1], c[:, ::-1], y,
                                            method="sequential")[:, ::-1])(x, c, y_init)
    np.testing.assert_array_equal(forward, flipped)
    batched = jax.vmap(native.linear_recurrence)(np.stack([x, x + 1]), np.stack([c, c]),
                                                 np.stack([y_init, y_init]))
    np.testing.assert_array_equal(batched[0], scan)


def test_the_recurrence_kernel_has_the_scans_gradient():
    from stepcredit.advantages.recurrence import reverse_linear_recurrence as solve

    x, c, y_init = recurrence_inputs(5, 7)
    weights = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)

    def loss(method):
        return jax.grad(lambda *a: jnp.sum(weights * solve(*a, method=method)), argnums=(0, 1, 2))

    for ours, scan in zip(jax.jit(loss("auto"))(x, c, y_init), loss("sequential")(x, c, y_init)):
        np.testing.assert_allclose(ours, scan, rtol=1e-5, atol=1e-5)


def test_the_recurrence_runs_the_scan_off_cpu_for_other_dtypes_and_without_a_kernel(monkeypatch):
    from stepcredit.advantages.recurrence import recurrence_method
    from stepcredit.advantages.recurrence import reverse_linear_recurrence as solve

    x, c, y_init = recurrence_inputs(3, 5)
    assert native._RECURRENCE_TARGET in exported_text(solve, "cpu", native._RECURRENCE_TARGET,
                                                      x, c, y_init)
    assert native._RECURRENCE_TARGET not in exported_text(solve, "cuda", native._RECURRENCE_TARGET,
                                                          x, c, y_init)
    assert recurrence_method(x, c, y_init) == "native"
    assert recurrence_method(x, c, y_init, backend="cuda") == "sequential"
    assert recurrence_method(x.astype(jnp.bfloat16), c, y_init) == "sequential"
    assert native._RECURRENCE_TARGET not in lowered_text(solve, x.astype(jnp.bfloat16), c, y_init)
    monkeypatch.setattr(native, "build_error", lambda: "no compiler here")
    assert recurrence_method(x, c, y_init) == "sequential"
    retraced = lambda x, c, y: solve(x, c, y)  # noqa: E731 (a fresh trace)
    assert native._RECURRENCE_TARGET not in lowered_text(retraced, x, c, y_init)
    np.testing.assert_array_equal(jax.jit(retraced)(x, c, y_init),
                                  solve(x, c, y_init, method="sequential"))


def normalize_inputs(shape=(64, 9), num_groups=11, seed=0):
    rng = np.random.default_rng(seed)
    values = (rng.normal(size=shape) * rng.choice([1e-3, 1.0, 1e3], size=shape)).astype(np.float32)
    values[rng.random(shape) < 0.1] = 2.0  # ties, and groups whose valid values are all equal
    ids = rng.integers(0, num_groups, size=shape).astype(np.int32)
    return values, ids, rng.random(shape) < 0.8


@pytest.mark.parametrize("std", ["unbiased", "biased", "none", "leave_one_out"])
@pytest.mark.parametrize("singleton", ["zero", "raw"])
@pytest.mark.parametrize("layout", ["random", "sorted", "rows", "anchors", "padded",
                                    "singletons", "invalid"])
def test_the_normalize_kernel_equals_the_segment_sums_bit_for_bit(std, singleton, layout):
    from stepcredit.advantages.group import _xla_normalize

    values, ids, valid = normalize_inputs((4096, 3) if layout != "random" else (64, 9),
                                          num_groups=300 if layout != "random" else 11)
    if layout == "sorted":  # long runs of one group: the chunked sums
        ids = np.sort(ids.ravel()).reshape(ids.shape)
    if layout == "rows":  # a group per row block, as GRPO's and iStar's
        ids = np.broadcast_to((np.arange(ids.shape[0]) // 8)[:, None], ids.shape).astype(np.int32)
    if layout == "anchors":  # GiGPO's step groups: a few anchors in each block of 8 rows,
        # an id change at almost every element (reordered group by group, then chunked)
        ids = ((np.arange(ids.shape[0]) // 8)[:, None] * 3 + ids % 3).astype(np.int32)
    if layout == "padded":  # the same, half the rows padding: groups with no valid member
        ids = ((np.arange(ids.shape[0]) // 8)[:, None] * 3 + ids % 3).astype(np.int32)
        valid = valid & (np.arange(ids.shape[0]) % 16 < 8)[:, None]
    if layout == "singletons":  # mostly one member per group: summed in place
        ids = np.random.default_rng(1).permutation(ids.size).reshape(ids.shape).astype(np.int32)
    if layout == "invalid":
        valid = np.zeros_like(valid)
    num_groups = int(ids.max()) + 2  # one group that holds nothing
    kwargs = dict(num_groups=num_groups, std=std, eps=1e-6, singleton=singleton)
    expected = jax.jit(functools.partial(_xla_normalize, axis_name=None, **kwargs))(values, ids,
                                                                                   valid)
    actual = jax.jit(functools.partial(native.group_normalize, **kwargs))(values, ids, valid)
    np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("std", ["unbiased", "none"])
def test_the_normalize_kernel_scales_groups_of_extreme_magnitude_as_xla_does(std):
    from stepcredit.advantages.group import _xla_normalize

    magnitudes = np.array([0.0, 1e-45, 1e-40, 1.1754942e-38, 1e-30, 1.0, 1e30, 3e38, np.inf],
                          np.float32)
    rng = np.random.default_rng(3)
    values = (magnitudes[:, None] * rng.choice([-1.0, -0.5, 0.25, 1.0], (9, 40))).astype(
        np.float32)
    ids = np.broadcast_to(np.arange(9)[:, None], values.shape).astype(np.int32)
    for layout in (lambda x: x, lambda x: x.T):  # runs, and ids that change every element
        kwargs = dict(num_groups=9, std=std, eps=1e-6, singleton="zero")
        args = [np.ascontiguousarray(layout(x)) for x in (values, ids, np.ones(values.shape, bool))]
        expected = jax.jit(functools.partial(_xla_normalize, axis_name=None, **kwargs))(*args)
        actual = jax.jit(functools.partial(native.group_normalize, **kwargs))(*args)
        np.testing.assert_array_equal(actual, expected)


def test_the_normalize_kernel_keeps_a_nan_in_its_group_and_clamps_out_of_range_ids():
    from stepcredit.advantages.group import _xla_normalize

    values, ids, valid = normalize_inputs()
    values[0, 0], valid[0, 0] = np.nan, True
    ids[1, :3] = [-4, 11, 99]  # outside [0, 11): left out of the sums, read a clamped group
    kwargs = dict(num_groups=11, std="unbiased", eps=1e-6, singleton="zero")
    expected = jax.jit(functools.partial(_xla_normalize, axis_name=None, **kwargs))(values, ids,
                                                                                   valid)
    actual = jax.jit(functools.partial(native.group_normalize, **kwargs))(values, ids, valid)
    np.testing.assert_array_equal(actual, expected)
    assert np.isnan(actual[ids == ids[0, 0]][valid[ids == ids[0, 0]]]).all()
    batched = jax.vmap(functools.partial(native.group_normalize, **kwargs))(
        np.stack([values, values]), np.stack([ids, ids]), np.stack([valid, valid]))
    np.testing.assert_array_equal(batched[1], actual)


def test_group_normalisation_uses_the_kernel_on_cpu_only_where_it_applies(monkeypatch):
    from stepcredit.advantages.group import _normalize

    values, ids, valid = normalize_inputs()

    def normalized(values, eps=1e-6):
        return _normalize(values, ids, valid, 11, std="unbiased", eps=eps, singleton="zero",
                          axis_name=None)

    target = native._NORMALIZE_TARGET
    assert target in exported_text(normalized, "cpu", target, values)
    assert target not in exported_text(normalized, "cuda", target, values)
    assert target not in lowered_text(normalized, values.astype(jnp.bfloat16))
    assert target not in lowered_text(normalized, values, 1e-6)  # eps traced
    monkeypatch.setattr(native, "build_error", lambda: "no compiler here")
    retraced = lambda values: normalized(values)  # noqa: E731 (a fresh trace)
    assert target not in lowered_text(retraced, values)


def test_group_kernels_inside_shard_map(mesh4):
    values, ids, valid = normalize_inputs((8, 9))
    kwargs = dict(num_groups=11, std="unbiased", eps=1e-6, singleton="zero")
    sharded = jax.jit(jax.shard_map(
        lambda v, i: native.group_normalize(v, i, jnp.ones(v.shape, bool), **kwargs),
        mesh=mesh4, in_specs=P("data"), out_specs=P("data")))
    per_shard = [native.group_normalize(v, i, np.ones(v.shape, bool), **kwargs)
                 for v, i in zip(np.split(values, 4), np.split(ids, 4))]
    np.testing.assert_array_equal(sharded(values, ids), np.concatenate(per_shard))
    x, c, y_init = recurrence_inputs(8, 5)
    solve = jax.jit(jax.shard_map(lambda x, c, y: native.linear_recurrence(x, jnp.ones_like(c), y),
                                  mesh=mesh4, in_specs=P("data"), out_specs=P("data")))
    np.testing.assert_array_equal(solve(x, c, y_init),
                                  native.linear_recurrence(x, np.ones_like(c), y_init))


def token_view(batch=19, steps=5, seed=0):
    rng = np.random.default_rng(seed)
    step_index = np.sort(rng.integers(-1, steps, size=(batch, 23)), axis=1).astype(np.int32)
    step_index[rng.random(step_index.shape) < 0.2] = -1  # observation tokens between steps
    values = rng.normal(size=step_index.shape).astype(np.float32)
    return rng.normal(size=(batch, steps)).astype(np.float32), values, step_index


@pytest.mark.parametrize("batch", [19, 6007])  # one part; two threads' (B x N above 2^17)
def test_the_token_kernels_equal_the_gather_and_the_scatter_with_their_gradients(batch):
    from stepcredit.advantages import tokens

    step_values, token_values, step_index = token_view(batch)
    pairs = [
        (tokens.broadcast_to_tokens, tokens._xla_broadcast, step_values),
        (tokens.token_rewards_from_steps,
         functools.partial(tokens._xla_last_tokens, last_only=True), step_values),
        (functools.partial(tokens.step_rewards_from_tokens, num_steps=5),
         functools.partial(tokens._xla_step_sums, num_steps=5), token_values),
    ]
    for ours, xla, values in pairs:
        np.testing.assert_array_equal(jax.jit(ours)(values, step_index),
                                      jax.jit(xla)(values, step_index))
        weights = np.random.default_rng(2).normal(size=xla(values, step_index).shape)
        grad = lambda fn: jax.grad(lambda v: jnp.sum(weights * fn(v, step_index)))(values)  # noqa: E731
        np.testing.assert_allclose(grad(ours), grad(xla), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(jax.vmap(ours)(values[None], step_index[None])[0],
                                      xla(values, step_index))
    target = native._BROADCAST_TARGET
    assert target in exported_text(tokens.broadcast_to_tokens, "cpu", target, step_values,
                                   step_index)
    assert target not in exported_text(tokens.broadcast_to_tokens, "cuda", target, step_values,
                                       step_index)
    sums = functools.partial(tokens.step_rewards_from_tokens, num_steps=5)
    assert native._STEP_SUMS_TARGET not in exported_text(sums, "cuda", native._STEP_SUMS_TARGET,
                                                         token_values, step_index)


def empg_inputs(batch=13, steps=7, seed=0, per_row=False):
    """Rows with holes, an empty row, NaN at invalid steps; B x T not a multiple of 8."""
    rng = np.random.default_rng(seed)
    mask = rng.random((batch, steps)) < 0.7
    mask[0] = False
    entropy = np.where(mask, rng.uniform(0.0, 4.0, (batch, steps)), np.nan).astype(np.float32)
    shape = (batch,) if per_row else (batch, steps)
    advantages = rng.normal(size=shape).astype(np.float32)
    if not per_row:
        advantages = np.where(mask, advantages, np.nan).astype(np.float32)
    return advantages, entropy, mask


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("center", [True, False])
def test_the_empg_kernel_equals_the_xla_computation(per_row, center):
    empg_module = importlib.import_module("stepcredit.advantages.empg")  # not the function
    for seed, (batch, steps) in enumerate([(13, 7), (4096, 16), (3, 1), (1, 33)]):
        advantages, entropy, mask = empg_inputs(batch, steps, seed, per_row)
        hyper = dict(k=0.5 + seed, k_future=2.0 - 0.3 * seed, zeta=0.05 * (seed + 1), eps=1e-8,
                     center=center)
        kernel = jax.jit(functools.partial(native.empg, **hyper))(advantages, entropy, mask)
        xla = jax.jit(functools.partial(empg_module._xla_empg, axis_name=None, **hyper))(
            advantages, entropy, mask)
        np.testing.assert_allclose(kernel, xla, rtol=2e-6, atol=2e-6 * np.abs(xla).max())
        assert np.all(np.asarray(kernel)[~mask] == 0.0)
    batched = jax.vmap(functools.partial(native.empg, **hyper))(
        np.stack([advantages, -advantages]), np.stack([entropy, entropy]), np.stack([mask, mask]))
    np.testing.assert_allclose(batched[1], native.empg(-advantages, entropy, mask, **hyper),
                               rtol=1e-6)


def test_the_empg_kernel_keeps_a_nan_and_zeroes_an_empty_batch():
    advantages, entropy, mask = empg_inputs()
    hyper = dict(k=1.0, k_future=1.0, zeta=0.05, eps=1e-8, center=True)
    entropy[mask.nonzero()[0][0], mask.nonzero()[1][0]] = np.nan
    out = np.asarray(native.empg(advantages, entropy, mask, **hyper))
    assert np.isnan(out[mask]).all() and np.all(out[~mask] == 0.0)
    empty = native.empg(advantages, entropy, np.zeros_like(mask), **hyper)
    np.testing.assert_array_equal(empty, np.zeros(mask.shape, np.float32))
    # An exponent below float32's range gives 0, as exp does.
    np.testing.assert_array_equal(
        native.empg(np.ones(2, np.float32), np.array([[0.0, 1.0]] * 2, np.float32),
                    np.ones((2, 2), bool), k=200.0, k_future=0.0, zeta=0.0, eps=0.0,
                    center=False)[:, 1], [0.0, 0.0])


def test_empg_uses_the_kernel_on_cpu_only_where_it_applies(monkeypatch, mesh4):
    from stepcredit.advantages.empg import empg

    advantages, entropy, mask = empg_inputs(8, 5)
    target = native._EMPG_TARGET
    call = lambda a, h: empg(a, h, mask)  # noqa: E731
    assert target in exported_text(call, "cpu", target, advantages, entropy)
    assert target not in exported_text(call, "cuda", target, advantages, entropy)
    assert target not in lowered_text(lambda a, h, k: empg(a, h, mask, k=k), advantages, entropy,
                                      1.0)  # k traced
    sharded = jax.shard_map(lambda a, h, m: empg(a, h, m, axis_name="data"), mesh=mesh4,
                            in_specs=P("data"), out_specs=P("data"))
    assert target not in lowered_text(sharded, advantages, entropy, mask)
    np.testing.assert_allclose(jax.jit(sharded)(advantages, entropy, mask),
                               jax.jit(call)(advantages, entropy), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(native, "build_error", lambda: "no compiler here")
    assert target not in lowered_text(lambda a, h: empg(a, h, mask), advantages, entropy)


@pytest.mark.parametrize("gain", ["probability", "log_probability"])
def test_the_information_gain_kernel_equals_the_xla_computation(gain):
    igpo_module = importlib.import_module("stepcredit.advantages.igpo")  # not the function
    for seed, (batch, steps) in enumerate([(13, 7), (4096, 16), (3, 1), (1, 33)]):
        rng = np.random.default_rng(seed)
        mask = rng.random((batch, steps)) < 0.7
        mask[0] = False
        logp = np.where(mask, -rng.uniform(0.0, 6.0, (batch, steps)), np.nan).astype(np.float32)
        kernel = jax.jit(functools.partial(native.information_gain, gain=gain))(logp, mask)
        xla = jax.jit(functools.partial(igpo_module._xla_information_gain, gain=gain))(logp, mask)
        if gain == "log_probability":
            np.testing.assert_array_equal(kernel, xla)
        else:
            np.testing.assert_allclose(kernel, xla, rtol=0, atol=4e-7)
    batched = jax.vmap(functools.partial(native.information_gain, gain=gain))(
        np.stack([logp, logp / 2]), np.stack([mask, mask]))
    np.testing.assert_array_equal(batched[1], native.information_gain(logp / 2, mask, gain=gain))
    # A NaN at a valid turn reaches that turn and the valid turn before it, as in XLA.
    row = np.array([[-1.0, np.nan, -2.0, -0.5]], np.float32)
    out = np.asarray(native.information_gain(row, np.ones_like(row, bool), gain=gain))
    assert np.isnan(out[0, :2]).all() and np.isfinite(out[0, 2:]).all()


def test_information_gain_uses_the_kernel_on_cpu_only(monkeypatch):
    from stepcredit.advantages.igpo import information_gain

    logp = -np.ones((4, 5), np.float32)
    mask = np.ones((4, 5), bool)
    target = native._GAIN_TARGET
    assert target in exported_text(information_gain, "cpu", target, logp, mask)
    assert target not in exported_text(information_gain, "cuda", target, logp, mask)
    assert target not in lowered_text(information_gain, logp.astype(jnp.bfloat16), mask)
    monkeypatch.setattr(native, "build_error", lambda: "no compiler here")
    assert target not in lowered_text(lambda a, m: information_gain(a, m), logp, mask)


def test_final_turns_by_the_kernel_equal_the_argmax_and_lower_only_on_cpu():
    mt_grpo = importlib.import_module("stepcredit.advantages.mt_grpo")  # not the function
    rng = np.random.default_rng(0)
    mask = rng.random((37, 9)) < 0.5
    mask[0], mask[1] = False, True
    np.testing.assert_array_equal(jax.jit(mt_grpo.final_turns)(mask),
                                  mt_grpo._argmax_final_turns(mask))
    np.testing.assert_array_equal(jax.vmap(native.last_valid)(np.stack([mask, ~mask]))[1],
                                  mt_grpo._argmax_final_turns(~mask))
    target = native._LAST_TARGET
    assert target in exported_text(mt_grpo.final_turns, "cpu", target, mask)
    assert target not in exported_text(mt_grpo.final_turns, "cuda", target, mask)


def anchor_inputs(batch=37, steps=9, seed=0, spread_ids=False):
    """Rows with holes, an empty row, NaN at invalid steps, a few anchors per episode group
    (so that step groups at several history depths hold several steps), episode groups of
    unequal sizes in no order, and B x T not a multiple of 8."""
    rng = np.random.default_rng(seed)
    mask = rng.random((batch, steps)) < 0.75
    mask[0] = False
    rewards = np.where(mask, rng.normal(size=(batch, steps)) * 10.0 ** rng.integers(-2, 3),
                       np.nan).astype(np.float32)
    anchors = rng.integers(0, 3, (batch, steps)).astype(np.int32)
    groups = rng.integers(0, max(batch // 5, 1), batch)
    # Ids far apart take the kernel's sort instead of its counting sort.
    groups = (groups * 1_000_003 - 7 if spread_ids else groups).astype(np.int32)
    scores = rng.normal(size=batch).astype(np.float32)
    return rewards, anchors, groups, mask, scores


GIGPO_FAMILY = {
    "gigpo": dict(omega=0.7),
    "ecpo": dict(omega=1.3, kappa=1.5),
    "hgpo": dict(omega=0.9, max_depth=3, min_depth=0, alpha=0.5),
}


@pytest.mark.parametrize("name", sorted(GIGPO_FAMILY))
@pytest.mark.parametrize("std, singleton", [("unbiased", "zero"), ("biased", "raw"),
                                            ("none", "raw")])
def test_the_anchor_group_kernel_equals_the_xla_computation(name, std, singleton):
    estimator = getattr(adv, name)
    for seed, (batch, steps, spread) in enumerate([(37, 9, False), (4096, 16, False),
                                                   (23, 1, True), (1, 33, False)]):
        rewards, anchors, groups, mask, scores = anchor_inputs(batch, steps, seed, spread)
        for given in (None, scores):
            def run(method, rewards, anchors, groups, mask, given):
                return estimator(rewards, anchors, groups, mask, episode_scores=given, gamma=0.9,
                                 std=std, singleton=singleton, method=method,
                                 **GIGPO_FAMILY[name])

            kernel = jax.jit(functools.partial(run, "auto"))(rewards, anchors, groups, mask, given)
            xla = jax.jit(functools.partial(run, "sequential"))(rewards, anchors, groups, mask,
                                                                 given)
            assert np.all(np.asarray(kernel)[~mask] == 0.0)
            if given is None:
                # XLA:CPU may add a row's rewards in a tree, the kernel adds them in order;
                # given XLA's sums, the kernel gives XLA's numbers.
                np.testing.assert_allclose(kernel, xla, rtol=0, atol=1e-5 * np.abs(xla).max())
                given = jax.jit(lambda r, m: jnp.sum(jnp.where(m, r, 0.0), axis=1))(rewards,
                                                                                     mask)
                kernel = jax.jit(functools.partial(run, "auto"))(rewards, anchors, groups, mask,
                                                                 given)
            if name == "hgpo":  # XLA:CPU fuses its last multiply-add for some shapes only
                np.testing.assert_allclose(kernel, xla, rtol=0, atol=1e-6 * np.abs(xla).max())
            else:
                np.testing.assert_array_equal(kernel, xla)


def test_the_anchor_group_kernel_keeps_a_nan_in_its_groups_and_maps_over_a_batch():
    rewards, anchors, groups, mask, _ = anchor_inputs()
    row, step = mask.nonzero()[0][-1], mask.nonzero()[1][-1]
    rewards[row, step] = np.nan
    gigpo = jax.jit(lambda *args: adv.gigpo(*args, method="auto"))
    xla = jax.jit(lambda *args: adv.gigpo(*args, method="sequential"))
    out = np.asarray(gigpo(rewards, anchors, groups, mask))
    np.testing.assert_array_equal(out, xla(rewards, anchors, groups, mask))
    others = groups != groups[row]
    assert np.isnan(out[row, step]) and np.isfinite(out[others][mask[others]]).all()
    batched = jax.vmap(gigpo)(np.stack([rewards, -rewards]), np.stack([anchors, anchors]),
                              np.stack([groups, groups]), np.stack([mask, mask]))
    np.testing.assert_array_equal(batched[1], gigpo(-rewards, anchors, groups, mask))
    # Across history depths a NaN return stays in the step groups it belongs to, as in
    # XLA, whether they hold other steps (their statistics are finished) or not. At the
    # first valid step of its row, given finite scores, it leaves the steps of its episode
    # group with another anchor finite.
    rewards, anchors, groups, mask, scores = anchor_inputs()
    row = next(b for b in range(len(mask)) if mask[b].any())
    step = mask[row].argmax()
    rewards[row, step] = np.nan
    options = dict(episode_scores=scores, max_depth=3, alpha=0.5)
    out = np.asarray(jax.jit(lambda *args: adv.hgpo(*args, **options))(
        rewards, anchors, groups, mask))
    xla = np.asarray(jax.jit(lambda *args: adv.hgpo(*args, method="sequential", **options))(
        rewards, anchors, groups, mask))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(xla))
    np.testing.assert_allclose(out, xla, rtol=0, atol=1e-5 * np.nanmax(np.abs(xla)))
    elsewhere = mask & (groups[:, None] == groups[row]) & (anchors != anchors[row, step])
    assert np.isnan(out[row, step]) and elsewhere.any() and np.isfinite(out[elsewhere]).all()


def test_the_gigpo_family_uses_the_kernel_on_cpu_only_where_it_applies(monkeypatch, mesh4):
    rewards, anchors, groups, mask, _ = anchor_inputs(8, 5)
    rewards = np.nan_to_num(rewards)
    target = native._ANCHOR_TARGET
    for name, options in GIGPO_FAMILY.items():
        options = {**options, "num_groups": int(groups.max()) + 1}  # no other custom call
        estimator = getattr(adv, name)
        call = lambda r, a, g, m, estimator=estimator, options=options: estimator(  # noqa: E731
            r, a, g, m, **options)
        assert target in exported_text(call, "cpu", target, rewards, anchors, groups, mask)
        assert target not in exported_text(call, "cuda", target, rewards, anchors, groups, mask)
        assert target not in lowered_text(
            lambda r, a, g, m, estimator=estimator, options=options: estimator(
                r, a, g, m, method="sequential", **options), rewards, anchors, groups, mask)
        assert target not in lowered_text(
            lambda r, a, g, m, omega, estimator=estimator, options=options: estimator(
                r, a, g, m, **{**options, "omega": omega}), rewards, anchors, groups, mask, 1.0)
    sharded = jax.shard_map(lambda r, a, g, m: adv.gigpo(r, a, g, m, axis_name="data"),
                            mesh=mesh4, in_specs=P("data"), out_specs=P("data"))
    assert target not in lowered_text(sharded, rewards, anchors, groups, mask)
    np.testing.assert_allclose(jax.jit(sharded)(rewards, anchors, groups, mask),
                               jax.jit(adv.gigpo)(rewards, anchors, groups, mask),
                               rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(native, "build_error", lambda: "no compiler here")
    assert target not in lowered_text(lambda *args: adv.gigpo(*args), rewards, anchors, groups,
                                      mask)


@pytest.mark.parametrize("std", ["unbiased", "biased", "none", "leave_one_out"])
def test_the_turn_group_kernel_equals_the_transposed_group_normalisation(std):
    group_module = importlib.import_module("stepcredit.advantages.group")  # not grpo's module
    for seed, (batch, steps) in enumerate([(37, 9), (4096, 16), (23, 1), (5, 19)]):
        rng = np.random.default_rng(seed)
        mask = rng.random((batch, steps)) < 0.75
        values = np.where(mask, rng.normal(size=(batch, steps)) * 10.0 ** (seed - 1),
                          np.nan).astype(np.float32)
        values[:, 0] = np.where(mask[:, 0], 3.0, np.nan)  # a turn whose values are all equal
        ids = rng.integers(0, max(batch // 4, 1), batch).astype(np.int32)
        num_groups = int(ids.max()) + 1
        for singleton in ("zero", "raw"):
            kernel = jax.jit(functools.partial(native.turn_groups, std=std, eps=1e-6,
                                               singleton=singleton))(values, ids, mask)

            def transposed(values, ids, mask, singleton=singleton):
                segments = ids[:, None] * steps + jnp.arange(steps)[None, :]
                return group_module._xla_normalize(
                    values.T, segments.T, mask.T, num_groups=num_groups * steps, std=std,
                    eps=1e-6, singleton=singleton, axis_name=None).T

            np.testing.assert_array_equal(kernel, jax.jit(transposed)(values, ids, mask))
    values[mask.nonzero()[0][0], mask.nonzero()[1][0]] = np.nan  # kept in its segment only
    out = np.asarray(native.turn_groups(values, ids, mask, std=std, eps=1e-6, singleton="zero"))
    np.testing.assert_array_equal(out, jax.jit(transposed)(values, ids, mask))
    batched = jax.vmap(functools.partial(native.turn_groups, std=std, eps=1e-6,
                                         singleton="zero"))(
        np.stack([values, -values]), np.stack([ids, ids]), np.stack([mask, mask]))
    np.testing.assert_array_equal(
        batched[1], native.turn_groups(-values, ids, mask, std=std, eps=1e-6, singleton="zero"))


@pytest.mark.parametrize("name", ["gtpo", "kevin", "mt_grpo", "igpo"])
def test_turn_level_estimators_by_the_turn_group_kernel_equal_their_xla_computation(
        name, monkeypatch):
    estimator = getattr(adv, name)
    options = {"gtpo": [dict(baseline=b, gamma=0.7) for b in ("same_turn", "all_turns")],
               "kevin": [dict(baseline=b, gamma=0.4) for b in ("same_turn", "all_turns")],
               "mt_grpo": [dict(turn_baseline=b, final_turn=f, lam=0.6)
                           for b in ("per_turn", "pooled") for f in ("outcome", "both")],
               "igpo": [dict(order=o, gamma=g) for o in ("normalize_first", "discount_first")
                        for g in (1.0, 0.7)]}[name]
    for seed, (batch, steps) in enumerate([(37, 9), (4096, 16), (23, 1), (5, 19)]):
        rng = np.random.default_rng(seed)
        mask = rng.random((batch, steps)) < 0.75
        rewards = np.where(mask, rng.normal(size=(batch, steps)), np.nan).astype(np.float32)
        scores = rng.normal(size=batch).astype(np.float32)
        ids = rng.integers(0, max(batch // 4, 1), batch).astype(np.int32)
        for std in ("unbiased", "none"):
            for extra in options:
                if name in ("mt_grpo", "igpo"):
                    def call(r, i, m, extra=extra, std=std):
                        return estimator(r, scores, i, m, std=std, **extra)
                else:
                    def call(r, i, m, extra=extra, std=std):
                        return estimator(r, i, m, std=std, singleton="raw", **extra)
                kernel = jax.jit(call)(rewards, ids, mask)
                with monkeypatch.context() as patch:
                    patch.setattr(native, "build_error", lambda: "no compiler here")
                    xla = jax.jit(lambda *args, call=call: call(*args))(rewards, ids, mask)
                if name == "igpo" or "pooled" in extra.values() or "all_turns" in extra.values():
                    # The kernel adds a pooled segment's per-turn sums in turn order.
                    np.testing.assert_allclose(kernel, xla, rtol=1e-5, atol=1e-5)
                else:
                    np.testing.assert_array_equal(kernel, xla)


def test_turn_level_estimators_use_the_turn_group_kernel_on_cpu_only(monkeypatch):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(8, 5)).astype(np.float32)
    ids = np.repeat(np.arange(2), 4).astype(np.int32)
    mask = rng.random((8, 5)) < 0.8
    target = native._TURN_TARGET
    calls = {
        "gtpo": lambda r, m: adv.gtpo(r, ids, m, num_groups=2),
        "kevin": lambda r, m: adv.kevin(r, ids, m, num_groups=2),
        "mt_grpo": lambda r, m: adv.mt_grpo(r, r.sum(axis=1), ids, m, num_groups=2,
                                            final_turn="both"),
        "igpo": lambda r, m: adv.igpo(r, r.sum(axis=1), ids, m, num_groups=2),
    }
    for call in calls.values():
        assert target in lowered_text(call, rewards, mask)
        assert target not in exported_text(call, "cuda", target, rewards, mask)
        assert target not in lowered_text(call, rewards.astype(jnp.bfloat16), mask)
    assert target not in lowered_text(lambda r, m: adv.gtpo(r, ids, m, num_groups=2,
                                                            method="sequential",
                                                            baseline="all_turns"),
                                      rewards, mask)
    assert target not in lowered_text(lambda r, m: adv.igpo(r, r.sum(axis=1), ids, m,
                                                            num_groups=2, normalize="separate"),
                                      rewards, mask)
    monkeypatch.setattr(native, "build_error", lambda: "no compiler here")
    assert target not in lowered_text(lambda r, m: calls["gtpo"](r, m), rewards, mask)
