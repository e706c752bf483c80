"""The pipelined experiments through the real launcher: per-step losses equal gpt_tiny_dp's
(1F1B, GPipe, the circular schedule, PP x TP), also across checkpoints moved between PP and DP."""

import csv
import os

import numpy as np
import pytest

from tests import forked_python
from tests.numerics import assert_close
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Launches without --cpu_devices get the session's 8 devices; see tests/environment.py.
ENV = child_environment(keep_device_count=True)
STEPS = 20


def _losses(tmp_path, name, *extra):
    run_dir = tmp_path / name
    result = forked_python.run(
        ["-m", "titanax.launch", f"--config={name.split('+')[0]}",
         f"--trainer_dir={run_dir}", f"--config.max_steps={STEPS}", "--config.log_every=1",
         "--config.evalers={}", "--config.checkpoint=None", *extra],
        cwd=REPO_ROOT, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return np.array([float(r["loss"]) for r in _rows(run_dir, pipelined="pp" in name)])


def _rows(run_dir, *, pipelined):
    """The run's step rows of metrics.csv; a pipelined run's each with its schedule's bubble."""
    with open(run_dir / "metrics.csv", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    if pipelined:  # The schedule's bubble is reported with the step metrics.
        assert all(0 < float(r["pipeline_bubble"]) < 0.5 for r in rows)
    return rows


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("dp"), "gpt_tiny_dp")


# (gpt_tiny_pp's own schedule, 1F1B, and the circular one train their first 5 steps in the
# resume test below, against the same reference.)
@pytest.mark.parametrize("name,extra", [
    ("gpt_tiny_pp+gpipe", ["--config.plan.pipeline_parallel.schedule=gpipe"]),
    ("gpt_tiny_pp_tp", []),
])
def test_pipelined_experiment_losses_equal_gpt_tiny_dp(tmp_path, reference, name, extra):
    losses = _losses(tmp_path, name, *extra)
    assert len(losses) == len(reference) == STEPS
    assert_close(losses, reference, what="losses")


def test_a_pipelined_run_resumes_without_the_pipeline_and_back(tmp_path, reference):
    """PP -> DP -> PP and circular -> DP through checkpoints: the losses of the run that never
    moved (``reference``: the runs here stay inside the 100-step warm-up, where max_steps does
    not change the learning rate)."""
    def launch(name, run_dir, steps, *extra):
        result = forked_python.run(
            ["-m", "titanax.launch", f"--config={name}",
             f"--trainer_dir={run_dir}", f"--config.max_steps={steps}", "--config.log_every=1",
             "--config.evalers={}", "--config.checkpoint.save_every_n_steps=5", *extra],
            cwd=REPO_ROOT, env=ENV, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        rows = _rows(run_dir, pipelined=False)
        return {int(r["step"]): float(r["loss"]) for r in rows}, result.stdout

    straight = dict(enumerate(reference, start=1))
    first, _ = launch("gpt_tiny_pp", tmp_path / "moved", 5)
    _rows(tmp_path / "moved", pipelined=True)  # (Its rows alone so far: each has its bubble.)
    moved, stdout = launch("gpt_tiny_dp", tmp_path / "moved", 10)  # PP checkpoint -> DP run.
    assert "restored the run" in stdout and "differs from the one saved with step 5" in stdout
    back, _ = launch("gpt_tiny_pp", tmp_path / "moved", 15)  # DP checkpoint -> PP run.
    # And the circular schedule's view of the layers restores from / saves to the same layout.
    circular_first, _ = launch("gpt_tiny_pp", tmp_path / "circular", 5,
                               "--config.plan.pipeline_parallel.schedule=circular",
                               "--config.plan.pipeline_parallel.virtual_stages=2")
    _rows(tmp_path / "circular", pipelined=True)
    circular, _ = launch("gpt_tiny_dp", tmp_path / "circular", 10)
    for name, losses in (("1F1B", first), ("circular", circular_first)):
        assert sorted(losses) == [1, 2, 3, 4, 5], (name, sorted(losses))
        assert_close([losses[s] for s in range(1, 6)], [straight[s] for s in range(1, 6)],
                     what=f"losses of gpt_tiny_pp's first steps, {name}")
    assert_close([back[s] for s in range(6, 16)], [straight[s] for s in range(6, 16)],
                 what="losses of the run moved PP -> DP -> PP")
    assert moved[10] == back[10]
    assert_close([circular[s] for s in range(6, 11)], [straight[s] for s in range(6, 11)],
                 what="losses of the run moved circular -> DP")
