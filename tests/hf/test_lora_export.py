"""A LoRA fine-tune from a Hugging Face directory through the launcher (``llama_tiny_lora_sft``),
exported both ways: the PEFT adapter loaded by ``peft.PeftModel.from_pretrained`` onto the base,
and the merged model in plain transformers, each with Titanax's logits; the base weights in the
run's checkpoint are the directory's, bit for bit."""

import json
import os

import numpy as np
import pytest

from tests.commands import run_module
from tests.modules import lora_reference
from tests.numerics import CROSS_FRAMEWORK, assert_close, assert_identical
from titanax.hf import importer
from titanax.modules import lora
from titanax.train import saved_run



_run = run_module


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """``(base HF dir, run dir)``: a tiny random byte-level Llama fine-tuned with LoRA on
    prompt/completion records."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("lora")
    base = str(root / "base")
    LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2)).save_pretrained(base)
    data = root / "pairs.jsonl"
    rng = np.random.default_rng(0)
    with open(data, "w", encoding="utf-8") as f:
        for _ in range(400):
            a, b = (int(x) for x in rng.integers(0, 50, 2))
            f.write(json.dumps({"prompt": f"{a} plus {b} is", "completion": f" {a + b}."}) + "\n")
    run = str(root / "run")
    _run("titanax.launch", "--config=llama_tiny_lora_sft", f"--config.init_from={base}",
         f"--config.train_input.source.files=['{data}']", f"--trainer_dir={run}",
         "--cpu_devices=8", "--config.max_steps=8", "--config.log_every=1",
         "--config.learner.optimizer.learning_rate.warmup_steps=2",
         "--config.evalers={}")
    return base, run


def _ids():
    return np.random.default_rng(1).integers(0, 256, (4, 20)).astype(np.int32)


def _titanax_logits(run):
    engine = saved_run.restored_engine(run)
    return engine, np.asarray(engine.steps.model_method("logits")(engine.state.params, _ids()))


def test_the_base_stays_the_directorys_and_the_adapters_moved(lora_run):
    base, run = lora_run
    engine, _ = _titanax_logits(run)
    params = {k: np.asarray(v) for k, v in _flat(engine.canonical_params()).items()}
    frozen = {k: v for k, v in params.items() if not lora.is_adapter(k)}
    assert_identical(frozen, {k: v for k, v in _flat(importer.params_as_numpy(base)).items()},
                     what="frozen weights after training")
    moved = [k for k, v in params.items() if k.endswith(lora.B_SUFFIX) and np.abs(v).max() > 0]
    assert len(moved) == 6, moved  # Every B moved off zero: the adapters trained.


def test_the_peft_adapter_on_the_base_gives_titanax_logits(lora_run, tmp_path):
    base, run = lora_run
    target = str(tmp_path / "adapter")
    _run("titanax.export", f"--trainer_dir={run}", f"--to={target}", "--format=peft",
         "--cpu_devices=8")
    assert sorted(os.listdir(target)) == ["adapter_config.json", "adapter_model.safetensors"]
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), target).eval()
    with torch.no_grad():
        theirs = model(torch.tensor(_ids())).logits.numpy()
        with model.disable_adapter():
            plain = model(torch.tensor(_ids())).logits.numpy()
    _, ours = _titanax_logits(run)
    assert_close(theirs, ours, bound=CROSS_FRAMEWORK, what="peft's logits of the adapter")
    assert np.abs(plain - theirs).max() > 1e-3  # The adapter changes the model.


def test_the_merged_export_gives_titanax_logits_in_plain_transformers(lora_run, tmp_path):
    _, run = lora_run
    target = str(tmp_path / "merged")
    _run("titanax.export", f"--trainer_dir={run}", f"--to={target}", "--cpu_devices=8")
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor(_ids())).logits.numpy()
    _, ours = _titanax_logits(run)
    assert_close(theirs, ours, bound=CROSS_FRAMEWORK, what="the merged model's logits")
    # The run (adapters applied by its layers) and its merged export generate alike.
    prompt = "--prompt_ids=52,32,112,108,117,115"
    from_run = _run("titanax.generate", f"--trainer_dir={run}", prompt, "--max_new_tokens=8",
                    "--cpu_devices=8")
    from_hf = _run("titanax.generate", f"--hf={target}", prompt, "--max_new_tokens=8")
    ids_line = [line for line in from_run.stdout.splitlines() if line.startswith("ids: ")]
    assert len(ids_line) == 1 and ids_line[0] in from_hf.stdout.splitlines(), (
        from_run.stdout, from_hf.stdout)


def test_a_peft_export_of_a_run_without_adapters_is_refused(tmp_path):
    run = str(tmp_path / "plain")
    _run("titanax.launch", "--config=gpt_tiny_dp", f"--trainer_dir={run}", "--cpu_devices=8",
         "--config.max_steps=1", "--config.evalers={}")
    refused = _run("titanax.export", f"--trainer_dir={run}", f"--to={tmp_path / 'x'}",
                   "--format=peft", "--cpu_devices=8", expect=2)
    assert "--format" in refused.stderr and "no adapters" in refused.stderr


@pytest.mark.parametrize("changes,path,said", [
    ([], "--format", "no Hugging Face directory (init_from was not set)"),
    (["--config.model.norm=layer"], "model", "llama has norm='rms'"),
], ids=["base from no HF directory", "a model no HF family computes"])
def test_a_peft_export_without_an_hf_base_to_load_onto_is_refused(lora_run, tmp_path, changes,
                                                                   path, said):
    """LoRA runs from random weights (init_from=None): a PEFT adapter would have no base model
    to load onto, and one of a model no HF family computes no modules to attach to (both
    written before)."""
    run = str(tmp_path / "run")
    _run("titanax.launch", "--config=llama_tiny_lora_sft", "--config.init_from=None",
         f"--config.train_input.source.files=['{os.path.dirname(lora_run[0])}/pairs.jsonl']",
         f"--trainer_dir={run}", "--cpu_devices=8", "--config.max_steps=1",
         "--config.evalers={}", *changes)
    refused = _run("titanax.export", f"--trainer_dir={run}", f"--to={tmp_path / 'x'}",
                   "--format=peft", "--cpu_devices=8", expect=2)
    assert f"{path}: " in refused.stderr and said in refused.stderr, refused.stderr[-2000:]
    assert not os.path.exists(tmp_path / "x" / "adapter_model.safetensors")


def _flat(tree, prefix=""):
    out = {}
    for name, value in tree.items():
        path = f"{prefix}/{name}" if prefix else name
        out.update(_flat(value, path) if isinstance(value, dict) else {path: value})
    return out


# Every weight today's families let LoRA adapt: the default targets (attention q / k / v / output,
# latent attention's low-rank projections, Gated DeltaNet's q / k / v, the dense MLPs) and Gated
# DeltaNet's gate and decay projections.
_EVERY_ADAPTABLE = lora.DEFAULT_TARGETS + (r"(^|/)attn/(z|a|b)_weight$",)
# Every attention projection (what the refusal of DeepSeek-V3's MLP adapters suggests).
_ATTENTION = (r"(^|/)attn/.*weight$",)


@pytest.mark.parametrize("kind", ["gemma3", "gpt_oss", "deepseek_v3", "deepseek_v3_q_proj",
                                  "qwen3_5", "qwen3_5_moe", "gemma3_vision", "qwen3_5_vision"])
def test_todays_families_peft_adapters_give_titanax_logits(kind, tmp_path_factory, tmp_path):
    """Adapters on every adaptable weight of each new family, moved off zero, exported as PEFT
    and loaded onto the transformers model: its logits are Titanax's. Covers the weights whose
    Hugging Face tensor is shared (Qwen 3.5's in_proj_qkv: q, k and v in one adapter of rank
    3r; its gated q_proj: the query's rows), reordered (DeepSeek-V3's interleaved RoPE rows)
    or folded from heads -- and multimodal bases as transformers builds them for a causal LM
    (Gemma 3's language model nested beside its vision tower, Qwen 3.5's alone)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from tests.hf import reference_models
    from titanax.hf.peft_export import export_peft
    directory = reference_models.saved_model(kind, tmp_path_factory.getbasetemp())
    # (PEFT reads DeepSeek-V3's MLP names as its experts': attention only, the MLP refused below.)
    targets = {"qwen3_5": _EVERY_ADAPTABLE, "qwen3_5_moe": _EVERY_ADAPTABLE,
               "deepseek_v3": _ATTENTION, "deepseek_v3_q_proj": _ATTENTION}
    # (Qwen 3.5 under rsLoRA: its joined q / k / v adapter's scale, alpha / sqrt(r) per part.)
    engine = reference_models.engine_for(directory, data=1, lora=lora.LoRA.default_config().set(
        rank=4, alpha=8.0, targets=targets.get(kind, lora.DEFAULT_TARGETS),
        rslora=kind == "qwen3_5"))
    params = lora_reference.with_moved_adapters(engine.state.params, scale=0.3)
    ids = reference_models.token_ids(rows=2, length=12)
    ours = np.asarray(engine.steps.model_method("logits")(params, ids))
    target = str(tmp_path / "adapter")
    export_peft(engine.states.canonical_params(params), model_cfg=engine.model.config,
                specs=engine.model_specs(), lora_cfg=engine.config.lora, directory=target,
                base_model=directory)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32), target).eval()
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
        with model.disable_adapter():
            plain = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(plain - theirs).max() > 1e-2  # The adapters change the model.
    tower = [n for n, _ in model.named_modules() if "vision" in n and n.endswith("lora_A")]
    assert not tower, tower[:3]  # (A multimodal base's vision tower has none.)
    assert_close(theirs, ours, bound=CROSS_FRAMEWORK, what=f"peft's logits of {kind}'s adapters")
    if kind == "gemma3_vision":  # A base gone since training: its module names unknowable.
        from titanax.errors import HFError
        with pytest.raises(HFError, match="no such directory"):
            export_peft(engine.states.canonical_params(params), model_cfg=engine.model.config,
                        specs=engine.model_specs(), lora_cfg=engine.config.lora,
                        directory=str(tmp_path / "gone"), base_model=str(tmp_path / "moved"))
        assert not os.path.exists(tmp_path / "gone")
    if kind == "deepseek_v3":
        _refused_with_mlp_adapters(directory, ids, tmp_path)
        _refused_with_prediction_depth_adapters(directory, tmp_path)


