"""Compiled CPU kernels (XLA FFI custom calls), built on first use.

`masked_gae` computes exactly what `step_gae` and `token_gae` compute, in one
pass over batch-major rows (`masked_gae.cc`): XLA:CPU runs a `lax.scan` as one
small kernel per time step and pays for transposing `[B, T]` arrays to time-major
and back, which keeps the scan several times above the memory-copy floor; the
kernel reads each input once, writes each output once and solves eight steps at
a time in SIMD registers.

`pair_ids` gives equal int32 pairs one dense id (`pair_ids.cc`, GiGPO's step
groups): with a hash table in one pass instead of XLA:CPU's comparator sort,
which costs over a hundred times the memory-copy floor.

`linear_recurrence` solves y_t = x_t + c_t y_{t+1} (or y_{t-1}) along batch-major
rows (`recurrence.cc`), eight rows at a time, where the scan pays per-step kernels
and transposes; `group_normalize` is the group normalisation of `group._normalize`
in four passes with per-group accumulators (`group_normalize.cc`), where XLA:CPU
runs six scatters and six gathers. Both round every operation as the XLA
computations they replace (a fused multiply-add where XLA:CPU fuses one, sums
in element order), so they give the same float32 numbers. `steps_to_tokens` and `tokens_to_steps`
(`tokens.cc`) move values between the step and the token view row by row, where
XLA:CPU runs a gather and a scatter over every token. These row kernels (GAE, the
recurrence and the token moves) share a large batch's rows among XLA's CPU threads,
one part per thread where each part holds at least 2^16 elements (`parallel.h`).
`empg` is EMPG's whole modulation in four passes (`empg.cc`), where XLA:CPU runs about
twenty kernels, and `information_gain` IGPO's turn gains in two (`information_gain.cc`);
their exponentials make them equal to the XLA computations to float32 rounding, not
bit for bit. `last_valid` marks each row's last valid position (`last_valid.cc`),
where XLA:CPU runs an argmax. `anchor_groups` is GiGPO's, ECPO's and HGPO's whole
computation (`anchor_groups.cc`): episode scores and their normalisation, step returns,
the anchor groups at every history depth and theirs, one episode group at a time and
the episode groups shared among XLA's threads, where XLA:CPU runs a dozen passes over
the batch per depth; `turn_groups` the group normalisation within (episode group, turn)
segments or within episode groups, of values or of their discounted returns, with
MT-GRPO's outcome term or IGPO's final scores and discounting after (`turn_groups.cc`),
eight turns at a time in vector registers, where XLA:CPU computes the returns in three
passes and transposes the batch so that the group kernel finds each segment's members
together.

The C++ sources are compiled with the system compiler (`$CXX`, else `c++`) the
first time a process uses it, against the XLA FFI headers that jaxlib ships,
and cached under `$STEPCREDIT_NATIVE_CACHE` (default `~/.cache/stepcredit/native`),
keyed by the source, the flags, the jax and jaxlib versions and the CPU, so a
cached library never runs on a CPU it was not built for.

The GAE kernel is float32 and CPU-only: `step_gae` lowers to it on CPU and to the
sequential scan on other backends, for other dtypes, for gamma or lam traced
under `jit`, and where the kernel cannot be built (`gae.gae_method`). It has no
derivative (advantages and returns are regression and policy-gradient targets).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import platform
import shlex
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import _checks

_SOURCES = tuple(os.path.join(os.path.dirname(__file__), name)
                 for name in ("masked_gae.cc", "pair_ids.cc", "recurrence.cc",
                              "group_normalize.cc", "tokens.cc", "empg.cc",
                              "information_gain.cc", "last_valid.cc", "anchor_groups.cc",
                              "turn_groups.cc"))
# Included by the sources: part of the build's cache key, not compiled alone.
_HEADERS = tuple(os.path.join(os.path.dirname(__file__), name)
                 for name in ("simd.h", "group_stats.h", "parallel.h", "episode_rows.h"))
# FFI target name -> the handler symbol in the library.
_TARGET = "stepcredit_masked_gae_f32"
_PAIR_TARGET = "stepcredit_pair_ids_s32"
_RECURRENCE_TARGET = "stepcredit_linear_recurrence_f32"
_NORMALIZE_TARGET = "stepcredit_group_normalize_f32"
_BROADCAST_TARGET = "stepcredit_steps_to_tokens_f32"
_STEP_SUMS_TARGET = "stepcredit_tokens_to_steps_f32"
_EMPG_TARGET = "stepcredit_empg_f32"
_GAIN_TARGET = "stepcredit_information_gain_f32"
_LAST_TARGET = "stepcredit_last_valid"
_ANCHOR_TARGET = "stepcredit_anchor_groups_f32"
_TURN_TARGET = "stepcredit_turn_groups_f32"
_SYMBOLS = {_TARGET: "StepcreditMaskedGaeF32", _PAIR_TARGET: "StepcreditPairIdsS32",
            _RECURRENCE_TARGET: "StepcreditLinearRecurrenceF32",
            _NORMALIZE_TARGET: "StepcreditGroupNormalizeF32",
            _BROADCAST_TARGET: "StepcreditStepsToTokensF32",
            _STEP_SUMS_TARGET: "StepcreditTokensToStepsF32", _EMPG_TARGET: "StepcreditEmpgF32",
            _GAIN_TARGET: "StepcreditInformationGainF32", _LAST_TARGET: "StepcreditLastValid",
            _ANCHOR_TARGET: "StepcreditAnchorGroupsF32", _TURN_TARGET: "StepcreditTurnGroupsF32"}
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-w")


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
    """Compiles the kernels once per (sources, flags, jax, CPU) and returns the library's path.

    The library is written to a temporary name and renamed into place, so a build
    interrupted halfway never leaves a broken library behind the cache key.
    """
    compiler = shlex.split(os.environ.get("CXX", "c++"))
    flags = (*_FLAGS, "-I", jax.ffi.include_dir())
    source = b""
    for path in (*_SOURCES, *_HEADERS):
        with open(path, "rb") as f:
            source += f.read()
    versions = (jax.__version__, importlib.metadata.version("jaxlib"))
    key = hashlib.sha256(source + repr((compiler, flags, versions,
                                        _cpu_identity())).encode()).hexdigest()[:16]
    directory = cache_dir()
    path = os.path.join(directory, f"kernels-{key}.so")
    if os.path.exists(path):
        return path
    try:
        os.makedirs(directory, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".so.partial", dir=directory)
    except OSError as e:
        raise NativeBuildError(f"method='native': cannot write to the kernel cache {directory!r} "
                               f"({e}); set STEPCREDIT_NATIVE_CACHE to a writable directory") from e
    os.close(fd)
    try:
        try:
            build = subprocess.run([*compiler, *flags, *_SOURCES, "-o", partial],
                                   capture_output=True, text=True)
        except FileNotFoundError as e:
            raise NativeBuildError(
                f"method='native': no C++ compiler {compiler[0]!r} (set CXX); "
                "method='sequential' computes the same without one") from e
        if build.returncode != 0:
            raise NativeBuildError(f"method='native': {shlex.join(compiler)} failed to compile "
                                   f"{' '.join(_SOURCES)}:\n"
                                   f"{build.stderr[-2000:]}")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


@functools.cache
def _register() -> None:
    library = ctypes.cdll.LoadLibrary(library_path())
    for target, symbol in _SYMBOLS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")


def build_error() -> str | None:
    """None once the kernel is built and registered in this process, else why it could not be."""
    try:
        _register()
    except NativeBuildError as e:
        return str(e)
    return None


def on_cpu(kernel, fallback, *arrays, warn_as: str | None = None):
    """`kernel(*arrays)` on CPU where the kernels are built, else `fallback(*arrays)`.

    A function traced once may be lowered for CPU and for an accelerator, so the
    platform is chosen at lowering (`jax.lax.platform_dependent`); whether the
    kernels build is asked when the CPU branch is traced. Every estimator that has
    a CPU kernel chooses it here.

    Args:
      kernel: the compiled kernel's call, a function of `arrays`.
      fallback: the XLA computation of the same result (same pytree, shapes and dtypes).
      *arrays: the arguments both take.
      warn_as: where given, a kernel that cannot be built is reported by a warning
        that starts with it (for a caller who asked for the kernel by name);
        otherwise the fallback runs without one.

    Returns:
      The result of the branch chosen for the platform.
    """
    def cpu(*arrays):
        error = build_error()
        if error is None:
            return kernel(*arrays)
        if warn_as is not None:
            warnings.warn(f"{warn_as}: {error}")
        return fallback(*arrays)

    return jax.lax.platform_dependent(*arrays, cpu=cpu, default=fallback)


def supports(rewards: jax.Array, values: jax.Array, bootstrap_value: jax.Array, gamma,
             lam) -> bool:
    """Whether the kernel takes these arguments: float32 arrays; gamma, lam known when tracing."""
    arrays = (rewards, values, bootstrap_value)
    return all(x.dtype == jnp.float32 for x in arrays) and _checks.is_concrete(gamma, lam)


def _vary_over(x: jax.Array, axes: frozenset) -> jax.Array:
    missing = tuple(sorted(axes - jax.typeof(x).manual_axis_type.varying))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def masked_gae(rewards: jax.Array, values: jax.Array, mask: jax.Array,
               bootstrap_value: jax.Array, *, gamma: float,
               lam: float) -> tuple[jax.Array, jax.Array]:
    """Masked GAE advantages and returns, `[B, T]` each, by the compiled CPU kernel.

    The recursion and conventions of `step_gae` (masked positions skipped and set to
    0; `bootstrap_value` after each row's last valid step), whose boundary checks
    the arguments have passed:

        A_t = r_t + gamma V_{next(t)} - V_t + gamma lam A_{next(t)},   R_t = A_t + V_t

    Args:
      rewards: `[B, T]` float32.
      values: `[B, T]` float32.
      mask: `[B, T]` bool.
      bootstrap_value: `[B]` float32.
      gamma: discount, known when tracing (not a traced value).
      lam: GAE lambda, known when tracing.

    Returns:
      `(advantages, returns)`, `[B, T]` float32 each.

    Raises:
      TypeError: arguments the kernel does not take (see `supports`).
      NativeBuildError: the kernel could not be built.

    References:
      Schulman et al., arXiv 1506.02438; StepPO, arXiv 2604.18401.
    """
    if not supports(rewards, values, bootstrap_value, gamma, lam):
        raise TypeError(f"masked_gae: the kernel takes float32 arrays (got {rewards.dtype}, "
                        f"{values.dtype}, {bootstrap_value.dtype}) and gamma and lam known "
                        f"when tracing (known: {_checks.is_concrete(gamma, lam)})")
    _register()
    # Inside shard_map, a custom call needs every operand to vary over the same mesh
    # axes; its outputs then vary over them too.
    varying = frozenset().union(*(jax.typeof(x).manual_axis_type.varying
                                  for x in (rewards, values, mask, bootstrap_value)))
    operands = [_vary_over(x, varying) for x in (rewards, values, mask, bootstrap_value)]
    out = jax.ShapeDtypeStruct(rewards.shape, rewards.dtype)
    call = jax.ffi.ffi_call(_TARGET, (out, out), vmap_method="broadcast_all")
    advantages, returns = call(*operands, gamma=np.float32(gamma), lam=np.float32(lam))
    return _vary_over(advantages, varying), _vary_over(returns, varying)


def pair_ids(first: jax.Array, second: jax.Array) -> jax.Array:
    """Dense ids of the pairs (first[i], second[i]) by the compiled CPU kernel.

    Equal pairs get equal ids, distinct pairs distinct ones, numbered 0, 1, ...
    in the order of their first occurrence.

    Args:
      first, second: `[n]` int32.

    Returns:
      `[n]` int32 ids in [0, number of distinct pairs).

    Raises:
      NativeBuildError: the kernel could not be built.
    """
    _register()
    varying = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in (first, second)))
    first, second = (_vary_over(x, varying) for x in (first, second))
    call = jax.ffi.ffi_call(_PAIR_TARGET, jax.ShapeDtypeStruct(first.shape, jnp.int32),
                            vmap_method="sequential")
    return _vary_over(call(first, second), varying)


def _aligned(*arrays: jax.Array) -> tuple[frozenset, list[jax.Array]]:
    """The mesh axes any operand varies over, and the operands made to vary over all of them
    (inside shard_map a custom call needs its operands aligned)."""
    varying = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in arrays))
    return varying, [_vary_over(x, varying) for x in arrays]


def linear_recurrence(x: jax.Array, c: jax.Array, y_init: jax.Array, *,
                      reverse: bool = True) -> jax.Array:
    """Solves y_t = x_t + c_t y_{t+1} (reverse) or y_t = x_t + c_t y_{t-1} (forward) per row.

    The boundary value y_init is y_T (reverse) or y_{-1} (forward). Each step is
    rounded as XLA:CPU compiles the step of `lax.scan` (one fused multiply-add where
    the CPU has them), so the two agree bit for bit.

    Args:
      x, c: `[B, T]` float32.
      y_init: `[B]` float32.
      reverse: run from the last time step to the first (True) or forwards.

    Returns:
      `[B, T]` float32 solution y.

    Raises:
      TypeError: an argument is not float32.
      NativeBuildError: the kernel could not be built.
    """
    if not all(jnp.result_type(a) == jnp.float32 for a in (x, c, y_init)):
        raise TypeError("linear_recurrence: the kernel takes float32 arrays")
    _register()
    varying, operands = _aligned(x, c, y_init)
    call = jax.ffi.ffi_call(_RECURRENCE_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32),
                            vmap_method="broadcast_all")
    return _vary_over(call(*operands, reverse=bool(reverse)), varying)


# `group._normalize`'s std option -> the kernel's code.
_STD_CODES = {"unbiased": 0, "biased": 1, "none": 2, "leave_one_out": 3}


def group_normalize(values: jax.Array, ids: jax.Array, valid: jax.Array, *, num_groups: int,
                    std: str, eps: float, singleton: str) -> jax.Array:
    """`group._normalize` (no mesh axis) by the compiled CPU kernel, bit for bit.

    Within each group g of the valid elements,

        out_i = (v_i - mean_g) / (std_g + eps)     (v_i - mean_g for std="none",
                                                    (v_i - mean_g) n_g / max(n_g - 1, 1)
                                                    for std="leave_one_out")

    0 where the divisor is not positive, 0 in a group whose valid values are all
    equal, v_i / (1 + eps) (v_i for std="none") for a singleton with
    singleton="raw", and 0 at invalid elements; the statistics are those of
    `group._group_stats` (power-of-two scaled, two passes).

    Args:
      values: float32, any shape.
      ids: int32 group ids in [0, num_groups), the shape of `values`.
      valid: bool, the shape of `values`.
      num_groups: static number of groups.
      std: "unbiased", "biased", "none" or "leave_one_out".
      eps: added to the std, known when tracing.
      singleton: "zero" or "raw".

    Returns:
      Float32 advantages of the shape of `values`.

    Raises:
      TypeError: values not float32 or eps traced.
      NativeBuildError: the kernel could not be built.
    """
    if jnp.result_type(values) != jnp.float32 or not _checks.is_concrete(eps):
        raise TypeError("group_normalize: the kernel takes float32 values and eps known when "
                        "tracing")
    _register()
    varying, operands = _aligned(values, ids.astype(jnp.int32), valid)
    # "sequential": a vmapped call normalises each batch member's groups apart.
    call = jax.ffi.ffi_call(_NORMALIZE_TARGET, jax.ShapeDtypeStruct(values.shape, jnp.float32),
                            vmap_method="sequential")
    out = call(*operands, num_groups=np.int64(num_groups), std=np.int32(_STD_CODES[std]),
               eps=np.float32(eps), one_plus_eps=np.float32(1.0 + float(eps)),
               singleton_raw=singleton == "raw")
    return _vary_over(out, varying)


def steps_to_tokens(step_values: jax.Array, step_index: jax.Array, *,
                    last_only: bool = False) -> jax.Array:
    """`[B, N]`: each token's step value, step_values[b, step_index[b, n]], 0 where the index is
    negative (indices past T - 1 read step T - 1, as XLA's gather clamps them).

    Args:
      step_values: `[B, T]` float32.
      step_index: `[B, N]` int32.
      last_only: 0 also at every token but the last of its step (where the next token's
        index differs, or the row ends): where a step's reward sits.

    Raises:
      NativeBuildError: the kernel could not be built.
    """
    _register()
    varying, operands = _aligned(step_values, step_index.astype(jnp.int32))
    call = jax.ffi.ffi_call(_BROADCAST_TARGET,
                            jax.ShapeDtypeStruct(step_index.shape, jnp.float32),
                            vmap_method="broadcast_all")
    return _vary_over(call(*operands, last_only=bool(last_only)), varying)


def tokens_to_steps(token_values: jax.Array, step_index: jax.Array, num_steps: int) -> jax.Array:
    """`[B, T]`: each step's sum of its tokens' values, in token order (as XLA's scatter adds
    them); tokens whose index lies outside [0, num_steps) are left out.

    Args:
      token_values: `[B, N]` float32.
      step_index: `[B, N]` int32.
      num_steps: static T.

    Raises:
      NativeBuildError: the kernel could not be built.
    """
    _register()
    varying, operands = _aligned(token_values, step_index.astype(jnp.int32))
    shape = token_values.shape[:-1] + (num_steps,)
    call = jax.ffi.ffi_call(_STEP_SUMS_TARGET, jax.ShapeDtypeStruct(shape, jnp.float32),
                            vmap_method="broadcast_all")
    return _vary_over(call(*operands, num_steps=np.int64(num_steps)), varying)


def empg(advantages: jax.Array, entropy: jax.Array, mask: jax.Array, *, k: float, k_future: float,
         zeta: float, eps: float, center: bool) -> jax.Array:
    """`empg.empg` (no mesh axis) by the compiled CPU kernel, to float32 rounding.

    Over the valid steps, H~ = (H - min H) / (max H - min H + eps),
    g = exp(-k H~) / mean exp(-k H~), and

        out = g A + zeta exp(-k_future H~[next valid step of the row]),

    less its mean over the valid steps when `center`; 0 at invalid steps.

    Args:
      advantages: `[B]` (one per row) or `[B, T]` float32.
      entropy: `[B, T]` float32.
      mask: `[B, T]` bool.
      k, k_future, zeta, eps: EMPG's hyperparameters, known when tracing.
      center: subtract the mean over valid steps.

    Returns:
      `[B, T]` float32.

    Raises:
      TypeError: arrays not float32 or hyperparameters traced.
      NativeBuildError: the kernel could not be built.

    References:
      Wang et al., arXiv 2509.09265, Eqs. 8-12.
    """
    if (not all(jnp.result_type(x) == jnp.float32 for x in (advantages, entropy))
            or not _checks.is_concrete(k, k_future, zeta, eps)):
        raise TypeError("empg: the kernel takes float32 arrays and hyperparameters known when "
                        "tracing")
    _register()
    varying, operands = _aligned(advantages, entropy, mask)
    # "sequential": the minimum, maximum and means are each batch member's own.
    call = jax.ffi.ffi_call(_EMPG_TARGET, jax.ShapeDtypeStruct(entropy.shape, jnp.float32),
                            vmap_method="sequential")
    out = call(*operands, k=np.float32(k), k_future=np.float32(k_future), zeta=np.float32(zeta),
               eps=np.float32(eps), center=bool(center))
    return _vary_over(out, varying)


def information_gain(answer_logp: jax.Array, mask: jax.Array, *, gain: str) -> jax.Array:
    """`igpo.information_gain` by the compiled CPU kernel (to float32 rounding for the
    probability gain, bit for bit for the log-probability gain).

        IG_t = b_{t'} - b_t at a valid turn t with a later valid turn (t' the first),
        0 at each row's last valid turn and at invalid turns,

    with b = exp(answer_logp) (gain="probability") or answer_logp ("log_probability").

    Args:
      answer_logp: `[B, T]` float32.
      mask: `[B, T]` bool.
      gain: "probability" or "log_probability".

    Returns:
      `[B, T]` float32.

    Raises:
      TypeError: answer_logp not float32.
      NativeBuildError: the kernel could not be built.

    References:
      Wang et al., arXiv 2510.14967.
    """
    if jnp.result_type(answer_logp) != jnp.float32:
        raise TypeError("information_gain: the kernel takes float32 log-probs")
    _register()
    varying, operands = _aligned(answer_logp, mask)
    call = jax.ffi.ffi_call(_GAIN_TARGET, jax.ShapeDtypeStruct(answer_logp.shape, jnp.float32),
                            vmap_method="broadcast_all")
    return _vary_over(call(*operands, probability=gain == "probability"), varying)


def last_valid(mask: jax.Array) -> jax.Array:
    """`[..., T]` bool: True at each row's last True position of `mask`, by the compiled CPU
    kernel (an all-False row has none).

    Raises:
      NativeBuildError: the kernel could not be built.
    """
    _register()
    varying, operands = _aligned(mask)
    call = jax.ffi.ffi_call(_LAST_TARGET, jax.ShapeDtypeStruct(mask.shape, jnp.bool_),
                            vmap_method="broadcast_all")
    return _vary_over(call(*operands), varying)


def anchor_groups(step_rewards: jax.Array, anchors: jax.Array, episode_ids: jax.Array,
                  mask: jax.Array, episode_scores: jax.Array | None, depth_weights: jax.Array, *,
                  gamma: float, omega: float, std: str, eps: float, singleton: str,
                  min_depth: int = 1, kappa: float | None = None) -> jax.Array:
    """The GiGPO family's advantages (`gigpo`, `ecpo`, `hgpo`) by the compiled CPU kernel.

    For row b with valid steps t, episode score S_b (the sum of its valid step rewards,
    in step order, unless `episode_scores` is given), discounted returns
    R_t = r_t + gamma R_{t+1} (invalid steps pass R on), and G_d(b, t) the valid steps
    of b's episode group whose last d anchors equal those of (b, t) (positions before a
    row's start count as one more state; G_0 the whole episode group), live_d the steps
    live at depth d - 1 with a second such step in G_d (every valid step is live before
    `min_depth`):

        A^E = S normalised over the episode group's rows with a valid step
        A_d = R normalised over the live members of G_d     (both as `group._normalize`)
        A^S = sum_d w_d A_d [live_d] / sum_d w_d [live_d]     (0 where none is live)
        out = A^E + omega A^S, or A^E + omega n / max(n + kappa, tiny) A^S with kappa
              (ECPO; n = |G_1|), 0 at invalid steps.

    GiGPO is depth_weights [0, 1] with min_depth 1; HGPO weights depths min_depth..D.
    Equal to the XLA computations of `gigpo`, `ecpo` and `hgpo` bit for bit with
    `episode_scores` given (HGPO: to float32 rounding, as XLA:CPU fuses its last
    multiply-add or not), and to float32 rounding without, since XLA:CPU adds a row's
    rewards in a tree. The episode groups are shared among XLA's CPU threads.

    Args:
      step_rewards: `[B, T]` float32.
      anchors: `[B, T]` int32 state ids.
      episode_ids: `[B]` int32 episode group of each row.
      mask: `[B, T]` bool.
      episode_scores: `[B]` float32 S, or None for the sums of the valid step rewards.
      depth_weights: `[D + 1]` float32 w_d (D >= 1; entries below min_depth unused).
      gamma, omega, eps, kappa: known when tracing.
      std: "unbiased", "biased" or "none", at both levels.
      singleton: "zero" or "raw", for a one-row episode group.
      min_depth: 0 or 1.

    Returns:
      `[B, T]` float32 advantages.

    Raises:
      TypeError: arrays not float32 or hyperparameters traced.
      NativeBuildError: the kernel could not be built.

    References:
      GiGPO, arXiv 2505.10978; ECPO and HGPO as cited by `ecpo` and `hgpo`.
    """
    given = episode_scores is not None
    scores = episode_scores if given else jnp.zeros(step_rewards.shape[:1], jnp.float32)
    floats = (step_rewards, scores, depth_weights)
    hyperparameters = (gamma, omega, eps) + (() if kappa is None else (kappa,))
    if (not all(jnp.result_type(x) == jnp.float32 for x in floats)
            or not _checks.is_concrete(*hyperparameters)):
        raise TypeError("anchor_groups: the kernel takes float32 arrays and hyperparameters "
                        "known when tracing")
    _register()
    varying, operands = _aligned(step_rewards, anchors.astype(jnp.int32),
                                 episode_ids.astype(jnp.int32), mask, scores, depth_weights)
    # "sequential": each batch member's groups are its own.
    call = jax.ffi.ffi_call(_ANCHOR_TARGET,
                            jax.ShapeDtypeStruct(step_rewards.shape, jnp.float32),
                            vmap_method="sequential")
    out = call(*operands, gamma=np.float32(gamma), omega=np.float32(omega),
               kappa=np.float32(0.0 if kappa is None else kappa), shrink=kappa is not None,
               given_scores=given, std=np.int32(_STD_CODES[std]), eps=np.float32(eps),
               one_plus_eps=np.float32(1.0 + float(eps)), singleton_raw=singleton == "raw",
               min_depth=np.int64(min_depth))
    return _vary_over(out, varying)


def turn_groups(values: jax.Array, episode_ids: jax.Array, valid: jax.Array, *, std: str,
                eps: float, singleton: str, pooled: bool = False, gamma: float | None = None,
                discount: str = "before", final_scores: jax.Array | None = None,
                outcome_scores: jax.Array | None = None, lam: float = 1.0,
                credit_final: bool = True) -> jax.Array:
    """`group._normalize` within (episode group, turn) segments, by the compiled CPU kernel.

        out[b, t] = (x[b, t] - mean_g,t) / (std_g,t + eps),  g = episode_ids[b], over the
                    rows of g valid at turn t (pooled: over every valid turn of g's rows)

    with x the values, or with `gamma` their discounted returns
    G_t = v_t + gamma G_{t+1} over the valid turns (`gae.discounted_returns`), and
    `group._normalize`'s conventions; its numbers bit for bit per turn (each segment
    summed in element order), to float32 rounding pooled (the per-turn sums added in turn
    order). The episode groups are shared among XLA's CPU threads.

    With `final_scores` `[B]`, each row's last valid value is replaced by its score
    first, and with discount "after" the normalised values are discounted instead,
    out_t = A_t + gamma out_{t+1} over the valid turns: IGPO's advantages (`igpo`,
    normalize "joint": pooled; order "normalize_first": discount "after").

    With `outcome_scores` `[B]`, MT-GRPO's advantages (`mt_grpo`): the turn term is taken
    over the credited turns (every valid turn, or with credit_final False all but each
    row's last), A^O the scores normalised within the episode group (`grpo`), and

        out = turn + lam A^O at credited turns, A^O at the other valid turns, 0 elsewhere.

    Args:
      values: `[B, T]` float32.
      episode_ids: `[B]` int32.
      valid: `[B, T]` bool.
      std: "unbiased", "biased", "none" or "leave_one_out".
      eps, gamma, lam: known when tracing.
      singleton: "zero" or "raw".
      pooled: one segment per episode group instead of one per turn.
      discount: with `gamma`, "before" (normalise the returns) or "after" (discount the
        normalised values).
      final_scores: `[B]` float32 scores that replace each row's last valid value, or None.
      outcome_scores: `[B]` float32 trajectory scores, or None.
      credit_final: whether each row's last valid turn earns turn credit.

    Returns:
      `[B, T]` float32.

    Raises:
      TypeError: arrays not float32, or eps, gamma or lam traced.
      ValueError: an unknown discount, or both score arrays.
      NativeBuildError: the kernel could not be built.

    References:
      MT-GRPO, arXiv 2505.11821 (as cited by `mt_grpo`); IGPO, arXiv 2510.14967 (as
      cited by `igpo`).
    """
    if discount not in ("before", "after"):
        raise ValueError(f"turn_groups: discount={discount!r}; expected 'before' or 'after'")
    if final_scores is not None and outcome_scores is not None:
        raise ValueError("turn_groups: final_scores and outcome_scores cannot both be given")
    outcome = outcome_scores is not None
    given = final_scores if outcome_scores is None else outcome_scores
    scores = jnp.zeros(values.shape[:1], jnp.float32) if given is None else given
    if (any(jnp.result_type(x) != jnp.float32 for x in (values, scores))
            or not _checks.is_concrete(eps, lam, *(() if gamma is None else (gamma,)))):
        raise TypeError("turn_groups: the kernel takes float32 arrays and eps, gamma and lam "
                        "known when tracing")
    _register()
    varying, operands = _aligned(values, episode_ids.astype(jnp.int32), valid, scores)
    # "sequential": each batch member's groups are its own.
    call = jax.ffi.ffi_call(_TURN_TARGET, jax.ShapeDtypeStruct(values.shape, jnp.float32),
                            vmap_method="sequential")
    out = call(*operands, std=np.int32(_STD_CODES[std]), eps=np.float32(eps),
               one_plus_eps=np.float32(1.0 + float(eps)), singleton_raw=singleton == "raw",
               pooled=bool(pooled),
               discount=np.int32(0 if gamma is None else 1 if discount == "before" else 2),
               gamma=np.float32(0.0 if gamma is None else gamma),
               final_scores=final_scores is not None, outcome=outcome,
               credit_final=bool(credit_final), lam=np.float32(lam))
    return _vary_over(out, varying)
