"""Fine-tuning from a Hugging Face directory through the launcher, exporting, generating."""

import os
import pathlib
import shutil

import numpy as np
import pytest

from tests.commands import run_module
from tests.numerics import CROSS_FRAMEWORK, assert_close
from titanax.train import saved_run

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_run = run_module


@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory):
    """A tiny random Llama whose vocabulary is bytes, so it trains on the bundled text."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    directory = str(tmp_path_factory.mktemp("hf") / "llama_bytes")
    LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def fine_tuned(byte_llama, tmp_path_factory):
    run = str(tmp_path_factory.mktemp("runs") / "ft")
    result = _run("titanax.launch", "--config=llama_tiny_dp_tp", f"--config.init_from={byte_llama}",
                  f"--trainer_dir={run}", "--cpu_devices=8", "--config.max_steps=20",
                  "--config.log_every=1", "--config.evalers={}")
    return run, result.stdout


def test_the_run_starts_from_the_checkpoint_and_says_so(fine_tuned, byte_llama):
    run, stdout = fine_tuned
    assert f"model from {byte_llama}/config.json" in stdout
    assert "model.num_layers: 4 -> 2" in stdout
    assert f"params from Hugging Face {byte_llama} (step 0, fresh optimizer)" in stdout
    record = open(os.path.join(run, "config.txt")).read()
    assert f"init_from: '{byte_llama}'" in record and "model.model_dim: 64" in record
    losses = [float(line.split("loss ")[1].split()[0]) for line in stdout.splitlines()
              if line.startswith("step ") and " loss " in line]
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.5, losses


def _exported_in_transformers(run, target, *, architecture=None):
    """``titanax.export`` of ``run`` to ``target``; transformers' own class (``architecture``,
    when named) loads it with the run's logits."""
    import torch
    from transformers import AutoModelForCausalLM
    _run("titanax.export", f"--trainer_dir={run}", f"--to={target}", "--cpu_devices=8")
    ids = np.random.default_rng(0).integers(0, 256, (8, 24)).astype(np.int32)
    engine = saved_run.restored_engine(run)
    ours = np.asarray(engine.steps.model_method("logits")(engine.state.params, ids))
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    if architecture is not None:
        assert type(model).__name__ == architecture
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    assert_close(theirs, ours, bound=CROSS_FRAMEWORK,
                 what=f"transformers' logits of the exported {architecture or ''} run")


def _generates_alike(run, target):
    """``titanax.generate`` on the run and ``--hf`` on its export: the same greedy ids."""
    prompt = "--prompt_ids=82,79,77,69,79,58"
    from_run = _run("titanax.generate", f"--trainer_dir={run}", prompt, "--max_new_tokens=16",
                    "--cpu_devices=8")
    from_hf = _run("titanax.generate", f"--hf={target}", prompt, "--max_new_tokens=16",
                   "--cpu_devices=8", "--model_parallel=2")
    ids_line = [line for line in from_run.stdout.splitlines() if line.startswith("ids: ")]
    assert len(ids_line) == 1 and len(ids_line[0].split()) >= 2, from_run.stdout
    assert ids_line[0] in from_hf.stdout.splitlines(), (from_run.stdout, from_hf.stdout)


def test_exported_run_loads_in_transformers_with_titanax_logits(fine_tuned, tmp_path):
    run, _ = fine_tuned
    target = str(tmp_path / "export")
    _exported_in_transformers(run, target)
    # A second export to the same place is refused, and the first is left as it was.
    before = sorted(os.listdir(target))
    refused = _run("titanax.export", f"--trainer_dir={run}", f"--to={target}",
                   "--cpu_devices=8", expect=2)
    assert "not an empty directory" in refused.stderr and sorted(os.listdir(target)) == before
    _generates_alike(run, target)


def test_bad_hf_directories_exit_2_naming_the_file(byte_llama, tmp_path):
    import json
    empty = tmp_path / "no_config"
    empty.mkdir()
    result = _run("titanax.launch", "--config=llama_tiny_dp_tp", f"--config.init_from={empty}",
                  "--print_config", expect=2)
    assert f"{empty}/config.json: the directory has no config.json" in result.stderr
    falcon = tmp_path / "falcon"
    shutil.copytree(byte_llama, falcon)
    config = json.loads((falcon / "config.json").read_text())
    (falcon / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    result = _run("titanax.launch", "--config=llama_tiny_dp_tp", f"--config.init_from={falcon}",
                  "--print_config", expect=2)
    assert "config.json: model_type: model_type 'falcon' is not supported" in result.stderr
    # A tensor missing from the weights: named, with the param it feeds, before any step.
    from safetensors.numpy import load_file, save_file
    weights = falcon / "model.safetensors"
    (falcon / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(weights))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(weights))
    result = _run("titanax.launch", "--config=llama_tiny_dp_tp", f"--config.init_from={falcon}",
                  f"--trainer_dir={tmp_path / 'run'}", "--cpu_devices=8", expect=2)
    assert "'model.layers.1.mlp.up_proj.weight' is missing (Titanax param " \
           "decoder/layer/mlp/gate_up_weight)" in result.stderr
    assert "step " not in result.stdout


