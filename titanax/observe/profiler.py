"""Profiler windows: a ``jax.profiler`` trace of chosen train steps, written under the run dir.

``--config.profile.start_step=N --config.profile.num_steps=K`` traces steps N .. N+K-1 (counted
from 1, as the progress line counts them) into ``<trainer_dir>/<subdir>/plugins/profile/<run>/``,
the layout TensorBoard's profile plugin (and Perfetto, through it) reads:
``tensorboard --logdir <trainer_dir>/profile``. Start after the first step: step 1 includes
compilation. The trace is stopped only after the last traced step has finished on the device, so
it holds whole steps rather than their dispatch.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import jax

from titanax.config import Configurable

_log = logging.getLogger("titanax")


class Profile(Configurable):
    """Traces a window of train steps with ``jax.profiler``."""

    class Config(Configurable.Config):
        # First step traced (1-based; step 1 also compiles, so start at 2 or later).
        start_step: int = 5
        # Steps traced.
        num_steps: int = 3
        # Directory of the trace, inside the trainer dir.
        subdir: str = "profile"

        def _validate_values(self):
            if self.start_step < 1:
                yield "start_step", f"must be >= 1, got {self.start_step}"
            if self.num_steps < 1:
                yield "num_steps", f"must be >= 1, got {self.num_steps}"

    def __init__(self, cfg=None, *, trainer_dir: Optional[str] = None, **fields):
        super().__init__(cfg, **fields)
        self.log_dir = os.path.abspath(os.path.join(trainer_dir or ".", self.config.subdir))
        self.active = False
        self.done = False
        self._last = 0

    def before_step(self, step: int, in_flight=None) -> None:
        """``step`` is the 1-based number of the step about to run; ``in_flight`` what earlier
        steps are still computing (waited for, so the trace holds whole steps). A run resumed
        past ``start_step`` starts the window at its first step."""
        if not self.active and not self.done and step >= self.config.start_step:
            jax.block_until_ready(in_flight)
            os.makedirs(self.log_dir, exist_ok=True)
            jax.profiler.start_trace(self.log_dir)
            self.active = True
            self._last = step + self.config.num_steps - 1
            print(f"titanax: profiling steps {step}..{self._last} into {self.log_dir}",
                  flush=True)

    def after_step(self, step: int, outputs) -> None:
        """Stops the trace after step ``start_step + num_steps - 1`` finished on the device."""
        if self.active and step >= self._last:
            jax.block_until_ready(outputs)
            self.stop()

    def stop(self) -> None:
        """Ends the trace (also when the run stops inside the window)."""
        if not self.done and not self.active:
            _log.warning("profile window from step %d was never reached: no trace written",
                         self.config.start_step)
            print(f"titanax: warning: the profile window (from step {self.config.start_step}) "
                  "was never reached; no trace was written", flush=True)
            self.done = True
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            self.done = True
            _log.info("profile written to %s", self.log_dir)
