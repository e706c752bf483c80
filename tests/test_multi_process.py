"""Several real processes on loopback, started by the launcher's --local_processes (or by hand):
the same numbers as one process, checkpoints that move between process layouts, an agreed
preemption, a dead peer that ends the job instead of hanging it, and the user-script entry point.

Each job runs in subprocesses with its own simulated CPU devices; the pytest process only reads
their metrics.csv and checkpoints.
"""

import functools
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from titanax.runtime import local_processes
from titanax.runtime.peer_watch import EXIT_LOST_PEER
from tests import forked_python
from tests.environment import child_environment
from tests.numerics import ADAM, assert_close
from tests.run_outputs import metric_rows, newest_params

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
# Every run here stays inside the experiments' 100-step warm-up, where the learning rate does not
# depend on max_steps: runs of different lengths take the same steps (one reference serves all).
REFERENCE_STEPS = 26
# The final held-out evaluation is not what these tests check; 1 batch instead of 50 keeps it run.
ONE_EVAL_BATCH = "--config.evalers['heldout'].num_batches=1"
# The model (pipe) axis outermost: each process holds one model (pipe) rank of every data shard,
# so both processes feed the same rows -- the layout "rows by process index" gets wrong.
MODEL_SPANS = ["--config.mesh.axes=('model','data')", "--config.mesh.shape=(2,None)"]
PIPE_SPANS = ["--config.mesh.axes=('pipe','data')", "--config.mesh.shape=(2,None)"]
# Two slices, one per process (multi-slice: runtime/slices.py): the model axis outermost in the
# mesh, but data the axis spread over them (dcn_shape), so each process holds both model ranks
# of its data shards and only the data reduction crosses between them.
DATA_OVER_SLICES = ["--config.mesh.axes=('model','data')", "--config.mesh.shape=(2,None)",
                    "--config.mesh.dcn_shape=(1,2)"]
# The context axis outermost: each process holds two context ranks of every row, so both feed
# the same rows and place different parts of each row's sequence (the ring crosses processes).
CONTEXT_SPANS = ["--config.mesh.axes=('context','data')", "--config.mesh.shape=(4,2)",
                 "--config.plan.context_parallel.strategy=ring"]
# The expert axis outermost: each process holds two expert ranks (4 of the 8 experts), so every
# dispatch and combine all-to-all crosses processes.
EXPERT_SPANS = ["--config.mesh.axes=('expert','data')", "--config.mesh.shape=(4,2)"]
# Shakespeare's bytes are all below 128: with the 256-byte vocabulary split over 2 model ranks,
# rank 1's half of the embedding and the head would never meet a token, so the rows rank 1 is fed
# could be anything and the losses would not show it. A 512-token BPE of the plays uses both
# halves: its bytes (below 256) and its merges (256 and up).
BPE_VOCAB = 512


def _env():
    return child_environment(PYTHONUNBUFFERED="1", quick_backend=True)


def _launch(*args, timeout=300, module="titanax.launch"):
    result = forked_python.run(["-m", module, *args], cwd=REPO_ROOT, env=_env(), timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def _run(name, trainer_dir, *extra, processes=1, steps=STEPS, devices_per_process=None):
    per_process = devices_per_process or 8 // processes
    devices = [f"--cpu_devices={per_process}"] if processes == 1 else [
        f"--local_processes={processes}", f"--cpu_devices={per_process}"]
    return _launch(f"--config={name}", f"--trainer_dir={trainer_dir}", *devices,
                   f"--config.max_steps={steps}", "--config.log_every=1", ONE_EVAL_BATCH, *extra)


def _losses(trainer_dir):
    return {step: float(row["loss"]) for step, row in metric_rows(trainer_dir).items()}


def _params(trainer_dir):
    return newest_params(trainer_dir)[1]


@functools.lru_cache(maxsize=None)
def _one_process(name, root, *extra):
    trainer_dir = os.path.join(root, f"{name}-1p" + "".join(extra).replace("/", "_"))
    _run(name, trainer_dir, *extra)
    return trainer_dir


@functools.lru_cache(maxsize=None)
def _two_processes(name, root, layout, *extra):
    """``(trainer_dir, stdout)`` of a 2-process run of STEPS steps on ``layout``."""
    trainer_dir = os.path.join(root, f"{name}-2p" + "".join(extra).replace("/", "_"))
    return trainer_dir, _run(name, trainer_dir, *layout, *extra, processes=2).stdout


@functools.lru_cache(maxsize=None)
def _reference_losses(name, root, *extra):
    """The per-step losses of one uninterrupted 1-process run of REFERENCE_STEPS steps."""
    trainer_dir = os.path.join(root, f"{name}-reference")
    _run(name, trainer_dir, *extra, steps=REFERENCE_STEPS)
    return _losses(trainer_dir)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("multi_process"))


