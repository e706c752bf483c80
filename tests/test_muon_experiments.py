"""``llama_tiny_muon`` through the real launcher on every layout of a dense model -- its own
(DP4 x TP2), DP8, ZeRO-1 and ZeRO-2 over 8, FSDP over 8, DP4 x TP2 with FSDP over data (two
axes split one matrix), 1F1B and circular pipelines (DP4 x PP2), HSDP (FSDP over 4 within 2
replicas) -- against the same model and batches on one device: Muon needs whole matrices, so
each matrix's blocks are sent to the one device that iterates it and the result's blocks back
(train/muon.py, train/muon_owners.py). A layout that orthogonalised its blocks alone, placed a
block in the wrong place of its matrix or handed a device another's result would be off by far
more than rounding. Also: the circular pipeline stopped after step 2 and resumed from its
checkpoint, and the own layout's ``--explain`` (the update's collectives outside every loop,
the matrices spread over all 8 devices, a device's Newton-Schulz FLOPs near its share).

Float64 (``JAX_ENABLE_X64=1``, ``--config.precision.float64=True``), so a correct layout agrees
to rounding, ``FLOAT64`` at each value's scale (tests/numerics.py). Compared: every step's loss
and gradient norm, and the final params. A one-step warmup: the rates are 0 at step 1 and at
their peaks from step 2, so the later losses check the params Muon moved.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.environment import child_environment
from tests.launch_cases import launch_in_one_child
from tests.numerics import FLOAT64, assert_close
from tests.run_outputs import metric_rows, newest_params

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_environment(keep_device_count=True, quick_backend=True, JAX_ENABLE_X64="1")
STEPS = 4
COMMON = ("--config=llama_tiny_muon", f"--config.max_steps={STEPS}", "--config.log_every=1",
          "--config.precision.float64=True", "--config.evalers={}",
          "--config.learner.optimizer.learning_rate.warmup_steps=1",
          "--config.learner.optimizer.adam_learning_rate.warmup_steps=1")
DATA_ONLY = ("--config.plan.tensor_parallel=None", "--config.mesh.axes=('data',)")
# The reference: one device, in a process of its own (a launch's mesh takes every device).
ONE_DEVICE = ("--cpu_devices=1", *DATA_ONLY, "--config.mesh.shape=(None,)")
# FSDP gathers the params once a step here, not per layer inside the layer loop: XLA:CPU keys
# every collective's rendezvous by one channel id (jax lowers all with channel 1), and a device
# that runs ahead into the next iteration's tiny gather can join the previous one's rendezvous
# (measured on this model in float64: "Check failed: id < num_threads", 1 to 2 of 4 runs abort;
# 0 of 6 with the gathers outside the loop). Muon's gathers are the update's either way.
PER_STEP = "--config.plan.zero.grad_sync=per_step"
PIPELINE = ("--config.plan.tensor_parallel=None", "--config.mesh.axes=('data','pipe')",
            "--config.mesh.shape=(None,2)", "--config.plan.pipeline_parallel.axis=pipe",
            "--config.plan.pipeline_parallel.microbatch_size=1")
# (The circular schedule views the stacked layers as [virtual stages, stages, layers]: the
# matrices' fan dimensions move two places.)
CIRCULAR = (*PIPELINE, "--config.plan.pipeline_parallel.schedule=circular",
            "--config.plan.pipeline_parallel.virtual_stages=2")
# layout -> its flags (after COMMON).
LAYOUTS = {
    "dp4 x tp2 (its own)": (),
    "dp8": (*DATA_ONLY, "--config.mesh.shape=(None,)"),
    "zero1 over 8": (*DATA_ONLY, "--config.mesh.shape=(None,)", "--config.plan.zero.stage=1",
                     "--config.plan.zero.min_shard_size=64"),
    "zero2 over 8": (*DATA_ONLY, "--config.mesh.shape=(None,)", "--config.plan.zero.stage=2",
                     "--config.plan.zero.min_shard_size=64"),
    "fsdp8": (*DATA_ONLY, "--config.mesh.shape=(None,)", "--config.plan.zero.stage=3",
              "--config.plan.zero.min_shard_size=64", PER_STEP),
    "dp4 x pp2 (1F1B)": PIPELINE,
    "dp4 x pp2 circular, 2 virtual stages": CIRCULAR,
    # Two axes split one matrix (TP's heads over model, FSDP's other fan dimension over data):
    # its blocks come from all 8 devices.
    "dp4 x tp2 with fsdp over data": ("--config.plan.zero.stage=3",
                                      "--config.plan.zero.min_shard_size=64", PER_STEP),
    "hsdp 2 x 4": ("--config.plan.tensor_parallel=None", "--config.mesh.axes=('data','fsdp')",
                   "--config.mesh.shape=(2,4)", "--config.plan.zero.stage=3",
                   "--config.plan.zero.axis=fsdp", "--config.plan.zero.min_shard_size=64",
                   PER_STEP),
}


def _launched(root):
    """``{layout: (per-step rows of metrics.csv, final params)}``: the layouts in one child on 8
    devices, one device in another."""
    dirs = {name: os.path.join(root, str(index)) for index, name in enumerate(LAYOUTS)}
    cases = [{"args": [*COMMON, *flags, f"--trainer_dir={dirs[name]}"], "cwd": REPO_ROOT}
             for name, flags in LAYOUTS.items()]
    # The circular layout stopped after step 2 and resumed (Muon's state from the checkpoint,
    # through the schedule's view of the layers; the schedules' length fixed at 4, as the
    # uninterrupted runs').
    resumed = os.path.join(root, "resumed")
    fixed = ("--config.learner.optimizer.learning_rate.decay_steps=4",
             "--config.learner.optimizer.adam_learning_rate.decay_steps=4")
    cases += [{"args": [*COMMON, *CIRCULAR, *fixed, "--config.max_steps=2",
                        f"--trainer_dir={resumed}"], "cwd": REPO_ROOT},
              {"args": [*COMMON, *CIRCULAR, *fixed, f"--trainer_dir={resumed}"],
               "cwd": REPO_ROOT}]
    # (Last: the own layout's --explain, its compiled step's collectives and Muon's lines.)
    cases.append({"args": [*COMMON, "--explain"], "cwd": REPO_ROOT})
    one = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-m", "titanax.launch", *COMMON, *ONE_DEVICE,
         f"--trainer_dir={os.path.join(root, 'one')}"], cwd=REPO_ROOT,
        env=child_environment(quick_backend=True, JAX_ENABLE_X64="1"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        results = launch_in_one_child(cases, folder=root, env=ENV)
    finally:
        output, _ = one.communicate(timeout=600)
    assert one.returncode == 0, output[-3000:]
    launched = {"one device": _outputs(os.path.join(root, "one"), "one device")}
    assert all(result["returncode"] == 0 for result in results[-3:]), \
        [result["stderr"][-3000:] for result in results[-3:]]
    launched["--explain"] = results.pop()["stdout"]
    assert "restored the run" in results.pop()["stdout"]
    results.pop()
    launched["resumed after step 2"] = _outputs(resumed, "resumed")
    for name, result in zip(LAYOUTS, results):
        assert result["returncode"] == 0, (name, result["stderr"][-3000:])
        launched[name] = _outputs(dirs[name], name)
    return launched


def _outputs(trainer_dir, name):
    """A run's per-step metrics and final params (float64: a run that fell back to float32
    would make FLOAT64's bound meaningless)."""
    step, params = newest_params(trainer_dir)
    assert step == STEPS and all(np.asarray(leaf).dtype == np.float64
                                 for leaf in _leaves(params)), (name, step)
    return metric_rows(trainer_dir), params


