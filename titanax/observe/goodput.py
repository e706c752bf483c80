"""Goodput: where a run's wall time went -- productive steps, or badput by cause.

The process is always in exactly one bucket: ``startup`` from the moment the process started
(imports, joining the job, building, restoring) until the training loop begins; then
``productive`` while it trains a step for the first time, or ``redone`` while it trains a step an
earlier launch of the run had already trained (the work a failure lost); ``data`` while the loop
waits for a batch, ``compile`` while a step is compiled, ``checkpoint`` while a save blocks,
``evaluation`` while evalers run; ``other`` after the loop (reports, shutdown). Switching buckets
is the only operation, so the buckets sum to the wall time exactly, by construction.

A run's goodput spans its launches: process 0 keeps ``<trainer_dir>/goodput.json`` (the seconds
of each bucket over every launch so far and the furthest step any launch trained), written at
every log step and at the end; a resumed run continues from it, and ``goodput`` in metrics.csv is
``productive / wall`` over all launches so far. Time between launches (a scheduler's queue, a
host's replacement) is nobody's process time and is not counted; a process killed with SIGKILL
loses its time since its last log step from the record (its steps after the checkpoint show up
as ``redone`` in the next launch).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Dict, Iterator, Optional

from titanax.utils.files import atomic_write_text, move_aside

# The buckets, productive first.
BUCKETS = ("productive", "startup", "compile", "data", "checkpoint", "evaluation", "redone",
           "other")
RECORD = "goodput.json"


def _process_start_age() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere 0, i.e. from the first
    import of this module)."""
    try:
        with open("/proc/self/stat", encoding="utf-8") as f:
            started_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="utf-8") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


class GoodputClock:
    """The process's buckets (see the module docstring); ``CLOCK`` is the one in use."""

    def __init__(self, *, started: Optional[float] = None):
        """``started``: ``time.monotonic()`` at the process's start (default: read from the
        system)."""
        now = time.monotonic()
        self._since = now - _process_start_age() if started is None else started
        self._bucket = "startup"
        self._seconds: Dict[str, float] = dict.fromkeys(BUCKETS, 0.0)
        # Earlier launches' seconds (a resumed run's record).
        self._earlier: Dict[str, float] = dict.fromkeys(BUCKETS, 0.0)
        self.launches = 1
        # The furthest step any launch trained (steps up to it are redone work).
        self.furthest_step = 0
        self._record_path: Optional[str] = None

    @property
    def bucket(self) -> str:
        return self._bucket

    def enter(self, bucket: str) -> None:
        """From now on the time goes to ``bucket``."""
        if bucket not in BUCKETS:
            raise ValueError(f"unknown goodput bucket {bucket!r}")
        now = time.monotonic()
        self._seconds[self._bucket] += now - self._since
        self._since, self._bucket = now, bucket

    @contextlib.contextmanager
    def spent_on(self, bucket: str) -> Iterator[None]:
        """The time inside goes to ``bucket``; then back to the bucket before."""
        before = self._bucket
        self.enter(bucket)
        try:
            yield
        finally:
            self.enter(before)

    def step_bucket(self, step_index: int) -> str:
        """Where training step ``step_index`` (0-based) goes: redone if a launch trained it."""
        return "redone" if step_index < self.furthest_step else "productive"

    def seconds(self) -> Dict[str, float]:
        """Every bucket's seconds over all launches so far (the current one up to now)."""
        now = time.monotonic()
        mine = dict(self._seconds)
        mine[self._bucket] += now - self._since
        return {b: self._earlier[b] + mine[b] for b in BUCKETS}

    def goodput(self) -> float:
        """Productive fraction of the wall time so far (0..1)."""
        seconds = self.seconds()
        wall = sum(seconds.values())
        return seconds["productive"] / wall if wall > 0 else 0.0

    # --- The run's record ----------------------------------------------------------------------

    def begin_run(self, *, trainer_dir: Optional[str], resumed: bool) -> None:
        """The run starts (``trainer_dir``: where process 0 keeps the record; None on the
        others). A resumed run continues its record; a new one moves an older record aside."""
        self._record_path = os.path.join(trainer_dir, RECORD) if trainer_dir else None
        if self._record_path is None or not os.path.exists(self._record_path):
            return
        if not resumed:
            move_aside(self._record_path)
            return
        try:
            with open(self._record_path, encoding="utf-8") as f:
                record = json.load(f)
            earlier = {b: float(record["seconds"].get(b, 0.0)) for b in BUCKETS}
            launches, furthest = int(record["launches"]), int(record["furthest_step"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            move_aside(self._record_path)  # (Unreadable: kept aside, the count starts anew.)
            return
        self._earlier, self.launches, self.furthest_step = earlier, launches + 1, furthest

    def trained(self, step: int) -> None:
        """Steps up to ``step`` are trained: noted, and the record written."""
        self.furthest_step = max(self.furthest_step, step)
        self.write()

    def write(self) -> None:
        if self._record_path is None:
            return
        record = {"goodput": round(self.goodput(), 6), "launches": self.launches,
                  "furthest_step": self.furthest_step,
                  "seconds": {b: round(s, 6) for b, s in self.seconds().items()}}
        try:
            atomic_write_text(self._record_path, json.dumps(record, indent=1) + "\n")
        except OSError:
            pass  # (An accounting file never stops a run.)

    def summary(self) -> str:
        """One line: goodput, the wall time, every bucket that holds time."""
        seconds = self.seconds()
        wall = sum(seconds.values())
        parts = ", ".join(f"{b} {s:.1f}s" for b, s in seconds.items() if s >= 0.05)
        over = f" over {self.launches} launches" if self.launches > 1 else ""
        return f"goodput {self.goodput():.3f} of {wall:.1f}s wall{over}: {parts}"


# The process's clock, started with the process.
CLOCK = GoodputClock()


def _start_anew_in_a_forked_child() -> None:
    """A forked process is a process of its own: its clock starts when it does, with none of its
    parent's seconds or record (as if it had started afresh and imported this module)."""
    CLOCK.__init__()  # pylint: disable=unnecessary-dunder-call


os.register_at_fork(after_in_child=_start_anew_in_a_forked_child)


def spent_on(bucket: str):
    """``with goodput.spent_on("checkpoint"):`` on the process's clock."""
    return CLOCK.spent_on(bucket)
