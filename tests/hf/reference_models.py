"""Tiny randomly initialised ``transformers`` models, saved as safetensors in a test directory.

Nothing is downloaded: each model is built from its config with a fixed seed. The init is
widened (``initializer_range``) so that logits spread over several nats -- a wrong rotation, a
swapped kv head or a missing bias moves them by far more than float32 rounding does.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Dict

import numpy as np

from titanax.config import config_for_function
from titanax.hf import importer
from titanax.parallel.expert_parallel import EP
from titanax.parallel.plan import CP, DP, PP, TP, Plan, ZeRO
from titanax.runtime.mesh import MeshSpec
from titanax.train import optimizers
from titanax.train import starting_params
from titanax.train.engine import Engine
from titanax.train.learner import Learner

VOCAB = 96
LAYERS = 2


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, initializer_range=0.3, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
        rope_theta=500000.0, bos_token_id=1, eos_token_id=2))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        initializer_range=0.3, tie_word_embeddings=True, rope_theta=1000000.0))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        initializer_range=0.3, tie_word_embeddings=False))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
        sliding_window=5, initializer_range=0.3, tie_word_embeddings=False))


def _qwen3_sliding():
    """Qwen 3 with sliding (window 5) and full attention in turn over four layers: imported as
    the layer pattern ("sliding", "full"), two repetitions (a pipeline of two stages cuts
    between them)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        initializer_range=0.3, tie_word_embeddings=True, rope_theta=1000000.0,
        use_sliding_window=True, sliding_window=5, max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"] * 2))


def _qwen3_5():
    """Qwen 3.5's text model: three Gated DeltaNet layers then a gated full attention, twice;
    its zero-started norms and decay params given values of their own (else a norm read as
    1 + w or w alike would pass)."""
    import torch
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    return model


def _qwen3_5_moe():
    """Qwen 3.5 MoE's text model: Qwen 3.5's layers (one linear then one full attention,
    twice), each MLP four experts (two per token) beside a shared expert with its sigmoid gate;
    the zero-started norms and decay params, and the gate, given values of their own."""
    import torch
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
        num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"] * 2,
        max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name or "expert_gate" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    return model


def _gemma3():
    """Gemma 3's text model: two sliding layers (window 5, plain RoPE at base 10000) then a full
    one (base 1000000, scaled linearly by 2), twice, then one sliding layer more (the stack's
    tail); queries scaled by 24 ** -0.5, not by the head width; its zero-started norms given
    values of their own. Its head is untied (a tied one, its embeddings scaled by 8, greedily
    repeats one token at this size: no test of generation); tests/hf/test_fine_tune.py ties
    one."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    model = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=5, layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2
        + ["sliding_attention"], max_position_embeddings=64, initializer_range=0.2,
        tie_word_embeddings=False, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000000.0}}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    return model


def _gemma3_vision():
    """Gemma 3 as most of its checkpoints are published: multimodal, a (tiny) SigLIP vision
    tower and projector beside the language model."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    text = dict(vocab_size=VOCAB + 4, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                layer_types=["sliding_attention", "full_attention"], initializer_range=0.2,
                max_position_embeddings=64)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=VOCAB + 1,
        eoi_token_index=VOCAB + 2, image_token_index=VOCAB + 3, initializer_range=0.2))


def _qwen3_5_vision():
    """Qwen 3.5 as published: multimodal, a (tiny) vision encoder beside the language model."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                max_position_embeddings=64, initializer_range=0.3)
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))


def _qwen3_5_moe_vision():
    """Qwen 3.5 MoE as published: multimodal, a (tiny) vision encoder beside the language
    model."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    text = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
                num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"],
                max_position_embeddings=64, initializer_range=0.3)
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text,
                                                               vision_config=vision))


def _gpt_oss():
    """gpt-oss: sliding (window 5) and full layers in turn, attention sinks and biases, YaRN
    (an original context of 8, so the ramp's both ends occur), four experts with biases (two
    per token), a biased router, the clamped SwiGLU (a limit of 1.5: values reach it here); its
    sinks and biases given values of their own."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM
    model = GptOssForCausalLM(GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=5, max_position_embeddings=64,
        initializer_range=0.3, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 8,
                         "rope_theta": 150000.0}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "sinks" in name or "bias" in name:
                param.copy_(torch.randn_like(param) * 0.5)
    return model


def _deepseek_v3():
    """DeepSeek-V3: latent attention (low-rank queries; YaRN with both mscales, an original
    context of 8), one dense layer, then eight sigmoid-scored experts in four groups (two per
    token, from the best two groups) with a choosing bias of its own, scaled gates and a shared
    expert."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
        max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 8, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.3)
    return model


