"""``--config.precision.bfloat16=True --config.precision.fp8=True`` through the real launcher on
``llama_tiny_dp_tp``: its own layout (DP4 x TP2), row-wise scales, FSDP over 8, a 1F1B
pipeline (DP4 x PP2) and LoRA adapters, each against the same run in bfloat16; ``gpt_oss_tiny``
(experts over an expert axis: their batched matrices in float8) against its bfloat16 run; a
run stopped after step 3 and resumed; ``--compile_only``'s count of the float8 dots XLA is
handed.

Float8 rounds each operand to 3 mantissa bits (e4m3) and the gradients to 2 (e5m2), so an FP8
run is not its bfloat16 run: each step's loss within 2% of it (the acceptance's bound, here at
the peak learning rate from step 2), and not equal to it (a run that ignored the flag would
be). Current scaling keeps no state between steps, so the resumed run quantizes exactly as
the uninterrupted one: its losses equal the uninterrupted run's to float32 rounding of the
printed value.
"""

import json
import os

import numpy as np

from tests.environment import child_environment
from tests.launch_cases import launch_in_one_child
from tests.run_outputs import metric_rows

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
COMMON = (f"--config.max_steps={STEPS}", "--config.log_every=1",
          "--config.evalers={}", "--config.precision.bfloat16=True",
          "--config.learner.optimizer.learning_rate.warmup_steps=1")
FP8 = "--config.precision.fp8=True"
DATA_ONLY = ("--config.plan.tensor_parallel=None", "--config.mesh.axes=('data',)",
             "--config.mesh.shape=(None,)")
# (FSDP's gathers once a step: see tests/test_muon_experiments.py's PER_STEP.)
FSDP = (*DATA_ONLY, "--config.plan.zero.stage=3", "--config.plan.zero.min_shard_size=64",
        "--config.plan.zero.grad_sync=per_step")
PIPELINE = ("--config.plan.tensor_parallel=None", "--config.mesh.axes=('data','pipe')",
            "--config.mesh.shape=(None,2)", "--config.plan.pipeline_parallel.axis=pipe",
            "--config.plan.pipeline_parallel.microbatch_size=1")
LORA = ("--config.lora.rank=8",)
LLAMA, GPT_OSS = "--config=llama_tiny_dp_tp", "--config=gpt_oss_tiny"
# name -> (experiment, flags after COMMON, the bfloat16 run it is held against)
RUNS = {
    "bf16": (LLAMA, (), None),
    "fp8": (LLAMA, (FP8,), "bf16"),
    "fp8 row-wise": (LLAMA, (FP8, "--config.precision.fp8_rowwise=True"), "bf16"),
    "fp8 fsdp8": (LLAMA, (FP8, *FSDP), "bf16"),
    "fp8 dp4 x pp2": (LLAMA, (FP8, *PIPELINE), "bf16"),
    "bf16 lora": (LLAMA, LORA, None),
    "fp8 lora": (LLAMA, (FP8, *LORA), "bf16 lora"),
    "bf16 gpt-oss": (GPT_OSS, (), None),
    "fp8 gpt-oss": (GPT_OSS, (FP8,), "bf16 gpt-oss"),
}


def _losses(trainer_dir):
    rows = metric_rows(trainer_dir)
    return np.array([float(rows[step]["loss"]) for step in range(1, STEPS + 1)])


def test_fp8_trains_like_bfloat16_on_every_layout_and_resumes_exactly(tmp_path):
    root = str(tmp_path)
    dirs = {name: os.path.join(root, str(index)) for index, name in enumerate(RUNS)}
    cases = [{"args": [experiment, *COMMON, *flags, f"--trainer_dir={dirs[name]}"],
              "cwd": REPO_ROOT}
             for name, (experiment, flags, _) in RUNS.items()]
    resumed = os.path.join(root, "resumed")
    fixed = (FP8, f"--config.learner.optimizer.learning_rate.decay_steps={STEPS}")
    cases += [{"args": [LLAMA, *COMMON, *fixed, "--config.max_steps=3",
                        f"--trainer_dir={resumed}"], "cwd": REPO_ROOT},
              {"args": [LLAMA, *COMMON, *fixed, f"--trainer_dir={resumed}"], "cwd": REPO_ROOT},
              {"args": [LLAMA, *COMMON, FP8, "--compile_only"], "cwd": REPO_ROOT}]
    results = launch_in_one_child(cases, folder=root,
                                  env=child_environment(keep_device_count=True,
                                                        quick_backend=True))
    for case, result in zip(cases, results):
        assert result["returncode"] == 0, (case["args"], result["stderr"][-3000:])

    # XLA is handed float8 dots for the 6 projections of the layer (q, k, v, o, gate_up,
    # down), forward and both backward products; the rest (attention's two products and the
    # head, forward and backward) stay bfloat16.
    report = json.loads(results[-1]["stdout"].strip().splitlines()[-1])
    assert (report["float8_dots"], report["dots"]) == (18, 27), report
    assert "float8: 18 of the step's 27 dots take float8 operands" in results[-1]["stdout"]

    losses = {name: _losses(folder) for name, folder in dirs.items()}
    assert losses["bf16"][-1] < losses["bf16"][0] - 0.05, losses["bf16"]  # It trains.
    for name, (_, _, against) in RUNS.items():
        if against is None:
            continue
        relative = np.abs(losses[name] - losses[against]) / losses[against]
        assert relative.max() <= 0.02, (name, losses[name], losses[against])
        assert relative.max() > 1e-4, (name, "equals bfloat16: float8 was not used")
    assert "restored the run" in results[-2]["stdout"]
    np.testing.assert_allclose(_losses(resumed)[3:], losses["fp8"][3:], rtol=2.0 ** -22)
