"""Hugging Face checkpoints imported into Titanax give transformers' logits, on every layout."""

import numpy as np
import pytest

from tests.hf import reference_models as ref
from tests.numerics import CROSS_FRAMEWORK, assert_close
from tests.hf.reference_models import engine_for
from titanax.hf import importer
from titanax.modules.module import functional

# Every family, its logits against transformers' (float32; the parity bound of tests/numerics).
KINDS = ("llama", "qwen3", "qwen2", "mistral", "gpt2", "qwen3_moe", "mixtral", "qwen3_sliding",
         "qwen3_5")


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
    ("qwen3_sliding", 4, 2), ("qwen3_5", 4, 2),
    # TP=4 over 2 (llama, qwen3) and 1 (mistral) kv heads: kv kept whole on every rank.
    ("llama", 2, 4), ("qwen3", 2, 4), ("mistral", 2, 4)])
def test_tensor_parallel_logits_equal_transformers(kind, data, model, root):
    directory = ref.saved_model(kind, root)
    engine = engine_for(directory, data=data, model=model)
    ids = ref.token_ids()
    logits = engine.steps.model_method("logits")(engine.state.params, ids)
    assert_close(np.asarray(logits), ref.hf_logits(directory, ids), bound=CROSS_FRAMEWORK,
                 what=f"{kind} logits on data={data} x model={model}")
    if kind != "gpt2":
        stack = engine.layout.param_specs["decoder"]["layer"]
        block = stack.get("0", stack)  # (A layer pattern's first member.)
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
    logits = ref.hf_logits(directory, batch["input_ids"])
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, batch["target_ids"][..., None], -1).mean()
    assert_close(loss, expected, bound=CROSS_FRAMEWORK, what=f"{kind} pipelined eval loss")


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_fsdp_logits_equal_transformers(kind, root):
    """FSDP: every param split over data=8 where a dimension divides; gathered for the call
    (a layer pattern's members one repetition at a time)."""
    directory = ref.saved_model(kind, root)
    engine = engine_for(directory, data=8, zero=3)
    stack = engine.layout.param_specs["decoder"]["layer"]
    assert "data" in tuple(stack.get("3", stack)["attn"]["q_weight"])
    ids = ref.token_ids()
    logits = engine.steps.model_method("logits")(engine.state.params, ids)
    assert_close(np.asarray(logits), ref.hf_logits(directory, ids), bound=CROSS_FRAMEWORK,
                 what=f"{kind} logits, FSDP data=8")
