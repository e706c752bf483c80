"""``llama_tiny_agent`` through the launcher, as a user runs it: a SIGTERM while episodes are
played and a resume give the uninterrupted run's rewards step for step, and two processes give
one process's (each plays its own records' episodes, the rounds go on while any process has
one running, the advantages over the gathered batch)."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests import forked_python
from tests.commands import sigterm_after_step
from tests.environment import child_environment
from tests.run_outputs import metric_column

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = child_environment(PYTHONUNBUFFERED="1")
ARGS = ["-m", "titanax.launch", "--config=llama_tiny_agent", "--config.max_steps=12",
        "--config.learner.optimizer.learning_rate.warmup_steps=2"]
COMMAND = [sys.executable, *ARGS]
STEPS = range(1, 13)


def _launch(trainer_dir, *extra):
    result = forked_python.run([*ARGS, f"--trainer_dir={trainer_dir}", *extra], cwd=REPO_ROOT,
                               env=ENV, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer_dir = str(tmp_path_factory.mktemp("agent") / "one")
    console = _launch(trainer_dir, "--cpu_devices=8")
    assert re.search(r"step\s+12/12  reward \S+  turns/mean \S+  tool_calls/mean", console)
    rewards = metric_column(trainer_dir, "reward")
    assert sorted(rewards) == list(STEPS) and len(set(rewards.values())) > 3, rewards
    return trainer_dir


def test_sigterm_while_playing_and_resume_give_the_uninterrupted_rewards(uninterrupted,
                                                                         tmp_path):
    trainer_dir = str(tmp_path / "interrupted")
    # (Sent after step 4's line: step 5's episodes are being played.)
    _, rest = sigterm_after_step(COMMAND + [f"--trainer_dir={trainer_dir}", "--cpu_devices=8"],
                                 step=4, env=ENV)
    saved = re.search(r"SIGTERM: saved step (\d+)", rest)
    assert saved and 4 <= int(saved.group(1)) < 12, rest
    _launch(trainer_dir, "--cpu_devices=8")
    for name in ("reward", "turns/mean", "tokens/mean"):
        want, got = metric_column(uninterrupted, name), metric_column(trainer_dir, name)
        assert [got[s] for s in STEPS] == [want[s] for s in STEPS], name


@pytest.mark.parametrize("layout", [[], ["--config.mesh.axes=('model','data')",
                                         "--config.mesh.shape=(2,None)"]],
                         ids=["data-spans-processes", "model-spans-processes"])
def test_two_processes_give_one_process_rewards(uninterrupted, tmp_path, layout):
    trainer_dir = str(tmp_path / "two")
    _launch(trainer_dir, "--local_processes=2", "--cpu_devices=4", *layout)
    for name in ("reward", "reward_std", "turns/mean", "tool_calls/mean"):
        want, got = metric_column(uninterrupted, name), metric_column(trainer_dir, name)
        assert [got[s] for s in STEPS] == [want[s] for s in STEPS], name
    want_norm, got_norm = (metric_column(d, "grad_norm") for d in (uninterrupted, trainer_dir))
    np.testing.assert_allclose([got_norm[s] for s in STEPS], [want_norm[s] for s in STEPS],
                               rtol=1e-4)


def test_an_error_on_one_process_stops_both_naming_it(tmp_path):
    """Process 1's environment raises while process 0's episodes go on: at the next round's
    agreement both stop -- process 1 naming its environment and record, process 0 naming
    process 1 -- exit 2, no hang, no traceback."""
    result = subprocess.run(
        COMMAND + [f"--trainer_dir={tmp_path / 'run'}", "--local_processes=2",
                   "--cpu_devices=4",
                   "--config.objective.environment=tests.agents.environments.FailsOnProcessOne"],
        cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300, check=False)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert re.search(r"FailsOnProcessOne.step \(record \S+prompts.jsonl:\d+, sample \d+\) "
                     r"raised RuntimeError: this process's tool is down", out), out[-3000:]
    assert "process 1 stopped: its episodes met an error" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
