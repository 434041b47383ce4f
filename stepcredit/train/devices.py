"""Data parallelism for the update: a 1-D 'data' mesh over the devices.

Minibatch rows are sharded over the mesh's 'data' axis, the parameters and
optimizer state are replicated; `jax.jit`'s SPMD partitioner then computes
each device's share of the loss and all-reduces the gradients, so one
optimizer step on the mesh equals the single-device step up to float
summation order. With one device nothing is moved: single-device runs are
unchanged.

The mesh may span several processes (after `jax.distributed.initialize()`,
`DataParallel(jax.devices())`): each process then passes its own rows, the
global minibatch is their concatenation in process order
(`jax.make_array_from_process_local_data`), and every process passes the same
parameters. The trainer builds such a mesh when it runs in several processes
(`initialize_processes`); the helpers below are the few host-side collectives
it needs besides the update.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


class DataParallel:
    """Places update inputs on a 'data' mesh: rows sharded, parameters replicated.

    Args:
      devices: the devices of the mesh (default: all local devices).

    Example:
      >>> dp = DataParallel()                      # 4 devices
      >>> dp.check_minibatch(16)                   # ok; 18 raises ValueError
      >>> params, opt = dp.replicate((params, opt))
      >>> params, opt, metrics = train_step(params, opt, dp.shard(batch), ...)
      >>> params, opt = dp.gather((params, opt))   # back on one device
    """

    def __init__(self, devices: Sequence[jax.Device] | None = None):
        devices = list(jax.local_devices() if devices is None else devices)
        if not devices:
            raise ValueError("DataParallel: devices is empty")
        self.mesh = Mesh(np.array(devices), ("data",))
        self.num_devices = len(devices)
        local = [d for d in devices if d.process_index == jax.process_index()]
        if not local:
            raise ValueError("DataParallel: none of the devices belongs to this process")
        self.num_local_devices = len(local)
        self.multiprocess = len(local) < len(devices)
        self._rows = NamedSharding(self.mesh, P("data"))
        self._replicated = NamedSharding(self.mesh, P())
        self._home = local[0]

    def check_minibatch(self, rows: int) -> None:
        """Raises unless `rows` (this process's rows) splits evenly over its devices."""
        if rows % self.num_local_devices:
            raise ValueError(f"data parallel update: minibatch_rows={rows} is not divisible by "
                             f"the {self.num_local_devices} devices of the mesh in this process; "
                             f"choose a multiple of {self.num_local_devices}")

    def shard(self, batch: Any) -> Any:
        """Splits every array of `batch` along its first axis over the devices; across
        processes, the global array stacks every process's `batch` in process order."""
        if self.num_devices == 1:
            return batch
        for leaf in jax.tree.leaves(batch):
            self.check_minibatch(leaf.shape[0])
        if self.multiprocess:
            return self._from_processes(batch, self._rows)
        return jax.device_put(batch, self._rows)

    def replicate(self, tree: Any) -> Any:
        """A copy of `tree` on every device (every process must pass the same values)."""
        if self.num_devices == 1:
            return tree
        if self.multiprocess:
            return self._from_processes(tree, self._replicated)
        return jax.device_put(tree, self._replicated)

    def gather(self, tree: Any) -> Any:
        """Replicated arrays back on this process's first device of the mesh (the rest of
        the trainer's home)."""
        if self.num_devices == 1:
            return tree
        if self.multiprocess:
            tree = jax.tree.map(lambda x: x.addressable_data(0), tree)
        return jax.device_put(tree, self._home)

    @staticmethod
    def _from_processes(tree: Any, sharding: NamedSharding) -> Any:
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)


def initialize_processes(coordinator: str, num_processes: int, process_id: int) -> None:
    """Joins this process to a multi-process JAX runtime (`jax.distributed.initialize`),
    with CPU collectives over gloo so that CPU-only hosts can all-reduce too.

    Args:
      coordinator: "host:port" of process 0's coordination service.
      num_processes: how many processes take part.
      process_id: this process's index, 0 to `num_processes - 1`.
    """
    if not 0 <= process_id < num_processes:
        raise ValueError(f"initialize_processes: process_id={process_id} must lie in "
                         f"[0, num_processes={num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def max_over_processes(value: int) -> int:
    """The largest `value` any process passes (every process must call it)."""
    return int(np.max(multihost_utils.process_allgather(np.int64(value))))


def mean_over_processes(tree: Any) -> Any:
    """Every leaf averaged over the processes (every process must call it)."""
    flat, unflatten = ravel_pytree(tree)  # one collective for the whole tree
    everywhere = multihost_utils.process_allgather(np.asarray(flat))
    return unflatten(jnp.asarray(everywhere.mean(axis=0), flat.dtype))


def from_process_0(tree: Any) -> Any:
    """Process 0's `tree` (same structure, shapes and dtypes everywhere), on every process."""
    received = multihost_utils.broadcast_one_to_all(keys_as_data(tree))
    return keys_like(tree, jax.tree.map(jnp.asarray, received))


def is_prng_key(x: Any) -> bool:
    """Whether `x` is a typed PRNG key array (`jax.random.key`)."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def keys_as_data(tree: Any) -> Any:
    """Host copies of `tree`'s arrays, typed PRNG keys as their raw data (what collectives
    and orbax's multi-process save accept); `keys_like` undoes it."""
    return jax.tree.map(lambda x: np.asarray(jax.random.key_data(x) if is_prng_key(x) else x),
                        tree)


def keys_like(template: Any, tree: Any) -> Any:
    """`tree` with raw key data wrapped back into typed keys wherever `template` holds one."""
    return jax.tree.map(
        lambda like, x: (jax.random.wrap_key_data(x, impl=jax.random.key_impl(like))
                         if is_prng_key(like) and not is_prng_key(x) else x), template, tree)


def agreed_by_process_0(flag: bool) -> bool:
    """Process 0's `flag`, on every process (a decision they must all take together)."""
    return bool(multihost_utils.broadcast_one_to_all(np.bool_(flag)))


def check_same_on_every_process(tree: Any, what: str) -> None:
    """Raises on every process unless each leaf of `tree` sums to the same value on all of
    them (replicas of one computation agree bit for bit; diverged ones do not)."""
    digest = np.array([float(np.sum(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree)])
    everywhere = multihost_utils.process_allgather(digest)
    differ = np.any(everywhere != everywhere[0], axis=0)
    if differ.any():
        raise RuntimeError(f"{what} differ between processes ({int(differ.sum())} of "
                           f"{differ.size} arrays)")
