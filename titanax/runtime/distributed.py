"""Starting jax's multi-controller runtime: one process per host (or per group of devices).

``initialize()`` resolves who is in the job (flags, ``TITANAX_*`` variables, SLURM, or one process;
see ``titanax.runtime.cluster``), calls ``jax.distributed.initialize`` when there is more than one
process, turns a failed or timed-out rendezvous into a ``DistributedError`` that says what to check,
and logs one line per process so a job's stderr shows at a glance who came up with which devices.
It must run before anything else touches jax devices.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Optional

from titanax import errors
from titanax.runtime.cluster import ClusterSpec, resolve_cluster

_log = logging.getLogger("titanax")


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, timeout_s: int = 300) -> ClusterSpec:
    """Joins the job (or runs single-process when there is none) and returns its layout."""
    spec = resolve_cluster(coordinator_address=coordinator_address, num_processes=num_processes,
                           process_id=process_id)
    import jax  # pylint: disable=import-outside-toplevel
    if spec.is_multi_process:
        if spec.coordinator_address is not None:
            # jax's client aborts the whole process (a C++ fatal error, no Python exception) when
            # the rendezvous times out, so check reachability first and fail with a message.
            _check_coordinator(spec, timeout_s)
        try:
            if spec.source == "slurm":
                jax.distributed.initialize(initialization_timeout=timeout_s)
            else:
                jax.distributed.initialize(coordinator_address=spec.coordinator_address,
                                           num_processes=spec.num_processes,
                                           process_id=spec.process_id,
                                           initialization_timeout=timeout_s)
        except Exception as e:  # pylint: disable=broad-except
            raise errors.DistributedError(
                f"joining the job failed ({type(e).__name__}: {str(e).splitlines()[0]})",
                path=f"coordinator {spec.coordinator_address or '(auto-detected)'}",
                suggestion=f"check that process 0 runs and is reachable at that address, that "
                           f"all {spec.num_processes or 'N'} processes started with the same "
                           f"--num_processes and distinct --process_id, and that nothing else "
                           f"uses the port (timeout {timeout_s}s)") from e
    devices = jax.devices()
    message = (f"titanax process {jax.process_index()}/{jax.process_count()}: "
               f"{jax.local_device_count()} local / {jax.device_count()} global "
               f"{devices[0].platform} device(s) [{spec.source}]")
    _log.warning(message)
    return spec


def _check_coordinator(spec: ClusterSpec, timeout_s: float) -> None:
    host, _, port_text = spec.coordinator_address.rpartition(":")
    port = int(port_text)
    where = f"coordinator {spec.coordinator_address}"
    if spec.process_id == 0:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", port))
            except OSError as e:
                raise errors.DistributedError(
                    f"process 0 cannot serve on port {port}: {e.strerror}", path=where,
                    suggestion="pick a free port for --coordinator_address") from e
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise errors.DistributedError(
                    f"no coordinator answered within {timeout_s}s ({e.strerror or e})",
                    path=where,
                    suggestion=f"check that process 0 runs and is reachable at that address, "
                               f"that all {spec.num_processes} processes use the same "
                               "--coordinator_address and --num_processes, and that no firewall "
                               "blocks the port") from e
            time.sleep(0.2)
