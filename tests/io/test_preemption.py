"""Surviving kills: SIGKILL at random moments (also mid-save) and a clean SIGTERM, through the
real launcher in subprocesses."""

import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np

from titanax.io.checkpointer import OrbaxCheckpoint
from tests import forked_python
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Launches without --cpu_devices get the session's 8 devices; see tests/environment.py.
ENV = child_environment(keep_device_count=True)
STEPS = 240


def _command(trainer_dir, steps=STEPS, save_every=10, log_every=10, quiet=True):
    command = [sys.executable, "-m", "titanax.launch", "--config=mnist_dp",
               f"--trainer_dir={trainer_dir}", f"--config.max_steps={steps}",
               "--config.evalers={}", f"--config.checkpoint.save_every_n_steps={save_every}",
               "--config.checkpoint.keep_last_n=2", f"--config.log_every={log_every}"]
    return command + (["--config.loggers=[]"] if quiet else [])


def _final_params(trainer_dir, step):
    checkpointer = OrbaxCheckpoint(path=os.path.join(trainer_dir, "checkpoints"))
    return checkpointer.load(step)


def _tmp_dirs(path):
    return [n for n in os.listdir(path) if "tmp" in n] if os.path.isdir(path) else []


def test_sigkill_at_random_moments_then_resume_gives_the_uninterrupted_result(tmp_path):
    reference_dir = tmp_path / "reference"
    done = forked_python.run(_command(reference_dir)[1:], cwd=REPO_ROOT, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    want = _final_params(str(reference_dir), STEPS)

    run_dir = tmp_path / "killed"
    checkpoints = run_dir / "checkpoints"
    rng = random.Random(0)
    killed_mid_save = 0
    restored_from = []
    for attempt in range(6):
        process = subprocess.Popen(_command(run_dir), cwd=REPO_ROOT, env=ENV,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if attempt % 2 == 0:
            # Kill while the k-th save of this attempt is still being written.
            target, seen = rng.randint(1, 3), set()
            while process.poll() is None:
                in_flight = set(_tmp_dirs(checkpoints))
                seen |= in_flight
                if in_flight and len(seen) >= target:
                    break
                time.sleep(0.001)
        else:
            deadline = time.monotonic() + rng.uniform(1.0, 5.0)  # Anywhere: compile, step, save.
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
        if process.poll() is None:
            killed_mid_save += bool(_tmp_dirs(checkpoints))
            process.send_signal(signal.SIGKILL)
        output = process.communicate(timeout=60)[0]
        restored_from += re.findall(r"restored the run from (\S+)", output)
    final = forked_python.run(_command(run_dir)[1:], cwd=REPO_ROOT, env=ENV, timeout=300)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    restored_from += re.findall(r"restored the run from (\S+)", final.stdout)
    assert killed_mid_save >= 1, "no kill landed during an async save"
    # Only complete step directories (named by their step) are ever restored.
    assert restored_from and all(os.path.basename(path).isdigit() for path in restored_from), \
        restored_from
    got = _final_params(str(run_dir), STEPS)
    for key in want:
        for name in want[key]:
            np.testing.assert_array_equal(got[key][name], want[key][name])


def test_sigterm_saves_the_current_step_and_exits_0(tmp_path):
    process = subprocess.Popen(_command(tmp_path, steps=100000, save_every=100000, log_every=20,
                                        quiet=False),
                               cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT,
                               text=True)
    lines = []
    for line in process.stdout:  # Ends (and the asserts below fail) if the process dies first.
        lines.append(line)
        if re.match(r"step\s+40\b", line):
            break
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    rest = process.communicate(timeout=120)[0]
    elapsed = time.monotonic() - sent
    assert process.returncode == 0, "".join(lines) + rest
    assert elapsed < 30, f"took {elapsed:.1f}s to stop"
    saved = re.search(r"SIGTERM: saved step (\d+)", rest)
    assert saved, rest
    step = int(saved.group(1))
    assert step >= 40
    checkpointer = OrbaxCheckpoint(path=str(tmp_path / "checkpoints"))
    assert checkpointer.all_steps() == [step]
    params = checkpointer.load(step)
    assert params["dense0"]["weight"].shape == (784, 256)
    assert not _tmp_dirs(tmp_path / "checkpoints")


def test_a_second_signal_exits_at_once_leaving_only_complete_checkpoints(tmp_path):
    process = subprocess.Popen(_command(tmp_path, steps=100000, save_every=20, log_every=20,
                                        quiet=False),
                               cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT,
                               text=True)
    for line in process.stdout:
        if re.match(r"step\s+60\b", line):
            break
    process.send_signal(signal.SIGTERM)
    for line in process.stdout:  # The second signal only counts once the first was handled.
        if "SIGTERM received" in line:
            break
    process.send_signal(signal.SIGTERM)
    rest = process.communicate(timeout=120)[0]
    assert process.returncode == 128 + signal.SIGTERM, rest
    assert "saved step" not in rest
    checkpointer = OrbaxCheckpoint(path=str(tmp_path / "checkpoints"))
    steps = checkpointer.all_steps()
    assert steps, "the periodic checkpoints before the signals are there"
    for step in steps:  # Every visible checkpoint is complete and readable.
        assert checkpointer.load(step)["dense0"]["weight"].shape == (784, 256)


def _assert_one_readable_checkpoint(trainer_dir):
    checkpointer = OrbaxCheckpoint(path=str(trainer_dir / "checkpoints"))
    steps = checkpointer.all_steps()
    assert len(steps) == 1 and steps[0] >= 1, steps
    assert checkpointer.load(steps[0])["dense0"]["weight"].shape == (784, 256)
    assert not _tmp_dirs(trainer_dir / "checkpoints")


def test_ctrl_c_with_the_output_piped_into_a_reader_that_exited_saves_and_exits_0(tmp_path):
    """``launch ... | tee log`` and Ctrl-C: tee dies with the run's terminal, and every line
    the run prints from then on meets a closed pipe -- the save comes first, exit 0."""
    process = subprocess.Popen(_command(tmp_path, steps=100000, save_every=100000, log_every=1,
                                        quiet=False),
                               cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
        if re.match(r"step\s+3\b", line):
            break
    process.stdout.close()  # The reader is gone: the pipe is closed.
    process.send_signal(signal.SIGINT)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr[-3000:]
    _assert_one_readable_checkpoint(tmp_path)


def test_sigterm_with_the_output_on_a_full_disk_saves_and_exits_0(tmp_path):
    """Every write to stdout fails (``/dev/full``: ENOSPC); the run trains, and SIGTERM saves."""
    with open("/dev/full", "w", encoding="utf-8") as full:
        process = subprocess.Popen(_command(tmp_path, steps=100000, save_every=100000,
                                            log_every=1, quiet=False),
                                   cwd=REPO_ROOT, env=ENV, stdout=full, stderr=subprocess.PIPE,
                                   text=True)
    metrics = tmp_path / "metrics.csv"
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline:  # Three steps logged.
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    assert process.poll() is None, process.communicate()[1][-3000:]
    process.send_signal(signal.SIGTERM)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    _assert_one_readable_checkpoint(tmp_path)
