"""Today's families through the real launcher, on every layout each trains under: each tiny
experiment (experiments/todays_models.py) on its own layout -- Gemma 3 under TP, Qwen 3.5's
hybrid stack in 1F1B pipeline stages, gpt-oss and DeepSeek-V3 with their experts over an
``expert`` axis -- and on each other layout its layers take (FSDP, TP, a pipeline, context
parallelism), against the same model and batches under data parallelism alone.

The runs are float64 (``JAX_ENABLE_X64=1``, ``--config.precision.float64=True``): a correct
layout agrees to rounding, ``FLOAT64`` at each value's scale (tests/numerics.py), and the
defects a layout can have (a missing 1/N, a shard read twice, a dropped microbatch) are off by
1e-3 or more. Compared: every step's loss and gradient norm (which AdamW's per-element
normalisation would hide in the params), the params of the final checkpoint, and DeepSeek-V3's
prediction depth's loss. A one-step warmup: the rate is 0 at step 1 and the peak from step 2,
so steps 3 and 4 check the params the steps before made.

Each family's launches run in one child process (tests/launch_cases.py: the launcher's parsing
and main, flags reset per launch).
"""

import json
import os

import jax
import numpy as np
import pytest

from tests.environment import child_environment
from tests.launch_cases import launch_in_one_child
from tests.numerics import FLOAT64, assert_close
from tests.run_outputs import metric_rows, newest_params

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_environment(keep_device_count=True, quick_backend=True, JAX_ENABLE_X64="1")
STEPS = 4
COMMON = (f"--config.max_steps={STEPS}", "--config.log_every=1",
          "--config.precision.float64=True", "--config.evalers={}",
          # (The peak rate from step 2: params move, so later losses check them.)
          "--config.learner.optimizer.learning_rate.warmup_steps=1")
# Every plan part but data parallelism off (before a layout switches its own part back on).
PARTS_OFF = ("--config.plan.tensor_parallel=None", "--config.plan.pipeline_parallel=None",
             "--config.plan.expert_parallel=None", "--config.plan.context_parallel=None")


def _mesh(axes, shape):
    """The flags of a mesh of ``axes`` (a tuple's text) and ``shape``."""
    return (f"--config.mesh.axes={axes}", f"--config.mesh.shape={shape}")


# layout -> (its flags, the mesh axes and the plan part it takes: what each run's saved
# config.json is checked for -- a flag that stopped taking effect would leave data parallelism
# alone, which trains like itself).
LAYOUTS = {
    "data only": (_mesh("('data',)", "(None,)"), ("data",), None),
    # ZeRO-3 over data: every param of 64 numbers or more sharded, gathered where used.
    "fsdp8": ((*_mesh("('data',)", "(None,)"), "--config.plan.zero.stage=3",
               "--config.plan.zero.min_shard_size=64"), ("data",), "zero"),
    "dp4 x tp2": ((*_mesh("('data','model')", "(None,2)"),
                   "--config.plan.tensor_parallel.axis=model"), ("data", "model"),
                  "tensor_parallel"),
    "dp4 x pp2": ((*_mesh("('data','pipe')", "(None,2)"),
                   "--config.plan.pipeline_parallel.axis=pipe",
                   "--config.plan.pipeline_parallel.microbatch_size=1"), ("data", "pipe"),
                  "pipeline_parallel"),
    "dp2 x cp4": ((*_mesh("('data','context')", "(None,4)"),
                   "--config.plan.context_parallel.axis=context"), ("data", "context"),
                  "context_parallel"),
    "dp2 x ep4": ((*_mesh("('data','expert')", "(None,4)"),
                   "--config.plan.expert_parallel.axis=expert"), ("data", "expert"),
                  "expert_parallel"),
}
PLAN_PARTS = ("zero", "tensor_parallel", "pipeline_parallel", "context_parallel",
              "expert_parallel")
