"""``python -m titanax.plot --trainer_dir=RUN [--trainer_dir=RUN2 ...] --metrics=loss,reward
--out=FILE.png``: the chosen metrics of one or several runs against the step, one panel per
metric, one line per run, written as a PNG.

It reads each run's ``metrics.csv`` (the CSV logger's table: a row per logged step, evaluations
in rows of their own, e.g. ``heldout/loss``), so it works on a finished run, a running one or a
copied directory, without TensorBoard. A metric no run logged is refused by name, with the
columns the runs have; a run that lacks one of the metrics is left out of that panel (said on
stdout). matplotlib is an optional extra: ``pip install 'titanax[plot]'``.

    python -m titanax.plot --trainer_dir=runs/llama_tiny_grpo --metrics=reward,kl --out=grpo.png
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Sequence, Tuple

from absl import flags

from titanax import command_line, errors
from titanax.utils import files

FLAGS = flags.FLAGS

METRICS_FILE = "metrics.csv"


def _define_flags() -> None:
    """The command's flags (defined only when it runs: modules imported together must not
    define the same names twice)."""
    flags.DEFINE_multi_string("trainer_dir", None, "A run directory (repeat the flag to draw "
                              "several runs in the same panels).")
    flags.DEFINE_list("metrics", ["loss"], "Comma-separated metrics.csv columns, one panel "
                      "each (e.g. loss,heldout/loss or reward,kl).")
    flags.DEFINE_string("out", None, "The PNG file to write.")
    flags.DEFINE_bool("log_y", False, "Logarithmic y axes.")


Series = Dict[str, List[Tuple[int, float]]]


def read_metrics(trainer_dir: str) -> Tuple[List[str], Series]:
    """``(columns, {column: [(step, value), ...]})`` of a run's metrics.csv, read as the CSV
    logger reads it back (``observe/loggers.py``); empty cells and non-numbers skipped; a step
    logged twice keeps its last value."""
    from titanax.observe.loggers import read_table  # pylint: disable=import-outside-toplevel
    columns, rows = read_table(os.path.join(trainer_dir, METRICS_FILE))
    columns = [c for c in columns if c != "step"]
    by_step: Dict[str, Dict[int, float]] = {c: {} for c in columns}
    for row in rows:
        try:
            step = int(row["step"])
        except (TypeError, ValueError, KeyError):
            continue
        for column in columns:
            try:
                value = float(row.get(column) or "")
            except ValueError:
                continue
            if math.isfinite(value):
                by_step[column][step] = value
    return columns, {c: sorted(points.items()) for c, points in by_step.items()}


def _check_flags() -> Tuple[List[str], List[str], str]:
    runs = list(FLAGS.trainer_dir or [])
    if not runs:
        raise errors.LaunchFlagError("missing", path="--trainer_dir",
                                     suggestion="e.g. --trainer_dir=runs/llama_tiny_grpo (repeat "
                                                "it to compare runs)")
    for run in runs:
        if not os.path.isfile(os.path.join(run, METRICS_FILE)):
            why = "does not exist" if not os.path.exists(run) else f"holds no {METRICS_FILE}"
            raise errors.LaunchFlagError(
                f"{run} {why}", path="--trainer_dir",
                suggestion="give a run directory the CSV logger wrote (its metrics.csv)")
    metrics = [m.strip() for m in FLAGS.metrics if m.strip()]
    if not metrics:
        raise errors.LaunchFlagError("no metric given", path="--metrics",
                                     suggestion="e.g. --metrics=loss,heldout/loss")
    out = FLAGS.out
    if not out:
        raise errors.LaunchFlagError("missing", path="--out", suggestion="e.g. --out=plot.png")
    if not out.lower().endswith(".png"):
        raise errors.LaunchFlagError(f"{out} is not a .png file", path="--out",
                                     suggestion="name the file FILE.png")
    problem = files.file_target_problem(out)
    if problem:
        raise errors.LaunchFlagError(problem, path="--out",
                                     suggestion="name a file in a writable directory")
    return runs, metrics, out


def _labels(runs: Sequence[str]) -> List[str]:
    """Each run's shortest distinct name: its directory's name, or more of its path where two
    share it."""
    parts = [os.path.normpath(os.path.abspath(r)).split(os.sep) for r in runs]
    depth = 1
    while depth < max(len(p) for p in parts):
        labels = [os.sep.join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
        depth += 1
    return [os.sep.join(p) for p in parts]


def plot(argv: Sequence[str]) -> int:
    del argv  # (Positional arguments are refused by command_line.main_of.)
    runs, metrics, out = _check_flags()
    tables = {run: read_metrics(run) for run in runs}
    known = sorted({c for columns, _ in tables.values() for c in columns})
    missing = [m for m in metrics if not any(tables[r][1].get(m) for r in runs)]
    if missing:
        raise errors.LaunchFlagError(
            f"no run logged {', '.join(missing)}", path="--metrics",
            suggestion=f"choose among the runs' columns: {', '.join(known)}")
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise errors.LaunchFlagError(
            "matplotlib is not installed", path="--out",
            suggestion="pip install 'titanax[plot]' (or pip install matplotlib)") from e
    matplotlib.use("Agg")  # (Files only: no display needed.)
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    figure, axes = plt.subplots(len(metrics), 1, figsize=(7, 2.6 * len(metrics)), squeeze=False)
    for panel, metric in zip(axes[:, 0], metrics):
        for run, label in zip(runs, _labels(runs)):
            points = tables[run][1].get(metric)
            if not points:
                print(f"titanax.plot: {label} logged no {metric}: left out of its panel")
                continue
            steps, values = zip(*points)
            panel.plot(steps, values, label=label, marker="." if len(points) < 30 else None)
        panel.set_ylabel(metric)
        if FLAGS.log_y:
            panel.set_yscale("log")
        panel.grid(alpha=0.3)
        panel.legend(fontsize="small")
    axes[-1, 0].set_xlabel("step")
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    print(f"titanax.plot: wrote {out} ({', '.join(metrics)} of {len(runs)} run(s))")
    return 0


if __name__ == "__main__":
    command_line.run(plot, name="titanax.plot", define_flags=_define_flags)
