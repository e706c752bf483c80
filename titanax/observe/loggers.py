"""Loggers: where step metrics go. Each is a Configurable with ``log_dict(metrics, step)``.

``Basic`` prints one progress line per log step (step N/total, loss, lr, grad norm, step time,
tokens/s, ETA); ``CSV`` keeps ``<trainer_dir>/metrics.csv`` one table; ``TensorBoard`` writes event
files with tensorboardX (no TensorFlow needed); ``WandB`` (``titanax.observe.wandb_logger``, the
optional extra ``titanax[wandb]``) sends the run config and the metrics to Weights & Biases. The
engine builds loggers on process 0 only, so a multi-process job logs once.
"""

from __future__ import annotations

import csv
import io
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from titanax.config import ConfigBase, Configurable
from titanax.utils.files import atomic_write_text, move_aside


class Logger(Configurable):
    """Base logger; subclasses implement ``log_dict``.

    ``trainer_dir``: the run directory (files a logger writes go there); ``run_config``: the
    whole run's config tree (the engine's), for loggers that record it with the metrics (W&B);
    None when a logger is built on its own. Subclasses that take their own ``__init__`` pass both
    on by keyword.
    """

    def __init__(self, cfg=None, *, trainer_dir: Optional[str] = None,
                 run_config: Optional[ConfigBase] = None, **fields):
        super().__init__(cfg, **fields)
        self.trainer_dir = trainer_dir
        self.run_config = run_config
        self.total_steps: Optional[int] = None
        # The metrics the run's objective is judged by (``Objective.console_columns``: a
        # preference run's rewards/accuracies, GRPO's reward), set by the Engine before start.
        self.console_columns: Tuple[str, ...] = ()

    def start(self, *, step: int, total_steps: Optional[int] = None, resumed: bool = False
              ) -> None:
        """Called once before training: the run starts at ``step`` of ``total_steps``.

        ``resumed``: the run continues from a checkpoint at ``step`` (what was logged after it
        will be logged again); otherwise it is a new run, and what an earlier run in the same
        directory logged must be kept apart from it.
        """
        del step, resumed
        self.total_steps = total_steps

    def log_scalar(self, name: str, value: float, step: int) -> None:
        self.log_dict({name: value}, step)

    def log_dict(self, metrics: Dict[str, float], step: int) -> None:
        raise NotImplementedError(type(self).__qualname__)

    def log_samples(self, rows: Sequence[Dict[str, Any]], step: int) -> None:
        """A few sampled completions at ``step`` (``observe/samples.py``: each row's
        ``prompt``, ``completion`` and, when rewarded, ``reward``). A logger that shows tables
        (W&B) records them; the others leave them to the run's samples.jsonl."""
        del rows, step

    def close(self) -> None:
        """Flushes and releases files."""


