"""Hugging Face checkpoints imported into Titanax give transformers' logits, on every layout."""

import numpy as np
import pytest

from tests.commands import run_module
from tests.hf import reference_models as ref
from tests.numerics import CROSS_FRAMEWORK, assert_close
from tests.hf.reference_models import engine_for
from titanax.hf import importer
from titanax.modules.module import functional

# Every family, its logits against transformers' (float32; the parity bound of tests/numerics).
KINDS = ("llama", "qwen3", "qwen2", "mistral", "gpt2", "qwen3_moe", "mixtral", "qwen3_sliding",
         "qwen3_5", "gemma3", "gpt_oss", "deepseek_v3", "deepseek_v3_q_proj", "qwen3_5_moe")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_models")


@pytest.mark.parametrize("kind", KINDS)
def test_one_device_logits_equal_transformers(kind, root):
    directory = ref.saved_model(kind, root)
    cfg = importer.model_config(directory)
    params = importer.params_as_numpy(directory, cfg)
    ids = ref.token_ids()
    logits, _ = functional(cfg.instantiate(), None, params, (ids,), method="logits",
                           is_training=False)
    expected = ref.hf_logits(directory, ids)
    assert np.std(expected) > 0.5, "the reference's logits are too flat to tell models apart"
    assert_close(np.asarray(logits), expected, bound=CROSS_FRAMEWORK, what=f"{kind} logits")


@pytest.mark.parametrize("kind,data,model", [
    ("llama", 4, 2), ("qwen3", 4, 2), ("qwen2", 4, 2), ("mistral", 4, 2), ("gpt2", 4, 2),
    ("qwen3_sliding", 4, 2), ("qwen3_5", 4, 2), ("gemma3", 4, 2), ("gpt_oss", 4, 2),
    ("deepseek_v3", 4, 2), ("qwen3_5_moe", 4, 2),
    # TP=4 over 2 (llama, qwen3) and 1 (mistral) kv heads: kv kept whole on every rank.
    ("llama", 2, 4), ("qwen3", 2, 4), ("mistral", 2, 4)])
def test_tensor_parallel_logits_equal_transformers(kind, data, model, root):
    directory = ref.saved_model(kind, root)
    engine = engine_for(directory, data=data, model=model)
    ids = ref.token_ids()
    logits = engine.steps.model_method("logits")(engine.state.params, ids)
    assert_close(np.asarray(logits), ref.hf_logits(directory, ids), bound=CROSS_FRAMEWORK,
                 what=f"{kind} logits on data={data} x model={model}")
    stack = engine.layout.param_specs["decoder"]["layer"]
    block = stack.get("0", stack)  # (A layer pattern's first member.)
    if kind == "deepseek_v3":  # (Latent attention: every head's keys and values split.)
        assert "model" in tuple(block["attn"]["kv_b_weight"]), block["attn"]["kv_b_weight"]
    elif kind != "gpt2":
        kv = block["attn"]["k_weight"]
        split = engine.model.num_kv_heads % model == 0
        assert ("model" in tuple(kv)) == split, kv


@pytest.mark.parametrize("kind", KINDS)
def test_pipelined_eval_loss_equals_transformers(kind, root):
    """Under PP the stack lives in stages: the eval loss (the schedule's forward) must equal
    the cross-entropy of transformers' logits."""
    directory = ref.saved_model(kind, root)
    engine = engine_for(directory, data=2, pipe=2, model=2)
    ids = ref.token_ids(length=17)
    batch = {"input_ids": ids[:, :-1], "target_ids": ids[:, 1:]}
    loss = engine.eval(data=[batch], steps=1)["loss"]
    assert_close(loss, _hf_mean_loss(directory, batch), bound=CROSS_FRAMEWORK,
                 what=f"{kind} pipelined eval loss")


