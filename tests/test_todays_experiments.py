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

import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.environment import child_environment
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
    return (f"--config.mesh.axes={axes}", f"--config.mesh.shape={shape}")


LAYOUTS = {
    "data only": _mesh("('data',)", "(None,)"),
    # ZeRO-3 over data: every param of 64 numbers or more sharded, gathered where used.
    "fsdp8": (*_mesh("('data',)", "(None,)"), "--config.plan.zero.stage=3",
              "--config.plan.zero.min_shard_size=64"),
    "dp4 x tp2": (*_mesh("('data','model')", "(None,2)"),
                  "--config.plan.tensor_parallel.axis=model"),
    "dp4 x pp2": (*_mesh("('data','pipe')", "(None,2)"),
                  "--config.plan.pipeline_parallel.axis=pipe",
                  "--config.plan.pipeline_parallel.microbatch_size=1"),
    "dp2 x cp4": (*_mesh("('data','context')", "(None,4)"),
                  "--config.plan.context_parallel.axis=context"),
    "dp2 x ep4": (*_mesh("('data','expert')", "(None,4)"),
                  "--config.plan.expert_parallel.axis=expert"),
}
# DeepSeek-V3 without its choosing bias's update, which a pipeline cannot carry (its dense
# first layer then runs on the first stage with the embedding): a pair of its own.
NO_CHOOSING_BIAS = ("--config.model.moe.router.balance_rate=0.0",)
# family -> (its experiment's own layout -- None: not run --, the others it is trained on here,
# extra flags of all its runs). Not here: Gemma 3 in pipeline stages (its tiny stack is one repetition of its
# 5:1 pattern and a tail: nothing to cut between), DeepSeek-V3 under context parallelism (its
# depths' shifted rows do not split).
FAMILIES = {
    "gemma3_tiny": ("dp4 x tp2", ("fsdp8", "dp2 x cp4"), ()),
    "qwen3_5_tiny": ("dp4 x pp2", ("fsdp8", "dp4 x tp2", "dp2 x cp4"), ()),
    "gpt_oss_tiny": ("dp2 x ep4", ("fsdp8", "dp4 x tp2", "dp4 x pp2", "dp2 x cp4"), ()),
    "deepseek_v3_tiny": ("dp2 x ep4", ("fsdp8", "dp4 x tp2"), ()),
    "deepseek_v3_tiny without the choosing bias": (None, ("dp4 x pp2",), NO_CHOOSING_BIAS),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("todays"))


def _runs(family):
    """``{layout: launcher flags}``: data only, the experiment's own layout (no flags), and the
    others."""
    own, others, extra = FAMILIES[family]
    experiment = family.split()[0]
    layouts = {"data only": LAYOUTS["data only"], **({f"{own} (its own)": ()} if own else {}),
               **{name: LAYOUTS[name] for name in others}}
    return {name: (f"--config={experiment}", *COMMON, *extra,
                   *(PARTS_OFF + flags if flags else ())) for name, flags in layouts.items()}


@functools.lru_cache(maxsize=None)
def _launched(family, root):
    """``{layout: (per-step rows of metrics.csv, final params)}`` of the family's runs."""
    runs = _runs(family)
    folder = os.path.join(root, family.replace(" ", "_"))
    dirs = {name: os.path.join(folder, name.replace(" ", "_")) for name in runs}
    cases = [{"args": [*args, f"--trainer_dir={dirs[name]}"], "cwd": REPO_ROOT}
             for name, args in runs.items()]
    os.makedirs(folder, exist_ok=True)
    given, got = os.path.join(folder, "cases.json"), os.path.join(folder, "results.json")
    with open(given, "w", encoding="utf-8") as f:
        json.dump(cases, f)
    run = subprocess.run([sys.executable, "-m", "tests.launch_cases", given, got], cwd=REPO_ROOT,
                         env=ENV, capture_output=True, text=True, timeout=1800, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(got, encoding="utf-8") as f:
        results = json.load(f)
    launched = {}
    for name, result in zip(runs, results):
        assert result["returncode"] == 0, (family, name, result["stderr"][-3000:])
        launched[name] = metric_rows(dirs[name]), _final_params(dirs[name])
    return launched


def _final_params(trainer_dir):
    step, params = newest_params(trainer_dir)
    assert step == STEPS, (trainer_dir, step)
    assert all(leaf.dtype == np.float64 for leaf in jax.tree_util.tree_leaves(params)), trainer_dir
    return params


def _column(rows, name):
    return [float(rows[step][name]) for step in range(1, STEPS + 1)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_layout_of_a_family_trains_like_data_parallelism_alone(family, root):
    launched = _launched(family, root)
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
