"""The pipelined experiments through the real launcher: per-step losses equal gpt_tiny_dp's."""

import csv
import os
import subprocess
import sys

import numpy as np
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 20


def _losses(tmp_path, name, *extra):
    run_dir = tmp_path / name
    result = subprocess.run(
        [sys.executable, "-m", "titanax.launch", f"--config={name.split('+')[0]}",
         f"--trainer_dir={run_dir}", f"--config.max_steps={STEPS}", "--config.log_every=1",
         "--config.evalers={}", "--config.checkpoint=None", *extra],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(run_dir / "metrics.csv", encoding="utf-8") as f:
        return np.array([float(r["loss"]) for r in csv.DictReader(f) if r.get("loss")])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("dp"), "gpt_tiny_dp")


@pytest.mark.parametrize("name,extra", [
    ("gpt_tiny_pp", []),
    ("gpt_tiny_pp+gpipe", ["--config.plan.pipeline_parallel.schedule=gpipe"]),
    ("gpt_tiny_pp_tp", []),
])
def test_pipelined_experiment_losses_equal_gpt_tiny_dp(tmp_path, reference, name, extra):
    losses = _losses(tmp_path, name, *extra)
    assert len(losses) == len(reference) == STEPS
    np.testing.assert_allclose(losses, reference, atol=1e-4)
