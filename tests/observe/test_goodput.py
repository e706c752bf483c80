"""Goodput: the buckets of a run (compile, checkpoints, evaluation, a kill -9 and its restart)
sum to the wall time the launches took, measured from outside; the clock's own rules."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from titanax.observe import goodput

from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (Long enough that the processes' exit, ~40 ms each after their last record, and the kill's
# latency stay well inside the 1%.)
STEPS, SAVE_EVERY, KILL_AFTER = 300, 100, 120


def _command(trainer_dir):
    return [sys.executable, "-m", "titanax.launch", "--config=mnist_dp", "--cpu_devices=8",
            f"--trainer_dir={trainer_dir}", f"--config.max_steps={STEPS}",
            "--config.log_every=1", f"--config.checkpoint.save_every_n_steps={SAVE_EVERY}",
            "--config.evalers['test'].every_n_steps=100",
            "--config.evalers['test'].input.source.held_out_per_class=20"]


def _logged_steps(trainer_dir):
    path = os.path.join(trainer_dir, "metrics.csv")
    if not os.path.exists(path):
        return set()
    with open(path, encoding="utf-8") as f:
        return {int(row["step"]) for row in csv.DictReader(f) if row.get("loss")}


def test_the_buckets_of_a_killed_and_restarted_run_sum_to_its_wall_time(tmp_path):
    trainer_dir = str(tmp_path / "run")
    env = child_environment()
    walls = []
    # Launch 1: killed (SIGKILL) once step 120 is logged and step 100's checkpoint committed.
    started = time.monotonic()
    first = subprocess.Popen(_command(trainer_dir), cwd=REPO_ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    committed = os.path.join(trainer_dir, "checkpoints", str(SAVE_EVERY))
    while first.poll() is None and not (KILL_AFTER in _logged_steps(trainer_dir)
                                        and os.path.isdir(committed)):
        time.sleep(0.005)
    assert first.poll() is None, first.stderr.read()[-3000:]
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    walls.append(time.monotonic() - started)
    with open(os.path.join(trainer_dir, goodput.RECORD), encoding="utf-8") as f:
        killed = json.load(f)
    assert killed["furthest_step"] >= KILL_AFTER and killed["launches"] == 1, killed
    # Launch 2: resumes from the newest checkpoint, trains again what launch 1 trained after it
    # (redone) and goes on to the end.
    started = time.monotonic()
    second = subprocess.run(_command(trainer_dir), cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=600, check=False)
    walls.append(time.monotonic() - started)
    assert second.returncode == 0, second.stderr[-3000:]
    restored = int(re.search(r"restored the run from \S+/(\d+)\n", second.stdout).group(1))
    assert restored < killed["furthest_step"], (restored, killed)

    with open(os.path.join(trainer_dir, goodput.RECORD), encoding="utf-8") as f:
        record = json.load(f)
    seconds = record["seconds"]
    assert record["launches"] == 2 and record["furthest_step"] == STEPS, record
    for bucket in ("productive", "startup", "compile", "checkpoint", "evaluation", "redone"):
        assert seconds[bucket] > 0, (bucket, record)
    # Within 1% of the wall time measured from outside (what SIGKILL took after launch 1's
    # last record, and the processes' start and exit, are the difference).
    assert sum(seconds.values()) == pytest.approx(sum(walls), rel=0.01), (walls, record)
    assert record["goodput"] == pytest.approx(seconds["productive"] / sum(seconds.values()),
                                              abs=1e-5)
    # metrics.csv: goodput at every logged step, a fraction, the last row the record's.
    with open(os.path.join(trainer_dir, "metrics.csv"), encoding="utf-8") as f:
        rows = [row for row in csv.DictReader(f) if row.get("loss")]
    values = [float(row["goodput"]) for row in rows]
    assert len(values) == STEPS and all(0 < v < 1 for v in values), values
    assert abs(values[-1] - record["goodput"]) < 0.02, (values[-1], record)
    assert "goodput " in second.stdout and "over 2 launches" in second.stdout, second.stdout


def test_the_clock_sums_to_its_wall_time_and_nests():
    clock = goodput.GoodputClock(started=time.monotonic())
    clock.enter("productive")
    with clock.spent_on("checkpoint"):
        with clock.spent_on("compile"):
            time.sleep(0.02)
        assert clock.bucket == "checkpoint"
        time.sleep(0.01)
    assert clock.bucket == "productive"
    seconds = clock.seconds()
    assert seconds["compile"] >= 0.02 and seconds["checkpoint"] >= 0.01
    assert clock.step_bucket(0) == "productive"
    clock.furthest_step = 3
    assert [clock.step_bucket(i) for i in (2, 3)] == ["redone", "productive"]
    with pytest.raises(ValueError):
        clock.enter("lunch")


def test_a_new_run_moves_an_old_record_aside_and_an_unreadable_one_is_kept(tmp_path):
    path = tmp_path / goodput.RECORD
    path.write_text(json.dumps({"launches": 3, "furthest_step": 9, "seconds": {"startup": 5}}))
    resumed = goodput.GoodputClock()
    resumed.begin_run(trainer_dir=str(tmp_path), resumed=True)
    assert resumed.launches == 4 and resumed.furthest_step == 9
    assert resumed.seconds()["startup"] >= 5
    fresh = goodput.GoodputClock()
    fresh.begin_run(trainer_dir=str(tmp_path), resumed=False)
    assert fresh.launches == 1 and not path.exists() and len(os.listdir(tmp_path)) == 1
    path.write_text("{not json")
    damaged = goodput.GoodputClock()
    damaged.begin_run(trainer_dir=str(tmp_path), resumed=True)
    assert damaged.launches == 1 and len(os.listdir(tmp_path)) == 2


def test_a_forked_process_starts_its_own_clock(tmp_path):
    """A process forked from one whose clock has run an hour (and keeps a run's record) starts
    its own: in startup, from its own start, with no record -- as a process started afresh."""
    kept = dict(vars(goodput.CLOCK))
    try:
        an_hour_ago = time.monotonic() - 3600.0
        goodput.CLOCK.__init__(started=an_hour_ago)  # pylint: disable=unnecessary-dunder-call
        goodput.CLOCK.begin_run(trainer_dir=str(tmp_path), resumed=False)
        goodput.CLOCK.enter("evaluation")
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:  # (The child reports its clock and leaves without running anything else.)
            clock = goodput.CLOCK
            os.write(writer, json.dumps({
                "seconds": clock.seconds(), "bucket": clock.bucket, "launches": clock.launches,
                "record": clock._record_path}).encode())  # pylint: disable=protected-access
            os._exit(0)  # pylint: disable=protected-access
        os.close(writer)
        with os.fdopen(reader) as f:
            child = json.loads(f.read())
        os.waitpid(pid, 0)
    finally:
        vars(goodput.CLOCK).update(kept)
    assert sum(child["seconds"].values()) < 60.0 and child["bucket"] == "startup", child
    assert child["launches"] == 1 and child["record"] is None, child
