"""Preemption: SIGTERM / SIGINT ask the engine to stop cleanly at the next step boundary.

The first signal sets a flag; the training loop finishes the step in progress, saves a checkpoint,
waits until it is fully written and exits with status 0 (a scheduler's SIGTERM is not a failure).
A second signal exits at once: an in-flight Orbax save is left as a temporary directory, which is
never mistaken for a checkpoint, so nothing that was saved is damaged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Iterator

_log = logging.getLogger("titanax")


class PreemptionGuard:
    """Records termination signals while installed."""

    def __init__(self):
        self.requested = False
        self.signal_name = ""

    def _handle(self, signum, frame):  # pylint: disable=unused-argument
        name = signal.Signals(signum).name
        if self.requested:
            _log.warning("second %s: exiting now (the last complete checkpoint is intact)", name)
            os._exit(128 + signum)  # pylint: disable=protected-access
        self.requested = True
        self.signal_name = name
        print(f"titanax: {name} received: finishing this step, saving a checkpoint, then exiting",
              flush=True)


@contextlib.contextmanager
def preemption_guard(enabled: bool = True) -> Iterator[PreemptionGuard]:
    """Installs SIGTERM/SIGINT handlers for the block (main thread only; no-op elsewhere)."""
    guard = PreemptionGuard()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield guard
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, guard._handle)  # pylint: disable=protected-access
    try:
        yield guard
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
