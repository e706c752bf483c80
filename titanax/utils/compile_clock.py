"""Seconds jax spends making programs (tracing, lowering, compiling), counted while a clock
runs -- so a command can report what it spent generating apart from what it spent compiling,
when its programs compile as first met (the decode engine's: a program per batch size).

It listens to jax's own events (``jax.monitoring``: ``/jax/core/compile/...`` durations), so
whatever compiles while the clock runs counts -- on any thread of the process -- and nothing
before or after it does.
"""

from __future__ import annotations

import threading
import time
from typing import List

import jax

# The events whose durations make a program (each jit's trace, lowering and backend compile).
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_running: List["CompileClock"] = []
_lock = threading.Lock()
_listening = False


def _listen(event: str, seconds: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        with _lock:
            for clock in _running:
                clock.compile_seconds += seconds


class CompileClock:
    """``with CompileClock() as clock:`` -- then ``clock.seconds`` (the wall time inside),
    ``clock.compile_seconds`` (jax's making of programs inside) and ``clock.run_seconds``
    (the rest)."""

    def __init__(self):
        self.seconds = 0.0
        self.compile_seconds = 0.0
        self._started = 0.0

    def __enter__(self) -> "CompileClock":
        global _listening  # pylint: disable=global-statement
        with _lock:
            if not _listening:  # (Once per process: jax keeps its listeners.)
                jax.monitoring.register_event_duration_secs_listener(_listen)
                _listening = True
            _running.append(self)
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._started
        with _lock:
            _running.remove(self)

    @property
    def run_seconds(self) -> float:
        return max(self.seconds - self.compile_seconds, 0.0)