def _refused_with_prediction_depth_adapters(directory, tmp_path):
    """A multi-token-prediction depth's adapter (``--config.model.mtp_depths=1`` adds a depth
    transformers builds no module for: PEFT would drop it on load) is refused by name."""
    from tests.hf import reference_models
    from titanax.errors import HFError
    from titanax.hf.peft_export import export_peft
    engine = reference_models.engine_for(directory, data=1, fresh=True, mtp_depths=1,
                                         lora=lora.LoRA.default_config().set(rank=4,
                                                                            targets=_ATTENTION))
    assert any(path.startswith("prediction/") for path in lora.adapted_paths(engine.model_specs()))
    with pytest.raises(HFError, match=r"lora.targets: prediction/.* multi-token-prediction"):
        export_peft(engine.states.canonical_params(engine.state.params),
                    model_cfg=engine.model.config, specs=engine.model_specs(),
                    lora_cfg=engine.config.lora, directory=str(tmp_path / "depths"),
                    base_model=directory)
    assert not os.path.exists(tmp_path / "depths")


def _refused_with_mlp_adapters(directory, ids, tmp_path):
    """PEFT (under transformers 5) would load a DeepSeek-V3 adapter's gate / up / down
    projections as the experts' fused weights, dropping a dense layer's adapter: refused by
    name; the merged export carries them (transformers' logits equal Titanax's)."""
    from tests.hf import reference_models
    from titanax.errors import HFError
    from titanax.hf import exporter
    from titanax.hf.peft_export import export_peft
    engine = reference_models.engine_for(directory, data=1,
                                         lora=lora.LoRA.default_config().set(rank=4))
    params = lora_reference.with_moved_adapters(engine.state.params, scale=0.3)
    canonical = engine.states.canonical_params(params)
    with pytest.raises(HFError, match=r"lora.targets: .*mlp.down_proj would be dropped"):
        export_peft(canonical, model_cfg=engine.model.config, specs=engine.model_specs(),
                    lora_cfg=engine.config.lora, directory=str(tmp_path / "refused"))
    assert not os.path.exists(tmp_path / "refused")
    merged = str(tmp_path / "merged")
    exporter.export_params(lora.merged_params(canonical, engine.model_specs(),
                                              scale=engine.converters[0].scale),
                           model_cfg=engine.model.config, directory=merged, source_dir=directory)
    ours = np.asarray(engine.steps.model_method("logits")(params, ids))
    assert_close(reference_models.hf_logits(merged, ids), ours, bound=CROSS_FRAMEWORK,
                 what="the merged DeepSeek-V3 export's logits")