@functools.lru_cache(maxsize=None)
def _both_vocab_halves(root):
    """Flags that train on a BPE of the plays whose ids fill both TP halves (BPE_VOCAB)."""
    from titanax.data import train_tokenizer  # pylint: disable=import-outside-toplevel
    out = os.path.join(root, "bpe")
    if not os.path.isdir(out):
        train_tokenizer.train(train_tokenizer.corpus_files(), vocab_size=BPE_VOCAB, out=out,
                              progress=False)
    return (f"--config.train_input.tokenizer.path={out}",
            f"--config.model.vocab_size={BPE_VOCAB}")


@pytest.mark.parametrize("name,layout,extra", [
    ("gpt_tiny_dp_tp", MODEL_SPANS, "bpe"), ("gpt_tiny_pp", PIPE_SPANS, []),
    ("llama_tiny_cp", CONTEXT_SPANS, []), ("moe_tiny_ep", EXPERT_SPANS, []),
    ("gpt_tiny_dp_tp", DATA_OVER_SLICES, "bpe")],
    ids=["dp-x-tp-model-spans-processes", "dp-x-pp-pipe-spans-processes",
         "dp-x-cp-context-spans-processes", "dp-x-ep-expert-spans-processes",
         "dp-x-tp-data-over-two-slices"])
def test_two_processes_train_like_one(root, name, layout, extra):
    """2 processes x 4 devices with the model (pipe, context, expert) axis across them: the per-step
    losses and the final params of 1 process x 8 devices (a process fed other rows, or another
    part of each row, than its peer on that axis changes both)."""
    extra = _both_vocab_halves(root) if extra == "bpe" else tuple(extra)
    single = _one_process(name, root, *extra)
    double, stdout = _two_processes(name, root, tuple(layout), *extra)
    want, got = _losses(single), _losses(double)
    assert sorted(got) == list(range(1, STEPS + 1)) and sorted(want) == sorted(got)
    assert_close([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], what="losses")
    # 6 AdamW steps in warm-up: see tests/numerics.py for why the tree's scale.
    assert_close(_params(double), _params(single), bound=ADAM, scale="tree",
                 what="params after Adam")
    # Only process 0 writes to stdout (the progress lines); both report their devices.
    assert "[0] step" in stdout and "[1] step" not in stdout
    assert stdout.count(" (forked from this launcher)\n") == 2, stdout[:2000]
    assert "[1] " in stdout and "titanax process 1/2" in stdout


def test_two_slices_cross_only_for_the_data_reduction(tmp_path):
    """Two processes as two slices, data over DCN and the model axis inside each: --explain's
    compiled step has one collective crossing slices, the data reduction of the gradients (the
    model axis's 21 all-reduces stay inside)."""
    result = _launch("--config=gpt_tiny_dp_tp", *DATA_OVER_SLICES, "--local_processes=2",
                     "--cpu_devices=4", "--explain", f"--trainer_dir={tmp_path}")
    lines = [line[4:] for line in result.stdout.splitlines() if line.startswith("[0] ")]
    assert ("mesh model=2 x data=4: 8 cpu device(s) in 2 process(es), 2 slices "
            "(over DCN: data=2)") in lines, result.stdout[-4000:]
    start = lines.index(next(line for line in lines if line.startswith("across the 2 slices")))
    assert "(1 of the step's " in lines[start], lines[start]
    assert lines[start + 1].startswith("  data: 1 x all-reduce (gradient_reduction), "), \
        lines[start:start + 3]
    assert not any(line.startswith("  ") for line in lines[start + 2:start + 3]), \
        lines[start:start + 3]  # (No second crossing line.)


