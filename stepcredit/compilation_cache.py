"""The persistent XLA compilation cache of the command line.

A run compiles its rollout, scoring and update once per shape it meets (prompt
widths, row widths, numbers of distinct rows): on the 2-core reference CPU that
is about a minute of a 20-minute run, and each run of a sweep would pay it
again. The commands (`stepcredit ...` and the sweep's workers) therefore keep
JAX's persistent compilation cache, so a program compiled once is read back by
every later process with the same jax, flags and shapes. The library itself
sets nothing: importing stepcredit leaves JAX's configuration alone.
"""

from __future__ import annotations

import os

DEFAULT_DIRECTORY = os.path.join(os.path.expanduser("~"), ".cache", "stepcredit-jax")
"""Where the cache lives unless `JAX_COMPILATION_CACHE_DIR` names another directory
(the same default as the Makefile's test command)."""


def use_compilation_cache() -> str:
    """Points JAX's persistent compilation cache at `$JAX_COMPILATION_CACHE_DIR`, or at
    `DEFAULT_DIRECTORY` when that is unset or empty; returns the directory."""
    import jax  # here, so that `stepcredit --help` does not wait for jax

    directory = os.environ.get("JAX_COMPILATION_CACHE_DIR") or DEFAULT_DIRECTORY
    jax.config.update("jax_compilation_cache_dir", directory)
    return directory
