"""Keeps a long run under Linux's limit on a process's memory mappings.

XLA:CPU maps every program it compiles into the process (a few hundred mappings
for the small policy's forward pass), and JAX keeps every program for the rest
of the process. A run meets many shapes (prompt widths, numbers of distinct
rows, the prefill passes of `stepcredit.models.sharing`), and a WebShop VinePPO
run, whose continuations meet the most, reached Linux's default
`vm.max_map_count` (65,530) in its 22nd iteration: LLVM could map no new
program and the process died (SIGSEGV). Clearing JAX's caches unmaps the
programs; the persistent compilation cache (`stepcredit.compilation_cache`)
reads back those needed again, so a clear costs their tracing, not their
compilation.
"""

from __future__ import annotations

import gc

SHARE = 0.75
"""The share of the limit above which `release_compiled_programs` clears the caches."""


def map_limit() -> int | None:
    """The most mappings a process may hold (`vm.max_map_count`), or None where not known."""
    try:
        with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def mapped_regions() -> int | None:
    """The mappings this process holds now, or None where not known."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return None


def release_compiled_programs(share: float = SHARE) -> bool:
    """Clears JAX's caches of compiled programs when this process holds more than `share`
    of the mappings it may; returns whether it did (never where the counts are unknown)."""
    limit, held = map_limit(), mapped_regions()
    if limit is None or held is None or held <= share * limit:
        return False
    import jax

    jax.clear_caches()
    gc.collect()  # the programs are unmapped when their last reference goes
    return True