# DeepSeek-V3 without its choosing bias's update, which a pipeline cannot carry (its dense
# first layer then runs on the first stage with the embedding): a pair of its own.
NO_CHOOSING_BIAS = ("--config.model.moe.router.balance_rate=0.0",)
# Gemma 3's tiny stack is one repetition of its 5:1 pattern and a tail layer: a pipeline has
# nothing to cut between. Two repetitions (13 layers) put the tail on the last stage.
TWO_REPETITIONS = ("--config.model.num_layers=13",)
# name -> (experiment, its own layout -- None: not run --, the other layouts it is trained on
# here, extra flags of all its runs). Not here: DeepSeek-V3 under context parallelism (its
# depths' shifted rows do not split).
FAMILIES = {
    "gemma3_tiny": ("gemma3_tiny", "dp4 x tp2", ("fsdp8", "dp2 x cp4"), ()),
    "gemma3_tiny with two repetitions": ("gemma3_tiny", None, ("dp4 x pp2",), TWO_REPETITIONS),
    "qwen3_5_tiny": ("qwen3_5_tiny", "dp4 x pp2", ("fsdp8", "dp4 x tp2", "dp2 x cp4"), ()),
    "gpt_oss_tiny": ("gpt_oss_tiny", "dp2 x ep4",
                     ("fsdp8", "dp4 x tp2", "dp4 x pp2", "dp2 x cp4"), ()),
    "deepseek_v3_tiny": ("deepseek_v3_tiny", "dp2 x ep4", ("fsdp8", "dp4 x tp2"), ()),
    "deepseek_v3_tiny without the choosing bias": ("deepseek_v3_tiny", None, ("dp4 x pp2",),
                                                   NO_CHOOSING_BIAS),
}


def _runs(family):
    """``{layout: (launcher flags, the layout it is)}``: data only, the experiment's own
    layout (no layout flags), and the others."""
    experiment, own, others, extra = FAMILIES[family]
    layouts = {"data only": "data only", **({f"{own} (its own)": own} if own else {}),
               **{name: name for name in others}}
    runs = {}
    for name, layout in layouts.items():
        flags = () if name.endswith("(its own)") else PARTS_OFF + LAYOUTS[layout][0]
        runs[name] = ((f"--config={experiment}", *COMMON, *extra, *flags), layout)
    return runs


def _launched(family, root):
    """``{layout: (per-step rows of metrics.csv, final params)}`` of the family's runs, each
    run's saved config checked to be its layout."""
    runs = _runs(family)
    dirs = {name: os.path.join(root, name.replace(" ", "_")) for name in runs}
    cases = [{"args": [*args, f"--trainer_dir={dirs[name]}"], "cwd": REPO_ROOT}
             for name, (args, _) in runs.items()]
    results = launch_in_one_child(cases, folder=root, env=ENV)
    launched = {}
    for (name, (_, layout)), result in zip(runs.items(), results):
        assert result["returncode"] == 0, (family, name, result["stderr"][-3000:])
        _check_layout(dirs[name], layout)
        launched[name] = metric_rows(dirs[name]), _final_params(dirs[name])
    return launched


def _check_layout(trainer_dir, layout):
    """The run's saved config has the layout's mesh axes and its plan part, no other."""
    with open(os.path.join(trainer_dir, "config.json"), encoding="utf-8") as f:
        saved = json.load(f)
    _, axes, part = LAYOUTS[layout]
    on = {name for name in PLAN_PARTS if saved["plan"][name] is not None}
    assert tuple(saved["mesh"]["axes"]) == axes and on == ({part} if part else set()), (
        trainer_dir, saved["mesh"]["axes"], on)


def _final_params(trainer_dir):
    """The newest checkpoint's params: the last step's, in float64 (a run that fell back to
    float32 would make FLOAT64's bound meaningless)."""
    step, params = newest_params(trainer_dir)
    assert step == STEPS, (trainer_dir, step)
    assert all(leaf.dtype == np.float64 for leaf in jax.tree_util.tree_leaves(params)), trainer_dir
    return params


def _column(rows, name):
    """The metric ``name`` at every step."""
    return [float(rows[step][name]) for step in range(1, STEPS + 1)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_layout_of_a_family_trains_like_data_parallelism_alone(family, tmp_path):
    launched = _launched(family, str(tmp_path))
    want_rows, want_params = launched.pop("data only")
    assert sorted(want_rows) == list(range(1, STEPS + 1)), sorted(want_rows)
    losses = _column(want_rows, "loss")
    assert losses[-1] < losses[0], losses  # It trains.
    for name, (rows, params) in launched.items():
        what = f"{family} on {name}"
        assert sorted(rows) == sorted(want_rows), (what, sorted(rows))
        for column in ("loss", "grad_norm") + ("mtp_loss/1",) * family.startswith("deepseek"):
            assert_close(_column(rows, column), _column(want_rows, column), bound=FLOAT64,
                         scale="leaf", what=f"{what}: {column}")
        assert_close(params, want_params, bound=FLOAT64, scale="leaf", what=f"{what}: params")
