"""One process of the two-process data test (run by test_distributed_data.py, not by pytest).

Usage: python -m tests.data.distributed_data_worker PROCESS_ID PORT OUT_JSON
"""

import json
import sys

import numpy as np

from titanax.runtime.cpu_devices import simulate_cpu_devices

simulate_cpu_devices(2)

from titanax.runtime import distributed  # noqa: E402


class RecordingSource:
    """Wraps a source and records every index read from it."""

    def __init__(self, source):
        self.source = source
        self.read = []

    def __len__(self):
        return len(self.source)

    def __getitem__(self, index):
        self.read.append(int(index))
        return self.source[index]


def main():
    process_id, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    distributed.initialize(f"127.0.0.1:{port}", 2, process_id, timeout_s=60)
    import jax  # pylint: disable=import-outside-toplevel
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel

    from titanax.data.pipeline import Input  # pylint: disable=import-outside-toplevel
    from titanax.data.sources import MNIST  # pylint: disable=import-outside-toplevel
    from titanax.runtime.mesh import MeshSpec  # pylint: disable=import-outside-toplevel

    source = RecordingSource(MNIST.default_config().set(split="test").instantiate())
    cfg = Input.default_config().set(global_batch_size=8, seed=7, prefetch=0)
    data = cfg.instantiate(source=source, process_index=jax.process_index(),
                           process_count=jax.process_count())
    mesh = MeshSpec(axes=("data",)).build()
    iterator = iter(data)
    local_labels, global_labels = [], []
    for _ in range(3):
        batch = next(iterator)
        local_labels.append(batch["label"].tolist())
        array = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")),
                                                       batch["label"])
        global_labels.append(np.asarray(multihost_utils.process_allgather(array, tiled=True))
                             .tolist())
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"local": local_labels, "global": global_labels,
                   "read": sorted(set(source.read))}, f)
    distributed.finish()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
