"""Watching the other processes of a job, so a dead one ends the job instead of hanging it.

When a process of a multi-process job dies (a crash, an OOM kill, ``kill -9``), its peers are
blocked in a collective that will never complete: without help they hang until jax's coordination
service gives up (100 s by default) and then abort from C++ with a stack trace that names no
one. Titanax starts jax's runtime with a short heartbeat and *recoverable* tasks, so the service
marks a silent peer dead within seconds and tells no one; a ``PeerWatch`` thread in every process
asks the service who is alive twice a second and, when a peer is gone, prints a
``DistributedError`` naming it and ends this process with ``EXIT_LOST_PEER``. A process whose own
step fails because a peer vanished (gloo: "connection closed by peer") asks the watch first
(``explain_failure``), so the error names the lost peer rather than a socket.

A job that ends well passes ``finish()`` -- a barrier every process reaches -- and stops the
watch there. A peer leaves the job only after that barrier, and first records that it left in the
service's key-value store (``LEFT_KEY``): the watch of a process that has not yet seen its own
barrier return (threads are scheduled late on a loaded machine) may already find that peer gone,
and must take it for finished, not dead.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import List, Optional

from titanax import errors

# Exit status of a process whose peer was lost (EX_TEMPFAIL: the job may be retried).
EXIT_LOST_PEER = 75

# Key a process sets in the coordination service's store, after the job's last barrier and
# before it disconnects: "I left in order".
LEFT_KEY = "titanax_left/{process}"


class PeerWatch:
    """A daemon thread that ends this process when a peer stops answering."""

    def __init__(self, *, client, num_processes: int, process_id: int,
                 heartbeat_timeout_s: int, poll_s: float = 0.5):
        self.client = client
        self.num_processes = num_processes
        self.process_id = process_id
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.poll_s = poll_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="titanax-peer-watch",
                                        daemon=True)

    def start(self) -> "PeerWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()

    def lost_peers(self) -> Optional[List[int]]:
        """The processes the coordination service no longer counts as alive ([0]: the
        coordinator itself stopped answering), or None when it could not be asked."""
        try:
            live = self.client.get_live_nodes(list(range(self.num_processes)))
        except Exception:  # pylint: disable=broad-except
            return None if self.process_id == 0 else [0]
        gone = set(range(self.num_processes)) - set(live)
        return sorted(p for p in gone if not self._left_in_order(p))

    def _left_in_order(self, process: int) -> bool:
        """Whether ``process`` passed the job's last barrier and said it leaves."""
        try:
            return self.client.key_value_try_get(LEFT_KEY.format(process=process)) == "1"
        except Exception:  # pylint: disable=broad-except  (not found, or no service to ask)
            return False

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_s):
            lost = self.lost_peers()
            if lost and not self._stopping.is_set():
                self._end(lost)

    def _end(self, lost: List[int]) -> None:
        names = ", ".join(f"process {p}" + (" (the coordinator)" if p == 0 else "")
                          for p in lost)
        error = errors.DistributedError(
            f"lost {names}: it stopped answering the job's heartbeat (timeout "
            f"{self.heartbeat_timeout_s}s); process {self.process_id} stops instead of "
            "waiting forever in a collective", path=f"process {lost[0]}",
            suggestion="see that process's own output for why it ended (killed, out of "
                       "memory, a crash); restart the job: it resumes from the last checkpoint")
        print(f"titanax: error: {error.format()}", file=sys.stderr, flush=True)
        os._exit(EXIT_LOST_PEER)  # pylint: disable=protected-access

    def explain_failure(self, wait_s: Optional[float] = None) -> Optional[List[int]]:
        """After this process's step failed: waits (up to about a heartbeat) for the service
        to name a lost peer -- the watch thread then ends the process with that message -- and
        returns None when every peer is still alive (the failure is this process's own)."""
        deadline = time.monotonic() + (wait_s if wait_s is not None
                                       else self.heartbeat_timeout_s + 2 * self.poll_s + 1)
        while time.monotonic() < deadline:
            lost = self.lost_peers()
            if lost:
                self._end(lost)
            time.sleep(self.poll_s)
        return None
