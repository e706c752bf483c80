"""Loggers: where step metrics go. Each is a Configurable with ``log_dict(metrics, step)``.

``Basic`` prints one progress line per log step (step, loss, lr, grad norm, step time, tokens/s,
ETA); ``CSV`` appends rows to ``<trainer_dir>/metrics.csv``; ``TensorBoard`` writes event files
with tensorboardX (no TensorFlow needed). Only process 0 writes, so a multi-process job logs once.
"""

from __future__ import annotations

import csv
import math
import os
import sys
from typing import Dict, Optional

from titanax.config import Configurable


class Logger(Configurable):
    """Base logger; subclasses implement ``log_dict``."""

    def __init__(self, cfg=None, *, trainer_dir: Optional[str] = None, **fields):
        super().__init__(cfg, **fields)
        self.trainer_dir = trainer_dir

    def log_scalar(self, name: str, value: float, step: int) -> None:
        self.log_dict({name: value}, step)

    def log_dict(self, metrics: Dict[str, float], step: int) -> None:
        raise NotImplementedError(type(self).__qualname__)

    def close(self) -> None:
        """Flushes and releases files."""


def _format(value: float) -> str:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    if isinstance(value, float) and (abs(value) >= 1e4 or 0 < abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


class Basic(Logger):
    """One readable progress line per log step on stdout."""

    class Config(Logger.Config):
        # Metrics shown first, in this order (others follow alphabetically when verbose).
        columns: tuple = ("loss", "learning_rate", "grad_norm", "step_time_s", "tokens_per_s",
                       "examples_per_s", "mfu")
        # Also print every other metric.
        verbose: bool = False

    def log_dict(self, metrics: Dict[str, float], step: int) -> None:
        cfg = self.config
        parts = [f"step {step:>6d}"]
        shown = [k for k in cfg.columns if k in metrics]
        others = sorted(k for k in metrics if k not in cfg.columns and k != "eta_s")
        # A line with none of the progress columns (compile time, an evaluation) shows its own.
        names = shown + (others if cfg.verbose or not shown else [])
        for name in names:
            if name in metrics:
                parts.append(f"{name} {_format(metrics[name])}")
        if "eta_s" in metrics:
            parts.append(f"eta {_duration(metrics['eta_s'])}")
        print("  ".join(parts), file=sys.stdout, flush=True)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class CSV(Logger):
    """Appends one row per log step to a CSV file (new columns start a new header row)."""

    class Config(Logger.Config):
        # File name inside the trainer dir (or an absolute path).
        filename: str = "metrics.csv"

    def __init__(self, cfg=None, *, trainer_dir=None, **fields):
        super().__init__(cfg, trainer_dir=trainer_dir, **fields)
        self.path = os.path.join(trainer_dir or ".", self.config.filename)
        self._columns: Optional[list] = None

    def log_dict(self, metrics: Dict[str, float], step: int) -> None:
        columns = ["step"] + sorted(metrics)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            if columns != self._columns:
                writer.writerow(columns)
                self._columns = columns
            writer.writerow([step] + [metrics[k] for k in columns[1:]])


class TensorBoard(Logger):
    """TensorBoard event files under ``<trainer_dir>/<subdir>``."""

    class Config(Logger.Config):
        # Directory inside the trainer dir for the event files.
        subdir: str = "tensorboard"

    def __init__(self, cfg=None, *, trainer_dir=None, **fields):
        super().__init__(cfg, trainer_dir=trainer_dir, **fields)
        from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
        self.log_dir = os.path.join(trainer_dir or ".", self.config.subdir)
        self._writer = SummaryWriter(self.log_dir)

    def log_dict(self, metrics: Dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
