"""Profiler windows and the memory watermark, through the real launcher."""

import csv
import glob
import os

from tests import forked_python
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Launches without --cpu_devices get the session's 8 devices; see tests/environment.py.
ENV = child_environment(keep_device_count=True, quick_backend=True)


def test_launcher_writes_a_profile_and_logs_compile_time_and_memory(tmp_path):
    result = forked_python.run(
        ["-m", "titanax.launch", "--config=mnist_dp", f"--trainer_dir={tmp_path}",
         "--config.max_steps=5", "--config.log_every=1", "--config.evalers={}",
         "--config.profile.start_step=2", "--config.profile.num_steps=2"],
        cwd=REPO_ROOT, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*"))
    assert len(runs) == 1, runs  # The layout TensorBoard's profile plugin reads.
    traces = [f for f in os.listdir(runs[0]) if f.endswith((".xplane.pb", ".trace.json.gz"))]
    assert any(f.endswith(".xplane.pb") for f in traces), traces
    assert all(os.path.getsize(os.path.join(runs[0], f)) > 1000 for f in traces)
    assert "profiling steps 2..3" in result.stdout
    with open(tmp_path / "metrics.csv", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    assert len(rows) == 5
    assert all(float(r["compile_time_s"]) > 0 and float(r["peak_memory_gib"]) > 0 for r in rows)
    assert "peak_memory_gib" in result.stdout and "compile_time_s" in result.stdout
