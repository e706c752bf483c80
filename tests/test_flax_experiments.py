"""flax_nnx_gpt_dp and flax_linen_cnn_fsdp through the real launcher: each trains, and a run
stopped at its checkpoint resumes with the per-step losses of the run that never stopped (the
NNX GPT resumes under FSDP: its checkpoint's params restore onto any state layout)."""

import csv
import os

import pytest

from tests import forked_python
from tests.environment import child_environment
from tests.numerics import ADAM, FLOAT32, assert_close

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_environment(keep_device_count=True, quick_backend=True)
STEPS, STOP = 8, 4


def _launch(config, run_dir, steps, *extra):
    result = forked_python.run(
        ["-m", "titanax.launch", f"--config={config}", "--cpu_devices=8",
         f"--trainer_dir={run_dir}", f"--config.max_steps={steps}", "--config.log_every=1",
         "--config.evalers={}", f"--config.checkpoint.save_every_n_steps={STOP}", *extra],
        cwd=REPO_ROOT, env=ENV, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.csv"), encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    return {int(r["step"]): float(r["loss"]) for r in rows}, result.stdout


@pytest.mark.parametrize("config,resume_flags,bound", [
    ("flax_nnx_gpt_dp", ("--config.plan.zero.stage=3",), ADAM),
    ("flax_linen_cnn_fsdp", (), FLOAT32),
])
def test_trains_and_resumes_with_the_uninterrupted_losses(tmp_path, config, resume_flags,
                                                          bound):
    whole, _ = _launch(config, tmp_path / "whole", STEPS)
    assert sorted(whole) == list(range(1, STEPS + 1))
    assert whole[STEPS] < whole[1]  # It trains.
    stopped, _ = _launch(config, tmp_path / "stopped", STOP)
    resumed, stdout = _launch(config, tmp_path / "stopped", STEPS, *resume_flags)
    assert "restored the run" in stdout
    assert_close([stopped[s] for s in range(1, STOP + 1)], [whole[s] for s in range(1, STOP + 1)],
                 what="losses before the stop", bound=FLOAT32)
    assert_close([resumed[s] for s in range(STOP + 1, STEPS + 1)],
                 [whole[s] for s in range(STOP + 1, STEPS + 1)], what="losses after resuming",
                 bound=bound)