def _check_explained(text):
    """DP4 x TP2's compiled step: the update's collectives all outside loops (none inside the
    Newton-Schulz iterations): the blocks to their owners and back by all-to-alls over
    ``model`` (the axis that splits them), the replicas' results by an all-gather over
    ``data``; a device's Newton-Schulz FLOPs within its 1/8 share + 10% (8x without the
    spread; 1.24x with each shape spread on its own: 12 matrices of the MLP's shape padded to
    16), every owner position 0..7 used."""
    update = [line.split() for line in text.splitlines() if "optimizer_update" in line]
    assert update and all(fields[3] == "no" for fields in update), text[-4000:]
    kinds = {(fields[0], fields[1]) for fields in update}
    assert {("all-to-all", "model"), ("all-gather", "data")} <= kinds, \
        [" ".join(fields) for fields in update]
    share = re.search(r"Newton-Schulz per device and step: \S+ GFLOP, ([0-9.]+)x its 1/8 share",
                      text)
    assert share is not None and float(share.group(1)) <= 1.10, text[-2000:]
    rows = [line for line in text.splitlines() if line.startswith("  decoder/")]
    assert rows and all("dataxmodel" in line for line in rows), rows
    owners = {int(p) for line in rows for p in line.split("dataxmodel")[-1].split()}
    assert owners == set(range(8)), text[-2000:]


def _leaves(tree):
    import jax  # pylint: disable=import-outside-toplevel
    return jax.tree_util.tree_leaves(tree)


def _column(rows, name):
    return [float(rows[step][name]) for step in range(1, STEPS + 1)]


def test_every_layout_trains_by_muon_like_one_device(tmp_path):
    launched = _launched(str(tmp_path))
    _check_explained(launched.pop("--explain"))
    want_rows, want_params = launched.pop("one device")
    losses = _column(want_rows, "loss")
    assert losses[-1] < losses[0] - 0.1, losses  # It trains.
    for name, (rows, params) in launched.items():
        for column in ("loss", "grad_norm"):
            assert_close(_column(rows, column), _column(want_rows, column), bound=FLOAT64,
                         scale="leaf", what=f"{name}: {column}")
        assert_close(params, want_params, bound=FLOAT64, scale="leaf", what=f"{name}: params")


def test_experts_over_an_expert_axis_train_by_muon_like_data_parallelism_alone(tmp_path):
    """gpt-oss's experts (``[layers, experts, D, 2, F]``) over an ``expert`` axis of 4: each
    device orthogonalises the experts it holds (the expert axis splits a batch dimension, so
    nothing is gathered over it and the matrices are spread over ``data`` alone), against the
    same run on data parallelism alone."""
    flags = ("--config=gpt_oss_tiny_muon", "--config_module=tests.train.muon_experiments",
             *COMMON[1:])
    runs = {"dp2 x ep4 (its own)": (), "dp8": ("--config.plan.expert_parallel=None", *DATA_ONLY,
                                              "--config.mesh.shape=(None,)")}
    dirs = {name: str(tmp_path / str(index)) for index, name in enumerate(runs)}
    cases = [{"args": [*flags, *extra, f"--trainer_dir={dirs[name]}"], "cwd": REPO_ROOT}
             for name, extra in runs.items()]
    results = launch_in_one_child(cases, folder=str(tmp_path), env=ENV)
    assert all(result["returncode"] == 0 for result in results), \
        [result["stderr"][-3000:] for result in results]
    (rows, params), (want_rows, want_params) = (_outputs(dirs[name], name) for name in runs)
    for column in ("loss", "grad_norm"):
        assert_close(_column(rows, column), _column(want_rows, column), bound=FLOAT64,
                     scale="leaf", what=f"experts over expert: {column}")
    assert_close(params, want_params, bound=FLOAT64, scale="leaf",
                 what="experts over expert: params")