def test_generate_reads_the_model_directorys_tokenizer(byte_llama, tmp_path):
    """A tokenizer.json beside the weights turns --prompt into ids and the ids back into text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    directory = tmp_path / "with_tokenizer"
    shutil.copytree(byte_llama, directory)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["to be or not to be that is the question"] * 20,
                                  trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    tokenizer.save(str(directory / "tokenizer.json"))
    result = _run("titanax.generate", f"--hf={directory}", "--prompt=to be or not",
                  "--max_new_tokens=5")
    lines = result.stdout.splitlines()
    ids = [line for line in lines if line.startswith("ids: ")]
    texts = [line for line in lines if line.startswith("text: ")]
    assert len(ids) == 1 and len(texts) == 1, result.stdout
    new_ids = [int(t) for t in ids[0].split()[1:]]
    assert 1 <= len(new_ids) <= 5 and texts[0] == "text: " + tokenizer.decode(new_ids)


def test_the_users_model_overrides_stay_over_the_checkpoints(byte_llama, tmp_path):
    """--config.model.* given with init_from is applied on top of the checkpoint's model; a
    relative init_from is recorded absolute."""
    relative = os.path.relpath(byte_llama, REPO_ROOT)
    result = _run("titanax.launch", "--config=llama_tiny_dp_tp",
                  f"--config.init_from={relative}", "--config.model.max_seq_len=32",
                  "--config.model.layer_remat_policy=nothing_saveable", "--print_config")
    assert "model.max_seq_len: 32\n" in result.stdout
    assert "model.layer_remat_policy: 'nothing_saveable'" in result.stdout
    assert f"init_from: '{byte_llama}'" in result.stdout


def test_a_model_of_another_architecture_is_refused_before_loading(byte_llama):
    """From Python, init_from with a model that is not the checkpoint's (same shapes, another
    rope_theta) is refused, not loaded into wrong numbers."""
    from titanax import errors
    from titanax.hf import importer
    from titanax.train.engine import Engine
    model = importer.model_config(byte_llama).set(rope_theta=1234.0)
    engine = Engine.default_config().set(model=model, init_from=byte_llama,
                                         loggers=[]).instantiate()
    with pytest.raises(errors.HFError, match="model.rope_theta: 10000.0 -> 1234.0"):
        engine.init_or_restore()


def test_commands_on_a_run_build_no_optimizer_state(fine_tuned):
    import jax
    run, _ = fine_tuned
    engine = saved_run.restored_engine(run)
    assert jax.tree_util.tree_leaves(engine.state.opt_state) == []
    assert engine.state.params["decoder"]["layer"]["attn"]["q_weight"].dtype == np.float32


def test_a_run_resumes_after_its_hf_directory_is_gone(byte_llama, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(byte_llama, source)
    run = str(tmp_path / "run")
    common = ("--config=llama_tiny_dp_tp", f"--config.init_from={source}", f"--trainer_dir={run}",
              "--cpu_devices=8", "--config.evalers={}", "--config.log_every=1")
    _run("titanax.launch", *common, "--config.max_steps=2")
    shutil.rmtree(source)
    resumed = _run("titanax.launch", *common, "--config.max_steps=3")
    assert "restored the run from" in resumed.stdout and "step      3/3" in resumed.stdout


def _qwen3_5(directory):
    """Qwen 3.5's text model: three Gated DeltaNet layers and a gated attention."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=128,
        initializer_range=0.1)).save_pretrained(directory)
    return "Qwen3_5ForCausalLM"


def _qwen3_5_moe(directory):
    """Qwen 3.5 MoE's text model: a Gated DeltaNet layer and a gated attention, each MLP four
    experts beside a gated shared expert."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM
    Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=128,
        initializer_range=0.1)).save_pretrained(directory)
    return "Qwen3_5MoeForCausalLM"


def _gemma3(directory):
    """Gemma 3's text model, its head tied to its sqrt(width)-scaled embeddings: two sliding
    layers and a full one, then a sliding one after the stack."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
        max_position_embeddings=128, initializer_range=0.1)).save_pretrained(directory)
    return "Gemma3ForCausalLM"


