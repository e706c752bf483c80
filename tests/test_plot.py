"""``python -m titanax.plot``: the metrics of runs (their metrics.csv, as the CSV logger writes
it) drawn into a PNG; bad flags refused by name."""

import os

import pytest

from titanax import plot
from titanax.observe.loggers import CSV
from tests import forked_python
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(trainer_dir, *, steps, with_reward):
    """A run's metrics.csv written by the CSV logger: loss (and reward) every step, a held-out
    loss in rows of its own."""
    logger = CSV(trainer_dir=str(trainer_dir))
    logger.start(step=0, total_steps=steps)
    for step in range(1, steps + 1):
        metrics = {"loss": 2.0 / step}
        if with_reward:
            metrics["reward"] = step / steps
        logger.log_dict(metrics, step)
        if step % 5 == 0:
            logger.log_dict({"heldout/loss": 2.5 / step}, step)
    logger.close()


def _plot(*args, cwd=REPO_ROOT):
    return forked_python.run(["-m", "titanax.plot", *args], cwd=cwd,
                             env=child_environment(), timeout=120)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plot")
    _write_run(root / "grpo", steps=20, with_reward=True)
    _write_run(root / "sft", steps=12, with_reward=False)
    return root


def test_metrics_are_read_as_the_csv_logger_wrote_them(runs):
    columns, series = plot.read_metrics(str(runs / "grpo"))
    assert {"loss", "reward", "heldout/loss"} <= set(columns)
    assert series["reward"] == [(s, s / 20) for s in range(1, 21)]
    assert series["heldout/loss"] == [(s, 2.5 / s) for s in (5, 10, 15, 20)]


def test_two_runs_two_metrics_make_a_png(runs, tmp_path):
    out = tmp_path / "figures" / "runs.png"  # (A folder not made yet: made.)
    result = _plot(f"--trainer_dir={runs / 'grpo'}", f"--trainer_dir={runs / 'sft'}",
                   "--metrics=loss,reward", f"--out={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 5000
    assert "sft logged no reward" in result.stdout  # (Left out of that panel, said.)


@pytest.mark.parametrize("args,path,said", [
    (["--metrics=loss", "--out={tmp}/a.png"], "--trainer_dir", "missing"),
    (["--trainer_dir={tmp}/nowhere", "--out={tmp}/a.png"], "--trainer_dir", "does not exist"),
    (["--trainer_dir={tmp}", "--out={tmp}/a.png"], "--trainer_dir", "holds no metrics.csv"),
    (["--trainer_dir={runs}/sft", "--metrics=loss,rewrad", "--out={tmp}/a.png"], "--metrics",
     "heldout/loss"),  # (The columns it could have meant.)
    (["--trainer_dir={runs}/sft", "--metrics=,", "--out={tmp}/a.png"], "--metrics",
     "no metric"),
    (["--trainer_dir={runs}/sft"], "--out", "missing"),
    (["--trainer_dir={runs}/sft", "--out={tmp}/a.pdf"], "--out", "not a .png"),
    (["--trainer_dir={runs}/sft", "--out={tmp}/a_file/a.png"], "--out", "a file"),
    (["--trainer_dir={runs}/sft", "--out={tmp}/dir.png"], "--out", "a directory"),
], ids=["no run", "run missing", "no metrics file", "unknown metric", "empty metrics",
        "no out", "not png", "out under a file", "out is a directory"])
def test_bad_flags_exit_2_naming_the_flag(runs, tmp_path, args, path, said):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "dir.png").mkdir()
    result = _plot(*[a.format(tmp=tmp_path, runs=runs) for a in args])
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    assert f"titanax.plot: error: {path}" in result.stderr and said in result.stderr, \
        result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.png")) or [p.name for p in tmp_path.glob("*.png")] == \
        ["dir.png"]