def _deepseek_v3_q_proj():
    """DeepSeek-V3 with full-rank queries (``q_proj``; q_lora_rank null) and two dense layers
    before the experts, no groups, two shared experts (one of twice the width)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, first_k_dense_replace=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, n_shared_experts=2, routed_scaling_factor=1.5,
        max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=False))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        initializer_range=0.3, tie_word_embeddings=False, router_aux_loss_coef=0.01))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_local_experts=4,
        num_experts_per_tok=2, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
        tie_word_embeddings=False))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64,
        initializer_range=0.3, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0))


BUILDERS: Dict[str, Callable] = {"llama": _llama, "qwen3": _qwen3, "qwen2": _qwen2,
                                 "mistral": _mistral, "gpt2": _gpt2, "qwen3_moe": _qwen3_moe,
                                 "mixtral": _mixtral, "qwen3_sliding": _qwen3_sliding,
                                 "qwen3_5": _qwen3_5, "gemma3": _gemma3,
                                 "gemma3_vision": _gemma3_vision,
                                 "qwen3_5_vision": _qwen3_5_vision, "gpt_oss": _gpt_oss,
                                 "deepseek_v3": _deepseek_v3,
                                 "deepseek_v3_q_proj": _deepseek_v3_q_proj,
                                 "qwen3_5_moe": _qwen3_5_moe,
                                 "qwen3_5_moe_vision": _qwen3_5_moe_vision}


@functools.lru_cache(maxsize=None)
def _saved(kind: str, root: str) -> str:
    import torch
    torch.manual_seed(0)
    model = BUILDERS[kind]()
    directory = os.path.join(root, kind)
    model.save_pretrained(directory)
    return directory


def saved_model(kind: str, root) -> str:
    """The directory of the tiny ``kind`` model (written once per test session root)."""
    return _saved(kind, str(root))


def hf_logits(directory: str, ids: np.ndarray) -> np.ndarray:
    """Logits of the saved model, by transformers itself (float32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy().astype(np.float64)


def token_ids(rows: int = 8, length: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (rows, length)).astype(np.int32)


def engine_for(directory, *, data, model=1, pipe=1, context=1, expert=1, zero=None, lora=None,
               fresh=False, **model_changes) -> Engine:
    """An Engine of the HF model on data x model x pipe x context x expert devices, its params
    imported (``lora``: a LoRA config, its adapters added fresh; ``fresh``: every param fresh,
    for ``model_changes`` that add weights the directory lacks)."""
    sizes = {"data": data, "model": model, "pipe": pipe, "context": context, "expert": expert}
    axes = tuple(a for a, n in sizes.items() if a == "data" or n > 1)
    plan = Plan.default_config().set(
        data_parallel=DP.default_config(),
        tensor_parallel=TP.default_config() if model > 1 else None,
        pipeline_parallel=PP.default_config().set(microbatch_size=2) if pipe > 1 else None,
        context_parallel=CP.default_config().set(axis="context") if context > 1 else None,
        expert_parallel=EP.default_config().set(axis="expert") if expert > 1 else None,
        zero=ZeRO.default_config().set(stage=zero) if zero else None)
    cfg = Engine.default_config().set(
        mesh=MeshSpec.default_config().set(axes=axes, shape=tuple(sizes[a] for a in axes),
                                           devices=list(range(data * model * pipe * context
                                                              * expert))),
        plan=plan, model=importer.model_config(directory).set(**model_changes),
        learner=Learner.default_config().set(
            optimizer=config_for_function(optimizers.sgd).set(learning_rate=0.1)),
        loggers=[], log_every=1000, lora=lora, init_from=directory if lora and not fresh else None)
    engine = cfg.instantiate()
    if fresh:
        engine.init_state()
        return engine
    # (With adapters: the directory's weights and fresh adapters, as a launched run starts.)
    engine.init_state(params=starting_params.params_from_hf(engine) if lora else
                      importer.params_for_engine(engine, directory))
    return engine
