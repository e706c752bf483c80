"""moe_tiny_ep through the real launcher: per-step losses equal the same model and batch on
data=8 (the expert axis folded into data); an EP=4 checkpoint resumes at EP=2; Qwen 3 MoE and
Mixtral directories fine-tune through ``--config.init_from`` and export back."""

import csv
import os

import numpy as np
import pytest

from tests import forked_python
from tests.environment import child_environment
from tests.numerics import ADAM, CROSS_FRAMEWORK, assert_close

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_environment(keep_device_count=True)
STEPS = 20
# The same model and batch on data=8 (the fixed interface).
DATA_ONLY = ("--config.plan.expert_parallel=None", "--config.mesh.axes=('data',)",
             "--config.mesh.shape=(None,)")
LOAD = "summaries/decoder/layer/mlp/expert_load"
DROPPED = "summaries/decoder/layer/mlp/dropped_fraction"


def _run(module, *args):
    result = forked_python.run(["-m", module, *args], cwd=REPO_ROOT, env=ENV, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def _launch(run_dir, steps, *extra, checkpoint=False):
    result = _run("titanax.launch", "--config=moe_tiny_ep", f"--trainer_dir={run_dir}",
                  f"--config.max_steps={steps}", "--config.log_every=1", "--config.evalers={}",
                  *(("--config.checkpoint.save_every_n_steps=10",) if checkpoint
                    else ("--config.checkpoint=None",)), *extra)
    with open(os.path.join(run_dir, "metrics.csv"), encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    return {int(r["step"]): r for r in rows}, result.stdout


def _losses(rows, steps):
    return [float(rows[s]["loss"]) for s in steps]


@pytest.fixture(scope="module")
def data_only(tmp_path_factory):
    rows, _ = _launch(tmp_path_factory.mktemp("data_only") / "run", STEPS, *DATA_ONLY)
    return rows


def test_expert_parallel_trains_like_the_data_only_run_and_resumes_at_ep2(tmp_path, data_only):
    """data 2 x expert 4 for 10 steps: the data-only run's losses, its load and drop metrics in
    the CSV per layer and in the progress line averaged; its checkpoint resumed at data 4 x
    expert 2 (the same 8 batch shards): the losses of the run that never moved; the checkpoint
    then generates (the expert axis joins data)."""
    run_dir, half = tmp_path / "moved", STEPS // 2
    rows, stdout = _launch(run_dir, half, checkpoint=True)
    steps = range(1, half + 1)
    assert sorted(rows) == list(steps)
    assert_close(_losses(rows, steps), _losses(data_only, steps), what="losses", bound=ADAM)
    assert float(data_only[STEPS]["loss"]) < float(data_only[1]["loss"])  # It trains.
    assert all(float(rows[s][DROPPED]) == 0.0 for s in steps)  # Capacity E / top_k.
    assert {f"{LOAD}/layer_{i}/{end}" for i in range(4) for end in ("max", "min")} <= set(rows[1])
    assert 0.0 <= float(rows[half][f"{LOAD}/min"]) < 1.0 < float(rows[half][f"{LOAD}/max"]) < 8.0
    assert "expert_load/max" in stdout and "dropped_fraction 0.0000" in stdout
    moved, stdout = _launch(run_dir, STEPS, "--config.mesh.shape=(4, 2)", checkpoint=True)
    assert "restored the run" in stdout
    steps = range(half + 1, STEPS + 1)
    assert_close(_losses(moved, steps), _losses(data_only, steps), what="losses after moving",
                 bound=ADAM)
    result = _run("titanax.generate", f"--trainer_dir={run_dir}", "--prompt_ids=1,2,3",
                  "--max_new_tokens=4")
    assert "ids:" in result.stdout


def _byte_moe(kind, directory):
    """A tiny random Qwen 3 MoE or Mixtral whose vocabulary is bytes (it trains on the text)."""
    import torch
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1,
                  num_experts_per_tok=2)
    if kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=8, head_dim=16,
            norm_topk_prob=True, **common))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=48, num_local_experts=4, **common))
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_an_hf_moe_fine_tunes_under_expert_parallelism_and_exports_back(kind, tmp_path):
    source = _byte_moe(kind, str(tmp_path / kind))
    run = tmp_path / "run"
    rows, stdout = _launch(run, 10, f"--config.init_from={source}", checkpoint=True)
    assert f"params from Hugging Face {source}" in stdout
    # The experiment's dispatch, capacity and balancing weights are kept over the import's.
    assert "model.moe.dispatch" not in stdout and "model.moe.capacity_factor" not in stdout
    losses = _losses(rows, range(1, 11))
    assert losses[-1] < losses[0], losses
    target = str(tmp_path / "export")
    _run("titanax.export", f"--trainer_dir={run}", f"--to={target}")
    from titanax.train import saved_run  # pylint: disable=import-outside-toplevel
    engine = saved_run.restored_engine(str(run))
    ids = np.random.default_rng(0).integers(0, 256, (8, 24)).astype(np.int32)
    ours = np.asarray(engine.steps.model_method("logits")(engine.state.params, ids))
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert type(model).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM",
                                    "mixtral": "MixtralForCausalLM"}[kind]
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    assert_close(theirs, ours, bound=CROSS_FRAMEWORK, what=f"transformers' logits of the "
                                                           f"fine-tuned {kind}")
