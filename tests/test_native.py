"""The compiled GAE kernel: its boundary, its build cache, and the backends it lowers for.

Its numbers are checked with every other method in test_kernels.py.
"""

import functools
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


def test_build_is_cached_by_key_and_leaves_no_partial_file(fresh_cache):
    path = native.library_path()
    assert os.path.dirname(path) == str(fresh_cache)
    assert os.listdir(fresh_cache) == [os.path.basename(path)]
    mtime = os.path.getmtime(path)
    native.library_path.cache_clear()
    assert native.library_path() == path and os.path.getmtime(path) == mtime


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
