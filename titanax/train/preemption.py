"""Preemption: SIGTERM / SIGINT ask the run to stop cleanly at the next safe point.

The first signal only records a request. While training, the loop finishes the step in progress,
saves a checkpoint, waits until it is verified as committed and exits with status 0 (a
scheduler's SIGTERM is not a failure). A second signal exits at once: an in-flight Orbax save is
left as a temporary directory, which is never mistaken for a checkpoint.

The launcher installs the handlers as its very first action (``install_early``), so Ctrl-C in the
first seconds -- while jax starts, the config is built, the step compiles -- never becomes a
``KeyboardInterrupt`` unwinding through jax's and Orbax's threads (which ended in a segfault).
Such a request is honoured at the next safe point: before the first step there is nothing to
save, so the run says so and exits 0; once training runs, the training loop's guard takes it over.

Several processes must stop at the *same* step -- the save is a collective, and a process that
stops alone leaves the others blocked in the next step. Once jax's runtime joined a multi-process
job, SIGTERM belongs to jax's preemption notifier, which agrees with every process on a step (the
largest any of them reached, plus one); the guard then asks ``reached_preemption_sync_point`` at
every step instead of looking at a local flag. From the moment the job is joined
(``hand_over_to_job``) no process acts on a signal alone: a request recorded before is re-raised
as a SIGTERM to itself, and so is Ctrl-C (a second Ctrl-C exits at once), so every stop goes
through the agreement; the checks before and after training (``exit_if_requested``,
``stop_if_requested``) then find nothing to act on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Iterator, Optional

_log = logging.getLogger("titanax")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionGuard:
    """Records termination signals while installed; ``agreed``: in a multi-process job, where
    the stop is decided together (see the module docstring)."""

    def __init__(self, agreed: bool = False):
        self.requested = False
        self.signal_name = ""
        self.agreed = agreed

    def _handle(self, signum, frame):  # pylint: disable=unused-argument
        name = signal.Signals(signum).name
        if self.requested:
            _log.warning("second %s: exiting now (the last complete checkpoint is intact)", name)
            os._exit(128 + signum)  # pylint: disable=protected-access
        self.requested = True
        self.signal_name = name
        self.announce()

    def should_stop(self, step: int) -> bool:  # pylint: disable=unused-argument
        """Whether to save and stop after ``step``. In an agreed guard every process must ask
        after every step: all of them get True after the same one."""
        global _SYNC_CALLS  # pylint: disable=global-statement
        if self.agreed and not self.requested:
            from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
            # jax's counter is the number of calls since the job started (a notice before the
            # first call stops at call 1), not the train step a resumed run starts from.
            _SYNC_CALLS += 1
            if multihost_utils.reached_preemption_sync_point(_SYNC_CALLS):
                self.requested, self.signal_name = True, "SIGTERM (agreed by every process)"
        return self.requested

    def announce(self) -> None:
        print(f"titanax: {self.signal_name} received: finishing this step, saving a checkpoint, "
              "then exiting", flush=True)


class _EarlyGuard(PreemptionGuard):
    def announce(self) -> None:
        print(f"titanax: {self.signal_name} received: stopping at the next safe point",
              flush=True)


# The process-wide request recorded before training started (None: handlers not installed).
_EARLY: Optional[_EarlyGuard] = None
# Calls of reached_preemption_sync_point in this job (its step counter).
_SYNC_CALLS = 0
# In a multi-process job: Ctrl-Cs received since the job was joined.
_JOB_INTERRUPTS = 0


def _start_anew_in_a_forked_child() -> None:
    """A forked process is a process of its own (a local job's child forked from its launcher):
    no request, sync call or Ctrl-C of its parent's is its own."""
    global _EARLY, _SYNC_CALLS, _JOB_INTERRUPTS  # pylint: disable=global-statement
    _EARLY, _SYNC_CALLS, _JOB_INTERRUPTS = None, 0, 0


os.register_at_fork(after_in_child=_start_anew_in_a_forked_child)


def install_early() -> None:
    """Records SIGTERM / SIGINT from now on (main thread only); the launcher calls this first."""
    global _EARLY  # pylint: disable=global-statement
    if threading.current_thread() is not threading.main_thread():
        return
    _EARLY = _EARLY or _EarlyGuard()  # Installing twice keeps a request already recorded.
    for sig in _SIGNALS:
        signal.signal(sig, _EARLY._handle)  # pylint: disable=protected-access


def early_request() -> Optional[str]:
    """The name of a signal received before training started, or None."""
    return _EARLY.signal_name if _EARLY is not None and _EARLY.requested else None


def in_multi_process_job() -> bool:
    """Whether jax's runtime joined a job of several processes (without starting jax)."""
    import sys  # pylint: disable=import-outside-toplevel
    if "jax" not in sys.modules:
        return False
    from jax._src import distributed  # pylint: disable=import-outside-toplevel
    return distributed.global_state.client is not None


def hand_over_to_job() -> None:
    """After joining a multi-process job: every stop request goes to jax's notifier from now on
    (see the module docstring) -- one recorded before is re-raised as SIGTERM, Ctrl-C becomes a
    SIGTERM, a second Ctrl-C exits at once."""
    if not in_multi_process_job():
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupt_in_job)
    if _EARLY is not None and _EARLY.requested:
        _EARLY.requested, _EARLY.signal_name = False, ""
        os.kill(os.getpid(), signal.SIGTERM)


def _interrupt_in_job(signum, frame):  # pylint: disable=unused-argument
    global _JOB_INTERRUPTS  # pylint: disable=global-statement
    _JOB_INTERRUPTS += 1
    if _JOB_INTERRUPTS > 1:
        _log.warning("second SIGINT: exiting now (the last complete checkpoint is intact)")
        os._exit(128 + signum)  # pylint: disable=protected-access
    print("titanax: SIGINT received: asking every process to stop after the same step (again "
          "to exit at once)", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def exit_if_requested(where: str) -> None:
    """Exits with status 0 when a signal arrived and nothing has been trained yet."""
    name = early_request()
    if name is not None:
        print(f"titanax: {name} received {where}: nothing was trained, so there is nothing to "
              "save; exiting", flush=True)
        raise SystemExit(0)


def stop_if_requested(message: str) -> None:
    """Exits with status 0 after a signal when nothing more needs saving (``message`` says
    why), e.g. during the evaluation after training, whose checkpoint is already written."""
    name = early_request()
    if name is not None:
        print(f"titanax: {name} received: {message}; exiting", flush=True)
        raise SystemExit(0)


@contextlib.contextmanager
def preemption_guard(enabled: bool = True) -> Iterator[PreemptionGuard]:
    """Installs SIGTERM/SIGINT handlers for the block (main thread only; no-op elsewhere).

    A request recorded earlier (``install_early``) carries over into the guard.
    """
    agreed = in_multi_process_job()
    guard = PreemptionGuard(agreed=agreed)
    # In a job SIGTERM stays jax's (its notifier agrees on the step) and Ctrl-C is forwarded to
    # it (hand_over_to_job): the guard installs nothing and only asks at every step.
    if agreed:
        hand_over_to_job()
    if not enabled or agreed or threading.current_thread() is not threading.main_thread():
        yield guard
        return
    if early_request() is not None:
        guard.requested, guard.signal_name = True, early_request()
    previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    for sig in previous:
        signal.signal(sig, guard._handle)  # pylint: disable=protected-access
    try:
        yield guard
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if guard.requested and _EARLY is not None:
            _EARLY.requested, _EARLY.signal_name = True, guard.signal_name