def _hf_mean_loss(directory, batch):
    """transformers' mean next-token cross-entropy of ``batch``."""
    logits = ref.hf_logits(directory, batch["input_ids"])
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, batch["target_ids"][..., None], -1).mean()


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_5_moe"])
def test_expert_parallel_logits_equal_transformers(kind, root):
    """Experts over expert=4 (one each), tokens exchanged all-to-all, dropless: transformers'
    logits (gpt-oss: the experts' biases, the router's, the clamped SwiGLU)."""
    directory = ref.saved_model(kind, root)
    engine = engine_for(directory, data=2, expert=4)
    assert "expert" in tuple(engine.layout.param_specs["decoder"]["layer"]
                             .get("0", engine.layout.param_specs["decoder"]["layer"])
                             ["mlp"]["gate_up_weight"])
    ids = ref.token_ids()
    logits = engine.steps.model_method("logits")(engine.state.params, ids)
    assert_close(np.asarray(logits), ref.hf_logits(directory, ids), bound=CROSS_FRAMEWORK,
                 what=f"{kind} logits on data=2 x expert=4")


@pytest.mark.parametrize("kind", ["mistral", "gemma3", "qwen3_5", "qwen3_5_moe", "deepseek_v3"])
def test_context_parallel_eval_loss_equals_transformers(kind, root):
    """Context parallelism over 4 devices (each holds two eighths of every row; sliding windows
    reach across the cuts, Gated DeltaNet's state and convolution cross them, latent attention
    gathers the row's latents): the eval loss is transformers' cross-entropy."""
    directory = ref.saved_model(kind, root)
    engine = engine_for(directory, data=2, context=4)
    ids = ref.token_ids(length=17)
    batch = {"input_ids": ids[:, :-1], "target_ids": ids[:, 1:]}
    assert_close(engine.eval(data=[batch], steps=1)["loss"], _hf_mean_loss(directory, batch),
                 bound=CROSS_FRAMEWORK, what=f"{kind} eval loss, context=4")


@pytest.mark.parametrize("kind", ["llama", "qwen3_5", "gemma3", "gpt_oss", "deepseek_v3",
                                  "qwen3_5_moe"])
def test_fsdp_logits_equal_transformers(kind, root):
    """FSDP: every param split over data=8 where a dimension divides; gathered for the call
    (a layer pattern's members one repetition at a time; DeepSeek-V3's dense first layer
    outside the stack)."""
    directory = ref.saved_model(kind, root)
    engine = engine_for(directory, data=8, zero=3)
    stack = engine.layout.param_specs["decoder"]["layer"]
    for block in [v for k, v in stack.items() if k.isdigit()] or [stack]:
        attention = block["attn"]
        assert "data" in tuple(attention.get("q_weight", attention.get("kv_b_weight")))
    ids = ref.token_ids()
    logits = engine.steps.model_method("logits")(engine.state.params, ids)
    assert_close(np.asarray(logits), ref.hf_logits(directory, ids), bound=CROSS_FRAMEWORK,
                 what=f"{kind} logits, FSDP data=8")


@pytest.mark.parametrize("kind", ["gemma3_vision", "qwen3_5_vision", "qwen3_5_moe_vision"])
def test_a_multimodal_checkpoint_loads_its_language_model(kind, root):
    """Gemma 3, Qwen 3.5 and Qwen 3.5 MoE as mostly published -- multimodal: the language model's logits are
    transformers' multimodal model's on text (its vision tower left out, and said so)."""
    import torch
    from transformers import AutoModelForImageTextToText
    directory = ref.saved_model(kind, root)
    cfg = importer.model_config(directory)
    ids = ref.token_ids()
    logits, _ = functional(cfg.instantiate(), None, importer.params_as_numpy(directory, cfg),
                           (ids,), method="logits", is_training=False)
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(input_ids=torch.tensor(ids)).logits.numpy().astype(np.float64)
    assert np.std(expected) > 0.5, "the reference's logits are too flat to tell models apart"
    assert_close(np.asarray(logits), expected, bound=CROSS_FRAMEWORK, what=f"{kind} logits")
    if kind == "gemma3_vision":  # The command a user runs says what it left out.
        result = run_module("titanax.generate", f"--hf={directory}", "--prompt_ids=5,6,7",
                            "--max_new_tokens=3")
        assert (f"{directory} is a multimodal gemma3 checkpoint: its language model "
                "(gemma3_text) is loaded; its other ") in result.stderr
        assert "tensors (the vision tower and projector, any MTP head) are left out" in \
            result.stderr
