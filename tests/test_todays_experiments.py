"""Today's families through the real launcher: each tiny experiment (experiments/todays_models.py)
trains on the layout it needs -- Gemma 3 under TP, Qwen 3.5's hybrid stack in pipeline stages,
gpt-oss and DeepSeek-V3 with their experts over an ``expert`` axis -- with per-step losses and
gradient norms equal to the same model and batch under data parallelism alone (a one-step warmup:
the rate is 0 at step 1 and the peak from step 2, so steps 3 and 4 check the params the steps
before made; measured here, the largest difference 1.7e-7 of the scale, Qwen 3.5's losses --
DeepSeek-V3's equal bit for bit). The launches run in one child process
(tests/launch_cases.py: the launcher's parsing and main, flags reset per launch). Every other
layout of each family is checked against one device by the Engine
(tests/modules/models/test_layer_pattern.py)."""

import csv
import json
import os
import subprocess
import sys

import pytest

from tests.environment import child_environment
from tests.numerics import ADAM, assert_close

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_environment(keep_device_count=True, quick_backend=True)
STEPS = 4
EXPERIMENTS = ("gemma3_tiny", "qwen3_5_tiny", "gpt_oss_tiny", "deepseek_v3_tiny")
# The same model and batch on data=8 (every plan part but data parallelism off).
DATA_ONLY = ("--config.plan.tensor_parallel=None", "--config.plan.pipeline_parallel=None",
             "--config.plan.expert_parallel=None", "--config.mesh.axes=('data',)",
             "--config.mesh.shape=(None,)")


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """experiment -> {"own": per-step rows, "data only": per-step rows}."""
    root = tmp_path_factory.mktemp("todays")
    runs = [(name, layout) for name in EXPERIMENTS for layout in ("own", "data only")]
    cases = [{"args": [f"--config={name}", f"--trainer_dir={root / name / layout}",
                       f"--config.max_steps={STEPS}", "--config.log_every=1",
                       # (The peak rate from step 2: params move, so later losses check them.)
                       "--config.learner.optimizer.learning_rate.warmup_steps=1",
                       "--config.evalers={}", "--config.checkpoint=None",
                       *(DATA_ONLY if layout == "data only" else ())], "cwd": REPO_ROOT}
             for name, layout in runs]
    given = root / "cases.json"
    given.write_text(json.dumps(cases))
    got = root / "results.json"
    run = subprocess.run([sys.executable, "-m", "tests.launch_cases", str(given), str(got)],
                         cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=1200,
                         check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {}
    for (name, layout), result in zip(runs, json.loads(got.read_text())):
        assert result["returncode"] == 0, (name, layout, result["stderr"][-3000:])
        with open(root / name / layout / "metrics.csv", encoding="utf-8") as f:
            rows.setdefault(name, {})[layout] = {
                int(r["step"]): r for r in csv.DictReader(f) if r.get("loss")}
    return rows


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_family_on_its_layout_trains_like_data_parallelism_alone(name, launches):
    own, data_only = launches[name]["own"], launches[name]["data only"]
    steps = range(1, STEPS + 1)
    assert sorted(own) == sorted(data_only) == list(steps)
    losses = {layout: [float(rows[s]["loss"]) for s in steps]
              for layout, rows in (("own", own), ("data only", data_only))}
    assert_close(losses["own"], losses["data only"], bound=ADAM, what=f"{name} losses")
    # The gradients each step, whose scale Adam's update would hide.
    assert_close([float(own[s]["grad_norm"]) for s in steps],
                 [float(data_only[s]["grad_norm"]) for s in steps], bound=ADAM,
                 what=f"{name} gradient norms")
    assert losses["own"][-1] < losses["own"][0], losses  # It trains.
    if name == "deepseek_v3_tiny":  # Its prediction depth's loss is on the console and here.
        assert_close([float(own[s]["mtp_loss/1"]) for s in steps],
                     [float(data_only[s]["mtp_loss/1"]) for s in steps], bound=ADAM,
                     what="mtp_loss/1")
