"""One process of the two-process loopback test (run by test_distributed.py, not by pytest).

Usage: python -m tests.runtime.distributed_worker PROCESS_ID PORT [late_stop]

``late_stop``: process 0 stops its peer watch 3 s after the job's last barrier, as a thread
scheduled late on a loaded machine does -- the peer that left by then must not be taken for dead.
"""

import sys
import time

import numpy as np

from titanax.runtime.cpu_devices import simulate_cpu_devices

simulate_cpu_devices(2)

from titanax.runtime import distributed  # noqa: E402


def main():
    process_id, port = int(sys.argv[1]), sys.argv[2]
    distributed.initialize(f"127.0.0.1:{port}", 2, process_id, timeout_s=60)
    import jax  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel

    from titanax.parallel import collectives  # pylint: disable=import-outside-toplevel
    from titanax.runtime.mesh import MeshSpec, ProcessGroups  # pylint: disable=import-outside-toplevel

    mesh = MeshSpec(axes=("data",)).build()
    assert mesh.devices.size == 4, mesh
    ranks = ProcessGroups(mesh).ranks("data")
    # Each device contributes (its position along the axis + 1); the psum is 1+2+3+4 = 10.
    local = np.array([r + 1 for r in ranks], np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
    total = jax.jit(jax.shard_map(lambda v: collectives.psum(v, "data"), mesh=mesh,
                                  in_specs=P("data"), out_specs=P("data")))(x)
    values = sorted(float(np.asarray(s.data)[0]) for s in total.addressable_shards)
    print(f"RESULT process={jax.process_index()} ranks={list(ranks)} psum={values}", flush=True)
    if sys.argv[3:] == ["late_stop"] and process_id == 0:
        watch = distributed.watch()
        stop = watch.stop

        def late_stop():
            time.sleep(3)
            stop()
        watch.stop = late_stop
    distributed.finish()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
