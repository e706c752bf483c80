"""The examples run as shipped (small settings)."""

import os
import re

from tests import forked_python
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The examples as the session would run them (8 devices, the quick backend), with the children's
# code generation (tests/environment.py).
ENV = child_environment(keep_device_count=True, quick_backend=True)


def test_minimal_dp_script_trains_checkpoints_and_resumes(tmp_path):
    env = dict(ENV, MINIMAL_DP_EPOCHS="1")
    script = os.path.join(REPO_ROOT, "examples", "minimal_dp.py")
    first = forked_python.run([script], cwd=tmp_path, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "the training data ran out after step 31" in first.stdout
    assert os.listdir(tmp_path / "ckpts" / "run1") == ["31"]
    second = forked_python.run([script], cwd=tmp_path, env=env, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "restored the run from" in second.stdout and "after step 62" in second.stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", first.stdout + second.stdout)]
    assert losses[-1] < losses[0]


def test_reshard_example_moves_from_tp2_to_tp4(tmp_path):
    result = forked_python.run([os.path.join(REPO_ROOT, "examples", "reshard.py"),
                                "--steps", "4", "--dir", str(tmp_path / "ckpt")], cwd=REPO_ROOT,
                               env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TP=2: mesh {'data': 4, 'model': 2}" in result.stdout
    assert "local shard (4, 128, 256)" in result.stdout
    assert "TP=4: mesh {'data': 2, 'model': 4}" in result.stdout
    assert "local shard (4, 128, 128); restored from" in result.stdout
    assert "now at step 8" in result.stdout
    assert (tmp_path / "ckpt" / "checkpoints" / "8").is_dir()
    assert (tmp_path / "ckpt" / "metrics.csv").is_file()
    assert not os.path.exists(os.path.join(REPO_ROOT, "metrics.csv"))  # Nothing in the cwd.


def test_pipeline_example_trains_both_schedules_identically(tmp_path):
    result = forked_python.run([os.path.join(REPO_ROOT, "examples", "pipeline.py"),
                                "--steps", "3"], cwd=tmp_path, env=ENV,
                               timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {line.split()[0]: line.split("losses:")[1].split()
             for line in result.stdout.splitlines() if "losses:" in line}
    assert lines["1f1b"] == lines["gpipe"] and len(lines["1f1b"]) == 3
    assert "pipeline: schedule 1f1b, 2 stages on axis 'pipe', 2 of 4 layers per stage" \
        in result.stdout
    assert not os.listdir(tmp_path)  # Nothing written where it ran.


def test_pipeline_cnn_example_matches_the_unpipelined_cnn(tmp_path):
    result = forked_python.run([os.path.join(REPO_ROOT, "examples",
                                                             "pipeline_cnn.py"), "--steps", "4"],
                               cwd=tmp_path, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    curves = {line.split(" losses:")[0].strip(): line.split("losses:")[1].split("...")[0].split()
              for line in result.stdout.splitlines() if "losses:" in line}
    assert curves["2 stages"] == curves["1 stage"] and len(curves["1 stage"]) == 4
    assert "2 explicit stages on axis 'pipe'" in result.stdout
    assert "stage 0 'conv': 4 params" in result.stdout