def _gpt_oss(directory):
    """gpt-oss: sliding and full layers, sinks, YaRN, four biased experts (two per token)."""
    from transformers import GptOssConfig, GptOssForCausalLM
    GptOssForCausalLM(GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=128,
        initializer_range=0.1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 32,
                         "rope_theta": 150000.0})).save_pretrained(directory)
    return "GptOssForCausalLM"


def _deepseek_v3(directory):
    """DeepSeek-V3: latent attention (low-rank queries, YaRN), a dense first layer, then four
    sigmoid-scored experts in two groups with the choosing bias, a shared expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, max_position_embeddings=128, initializer_range=0.1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0,
                         "mscale_all_dim": 1.0})).save_pretrained(directory)
    return "DeepseekV3ForCausalLM"


def test_aux_loss_free_balancing_may_be_turned_on_over_a_checkpoint(tmp_path):
    """How fast the expert bias moves is a training rule, not the checkpoint's architecture: a
    DeepSeek-V3 model with router.balance_rate set still matches its directory; a changed
    scaling of the chosen gates does not."""
    from titanax.hf import fine_tune, importer
    _deepseek_v3(str(tmp_path))
    model = importer.model_config(str(tmp_path))
    model.moe.router.balance_rate = 0.001
    assert fine_tune.architecture_differences(model, str(tmp_path)) == []
    model.moe.router.routed_scaling = 1.0
    assert fine_tune.architecture_differences(model, str(tmp_path)) == [
        "model.moe.router.routed_scaling: 2.5 -> 1.0"]


def _deepseek_v3_with_prediction(directory):
    """``_deepseek_v3`` with a multi-token-prediction layer after its layers, as published."""
    from tests.hf.test_export import _with_prediction_layer  # pylint: disable=import-outside-toplevel
    architecture = _deepseek_v3(directory + "_plain")
    parts = pathlib.Path(directory + "_parts")
    parts.mkdir()
    shutil.copytree(_with_prediction_layer(directory + "_plain", parts)[0], directory)
    return architecture


@pytest.mark.parametrize("family,experiment,flags", [
    (_qwen3_5, "llama_tiny_dp_tp", ()), (_gemma3, "llama_tiny_dp_tp", ()),
    (_gpt_oss, "moe_tiny_ep", ()),
    (_deepseek_v3_with_prediction, "moe_tiny_ep", ("--config.model.mtp_depths=1",)),
    (_qwen3_5_moe, "moe_tiny_ep", ())],
    ids=["qwen3_5", "gemma3", "gpt_oss", "deepseek_v3", "qwen3_5_moe"])
def test_todays_families_fine_tune_export_and_load_in_transformers(family, experiment, flags,
                                                                   tmp_path):
    """Today's families (bytes for a vocabulary) through the Interface's commands: fine-tuned 3
    steps from their directory (dense ones on data 4 x TP 2, gpt-oss's, DeepSeek-V3's and Qwen
    3.5 MoE's experts on data 2 x expert 4; DeepSeek-V3's multi-token-prediction depth trained too, from its
    checkpoint's layer, and reported per step), exported, loaded by transformers' own class
    with Titanax's logits; for DeepSeek-V3, ``generate --hf`` on the export gives the run's
    greedy ids."""
    import torch
    torch.manual_seed(0)
    source, run, target = (str(tmp_path / name) for name in ("source", "run", "export"))
    architecture = family(source)
    result = _run("titanax.launch", f"--config={experiment}", f"--config.init_from={source}",
                  f"--trainer_dir={run}", "--cpu_devices=8", "--config.max_steps=3",
                  "--config.evalers={}", *flags)
    if flags:
        assert "mtp_loss/1 " in result.stdout, result.stdout
        exported = os.path.join(target, "model.safetensors")
    _exported_in_transformers(run, target, architecture=architecture)
    if flags:  # (The trained depth is in the export, where published checkpoints hold it.)
        from safetensors import safe_open
        with safe_open(exported, "np") as f:
            assert "model.layers.3.eh_proj.weight" in f.keys()
        # Generation from a run and from its export has no per-family code (generate.py: the
        # restored run's engine); each family generates as transformers does in
        # tests/hf/test_generate.py. One family here -- experts, a prediction depth -- shows a
        # fine-tuned run's restore for generation is its export's.
        _generates_alike(run, target)
