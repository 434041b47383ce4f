"""A long run stays under Linux's limit on memory mappings by clearing JAX's caches."""

import os

import jax
import jax.numpy as jnp
import pytest

from stepcredit.train import mappings

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"),
                                reason="counts mappings through Linux's /proc")


def test_the_counts_are_read_from_proc():
    held, limit = mappings.mapped_regions(), mappings.map_limit()
    assert 0 < held < limit
    grown = [jax.jit(lambda x, n=n: x * n)(jnp.ones(n + 3)) for n in range(20)]  # 20 programs
    assert mappings.mapped_regions() > held and len(grown) == 20


def test_the_caches_are_cleared_only_above_the_share(monkeypatch):
    double = jax.jit(lambda x: 2 * x)
    double(jnp.ones(3))
    assert not mappings.release_compiled_programs(share=1.0) and double._cache_size() == 1
    assert mappings.release_compiled_programs(share=0.0) and double._cache_size() == 0
    assert float(double(jnp.ones(3))[0]) == 2.0  # traced again on its next call
    monkeypatch.setattr(mappings, "map_limit", lambda: None)  # not Linux: never cleared
    assert not mappings.release_compiled_programs(share=0.0)
