"""Standard output that never stops a run: a closed pipe or a full disk swallows the text.

``python -m titanax.launch ... | tee log`` and Ctrl-C: the terminal interrupts ``tee`` as well,
and the run's next line -- "SIGINT received: saving" -- meets a pipe nobody reads. Python raises
``BrokenPipeError`` from that ``print``, in the middle of the signal handler or the save, and the
run ends with status 1 and no checkpoint. The same happens when the reader of the pipe exits
early (``| head``), or when stdout is a file on a full disk (``ENOSPC``), at any progress line.

What is printed is a report; what is saved is the run. ``protect_standard_streams()`` wraps
``sys.stdout`` and ``sys.stderr`` so that a write or flush that fails with an ``OSError`` turns
the stream into a sink for the rest of the process: the descriptor is pointed at ``/dev/null``
(so the interpreter's own last flush at exit succeeds too) and the text is dropped. Training,
saving and the exit status go on as if the text had been read.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO


class SafeStream:
    """A text stream whose ``write`` / ``flush`` never raise ``OSError`` (see the module
    docstring); everything else is the wrapped stream's."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        # Set once a write failed: the text goes nowhere from then on.
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):  # ValueError: the stream was closed under us.
                self._give_up()
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._give_up()

    def _give_up(self) -> None:
        """From now on the text is dropped; the descriptor is pointed at /dev/null so that
        whatever still holds it (the interpreter's flush at exit, a child process) can write."""
        self.broken = True
        try:
            descriptor = self._stream.fileno()
        except (OSError, ValueError, AttributeError):
            return
        try:
            sink = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(sink, descriptor)
            finally:
                os.close(sink)
        except OSError:
            pass
        try:  # The buffered text that failed: written to the sink, or dropped.
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def protect_standard_streams() -> None:
    """Wraps ``sys.stdout`` and ``sys.stderr`` in ``SafeStream`` (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, SafeStream):
            setattr(sys, name, SafeStream(stream))


class _TitanaxLines(logging.Handler):
    """The "titanax" logger's records as the run's other lines: information on stdout
    (``titanax: ...``), warnings and errors on stderr (``titanax: warning: ...``)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # pylint: disable=broad-except  (a bad format: show it raw)
            text = str(record.msg)
        if record.levelno >= logging.WARNING:
            print(f"titanax: {record.levelname.lower()}: {text}", file=sys.stderr, flush=True)
        else:
            print(f"titanax: {text}", flush=True)


def show_titanax_logs() -> None:
    """Titanax's log records shown by kind (see ``_TitanaxLines``), INFO and up, not repeated by
    the root logger's handlers (absl's "I1126 ..." lines). Idempotent."""
    log = logging.getLogger("titanax")
    if not any(isinstance(h, _TitanaxLines) for h in log.handlers):
        log.addHandler(_TitanaxLines())
    log.setLevel(logging.INFO)
    log.propagate = False
