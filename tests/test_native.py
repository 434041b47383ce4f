"""The compiled GAE kernel: its boundary, its build cache, and the backends it lowers for.

Its numbers are checked with every other method in test_kernels.py.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stepcredit.advantages import native, step_gae, token_gae
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


def test_traced_gamma_is_refused_with_its_name():
    rewards, values, mask, bootstrap = odd_batch(1, 9)

    @jax.jit
    def traced(gamma):
        return step_gae(rewards, values, mask, gamma=gamma, lam=LAM, method="native")

    with pytest.raises(TypeError, match="needs gamma as a number known when tracing"):
        traced(0.9)


def test_non_float32_inputs_are_refused_with_their_name():
    rewards, values, mask, bootstrap = odd_batch(1, 9)
    with pytest.raises(TypeError, match="rewards has dtype bfloat16"):
        native_advantages(jnp.asarray(rewards, jnp.bfloat16), values, mask, bootstrap)


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
