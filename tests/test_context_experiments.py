"""llama_tiny_cp through the real launcher: per-step losses equal the same model and batch on
data=8 (the context axis folded into data), for every strategy; a checkpoint moves between the
two."""

import csv
import os

import numpy as np
import pytest

from tests import forked_python
from tests.environment import child_environment
from tests.numerics import ADAM, assert_close

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_environment(keep_device_count=True)
STEPS = 20
# The same model and batch on data=8 (the fixed interface).
DATA_ONLY = ("--config.plan.context_parallel=None", "--config.mesh.axes=('data',)",
             "--config.mesh.shape=(None,)")


def _launch(run_dir, steps, *extra, checkpoint=False):
    result = forked_python.run(
        ["-m", "titanax.launch", "--config=llama_tiny_cp",
         f"--trainer_dir={run_dir}", f"--config.max_steps={steps}", "--config.log_every=1",
         "--config.evalers={}",
         *(("--config.checkpoint.save_every_n_steps=10",) if checkpoint
           else ("--config.checkpoint=None",)), *extra],
        cwd=REPO_ROOT, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.csv"), encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    return {int(r["step"]): float(r["loss"]) for r in rows}, result.stdout


@pytest.fixture(scope="module")
def data_only(tmp_path_factory):
    losses, _ = _launch(tmp_path_factory.mktemp("data_only") / "run", STEPS, *DATA_ONLY)
    return np.array([losses[s] for s in range(1, STEPS + 1)])


# (The ring trains its first 10 steps in the checkpoint test below, against the same run.)
@pytest.mark.parametrize("strategy", ["all_gather", "ulysses"])
def test_each_strategy_trains_like_the_data_only_run(tmp_path, data_only, strategy):
    losses, _ = _launch(tmp_path / "run", STEPS,
                        f"--config.plan.context_parallel.strategy={strategy}")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert_close([losses[s] for s in range(1, STEPS + 1)], data_only, what="losses",
                 bound=ADAM)
    assert data_only[-1] < data_only[0]  # It trains.


def test_a_checkpoint_moves_between_context_parallel_and_data_only(tmp_path, data_only):
    """CP (ring) -> data only -> CP (all_gather): the losses of the run that never moved."""
    run_dir = tmp_path / "moved"
    ring, _ = _launch(run_dir, 10, "--config.plan.context_parallel.strategy=ring",
                      checkpoint=True)
    assert sorted(ring) == list(range(1, 11))
    assert_close([ring[s] for s in range(1, 11)], data_only[:10], what="the ring's losses",
                 bound=ADAM)
    moved, stdout = _launch(run_dir, 15, *DATA_ONLY, checkpoint=True)
    assert "restored the run" in stdout and "differs from the one saved with step 10" in stdout
    back, _ = _launch(run_dir, 20, checkpoint=True)
    assert_close([moved[s] for s in range(11, 16)] + [back[s] for s in range(16, 21)],
                 data_only[10:], what="losses after moving", bound=ADAM)
    # The CP run's checkpoint generates (on data x model: the context axis joins data).
    result = forked_python.run(
        ["-m", "titanax.generate", f"--trainer_dir={run_dir}",
         "--prompt_ids=1,2,3", "--max_new_tokens=4"], cwd=REPO_ROOT, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ids:" in result.stdout