def _format(value: float) -> str:
    """Four decimals; whole numbers from 1000 up (tokens/s, counts); tiny ones in e-notation."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    if isinstance(value, float) and abs(value) >= 1e3:
        return f"{value:.0f}"
    if isinstance(value, float) and 0 < abs(value) < 1e-3:
        return f"{value:.3e}"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


class Basic(Logger):
    """One readable progress line per log step on stdout."""

    class Config(Logger.Config):
        # Metrics shown first, in this order (others follow alphabetically when verbose). An
        # entry "*/<name>" shows every metric whose path ends with /<name> (a layer's summary,
        # e.g. a mixture of experts' load imbalance averaged over its layers), as <name> -- with
        # the model child it comes from when several do (decoder, prediction); "<name>/*"
        # every metric under <name>/ (the multi-token-prediction depths' mtp_loss/1, /2...).
        columns: tuple = ("loss", "mtp_loss/*", "learning_rate", "grad_norm", "step_time_s",
                          "tokens_per_s", "examples_per_s", "mfu", "peak_memory_gib",
                          "compile_time_s", "pipeline_bubble", "*/expert_load/max",
                          "*/dropped_fraction")
        # Show the run's objective's metrics first, before ``columns`` (its
        # ``console_columns``: GRPO's reward, reward_std, kl...; a preference run's
        # rewards/accuracies and rewards/margins; distillation's reverse_kl).
        objective_columns: bool = True
        # Also print every other metric.
        verbose: bool = False

    def log_dict(self, metrics: Dict[str, float], step: int) -> None:
        cfg = self.config
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {step:>6d}{total}"]
        shown, labels = [], {}
        leading = self.console_columns if cfg.objective_columns else ()
        for column in dict.fromkeys((*leading, *cfg.columns)):
            if column.startswith("*/"):
                matches = sorted(k for k in metrics if k.endswith(column[1:]))
                shown += matches
                labels.update(_labels(matches, column[2:]))
            elif column.endswith("/*"):
                shown += sorted(k for k in metrics if k.startswith(column[:-1]))
            elif column in metrics:
                shown.append(column)
        others = sorted(k for k in metrics if k not in shown and k != "eta_s")
        # A line with none of the progress columns (compile time, an evaluation) shows its own.
        names = shown + (others if cfg.verbose or not shown else [])
        for name in names:
            if name in metrics:
                parts.append(f"{labels.get(name, name)} {_format(metrics[name])}")
        if "eta_s" in metrics:
            parts.append(f"eta {_duration(metrics['eta_s'])}")
        print("  ".join(parts), file=sys.stdout, flush=True)


def _labels(metrics: List[str], name: str) -> Dict[str, str]:
    """``name`` for one layer summary; for several, ``name(where)`` with the fewest leading
    parts of each one's module path that tell them apart (``summaries/decoder/...`` ->
    decoder; two prediction depths -> prediction/0, prediction/1)."""
    if len(metrics) <= 1:
        return {m: name for m in metrics}
    paths = [m.split("/")[1:] if m.startswith("summaries/") else m.split("/") for m in metrics]
    for depth in range(1, max(len(p) for p in paths) + 1):
        wheres = ["/".join(p[:depth]) for p in paths]
        if len(set(wheres)) == len(wheres):
            break
    return {m: f"{name}({w})" for m, w in zip(metrics, wheres)}


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class CSV(Logger):
    """One table in a CSV file: a header row, then one row per log call.

    A metric that first appears later (an evaluation, say) becomes a new column: the file is
    rewritten with the wider header and empty cells where a row has no value, so
    ``pandas.read_csv`` reads it as one table. On resume the rows logged after the restored step
    are dropped (they are logged again); a new run moves an earlier run's file aside
    (``metrics.<time>.csv``) instead of mixing rows of two runs.
    """

    class Config(Logger.Config):
        # File name inside the trainer dir (or an absolute path).
        filename: str = "metrics.csv"

    def __init__(self, cfg=None, *, trainer_dir=None, run_config=None, **fields):
        super().__init__(cfg, trainer_dir=trainer_dir, run_config=run_config, **fields)
        self.path = os.path.join(trainer_dir or ".", self.config.filename)
        self._columns: Optional[List[str]] = None
        self._rows: List[Dict[str, str]] = []

    def start(self, *, step: int, total_steps: Optional[int] = None, resumed: bool = False
              ) -> None:
        super().start(step=step, total_steps=total_steps, resumed=resumed)
        columns, rows = read_table(self.path)
        if rows and not resumed:
            move_aside(self.path)
            columns, rows = ["step"], []
        kept = [row for row in rows if _as_int(row.get("step")) <= step]
        self._columns, self._rows = columns or ["step"], kept
        if len(kept) != len(rows):
            self._rewrite()

    def log_dict(self, metrics: Dict[str, float], step: int) -> None:
        if self._columns is None:
            self._columns, self._rows = read_table(self.path)
            self._columns = self._columns or ["step"]
        row = {"step": str(step), **{k: repr(float(v)) if isinstance(v, float) else str(v)
                                     for k, v in metrics.items()}}
        # The same metrics at the same step again (a relaunch re-running the final evaluation,
        # the compile time at the resume step) replace the earlier row: one row per event.
        same = [i for i, old in enumerate(self._rows) if old.get("step") == row["step"]
                and set(old) == set(row)]
        if same:
            self._rows[same[-1]] = row
        else:
            self._rows.append(row)
        new_columns = sorted(k for k in metrics if k not in self._columns)
        if same or new_columns or not os.path.exists(self.path):
            self._columns = self._columns + new_columns
            self._rewrite()
            return
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            csv.writer(f).writerow([row.get(k, "") for k in self._columns])

    def _rewrite(self) -> None:
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(self._columns)
        for row in self._rows:
            writer.writerow([row.get(k, "") for k in self._columns])
        atomic_write_text(self.path, buffer.getvalue())


def read_table(path: str) -> Tuple[List[str], List[Dict[str, str]]]:
    """Columns and rows of a metrics CSV (also the older layout with repeated header rows)."""
    if not os.path.exists(path):
        return [], []
    columns: List[str] = []
    rows: List[Dict[str, str]] = []
    header: List[str] = []
    with open(path, newline="", encoding="utf-8") as f:
        for record in csv.reader(f):
            if not record:
                continue
            if record[0] == "step":
                header = record
                columns += [c for c in record if c not in columns]
                continue
            rows.append({k: v for k, v in zip(header, record) if v != ""})
    return columns, rows


def _as_int(text: Optional[str]) -> int:
    try:
        return int(float(text))
    except (TypeError, ValueError):
        return -1


class TensorBoard(Logger):
    """TensorBoard event files under ``<trainer_dir>/<subdir>``."""

    class Config(Logger.Config):
        # Directory inside the trainer dir for the event files.
        subdir: str = "tensorboard"

    def __init__(self, cfg=None, *, trainer_dir=None, run_config=None, **fields):
        super().__init__(cfg, trainer_dir=trainer_dir, run_config=run_config, **fields)
        self.log_dir = os.path.join(trainer_dir or ".", self.config.subdir)
        # Imported once, when the logger is built (see _summary_writer_class).
        self._writer_class = _summary_writer_class()
        self._writer = None
        self._purge_step: Optional[int] = None

    def start(self, *, step: int, total_steps: Optional[int] = None, resumed: bool = False
              ) -> None:
        """On resume, TensorBoard drops the events logged after ``step`` (they are logged
        again); a new run moves an earlier run's event files aside."""
        super().start(step=step, total_steps=total_steps, resumed=resumed)
        if not resumed and os.path.isdir(self.log_dir) and os.listdir(self.log_dir):
            move_aside(self.log_dir)
        self._purge_step = step + 1 if resumed else None

    def _open(self):
        """The writer, made on the first event (a run that fails before logging leaves none)."""
        if self._writer is None:
            self._writer = self._writer_class(self.log_dir, purge_step=self._purge_step)
        return self._writer

    def log_dict(self, metrics: Dict[str, float], step: int) -> None:
        writer = self._open()
        for name, value in metrics.items():
            writer.add_scalar(name, value, step)
        writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _summary_writer_class():
    """tensorboardX's ``SummaryWriter``, imported without torch where torch is installed but not
    yet loaded: tensorboardX imports it only to accept torch tensors (Titanax logs floats), and
    that import costs every run ~0.8 s of start-up (measured, 2 cores: importing tensorboardX
    after jax 0.83 s with torch installed). ``sys.modules["torch"] = None`` makes its optional
    ``import torch`` fail as if torch were absent; the entry is removed at once, so a later
    ``import torch`` loads it normally. (Another thread importing torch in that moment would
    fail; none of a run's own threads -- data, checkpointing -- imports torch.)"""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    finally:
        if sys.modules.get("torch", ...) is None:
            del sys.modules["torch"]
    return SummaryWriter
