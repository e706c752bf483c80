"""The local checkpoint tier through the real launcher: a two-process job, one process killed
with SIGKILL between persistent saves, resumes from the local tier's newer step with the
uninterrupted run's losses -- also when the killed process's local directory is gone and its
peer's copy serves; the tier's refusals; one process resuming from it."""

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import forked_python
from tests.environment import child_environment
from tests.run_outputs import metric_rows

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, LOCAL_EVERY = 12, 2
# mnist_dp stays in its 30-step warm-up: the learning rate does not depend on max_steps, so a
# run stopped anywhere and resumed takes the uninterrupted run's steps.
COMMON = ["--config=mnist_dp", "--local_processes=2", "--cpu_devices=2", "--config.log_every=1",
          "--config.evalers={}", "--config.checkpoint.save_every_n_steps=100"]


def _local(local_dir):
    return [f"--config.checkpoint.local_dir={local_dir}",
            f"--config.checkpoint.local_every_n_steps={LOCAL_EVERY}"]


def _losses(trainer_dir):
    return {step: float(row["loss"]) for step, row in metric_rows(trainer_dir).items()}


def _run(*args, steps=STEPS):
    return forked_python.run(["-m", "titanax.launch", *COMMON, *args,
                              f"--config.max_steps={steps}"], cwd=REPO_ROOT,
                             env=child_environment(), timeout=600)


def _killed_after_local_step(trainer_dir, local_dir):
    """A job of many steps whose process 1 gets SIGKILL once both processes' local step 6 is
    written: the job ends; the persistent tier has nothing."""
    job = subprocess.Popen([sys.executable, "-u", "-m", "titanax.launch", *COMMON,
                            *_local(local_dir), f"--trainer_dir={trainer_dir}",
                            "--config.max_steps=30", "--config.checkpoint.save_at_end=False"],
                           cwd=REPO_ROOT, env=child_environment(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, pid = [], None
    try:
        for line in job.stdout:
            lines.append(line)
            found = re.search(r"process 1 of 2 is pid (\d+)", line)
            pid = int(found.group(1)) if found else pid
            if re.match(r"\[0\] step\s+6/", line):
                break
        deadline = time.monotonic() + 120
        while len(glob.glob(os.path.join(local_dir, "*", "process_*", "6"))) < 2:
            assert job.poll() is None and time.monotonic() < deadline, "".join(lines[-40:])
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        rest = job.communicate(timeout=120)[0]
    finally:
        job.kill()
    # (The launcher names the first process it sees die: the killed one, or its peer, whose
    # collective with it aborts.)
    assert job.returncode != 0 and "was killed by signal" in rest, rest[-3000:]
    assert not os.path.isdir(os.path.join(trainer_dir, "checkpoints")) or not [
        n for n in os.listdir(os.path.join(trainer_dir, "checkpoints")) if n.isdigit()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    trainer_dir = str(tmp_path_factory.mktemp("uninterrupted"))
    result = _run(f"--trainer_dir={trainer_dir}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return _losses(trainer_dir)


@pytest.mark.parametrize("lose_its_disk", [False, True],
                         ids=["its-own-files", "its-files-gone-the-peer-copy-serves"])
def test_a_killed_process_resumes_from_the_local_tier(reference, tmp_path, lose_its_disk):
    trainer_dir, local_dir = str(tmp_path / "run"), str(tmp_path / "local")
    _killed_after_local_step(trainer_dir, local_dir)
    if lose_its_disk:  # Process 1's host is replaced: its local disk is empty.
        (own,) = glob.glob(os.path.join(local_dir, "*", "process_1"))
        shutil.rmtree(own)
    result = _run(*_local(local_dir), f"--trainer_dir={trainer_dir}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = re.search(r"restored the run from \S+/process_0/(\d+) \(local tier\)", result.stdout)
    assert found, result.stdout[-3000:]
    restored = int(found.group(1))
    assert restored >= 6 and restored % LOCAL_EVERY == 0, restored
    got = _losses(trainer_dir)
    after = list(range(restored + 1, STEPS + 1))
    np.testing.assert_array_equal([got[s] for s in after], [reference[s] for s in after])


def test_one_process_resumes_from_the_local_tier_and_a_fresh_run_sets_it_aside(tmp_path):
    local_dir = tmp_path / "local"
    launch = ["-m", "titanax.launch", "--config=mnist_dp", "--cpu_devices=8",
              "--config.log_every=1", "--config.evalers={}",
              "--config.checkpoint.save_every_n_steps=100", *_local(local_dir),
              f"--trainer_dir={tmp_path / 'run'}"]

    def run(*extra):
        done = forked_python.run([*launch, *extra], cwd=REPO_ROOT, env=child_environment(),
                                 timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout
    run("--config.max_steps=5", "--config.checkpoint.save_at_end=False")  # Local steps 2, 4.
    resumed = run("--config.max_steps=6")
    assert re.search(r"restored the run from \S+/process_0/4 \(local tier\)", resumed), resumed
    # A fresh run in the same place: the persistent steps and the local ones are set aside
    # (kept), and it starts from step 0.
    fresh = run("--config.max_steps=2", "--config.checkpoint.resume=never",
                "--config.checkpoint.overwrite=true")
    assert "restored" not in fresh and "moved the previous run's checkpoints" in fresh, fresh
    (run_dir,) = glob.glob(str(local_dir / "*"))
    assert glob.glob(os.path.join(run_dir, "process_0.superseded-*", "4")), os.listdir(run_dir)
