"""One of the two processes of `test_devices.py`'s multi-process update test.

Usage: python -m tests.train.multiprocess_worker PROCESS_ID PORT OUT.npz
Joins a two-process JAX runtime on this machine (CPU collectives over gloo),
takes its half of the test minibatch, runs one data-parallel `train_step` on
a mesh over both processes' devices and saves the parameters and metrics.
"""

import os
import sys

process_id, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from stepcredit.train.devices import DataParallel, initialize_processes  # noqa: E402

initialize_processes(f"localhost:{port}", 2, process_id)

from tests.train.test_devices import ROWS, minibatch, train_step  # noqa: E402

dp = DataParallel(jax.devices())
assert dp.multiprocess and dp.num_devices == 4 and dp.num_local_devices == 2
half = ROWS // 2
mine = jax.tree.map(lambda x: x[process_id * half:(process_id + 1) * half], minibatch())
params, _, metrics = train_step(dp.replicate, dp.shard(mine))
leaves = jax.tree.leaves(dp.gather(params))
np.savez(out, *[np.asarray(x) for x in leaves],
         **{f"metric:{k}": np.asarray(v.addressable_data(0)) for k, v in metrics.items()})
jax.distributed.shutdown()
