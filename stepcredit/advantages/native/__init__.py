"""Masked GAE as a compiled CPU kernel (an XLA FFI custom call), built on first use.

`masked_gae` computes exactly what `step_gae` and `token_gae` compute, in one
pass over batch-major rows (`masked_gae.cc`): XLA:CPU runs a `lax.scan` as one
small kernel per time step and pays for transposing `[B, T]` arrays to time-major
and back, which keeps the scan several times above the memory-copy floor; the
kernel reads each input once, writes each output once and solves eight steps at
a time in SIMD registers.

The C++ source is compiled with the system compiler (`$CXX`, else `c++`) the
first time a process uses it, against the XLA FFI headers that jaxlib ships,
and cached under `$STEPCREDIT_NATIVE_CACHE` (default `~/.cache/stepcredit/native`),
keyed by the source, the flags, the jax version and the CPU, so a cached library
never runs on a CPU it was not built for.

The kernel is float32 and CPU-only: `step_gae(..., method="native")` lowers to it
on CPU and to the sequential scan on other backends. It has no derivative
(advantages and returns are regression and policy-gradient targets).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

_SOURCE = os.path.join(os.path.dirname(__file__), "masked_gae.cc")
_SYMBOL = "StepcreditMaskedGaeF32"
_TARGET = "stepcredit_masked_gae_f32"
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


class NativeBuildError(RuntimeError):
    """The kernel could not be compiled or loaded (no compiler, or it failed)."""


def cache_dir() -> str:
    """Where compiled kernels are kept: `$STEPCREDIT_NATIVE_CACHE` or ~/.cache/stepcredit/native."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "stepcredit", "native")
    return os.environ.get("STEPCREDIT_NATIVE_CACHE", default)


def _cpu_identity() -> str:
    """The CPU model and feature flags: `-march=native` code is only valid on such a CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return platform.machine() + "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


@functools.cache
def library_path() -> str:
    """Compiles `masked_gae.cc` once per (source, flags, jax, CPU) and returns the library's path.

    The library is written to a temporary name and renamed into place, so a build
    interrupted halfway never leaves a broken library behind the cache key.
    """
    compiler = os.environ.get("CXX", "c++")
    flags = (*_FLAGS, "-I", jax.ffi.include_dir())
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + repr((compiler, flags, jax.__version__,
                                        _cpu_identity())).encode()).hexdigest()[:16]
    directory = cache_dir()
    path = os.path.join(directory, f"masked_gae-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so.partial", dir=directory)
    os.close(fd)
    try:
        try:
            build = subprocess.run([compiler, *flags, _SOURCE, "-o", partial],
                                   capture_output=True, text=True)
        except FileNotFoundError as e:
            raise NativeBuildError(
                f"method='native': no C++ compiler {compiler!r} (set CXX); "
                "method='sequential' computes the same without one") from e
        if build.returncode != 0:
            raise NativeBuildError(f"method='native': {compiler} failed to compile {_SOURCE}:\n"
                                   f"{build.stderr[-2000:]}")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


@functools.cache
def _register() -> None:
    library = ctypes.cdll.LoadLibrary(library_path())
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(getattr(library, _SYMBOL)),
                                platform="cpu")


def _python_float(fn: str, name: str, x) -> float:
    try:
        return float(x)
    except jax.errors.ConcretizationTypeError as e:
        raise TypeError(f"{fn}: method='native' needs {name} as a number known when tracing "
                        f"(it is compiled into the kernel call), not a traced value") from e


def masked_gae(rewards: jax.Array, values: jax.Array, mask: jax.Array,
               bootstrap_value: jax.Array, *, gamma: float,
               lam: float) -> tuple[jax.Array, jax.Array]:
    """Masked GAE advantages and returns, `[B, T]` each, by the compiled CPU kernel.

    The recursion and conventions of `step_gae` (masked positions skipped and set to
    0; `bootstrap_value` after each row's last valid step), already checked by it:

        A_t = r_t + gamma V_{next(t)} - V_t + gamma lam A_{next(t)},   R_t = A_t + V_t

    Args:
      rewards: `[B, T]` float32.
      values: `[B, T]` float32.
      mask: `[B, T]` bool.
      bootstrap_value: `[B]` float32.
      gamma: discount, a Python number (not traced).
      lam: GAE lambda, a Python number (not traced).

    Returns:
      `(advantages, returns)`, `[B, T]` float32 each.

    References:
      Schulman et al., arXiv 1506.02438; StepPO, arXiv 2604.18401.
    """
    fn = "masked_gae"
    for name, x in (("rewards", rewards), ("values", values), ("bootstrap_value", bootstrap_value)):
        if x.dtype != jnp.float32:
            raise TypeError(f"{fn}: method='native' computes in float32; {name} has dtype "
                            f"{x.dtype} (use method='sequential' for other dtypes)")
    gamma, lam = _python_float(fn, "gamma", gamma), _python_float(fn, "lam", lam)
    _register()
    out = jax.ShapeDtypeStruct(rewards.shape, rewards.dtype)
    call = jax.ffi.ffi_call(_TARGET, (out, out), vmap_method="broadcast_all")
    advantages, returns = call(rewards, values, mask, bootstrap_value,
                               gamma=np.float32(gamma), lam=np.float32(lam))
    # Inside shard_map the outputs vary over the mesh axes the inputs vary over.
    varying = tuple(sorted(jax.typeof(rewards).manual_axis_type.varying))
    if varying:
        advantages, returns = jax.lax.pcast((advantages, returns), varying, to="varying")
    return advantages, returns