def _start(*args):
    return subprocess.Popen([sys.executable, "-m", "titanax.launch", *args], cwd=REPO_ROOT,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _wait_for(process, text, lines, timeout=240):
    deadline = time.monotonic() + timeout
    for line in process.stdout:
        lines.append(line)
        if text in line:
            return
        assert time.monotonic() < deadline, "".join(lines[-50:])
    raise AssertionError(f"the job ended before printing {text!r}:\n" + "".join(lines[-50:]))


def _preempt(trainer_dir, shown, *extra):
    """A 2-process job on ``trainer_dir`` sent SIGTERM at process 1 only, once its output shows
    ``shown``: both stop after the same step, saved by process 0's request, and exit 0. Returns
    that step (the newest checkpoint)."""
    job = _start("--config=gpt_tiny_dp_tp", f"--trainer_dir={trainer_dir}", "--local_processes=2",
                 "--cpu_devices=4", "--config.max_steps=100000", "--config.log_every=1",
                 ONE_EVAL_BATCH, *MODEL_SPANS, *extra)
    lines = []
    try:
        _wait_for(job, shown, lines)
        pids = {int(line.split(" is pid ")[1].split()[0]) for line in lines
                if "process 1 of 2 is pid" in line}
        os.kill(pids.pop(), signal.SIGTERM)  # Process 1 only.
        rest, _ = job.communicate(timeout=240)
    finally:
        job.kill()
    output = "".join(lines) + rest
    assert job.returncode == 0, output[-4000:]
    saved = [line for line in output.splitlines() if "saved step" in line]
    assert len(saved) == 1 and saved[0].startswith("[0] titanax: SIGTERM"), output[-4000:]
    step = int(saved[0].split("saved step ")[1].split()[0])
    steps = sorted(int(d) for d in os.listdir(os.path.join(trainer_dir, "checkpoints"))
                   if d.isdigit())
    assert steps[-1] == step, (steps, step)
    return step


def test_a_checkpoint_moves_one_to_two_processes_and_sigterm_stops_both_at_one_saved_step(
        root):
    """The 1-process run of the first test (its 6-step checkpoint, copied) resumed in 2
    processes; SIGTERM to process 1 only, three times over that run: mid-run; in the resumed
    run after its periodic saves; in the next resumed run before its first step (jax's sync
    points are counted from the job's start, and only Titanax asks for them -- not Orbax's
    saves with the global step). Each time both processes stop after the same step, saved, and
    exit 0; resumed once more, in one process of 4 devices (a 2 x 4-device checkpoint moving to
    1 x 4: half the hosts and devices, the same global batch, each device's rows in two
    microbatches), the run has the losses of one that never moved or stopped."""
    name, vocab = "gpt_tiny_dp_tp", _both_vocab_halves(root)
    trainer_dir = os.path.join(root, "preempted")
    shutil.copytree(_one_process(name, root, *vocab), trainer_dir)
    first = _preempt(trainer_dir, f"[0] step {STEPS + 3:>6}/", *vocab)
    assert first >= STEPS + 3
    after_saves = first + 4
    second = _preempt(trainer_dir, f"[0] step {after_saves:>6}/", *vocab,
                      "--config.checkpoint.save_every_n_steps=2")
    assert second >= after_saves
    third = _preempt(trainer_dir, "[1] titanax process 1/2", *vocab)
    assert third > second
    # (Each device's rows doubled: in two microbatches, as docs/concepts.md says to keep memory.)
    fewer = _run("gpt_tiny_dp_tp", trainer_dir, *vocab,
                 "--config.plan.data_parallel.accumulate_steps=2",
                 steps=third + 2, devices_per_process=4)
    assert (f"titanax: step {third} was saved on 2 processes, mesh model=2 x data=4 (8 devices); "
            "the run continues on 1 process, mesh data=2 x model=2 (4 devices)") in fewer.stdout
    assert "each of the 2 data shards (was 4) takes 2x the rows" in fewer.stdout, fewer.stdout
    assert third + 2 <= REFERENCE_STEPS, f"stopped at step {third}: raise REFERENCE_STEPS"
    got, want = _losses(trainer_dir), _reference_losses("gpt_tiny_dp_tp", root, *vocab)
    assert_close([got[s] for s in range(1, third + 3)], [want[s] for s in range(1, third + 3)],
                 what="losses of the thrice preempted and resumed run")


def test_a_killed_process_ends_its_peer_within_seconds_naming_it(tmp_path):
    """kill -9 of one process mid-run: the other exits with EXIT_LOST_PEER and a message naming
    the lost process (no hang: the test's timeout is the backstop)."""
    port = local_processes.free_port()
    args = ["--config=gpt_tiny_dp", f"--trainer_dir={tmp_path}", "--config.max_steps=100000",
            "--config.log_every=1", "--cpu_devices=2", f"--coordinator_address=127.0.0.1:{port}",
            "--num_processes=2"]
    first = _start(*args, "--process_id=0")
    second = _start(*args, "--process_id=1")
    lines = []
    try:
        _wait_for(first, "step      3/", lines)
        os.killpg(second.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        rest, _ = first.communicate(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        first.kill()
        second.kill()
    output = "".join(lines) + rest
    assert first.returncode == EXIT_LOST_PEER, output[-4000:]
    assert elapsed < 30, elapsed
    assert "lost process 1" in output and "process 0 stops" in output, output[-4000:]


def test_the_user_script_entry_point_runs_in_every_process(tmp_path):
    result = _launch("--module=tests.runtime.user_main:main", "--config=gpt_tiny_dp",
                     "--local_processes=2", "--cpu_devices=2", "--config.max_steps=2",
                     ONE_EVAL_BATCH,
                     f"--trainer_dir={tmp_path}", module="titanax.run")
    assert (tmp_path / "checkpoints" / "2").is_dir() and (tmp_path / "metrics.csv").is_file()
    for index in (0, 1):
        assert f"[{index}] user main: process {index} of 2, step 2, loss" in result.stdout, \
            result.stdout[-4000:] + result.stderr[-4000:]
    # (Forked from titanax.run, which imported titanax.launch by name: no runpy warning.)
    assert result.stdout.count(" (forked from this launcher)\n") == 2, result.stdout[:2000]
    assert "RuntimeWarning" not in result.stdout + result.stderr, result.stdout[-4000:]


def test_an_error_every_process_meets_at_build_exits_2_in_each_without_an_abort(tmp_path):
    """A refusal at build time, after the processes have joined (GRPO's rollouts sampled
    ahead, refused with several processes): each process names the field and the job exits 2.
    Process 0 hosts jax's coordination service; leaving before its peer has shut down made the
    peer abort (signal 6) in about half of such runs (4 of 8 measured), so the job is run four
    times: without the orderly end, all four pass about once in 16 suites."""
    for attempt in range(4):
        result = forked_python.run(
            ["-m", "titanax.launch", "--config=llama_tiny_grpo",
             "--local_processes=2", "--cpu_devices=4", "--config.objective.max_staleness=1",
             f"--trainer_dir={tmp_path / str(attempt)}"], cwd=REPO_ROOT, env=_env(), timeout=300)
        output = result.stdout + result.stderr
        assert result.returncode == 2, (attempt, output[-4000:])
        for index in (0, 1):
            assert f"[{index}] titanax.launch: error: objective.max_staleness" in output, output
        assert "signal" not in output and "Aborted" not in output, output[-4000:]
