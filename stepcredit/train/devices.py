"""Data parallelism for the update: a 1-D 'data' mesh over the local devices.

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
parameters. The trainer itself still builds its mesh from the local devices.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
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
