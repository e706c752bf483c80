"""Starting jax's multi-controller runtime: one process per host (or per group of devices).

``initialize()`` resolves who is in the job (flags, ``TITANAX_*`` / ``JAX_COORDINATOR_ADDRESS``
variables, a cluster jax detects, or one process; see ``titanax.runtime.cluster``), calls
``jax.distributed.initialize`` when there is more than one process, turns a failed or timed-out
rendezvous into a ``DistributedError`` that says what to check, and logs one line per process so a
job's stderr shows at a glance who came up with which devices and from where. It must run before
anything else touches jax devices; the launcher calls it right after the config validated.

A multi-process job gets a short heartbeat and a ``PeerWatch`` (peer_watch.py): a dead peer ends
the job within seconds, named, instead of hanging it. ``finish()`` is the job's last barrier.
"""

from __future__ import annotations

import sys
import socket
import time
from typing import Optional

from titanax import errors
from titanax.runtime.cluster import ClusterSpec, resolve_cluster
from titanax.runtime.peer_watch import LEFT_KEY, PeerWatch


# Seconds without a heartbeat after which a process counts as dead.
DEFAULT_HEARTBEAT_TIMEOUT_S = 10

# The running job's watch (None: one process, or not started by Titanax).
_WATCH: Optional[PeerWatch] = None


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, timeout_s: int = 300,
               heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
               spec: Optional[ClusterSpec] = None) -> ClusterSpec:
    """Joins the job (or runs single-process when there is none) and returns its layout.

    ``spec``: an already resolved layout (the launcher's); otherwise resolved from the
    arguments and the environment. Joining twice is a no-op."""
    global _WATCH  # pylint: disable=global-statement
    spec = spec or resolve_cluster(coordinator_address=coordinator_address,
                                   num_processes=num_processes, process_id=process_id)
    import jax  # pylint: disable=import-outside-toplevel
    from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
    if spec.is_multi_process and jax_distributed.global_state.client is not None:
        return spec  # Joined already (the launcher did, before the experiment's run()).
    if spec.is_multi_process:
        if spec.coordinator_address is not None and spec.process_id is not None:
            # jax's client aborts the whole process (a C++ fatal error, no Python exception) when
            # the rendezvous times out, so check reachability first and fail with a message.
            _check_coordinator(spec, timeout_s)
        # Recoverable tasks: a dead peer is marked dead by the service (and named by our
        # watch) instead of aborting every survivor from C++.
        jax.config.update("jax_enable_recoverability", True)
        try:
            jax.distributed.initialize(coordinator_address=spec.coordinator_address,
                                       num_processes=spec.num_processes,
                                       process_id=spec.process_id,
                                       initialization_timeout=timeout_s,
                                       heartbeat_timeout_seconds=heartbeat_timeout_s)
        except Exception as e:  # pylint: disable=broad-except
            raise errors.DistributedError(
                f"joining the job failed ({type(e).__name__}: {str(e).splitlines()[0]})",
                path=f"coordinator {spec.coordinator_address or '(auto-detected)'}",
                suggestion=f"check that process 0 runs and is reachable at that address, that "
                           f"all {spec.num_processes or 'N'} processes started with the same "
                           f"--num_processes and distinct --process_id, and that nothing else "
                           f"uses the port (timeout {timeout_s}s)") from e
        _WATCH = PeerWatch(client=jax_distributed.global_state.client,
                           num_processes=jax.process_count(), process_id=jax.process_index(),
                           heartbeat_timeout_s=heartbeat_timeout_s).start()
    devices = jax.devices()
    # Every process says which devices it holds -- on stderr, which the other processes keep
    # (only process 0 keeps stdout).
    print(f"titanax process {jax.process_index()}/{jax.process_count()}: "
          f"{jax.local_device_count()} local / {jax.device_count()} global "
          f"{devices[0].platform} device(s) [{spec.source}]", file=sys.stderr, flush=True)
    return spec


def watch() -> Optional[PeerWatch]:
    """The job's peer watch (None for one process)."""
    return _WATCH


def finish(timeout_s: int = 600) -> None:
    """The job's orderly end: a barrier every process reaches (so none that finishes first is
    taken for dead), the watch stopped, then the runtime shut down -- the other processes first,
    process 0 (which hosts the coordination service) last, once they have left. A no-op for
    one process."""
    global _WATCH  # pylint: disable=global-statement
    if _WATCH is None:
        return
    import jax  # pylint: disable=import-outside-toplevel
    from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
    client = jax_distributed.global_state.client
    watch, _WATCH = _WATCH, None
    if client is None:
        watch.stop()
        return
    try:
        client.wait_at_barrier("titanax_finish", timeout_s * 1000)
    finally:  # (A watch left running could end the process with its own status.)
        watch.stop()
    if jax.process_index() != 0:
        # Said before leaving: process 0's watch may look before it sees the barrier return.
        client.key_value_set(LEFT_KEY.format(process=jax.process_index()), "1")
        jax.distributed.shutdown()
        return
    # Process 0 hosts the service: it leaves once the others have (they need it to leave).
    deadline = time.monotonic() + 30
    everyone = list(range(jax.process_count()))
    while time.monotonic() < deadline:
        try:
            if set(client.get_live_nodes(everyone)) <= {0}:
                break
        except Exception:  # pylint: disable=broad-except
            break
        time.sleep(0.05)
    jax.distributed.shutdown()


def finish_after_error(timeout_s: int = 30) -> None:
    """``finish`` for a process leaving on an error before its run ends. A config error is
    usually every process's (each reads the same config), and without the orderly end the
    process 0 that leaves first takes the coordination service with it, and a peer still
    shutting down aborts (signal 6) instead of exiting with the error's status. When a peer
    does not reach the barrier within ``timeout_s`` (an error of this process alone), this
    process leaves without the orderly end: the peers' watches see it gone, and one still
    shutting down may abort as before."""
    try:
        finish(timeout_s)
    except Exception:  # pylint: disable=broad-except
        pass  # (The barrier timed out: the error's own status still ends the process.)


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
