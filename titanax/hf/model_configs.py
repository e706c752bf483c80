"""Hugging Face ``config.json`` <-> Titanax model configs (GPT-2, Llama, Qwen 2/3, Qwen 3.5's text
model, Gemma 3's, Mistral, and the mixtures of experts Mixtral, Qwen 3 MoE and gpt-oss).

Every key of an HF config is either mapped onto a Titanax field, checked to hold the one value
Titanax implements (``hidden_act: silu``, no sliding window on Qwen, ...), or known not to change
the model's numbers (token ids, ``use_cache``, ``transformers_version``...). Anything else is
refused with its name: a field silently ignored is how a converted model runs and is wrong.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

from titanax import errors
from titanax.config import ConfigBase
from titanax.hf import fp8_blocks
from titanax.modules.layers.moe import MoE
from titanax.modules.layers.rotary import Llama3RopeScaling, LinearRopeScaling, YarnRopeScaling
from titanax.modules.layers.gated_deltanet import GatedDeltaNet
from titanax.modules.layers.latent_attention import MultiHeadLatentAttention
from titanax.modules.models.decoder import Decoder, gpt_config, is_gpt2, layer_kinds

# Keys of any HF config that do not change the model's numbers.
NEUTRAL_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range", "use_cache", "_name_or_path", "name_or_path", "return_dict",
    "output_hidden_states", "output_attentions", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder", "tie_encoder_decoder", "torchscript",
    "_attn_implementation_autoset", "tokenizer_class", "prefix", "task_specific_params",
    "finetuning_task", "max_length", "num_labels", "_num_labels", "gradient_checkpointing",
    "auto_map",  # (The classes of a checkpoint's own modeling code: Titanax runs its own.)
})

DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5_text", "gemma3_text")
# Decoders whose MLPs are mixtures of experts.
MOE_TYPES = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_5_moe_text")
# Model types read as another's (Kimi K2 is DeepSeek-V3's architecture, as transformers reads
# it); exported as that one.
ALIASES = {"kimi_k2": "deepseek_v3"}
MODEL_TYPES = ("gpt2",) + DECODER_TYPES + MOE_TYPES + tuple(ALIASES)
# Qwen 3.5's families: the dense text model and its mixture-of-experts variant.
QWEN3_5_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


def _refuse(key: str, value: Any, why: str, *, where: str) -> errors.HFError:
    return errors.HFError(f"{key}={value!r}: {why}", path=f"{where}: {key}",
                          suggestion="Titanax imports GPT-2, Llama, Qwen 2/3, Qwen 3 MoE, "
                                     "Qwen 3.5 and 3.5 MoE (text), Gemma 3 (text), gpt-oss, "
                                     "DeepSeek-V3, Mistral and Mixtral checkpoints as "
                                     "published; this one differs where named")


class _Reader:
    """Reads an HF config, remembering which keys were looked at."""

    def __init__(self, hf: Mapping[str, Any], where: str):
        self.hf, self.where, self.seen = dict(hf), where, set(NEUTRAL_KEYS)

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        return self.hf.get(key, default)

    def required(self, key: str) -> Any:
        self.seen.add(key)
        if self.hf.get(key) is None:
            raise errors.HFError(f"the config has no {key!r}", path=f"{self.where}: {key}",
                                 suggestion="a model directory written by transformers "
                                            "(save_pretrained) has it")
        return self.hf[key]

    def expect(self, key: str, allowed: Callable[[Any], bool], why: str,
               default: Any = None) -> Any:
        value = self.get(key, default)
        if not allowed(value):
            raise _refuse(key, value, why, where=self.where)
        return value

    def check_all_read(self) -> None:
        unknown = sorted(k for k in self.hf if k not in self.seen)
        if unknown:
            raise errors.HFError(
                f"the config has field(s) Titanax does not know: {', '.join(unknown)}",
                path=f"{self.where}: {unknown[0]}",
                suggestion="they may change the model's numbers, so they are not ignored; if "
                           "one does not (metadata), remove it from config.json")


def model_type_of(hf: Mapping[str, Any], *, where: str) -> str:
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise errors.HFError(f"model_type {model_type!r} is not supported",
                             path=f"{where}: model_type",
                             suggestion=f"supported: {', '.join(MODEL_TYPES)}; and the "
                                        "language model of multimodal gemma3, qwen3_5 and "
                                        "qwen3_5_moe directories")
    return model_type


def model_config_from_hf(hf: Mapping[str, Any], *, where: str = "config.json") -> ConfigBase:
    """The Titanax model config of an HF ``config.json`` (a ``Decoder.Config``: GPT-2's
    configuration of it for gpt2); refuses what it cannot reproduce exactly."""
    model_type = model_type_of(hf, where=where)
    reader = _Reader(hf, where)
    cfg = _gpt2(reader) if model_type == "gpt2" else _decoder(reader, model_type)
    reader.check_all_read()
    return cfg


def _gpt2(r: _Reader) -> Decoder.Config:
    r.expect("activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"),
             "Titanax's GPT uses GELU with the tanh approximation (gelu_new)", "gelu_new")
    r.expect("scale_attn_by_inverse_layer_idx", lambda v: not v, "not implemented", False)
    r.expect("add_cross_attention", lambda v: not v, "a decoder-only model has none", False)
    r.expect("scale_attn_weights", lambda v: v in (True, None), "not implemented", True)
    r.expect("tie_word_embeddings", lambda v: v in (True, None),
             "GPT-2's head is its embedding", True)
    r.get("reorder_and_upcast_attn")  # Numerics only: Titanax's softmax runs in float32.
    r.get("n_ctx")
    # Legacy fields of the published gpt2-medium/large/xl and distilgpt2 configs (unused by
    # transformers' GPT-2).
    r.expect("n_special", lambda v: not v, "extra special-token rows are not implemented", 0)
    r.get("predict_special_tokens")
    for key in ("summary_type", "summary_use_proj", "summary_activation",
                "summary_proj_to_labels", "summary_first_dropout"):
        r.get(key)  # The sequence-classification head: not part of the LM.
    dropout = r.get("resid_pdrop", 0.1)
    r.expect("embd_pdrop", lambda v: v == dropout,
             f"Titanax's GPT uses one dropout rate for embeddings and residuals "
             f"(resid_pdrop={dropout})", dropout)
    return gpt_config(
        vocab_size=r.required("vocab_size"), max_seq_len=r.required("n_positions"),
        num_layers=r.required("n_layer"), model_dim=r.required("n_embd"),
        num_heads=r.required("n_head"), hidden_dim=r.get("n_inner"),
        norm_eps=float(r.get("layer_norm_epsilon", 1e-5)), dropout_rate=float(dropout),
        attention_dropout_rate=float(r.get("attn_pdrop", 0.1)))


def _rope(r: _Reader, *, partial: bool = False) -> Dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` from either spelling: transformers 5's
    ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``; with ``partial`` (Qwen
    3.5) also ``rotary_fraction`` from ``partial_rotary_factor``, and its multimodal sections
    read without effect (text tokens carry one position in all three: plain RoPE)."""
    params = dict(r.get("rope_parameters") or {})
    if partial:  # (transformers' Qwen 3.5 default: 0.25, from either place.)
        top_level = r.get("partial_rotary_factor")
        fraction = float(params.pop("partial_rotary_factor", None) or top_level or 0.25)
        params.pop("mrope_section", None)
        params.pop("mrope_interleaved", None)
        return {**_rope_of(r, params, partial_read=True), "rotary_fraction": fraction}
    return _rope_of(r, params)


def _rope_of(r: _Reader, params: Dict[str, Any], *, partial_read: bool = False
             ) -> Dict[str, Any]:
    """``_rope`` of the ``rope_parameters`` left to read (``partial_read``: the partial rotary
    factor was taken already)."""
    scaling = r.get("rope_scaling")
    if scaling:
        params.update(scaling)
    top_level_theta = r.get("rope_theta")
    theta = params.pop("rope_theta", None) or top_level_theta or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if not partial_read and ("partial_rotary_factor" in params
                             or r.get("partial_rotary_factor") not in (None, 1, 1.0)):
        factor = params.get("partial_rotary_factor", r.get("partial_rotary_factor"))
        if factor not in (None, 1, 1.0):
            raise _refuse("partial_rotary_factor", factor, "Titanax rotates whole heads",
                          where=r.where)
        params.pop("partial_rotary_factor", None)
    return {"rope_theta": float(theta),
            "rope_scaling": _rope_scaling(r, rope_type, params, where="rope_parameters")}


# The scalings Titanax implements: HF rope_type -> (its config, the fields transformers needs,
# those it reads when present).
ROPE_SCALINGS = {
    "llama3": (Llama3RopeScaling, ("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings"), ()),
    "linear": (LinearRopeScaling, ("factor",), ()),
    "yarn": (YarnRopeScaling, ("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
              "truncate")),
}


def _rope_scaling(r: _Reader, rope_type: str, params: Dict[str, Any], *, where: str):
    """The scaling config of ``rope_type`` from its ``params`` (rope_theta and rope_type taken
    out already); None for the default RoPE."""
    if rope_type == "default":
        if params:
            raise _refuse(where, params, "fields without a rope_type that uses them",
                          where=r.where)
        return None
    if rope_type not in ROPE_SCALINGS:
        raise _refuse("rope_type", rope_type, "Titanax implements the default RoPE and the "
                      f"{', '.join(map(repr, ROPE_SCALINGS))} scalings", where=r.where)
    scaling, known, optional = ROPE_SCALINGS[rope_type]
    extra = set(params) - set(known) - set(optional)
    if extra:
        raise _refuse(where, sorted(extra), f"unknown {rope_type} scaling fields",
                      where=r.where)
    absent = sorted(k for k in known if params.get(k) is None)
    if absent:
        raise _refuse(where, params, f"{rope_type} scaling needs {', '.join(absent)} "
                      "(Titanax reads them from the config, not from transformers' fallbacks)",
                      where=r.where)
    scaling_cfg = scaling.default_config()
    for key in known + tuple(k for k in optional if params.get(k) is not None):
        default = getattr(scaling_cfg, key)
        kind = float if default is None else type(default)
        try:
            setattr(scaling_cfg, key, kind(params[key]))
        except (TypeError, ValueError) as e:
            raise _refuse(f"{where}.{key}", params[key], "not a number", where=r.where) from e
    return scaling_cfg


def _qwen3_5_moe_text(r: _Reader) -> Decoder.Config:
    """Qwen 3.5 MoE's text model (``Qwen3_5MoeForCausalLM``): Qwen 3.5's layers, each MLP a
    mixture of experts (softmax top-k, the chosen gates renormalised) beside a shared expert
    scaled by its own sigmoid gate (``shared_expert_gate``)."""
    cfg = _qwen3_5_text(r, moe_model=True)
    cfg.name = "qwen3_5_moe_text"
    cfg.moe = _moe(r, "qwen3_5_moe_text").set(
        shared_hidden_dim=r.required("shared_expert_intermediate_size"), shared_gate=True)
    cfg.moe.router.normalize_top_k = True  # (Always, in transformers' Qwen3_5MoeTopKRouter.)
    return cfg


def _qwen3_5_text(r: _Reader, *, moe_model: bool = False) -> Decoder.Config:
    """Qwen 3.5's text model (``Qwen3_5ForCausalLM``): its ``layer_types`` -- Gated DeltaNet
    ``linear_attention`` and gated ``full_attention`` -- as a layer pattern (``moe_model``: the
    MoE variant's, which has no dense MLP width)."""
    r.expect("hidden_act", lambda v: v == "silu", "Qwen 3.5's MLP and convolution use silu",
             "silu")
    r.expect("attention_bias", lambda v: not v, "Qwen 3.5's attention has no biases", False)
    r.expect("attention_dropout", lambda v: not v, "Titanax's decoder has no attention dropout",
             0.0)
    kinds_of = {"linear_attention": "linear", "full_attention": "full"}
    interval = r.get("full_attention_interval", 4)  # (transformers' default layer_types.)
    layer_types = r.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(r.required("num_hidden_layers"))]
    unknown = sorted(set(layer_types) - set(kinds_of))
    if unknown:
        raise _refuse("layer_types", unknown, "Qwen 3.5 has linear_attention and "
                      "full_attention layers", where=r.where)
    kinds = [kinds_of[t] for t in layer_types]
    if r.required("num_hidden_layers") != len(kinds):
        raise _refuse("layer_types", len(kinds), "names another number of layers than "
                      "num_hidden_layers", where=r.where)
    eps = float(r.get("rms_norm_eps", 1e-6))
    linear = GatedDeltaNet.default_config().set(
        num_key_heads=r.required("linear_num_key_heads"),
        num_value_heads=r.required("linear_num_value_heads"),
        key_head_dim=r.required("linear_key_head_dim"),
        value_head_dim=r.required("linear_value_head_dim"),
        conv_kernel_size=r.get("linear_conv_kernel_dim", 4), norm_eps=eps)
    heads = r.required("num_attention_heads")
    return Decoder.default_config().set(
        name="qwen3_5_text", vocab_size=r.required("vocab_size"),
        max_seq_len=r.required("max_position_embeddings"), num_layers=len(kinds),
        model_dim=r.required("hidden_size"), num_heads=heads,
        num_kv_heads=r.get("num_key_value_heads") or heads, head_dim=r.get("head_dim"),
        hidden_dim=r.get("intermediate_size") if moe_model else r.required("intermediate_size"),
        norm_eps=eps, qk_norm=True,
        norm_zero_centered=True, attention_output_gate=True,
        layer_pattern=_shortest_period(kinds) if "linear" in kinds else None,
        linear_attention=linear if "linear" in kinds else None,
        tie_embeddings=bool(r.get("tie_word_embeddings", False)), **_rope(r, partial=True))


def _shortest_period(kinds):
    """The shortest group of kinds that, repeated, gives the whole stack (its last repetition may
    stop part-way: the Decoder's tail)."""
    kinds = list(kinds)
    period = next(p for p in range(1, len(kinds) + 1)
                  if kinds == (kinds[:p] * -(-len(kinds) // p))[:len(kinds)])
    return tuple(kinds[:period])


# What transformers' Gemma3TextConfig holds where a config.json leaves a key out (a multimodal
# checkpoint's text_config is written as its difference from these: google/gemma-3-4b-it's names
# six keys).
GEMMA3_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                   "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                   "head_dim": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                   "query_pre_attn_scalar": 256, "sliding_window": 4096,
                   "tie_word_embeddings": True, "attention_bias": False}


def _gemma3_text(r: _Reader) -> Decoder.Config:
    """Gemma 3's text model (``Gemma3ForCausalLM``): sliding and full layers by ``layer_types``
    (every 6th full by default), each kind its own RoPE, the sandwich norms, the embeddings
    scaled by sqrt(hidden_size), queries scaled by ``query_pre_attn_scalar ** -0.5``; a key left
    out reads as transformers' default."""
    r.expect("hidden_activation", lambda v: v == "gelu_pytorch_tanh",
             "Gemma 3's MLP is GELU (tanh) gated", "gelu_pytorch_tanh")
    r.expect("attention_dropout", lambda v: not v, "Titanax's decoder has no attention dropout",
             0.0)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        r.expect(key, lambda v: v is None, "soft-capping is Gemma 2's; Titanax's Gemma 3 has "
                 "none (as every published Gemma 3)")
    r.expect("use_bidirectional_attention", lambda v: not v, "Titanax's decoder is causal "
             "(EmbeddingGemma's bidirectional mode is not a language model)", False)
    r.get("cache_implementation")  # (How transformers caches: "hybrid".)
    value = {key: r.get(key, default) for key, default in GEMMA3_DEFAULTS.items()}
    kinds = _gemma3_kinds(r, value["num_hidden_layers"])
    heads, head_dim, width = (value[k] for k in ("num_attention_heads", "head_dim",
                                                 "hidden_size"))
    scalar, bias = value["query_pre_attn_scalar"], bool(value["attention_bias"])
    sliding = "sliding" in kinds
    return Decoder.default_config().set(
        name="gemma3_text", vocab_size=value["vocab_size"],
        max_seq_len=value["max_position_embeddings"], num_layers=len(kinds), model_dim=width,
        num_heads=heads, num_kv_heads=value["num_key_value_heads"] or heads, head_dim=head_dim,
        hidden_dim=value["intermediate_size"], mlp_activation="gelu_tanh",
        norm_eps=float(value["rms_norm_eps"]), qk_norm=True, norm_zero_centered=True,
        branch_output_norms=True, embedding_multiplier=width ** 0.5,
        attention_scale=None if scalar == head_dim else float(scalar) ** -0.5,
        qkv_bias=bias, attention_output_bias=bias,
        sliding_window=value["sliding_window"] if sliding else None,
        layer_pattern=_shortest_period(kinds) if sliding and "full" in kinds else None,
        tie_embeddings=bool(value["tie_word_embeddings"]), **_gemma3_rope(r, kinds=set(kinds)))


def _gemma3_kinds(r: _Reader, layers: int) -> List[str]:
    """Every layer's kind: ``layer_types``, or every ``sliding_window_pattern``-th layer full
    (both spellings of the pattern read: transformers 5 writes ``_sliding_window_pattern``)."""
    patterns = {r.get("sliding_window_pattern"), r.get("_sliding_window_pattern")} - {None}
    if len(patterns) > 1:
        raise _refuse("sliding_window_pattern", sorted(patterns), "its two spellings disagree",
                      where=r.where)
    every = patterns.pop() if patterns else 6
    layer_types = r.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
    unknown = sorted(set(layer_types) - set(HF_LAYER_KINDS))
    if unknown or len(layer_types) != layers:
        raise _refuse("layer_types", unknown or len(layer_types), "Gemma 3 names each of its "
                      "num_hidden_layers sliding_attention or full_attention", where=r.where)
    return [HF_LAYER_KINDS[t] for t in layer_types]


def _gemma3_rope(r: _Reader, *, kinds) -> Dict[str, Any]:
    """Gemma 3's two RoPEs -- the full layers' (``rope_theta``, maybe scaled) and the sliding
    layers' (``rope_local_base_freq``, plain) -- from transformers 5's per-kind
    ``rope_parameters`` or the older flat keys."""
    params = dict(r.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full, local = params, {}
    full.update(r.get("rope_scaling") or {})
    # (The flat keys are read either way: transformers 5 takes the per-kind values first.)
    flat_theta, flat_local = r.get("rope_theta"), r.get("rope_local_base_freq")
    full_theta = float(full.pop("rope_theta", None) or flat_theta or 1e6)
    local_theta = float(local.pop("rope_theta", None) or flat_local or 1e4)
    local_type = local.pop("rope_type", None) or "default"
    full_type = full.pop("rope_type", None) or full.pop("type", None) or "default"
    same_rope = (local_theta, local_type, local) == (full_theta, full_type, full)
    scaling = _rope_scaling(r, full_type, full, where="rope_parameters.full_attention")
    if isinstance(scaling, YarnRopeScaling.Config) and not scaling.truncate:
        raise _refuse("rope_parameters.full_attention.truncate", False, "transformers reads "
                      "truncate only at the top of rope_parameters, which Gemma 3 keys by layer "
                      "type: it always rounds (leave truncate out, or true)", where=r.where)
    if kinds == {"full"}:  # Every layer one kind: that kind's RoPE for all.
        return {"rope_theta": full_theta, "rope_scaling": scaling}
    local_scaling = _rope_scaling(r, local_type, local, where="rope_parameters.sliding_attention")
    if kinds == {"sliding"}:
        return {"rope_theta": local_theta, "rope_scaling": local_scaling}
    if same_rope:  # Both kinds rotate alike (as Titanax writes a pattern without its own base).
        return {"rope_theta": full_theta, "rope_scaling": scaling}
    if local_scaling is not None:
        raise _refuse("rope_parameters.sliding_attention", {"rope_type": local_type, **local},
                      "Titanax rotates a pattern's sliding layers by plain RoPE at their own "
                      "base, or as the full layers", where=r.where)
    return {"rope_theta": full_theta, "rope_scaling": scaling, "sliding_rope_theta": local_theta}


def _gpt_oss(r: _Reader) -> Decoder.Config:
    """gpt-oss (``GptOssForCausalLM``): sliding and full layers by ``layer_types`` (in turn by
    default), attention sinks and biases, YaRN, and experts with biases, a biased router and the
    clamped SwiGLU. Quantised (MXFP4) checkpoints are refused: dequantise them first."""
    r.expect("quantization_config", lambda v: not v, "Titanax reads unquantised weights: "
             "load the model in transformers (dequantised) and save it again", None)
    r.expect("hidden_act", lambda v: v in (None, "silu"), "gpt-oss's experts are clamped SwiGLU",
             "silu")
    r.expect("attention_dropout", lambda v: not v, "Titanax's decoder has no attention dropout",
             0.0)
    top_k = r.required("num_experts_per_tok")
    r.expect("experts_per_token", lambda v: v in (None, top_k), "names another top-k than "
             "num_experts_per_tok")
    r.get("initial_context_length")  # (The original one; the YaRN parameters say it again.)
    layers = r.required("num_hidden_layers")
    layer_types = r.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    unknown = sorted(set(layer_types) - set(HF_LAYER_KINDS))
    if unknown or len(layer_types) != layers:
        raise _refuse("layer_types", unknown or len(layer_types), "gpt-oss names each of its "
                      "num_hidden_layers sliding_attention or full_attention", where=r.where)
    kinds = [HF_LAYER_KINDS[t] for t in layer_types]
    sliding = "sliding" in kinds
    balancing = bool(r.get("output_router_logits", False))
    coefficient = float(r.get("router_aux_loss_coef", 0.0) or 0.0)  # (Used when balancing.)
    moe = MoE.default_config().set(
        hidden_dim=r.required("intermediate_size"), num_experts=r.required("num_local_experts"),
        top_k=top_k, dispatch="dropless", activation="clamped_swiglu", expert_bias=True,
        swiglu_alpha=float(r.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(r.get("swiglu_limit", 7.0)),
        aux_loss_weight=coefficient / layers if balancing else 0.0)
    moe.router.normalize_top_k = True
    moe.router.bias = True
    heads = r.required("num_attention_heads")
    bias = bool(r.get("attention_bias", True))
    return Decoder.default_config().set(
        name="gpt_oss", vocab_size=r.required("vocab_size"),
        max_seq_len=r.required("max_position_embeddings"), num_layers=layers,
        model_dim=r.required("hidden_size"), num_heads=heads,
        num_kv_heads=r.get("num_key_value_heads") or heads, head_dim=r.get("head_dim"),
        hidden_dim=r.required("intermediate_size"), norm_eps=float(r.get("rms_norm_eps", 1e-5)),
        qkv_bias=bias, attention_output_bias=bias, attention_sinks=True, moe=moe,
        sliding_window=_window_of(r, sliding),
        layer_pattern=_shortest_period(kinds) if sliding and "full" in kinds else None,
        tie_embeddings=bool(r.get("tie_word_embeddings", False)), **_gpt_oss_rope(r))


# gpt-oss's RoPE where its config.json says none (transformers' GptOssConfig fills it in).
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def _gpt_oss_rope(r: _Reader) -> Dict[str, Any]:
    """``_rope``, with transformers' defaults for gpt-oss where the config leaves them out:
    YaRN (factor 32 over 4,096 tokens) at base 150,000."""
    theta = r.get("rope_theta")
    if not r.get("rope_parameters") and not r.get("rope_scaling"):
        return {"rope_theta": float(theta or 150000.0),
                "rope_scaling": _rope_scaling(r, "yarn", {k: v for k, v in GPT_OSS_ROPE.items()
                                                          if k != "rope_type"},
                                              where="rope_parameters")}
    rope = _rope(r)
    if not theta and "rope_theta" not in (r.get("rope_parameters") or {}):
        rope["rope_theta"] = 150000.0  # (transformers' gpt-oss base, not the generic one.)
    return rope


def _deepseek_v3_published_keys(r: _Reader) -> None:
    """The keys DeepSeek's own config.json (and Kimi K2's) carries beside transformers' ones:
    what its modeling code computes is what transformers' does, or refused by name."""
    r.expect("quantization_config", fp8_blocks.readable, "Titanax reads unquantised weights "
             "and FP8 blocks as DeepSeek publishes them (quant_method 'fp8', fmt 'e4m3', "
             "dynamic activations, a weight_block_size): dequantise others first", None)
    r.expect("scoring_func", lambda v: v in (None, "sigmoid"), "DeepSeek-V3 scores experts by "
             "sigmoid (softmax is DeepSeek-V2's)", "sigmoid")
    r.expect("topk_method", lambda v: v in (None, "noaux_tc"), "DeepSeek-V3 chooses the top "
             "groups, then experts, by score plus the choosing bias (noaux_tc)", "noaux_tc")
    r.expect("moe_layer_freq", lambda v: v in (None, 1), "every layer after the dense ones has "
             "experts in Titanax's DeepSeek-V3", 1)
    r.get("ep_size")  # (How DeepSeek's own code spread the experts: the plan's part here.)
    # (The sequence-wise balancing loss DeepSeek trained with; transformers computes none, nor
    # does an import: set model.moe.aux_loss_weight to train with one.)
    r.get("aux_loss_alpha")
    r.get("seq_aux")


def _deepseek_v3(r: _Reader) -> Decoder.Config:
    """DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head latent attention in every layer, the
    first ``first_k_dense_replace`` layers dense, the rest experts chosen by sigmoid scores plus
    a fixed choosing bias (``e_score_correction_bias``) among the best groups, with scaled gates
    and shared experts. The multi-token-prediction layers a checkpoint may hold after its last
    layer are left out (as transformers does) unless the run asks for depths
    (``--config.model.mtp_depths=1``: depth k's weights from MTP layer k). A key left out reads
    as transformers' default (None where the config says null: no low-rank queries)."""
    r.expect("hidden_act", lambda v: v == "silu", "DeepSeek-V3's MLPs are SwiGLU (silu)", "silu")
    r.expect("attention_bias", lambda v: not v, "no published DeepSeek-V3 has attention biases; "
             "Titanax does not map them", False)
    r.expect("attention_dropout", lambda v: not v, "Titanax's decoder has no attention dropout",
             0.0)
    r.expect("pretraining_tp", lambda v: v in (None, 1), "a split of the matmuls", 1)
    # (Absent: transformers' default, true; null reads as false in its modeling code.)
    r.expect("norm_topk_prob", lambda v: v is True, "Titanax's sigmoid router renormalises "
             "the chosen gates (as every published DeepSeek-V3)", True)
    r.expect("rope_interleave", lambda v: v is True, "Titanax reads the published layout, RoPE "
             "features in interleaved pairs", True)
    _deepseek_v3_published_keys(r)
    # (The MTP layers: read when the run sets model.mtp_depths, see above.)
    r.get("num_nextn_predict_layers")
    r.get("num_mtp_layers")
    r.get("output_router_logits")  # (DeepSeek-V3 adds no balancing loss in transformers.)
    heads = r.required("num_attention_heads")
    r.expect("num_key_value_heads", lambda v: v in (None, heads), "latent attention has as many "
             "key/value heads as query heads", heads)
    nope, rope = r.required("qk_nope_head_dim"), r.required("qk_rope_head_dim")
    r.expect("head_dim", lambda v: v in (None, rope), "transformers derives it: qk_rope_head_dim")
    r.expect("qk_head_dim", lambda v: v in (None, nope + rope),
             "transformers derives it: qk_nope_head_dim + qk_rope_head_dim")
    experts_width = r.required("moe_intermediate_size")
    moe = MoE.default_config().set(
        hidden_dim=experts_width, num_experts=r.required("n_routed_experts"),
        top_k=r.required("num_experts_per_tok"), dispatch="dropless",
        shared_hidden_dim=experts_width * int(r.get("n_shared_experts", 1) or 0))
    moe.router.set(scoring="sigmoid", normalize_top_k=True, choosing_bias=True,
                   routed_scaling=float(r.get("routed_scaling_factor", 2.5)),
                   num_groups=int(r.get("n_group", 8) or 1), top_groups=r.get("topk_group", 4))
    latent = MultiHeadLatentAttention.default_config().set(
        num_heads=heads, q_lora_rank=r.get("q_lora_rank", 1536),
        kv_lora_rank=r.required("kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=r.required("v_head_dim"))
    return Decoder.default_config().set(
        name="deepseek_v3", vocab_size=r.required("vocab_size"),
        max_seq_len=r.required("max_position_embeddings"),
        num_layers=r.required("num_hidden_layers"), model_dim=r.required("hidden_size"),
        num_heads=heads, hidden_dim=r.required("intermediate_size"),
        norm_eps=float(r.expect("rms_norm_eps", lambda v: v in (None, 1e-6), "transformers' "
                                "latent norms use 1e-6 whatever it says, and Titanax one "
                                "epsilon for every norm", 1e-6) or 1e-6),
        latent_attention=latent, moe=moe,
        first_dense_layers=int(r.get("first_k_dense_replace", 3) or 0),
        tie_embeddings=bool(r.get("tie_word_embeddings", False)), **_rope(r))


def _window_of(r: _Reader, sliding: bool) -> Optional[int]:
    """``sliding_window`` where some layer slides (read either way: with none it changes
    nothing)."""
    r.get("sliding_window")
    return r.required("sliding_window") if sliding else None


def _decoder(r: _Reader, model_type: str) -> Decoder.Config:
    if model_type == "qwen3_5_text":
        return _qwen3_5_text(r)
    if model_type == "qwen3_5_moe_text":
        return _qwen3_5_moe_text(r)
    if model_type == "gpt_oss":
        return _gpt_oss(r)
    if model_type == "gemma3_text":
        return _gemma3_text(r)
    if ALIASES.get(model_type, model_type) == "deepseek_v3":
        return _deepseek_v3(r)
    r.expect("hidden_act", lambda v: v == "silu", "the family's MLP is SwiGLU (silu)", "silu")
    r.expect("pretraining_tp", lambda v: v in (None, 1), "a Meta-only split of the matmuls", 1)
    r.expect("attention_dropout", lambda v: not v, "Titanax's decoder has no attention dropout",
             0.0)
    heads = r.required("num_attention_heads")
    width = r.required("hidden_size")
    window: Optional[int] = None
    qkv_bias = output_bias = False
    if model_type in ("mistral", "mixtral"):
        window = r.get("sliding_window")
    pattern = None
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        window, pattern = _qwen_layer_types(r, model_type)
    if model_type == "qwen2":
        qkv_bias = True
    elif model_type == "mixtral":
        pass  # No attention biases.
    else:
        bias = bool(r.get("attention_bias", False))
        qkv_bias = output_bias = bias
    mlp_bias = bool(r.get("mlp_bias", False)) if model_type == "llama" else False
    kv = r.get("num_key_value_heads") or heads
    head_dim = r.get("head_dim")
    moe = _moe(r, model_type) if model_type in MOE_TYPES else None
    return Decoder.default_config().set(moe=moe,
        name=model_type, vocab_size=r.required("vocab_size"),
        max_seq_len=r.required("max_position_embeddings"),
        num_layers=r.required("num_hidden_layers"), model_dim=width, num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim if head_dim not in (None, width // heads) else None,
        hidden_dim=r.required("intermediate_size"), norm_eps=float(r.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias, attention_output_bias=output_bias, mlp_bias=mlp_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"), sliding_window=window,
        layer_pattern=pattern, tie_embeddings=bool(r.get("tie_word_embeddings", False)),
        **_rope(r))


# HF layer_types -> Decoder layer_pattern kinds.
HF_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


def _qwen_layer_types(r: _Reader, model_type: str):
    """``(sliding_window, layer_pattern)`` of a Qwen config as transformers reads it: without
    ``use_sliding_window`` no layer slides; with it, the layers ``layer_types`` names
    ``sliding_attention`` (by default those from ``max_window_layers`` on) attend within
    ``sliding_window``. The pattern is the shortest group that repeats through the stack --
    None when every layer is alike (all sliding: one window for every layer)."""
    use = bool(r.get("use_sliding_window", False))
    if model_type == "qwen3_moe":  # (Its modeling code slides every layer or none.)
        r.expect("use_sliding_window", lambda v: not v, "Qwen 3 MoE's sliding window is not "
                 "mapped", False)
    if not use:
        r.get("sliding_window")  # (Read, unused: no layer slides.)
    window = r.required("sliding_window") if use else None
    first_sliding = r.get("max_window_layers", 28)
    layers = r.required("num_hidden_layers")
    layer_types = r.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
        for i in range(layers)]
    unknown = sorted(set(layer_types) - set(HF_LAYER_KINDS))
    if unknown:
        raise _refuse("layer_types", unknown, "Titanax maps full_attention and "
                      "sliding_attention layers", where=r.where)
    kinds = [HF_LAYER_KINDS[t] for t in layer_types]
    if window is None or "sliding" not in kinds:
        return None, None
    if set(kinds) == {"sliding"}:
        return window, None
    return window, _shortest_period(kinds)


def _moe(r: _Reader, model_type: str) -> MoE.Config:
    """The experts of a Mixtral / Qwen 3 MoE config. HF computes every token's experts, so the
    import is dropless. HF's one balancing loss over all layers (``router_aux_loss_coef``, added
    to the loss when ``output_router_logits``) is about the mean of the layers' own, so each
    layer weighs its own by coef / layers."""
    # HF adds its balancing loss to the training loss only with output_router_logits.
    balancing = bool(r.get("output_router_logits", False))
    coefficient = float(r.get("router_aux_loss_coef", 0.0) or 0.0)
    if model_type == "mixtral":
        experts = r.required("num_local_experts")
        hidden = r.required("intermediate_size")
        normalize = True
        r.expect("router_jitter_noise", lambda v: not v, "Titanax's router adds no noise", 0.0)
    else:
        # Published configs say num_experts; transformers 5 writes num_local_experts.
        experts = r.get("num_local_experts") or r.required("num_experts")
        hidden = r.required("moe_intermediate_size")
        r.get("intermediate_size")  # The dense MLPs' width: kept for the export only.
        normalize = bool(r.get("norm_topk_prob", model_type == "qwen3_5_moe_text"))
        r.expect("decoder_sparse_step", lambda v: v in (None, 1),
                 "every layer is a mixture of experts in Titanax's decoder", 1)
        r.expect("mlp_only_layers", lambda v: not v,
                 "every layer is a mixture of experts in Titanax's decoder", [])
    layers = r.required("num_hidden_layers")
    moe = MoE.default_config().set(
        hidden_dim=hidden, num_experts=experts, top_k=r.required("num_experts_per_tok"),
        dispatch="dropless",
        aux_loss_weight=coefficient / layers if balancing else 0.0)
    moe.router.normalize_top_k = normalize
    return moe


def moe_misfits(cfg: Decoder.Config, model_type: str) -> List[str]:
    """What of a mixture-of-experts model ``model_type`` would not compute."""
    if cfg.moe is None:
        return [f"{model_type} is a mixture of experts and the model has none"] \
            if model_type in MOE_TYPES else []
    if model_type not in MOE_TYPES:
        return [f"the model is a mixture of experts, which {model_type} is not"]
    if model_type == "deepseek_v3":
        return _deepseek_v3_moe_misfits(cfg.moe)
    problems: List[str] = []
    router, gpt_oss = cfg.moe.router, model_type == "gpt_oss"
    if (cfg.moe.activation == "clamped_swiglu") != gpt_oss or cfg.moe.expert_bias != gpt_oss \
            or router.bias != gpt_oss:
        problems.append("gpt_oss's experts -- and only its -- have biases, a biased router and "
                        "the clamped SwiGLU")
    if gpt_oss and not router.normalize_top_k:
        problems.append("gpt_oss renormalises the top-k gates")
    if router.scoring != "softmax" or router.routed_scaling != 1.0:
        problems.append("HF's MoE routers are softmax top-k with unscaled gates")
    if router.balance_rate or router.choosing_bias:
        problems.append("the expert bias that chooses (router.balance_rate, choosing_bias) has "
                        "no place in this family's router (deepseek_v3's has one), and choosing "
                        "without it changes the model")
    qwen3_5 = model_type == "qwen3_5_moe_text"
    if qwen3_5 and not (cfg.moe.shared_hidden_dim and cfg.moe.shared_gate):
        problems.append("qwen3_5_moe_text has a shared expert with its own sigmoid gate "
                        "(shared_hidden_dim, shared_gate)")
    if not qwen3_5 and (cfg.moe.shared_hidden_dim or cfg.moe.shared_gate):
        problems.append(f"{model_type} has no shared expert (qwen3_5_moe_text and deepseek_v3 "
                        "have)")
    if cfg.moe.activation not in ("silu", "clamped_swiglu"):
        problems.append("HF's experts are SwiGLU (silu)")
    if model_type in ("mixtral", "qwen3_5_moe_text") and not router.normalize_top_k:
        problems.append(f"{model_type} always renormalises the top-k gates")
    return problems


def _deepseek_v3_moe_misfits(moe: MoE.Config) -> List[str]:
    """What of a mixture of experts DeepSeek-V3's router and experts would not compute."""
    router, problems = moe.router, []
    if router.scoring != "sigmoid":
        problems.append("deepseek_v3's router scores by sigmoid")
    if not (router.choosing_bias or router.balance_rate):
        problems.append("deepseek_v3's router chooses with a bias (e_score_correction_bias): "
                        "set moe.router.choosing_bias")
    if router.bias or moe.expert_bias or moe.activation != "silu":
        problems.append("deepseek_v3's router and experts have no biases; its experts are "
                        "SwiGLU (silu)")
    if moe.shared_gate:
        problems.append("deepseek_v3's shared experts have no gate of their own")
    if moe.shared_hidden_dim % moe.hidden_dim:
        problems.append(f"deepseek_v3's shared experts are n_shared_experts x "
                        f"moe_intermediate_size={moe.hidden_dim} wide (shared_hidden_dim is "
                        f"{moe.shared_hidden_dim})")
    return problems


# --- Titanax -> HF -----------------------------------------------------------------------------

def hf_config_from_model(cfg: ConfigBase, *, model_type: Optional[str] = None,
                         extra: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """An HF ``config.json`` dict for a Titanax model config. ``model_type`` picks the HF family
    of a ``Decoder`` (default: the one its options need -- qwen3 with QK-norm, qwen2 with q/k/v
    biases only, mistral with a sliding window, llama otherwise); ``extra`` adds keys (token
    ids of the imported model)."""
    if isinstance(cfg, Decoder.Config) and is_gpt2(cfg):
        out = _gpt2_to_hf(cfg)
    elif isinstance(cfg, Decoder.Config):
        out = _decoder_to_hf(cfg, model_type or default_model_type(cfg))
    else:
        raise errors.HFError(f"no Hugging Face form for a {type(cfg).__qualname__}",
                             path="model", suggestion="export a Decoder model")
    out.update(dict(extra or {}))
    return out


def default_model_type(cfg: Decoder.Config) -> str:
    """The HF family whose modeling code computes what ``cfg`` does (checked by
    ``hf_config_from_model``: a model no family fits is refused there)."""
    if cfg.latent_attention is not None or cfg.first_dense_layers:
        return "deepseek_v3"
    if cfg.branch_output_norms or cfg.embedding_multiplier != 1.0:
        return "gemma3_text"
    if cfg.attention_sinks or (cfg.moe is not None and cfg.moe.expert_bias):
        return "gpt_oss"
    if cfg.norm_zero_centered or cfg.attention_output_gate or \
            "linear" in (cfg.layer_pattern or ()):
        return "qwen3_5_moe_text" if cfg.moe is not None else "qwen3_5_text"
    if cfg.moe is not None:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias and not cfg.attention_output_bias:
        return "qwen2"
    if cfg.sliding_window is not None:
        return "mistral"
    return "llama"


def _misfits(cfg: Decoder.Config, model_type: str) -> List[str]:
    """What of ``cfg`` the HF family ``model_type`` would not compute (its loader would drop
    or ignore it: a model that loads and is wrong)."""
    problems: List[str] = moe_misfits(cfg, model_type)
    # The family's GPT-2 switches, which no RoPE family computes.
    qwen3_5, gemma3 = model_type in QWEN3_5_TYPES, model_type == "gemma3_text"
    for name, want in (("norm", "rms"), ("mlp_activation", "gelu_tanh" if gemma3 else "silu"),
                       ("gated_mlp", True), ("fused_qkv", False),
                       ("norm_zero_centered", qwen3_5 or gemma3),
                       ("attention_output_gate", qwen3_5), ("branch_output_norms", gemma3)):
        if getattr(cfg, name) != want:
            problems.append(f"{model_type} has {name}={want!r} (this model: "
                            f"{getattr(cfg, name)!r})")
    problems += _gemma3_misfits(cfg, model_type)
    problems += _deepseek_v3_misfits(cfg, model_type)
    if cfg.mtp_depths and model_type != "deepseek_v3":
        problems.append(f"only deepseek_v3 holds multi-token-prediction layers (mtp_depths is "
                        f"{cfg.mtp_depths})")
    if cfg.attention_sinks != (model_type == "gpt_oss"):
        problems.append("gpt_oss has attention sinks and no other family does")
    if model_type == "gpt_oss" and cfg.qkv_bias != cfg.attention_output_bias:
        problems.append("gpt_oss's attention_bias sets q/k/v and output biases together")
    if cfg.qk_norm != (model_type in ("qwen3", "qwen3_moe", "gemma3_text") + QWEN3_5_TYPES):
        problems.append("qwen3, qwen3_moe, qwen3_5 and gemma3_text have QK-norm and no "
                        "other family does")
    if cfg.rotary_fraction != 1.0 and not qwen3_5:
        problems.append(f"{model_type} rotates whole heads (rotary_fraction is "
                        f"{cfg.rotary_fraction})")
    if qwen3_5 and (cfg.qkv_bias or cfg.attention_output_bias):
        problems.append(f"{model_type} has no attention biases")
    if qwen3_5 and cfg.linear_attention is not None and \
            cfg.linear_attention.norm_eps != cfg.norm_eps:
        problems.append(f"{model_type}'s Gated DeltaNet norm has the model's rms_norm_eps")
    if model_type == "qwen2" and (not cfg.qkv_bias or cfg.attention_output_bias):
        problems.append("qwen2 has q/k/v biases and no output bias")
    if model_type in ("llama", "qwen3", "qwen3_moe") and \
            cfg.qkv_bias != cfg.attention_output_bias:
        problems.append(f"{model_type}'s attention_bias sets q/k/v and output biases together")
    if model_type in ("mistral", "mixtral") and (cfg.qkv_bias or cfg.attention_output_bias):
        problems.append(f"{model_type} has no attention biases")
    problems += _pattern_misfits(cfg, model_type)
    if cfg.mlp_bias and model_type != "llama":
        problems.append("only llama has MLP biases (mlp_bias)")
    if cfg.rope_scaling is not None and model_type not in ("llama", "gemma3_text") and not (
            isinstance(cfg.rope_scaling, YarnRopeScaling.Config)
            and model_type in ("qwen2", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3")):
        problems.append("rope scaling is written for llama and gemma3_text (YaRN for Qwen, "
                        "gpt_oss and deepseek_v3 too) only")
    return problems


def _gemma3_misfits(cfg: Decoder.Config, model_type: str) -> List[str]:
    """Gemma 3's own switches against ``model_type``: its embedding scale, its attention scale,
    its one attention_bias."""
    head_dim = cfg.head_dim or cfg.model_dim // cfg.num_heads
    problems = []
    if model_type == "gemma3_text":
        if isinstance(cfg.rope_scaling, YarnRopeScaling.Config) and not cfg.rope_scaling.truncate:
            problems.append("gemma3_text's YaRN always rounds its ramp (truncate=False is not "
                            "read from its per-kind rope_parameters)")
        if cfg.embedding_multiplier != cfg.model_dim ** 0.5:
            problems.append(f"gemma3_text scales the embeddings by sqrt(hidden_size)="
                            f"{cfg.model_dim ** 0.5} (this model: {cfg.embedding_multiplier})")
        if cfg.qkv_bias != cfg.attention_output_bias:
            problems.append("gemma3_text's attention_bias sets q/k/v and output biases together")
        if cfg.mlp_bias:
            problems.append("gemma3_text has no MLP biases")
        return problems
    if cfg.embedding_multiplier != 1.0:
        problems.append(f"{model_type} does not scale its embeddings (embedding_multiplier is "
                        f"{cfg.embedding_multiplier})")
    if cfg.attention_scale not in (None, head_dim ** -0.5):
        problems.append(f"{model_type} scales scores by 1/sqrt(head_dim) (attention_scale is "
                        f"{cfg.attention_scale})")
    return problems


def _deepseek_v3_misfits(cfg: Decoder.Config, model_type: str) -> List[str]:
    """What of latent attention and dense first layers ``model_type`` would not compute."""
    deepseek = model_type == "deepseek_v3"
    if (cfg.latent_attention is not None) != deepseek:
        return ["deepseek_v3 -- and only it -- has latent attention (latent_attention)"]
    if not deepseek:
        return ["only deepseek_v3 has dense first layers"] if cfg.first_dense_layers else []
    problems = []
    if cfg.norm_eps != 1e-6:  # (transformers' latent norms take no epsilon from the config.)
        problems.append(f"deepseek_v3's latent norms use epsilon 1e-6 whatever rms_norm_eps "
                        f"says, and Titanax one epsilon (norm_eps is {cfg.norm_eps})")
    if cfg.latent_attention.bias:
        problems.append("deepseek_v3's attention_bias is not mapped (latent_attention.bias)")
    return problems


def _pattern_misfits(cfg: Decoder.Config, model_type: str) -> List[str]:
    """What of the layers' kinds and windows ``model_type`` would not compute."""
    qwen = model_type in ("qwen2", "qwen3", "qwen3_moe")
    if cfg.layer_pattern is None and model_type in QWEN3_5_TYPES and cfg.sliding_window:
        return [f"{model_type} has no sliding window"]
    if cfg.layer_pattern is None:
        if cfg.sliding_window is not None and \
                model_type not in ("mistral", "mixtral", "gemma3_text", "gpt_oss"):
            return ["only mistral, mixtral and gemma3_text have one sliding window for every "
                    "layer"]
        return []
    problems = []
    kinds = set(cfg.layer_pattern)
    if model_type in QWEN3_5_TYPES:
        if kinds - {"linear", "full"}:
            problems.append(f"{model_type} has linear_attention and full_attention layers only")
    elif not (qwen or model_type in ("gemma3_text", "gpt_oss")):
        problems.append("only qwen2, qwen3, qwen3_moe, qwen3_5_text and gemma3_text name each "
                        "layer's kind (layer_types)")
    elif "linear" in kinds:
        problems.append(f"{model_type} has no Gated DeltaNet ('linear') layers: qwen3_5_text "
                        "has")
    if cfg.sliding_rope_theta is not None and model_type != "gemma3_text":
        problems.append(f"{model_type} rotates every layer by one rope_theta "
                        "(sliding_rope_theta is set)")
    return problems


def _gpt2_to_hf(cfg: Decoder.Config) -> Dict[str, Any]:
    # Learned positions make it GPT-2's family: everything else must be GPT-2's too, or the
    # HF model would load and compute something else.
    gpt2 = gpt_config()
    switches = ("norm", "fused_qkv", "qkv_bias", "attention_output_bias", "mlp_bias",
                "gated_mlp", "mlp_activation", "tie_embeddings", "moe", "qk_norm",
                "sliding_window", "layer_pattern", "norm_zero_centered",
                "attention_output_gate", "rotary_fraction", "branch_output_norms",
                "embedding_multiplier", "attention_scale", "attention_sinks",
                "first_dense_layers", "latent_attention", "mtp_depths")
    misfits = [f"{name}={getattr(cfg, name)!r} (GPT-2: {getattr(gpt2, name)!r})"
               for name in switches if getattr(cfg, name) != getattr(gpt2, name)]
    # (Heads written out at their default values are GPT-2's too.)
    if cfg.num_kv_heads not in (None, cfg.num_heads):
        misfits.append(f"num_kv_heads={cfg.num_kv_heads} (GPT-2: one per query head)")
    if cfg.head_dim not in (None, cfg.model_dim // cfg.num_heads):
        misfits.append(f"head_dim={cfg.head_dim} (GPT-2: model_dim / num_heads)")
    if misfits:
        raise errors.HFError(
            "learned positions are GPT-2's, and the rest of this model is not: "
            + "; ".join(misfits), path="model",
            suggestion="export a model configured as titanax.modules.models.decoder.gpt_config, "
                       "or with rotary positions (a Llama-family export)")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len,
            "n_embd": cfg.model_dim, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
            "n_inner": cfg.hidden_dim, "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new", "resid_pdrop": cfg.dropout_rate,
            "embd_pdrop": cfg.dropout_rate, "attn_pdrop": cfg.attention_dropout_rate,
            "tie_word_embeddings": True, "scale_attn_weights": True}


def _qwen3_5_to_hf(cfg: Decoder.Config) -> Dict[str, Any]:
    """Qwen 3.5's own keys: every layer's type, the Gated DeltaNet sizes, the partial RoPE."""
    names = {"linear": "linear_attention", "full": "full_attention"}
    out: Dict[str, Any] = {
        "attention_bias": False,
        "layer_types": [names[k] for k in layer_kinds(cfg)],
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.rotary_fraction}}
    gdn = cfg.linear_attention
    if gdn is not None:
        out.update(linear_num_key_heads=gdn.num_key_heads,
                   linear_num_value_heads=gdn.num_value_heads,
                   linear_key_head_dim=gdn.key_head_dim, linear_value_head_dim=gdn.value_head_dim,
                   linear_conv_kernel_dim=gdn.conv_kernel_size)
    return out


def _qwen_layer_types_to_hf(cfg: Decoder.Config) -> Dict[str, Any]:
    """A Qwen config's sliding-window keys: every layer's type, from the layer pattern."""
    if cfg.layer_pattern is None:
        return {"use_sliding_window": False, "sliding_window": None}
    names = {kind: name for name, kind in HF_LAYER_KINDS.items()}
    return {"use_sliding_window": True, "sliding_window": cfg.sliding_window,
            "max_window_layers": 0, "layer_types": [names[k] for k in layer_kinds(cfg)]}


def _rope_to_hf(theta: float, scaling) -> Dict[str, Any]:
    """transformers 5's ``rope_parameters`` of one RoPE."""
    if scaling is None:
        return {"rope_theta": theta, "rope_type": "default"}
    if isinstance(scaling, LinearRopeScaling.Config):
        return {"rope_theta": theta, "rope_type": "linear", "factor": scaling.factor}
    if isinstance(scaling, YarnRopeScaling.Config):
        fields = ROPE_SCALINGS["yarn"][1] + ROPE_SCALINGS["yarn"][2]
        return {"rope_theta": theta, "rope_type": "yarn",
                **{k: getattr(scaling, k) for k in fields if getattr(scaling, k) is not None}}
    return {"rope_theta": theta, "rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}


def _gemma3_to_hf(cfg: Decoder.Config) -> Dict[str, Any]:
    """A whole Gemma 3 text ``config.json``: every layer's type, each kind's RoPE (the sliding
    layers' as the full ones' when sliding_rope_theta is None), the query scalar."""
    head_dim = cfg.head_dim or cfg.model_dim // cfg.num_heads
    names = {kind: name for name, kind in HF_LAYER_KINDS.items()}
    full = _rope_to_hf(cfg.rope_theta, cfg.rope_scaling)
    local = full if cfg.sliding_rope_theta is None else _rope_to_hf(cfg.sliding_rope_theta, None)
    scalar = head_dim if cfg.attention_scale is None else cfg.attention_scale ** -2
    if abs(scalar - round(scalar)) < 1e-6 * scalar:  # (HF writes an int.)
        scalar = int(round(scalar))
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.model_dim,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads, "head_dim": head_dim,
        "intermediate_size": cfg.hidden_dim or 4 * cfg.model_dim, "rms_norm_eps": cfg.norm_eps,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias, "attention_dropout": 0.0,
        "query_pre_attn_scalar": scalar, "sliding_window": cfg.sliding_window,
        "layer_types": [names[k] for k in layer_kinds(cfg)],
        "rope_parameters": {"full_attention": full, "sliding_attention": dict(local)},
        # The older spelling too, for transformers 4.x readers (a plain sliding RoPE only).
        "rope_theta": cfg.rope_theta,
        "rope_local_base_freq": local["rope_theta"],
        "rope_scaling": ({k: v for k, v in full.items() if k != "rope_theta"}
                         if cfg.rope_scaling is not None else None),
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "use_bidirectional_attention": False}


def _gpt_oss_to_hf(cfg: Decoder.Config) -> Dict[str, Any]:
    """A whole gpt-oss ``config.json``."""
    moe = cfg.moe
    names = {kind: name for name, kind in HF_LAYER_KINDS.items()}
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.model_dim,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads,
        "head_dim": cfg.head_dim or cfg.model_dim // cfg.num_heads,
        "intermediate_size": moe.hidden_dim, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.qkv_bias,
        "attention_dropout": 0.0, "sliding_window": cfg.sliding_window,
        "layer_types": [names[k] for k in layer_kinds(cfg)],
        "rope_parameters": _rope_to_hf(cfg.rope_theta, cfg.rope_scaling),
        # The older spelling too, for transformers 4.x readers.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": ({k: v for k, v in _rope_to_hf(cfg.rope_theta, cfg.rope_scaling).items()
                          if k != "rope_theta"} if cfg.rope_scaling is not None else None),
        "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "swiglu_alpha": moe.swiglu_alpha, "swiglu_limit": moe.swiglu_limit,
        "router_aux_loss_coef": moe.aux_loss_weight * cfg.num_layers,
        "output_router_logits": moe.aux_loss_weight > 0}


def _deepseek_v3_to_hf(cfg: Decoder.Config) -> Dict[str, Any]:
    """A whole DeepSeek-V3 ``config.json``, RoPE features in the published interleaved layout
    (param_map reorders them); the multi-token-prediction depths as the layers after the last
    (``num_nextn_predict_layers``)."""
    moe, mla = cfg.moe, cfg.latent_attention
    router = moe.router
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.model_dim,
        "intermediate_size": cfg.hidden_dim or 4 * cfg.model_dim,
        "moe_intermediate_size": moe.hidden_dim, "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads, "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.shared_hidden_dim // moe.hidden_dim,
        "routed_scaling_factor": router.routed_scaling, "n_group": router.num_groups,
        "topk_group": router.top_groups or router.num_groups, "norm_topk_prob": True,
        "first_k_dense_replace": cfg.first_dense_layers, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "rope_interleave": True,
        "num_nextn_predict_layers": cfg.mtp_depths,
        "rope_parameters": _rope_to_hf(cfg.rope_theta, cfg.rope_scaling)}


def _decoder_to_hf(cfg: Decoder.Config, model_type: str) -> Dict[str, Any]:
    problems = _misfits(cfg, model_type)
    if problems:
        fits = [t for t in DECODER_TYPES + MOE_TYPES if not _misfits(cfg, t)]
        raise errors.HFError(f"the model does not fit HF model_type {model_type!r}: "
                             + "; ".join(problems), path="model",
                             suggestion=f"export as {fits[0]!r}" if fits else
                             "no Hugging Face family computes this combination: change the "
                             "model's options (see docs/huggingface.md)")
    if model_type == "gemma3_text":
        return _gemma3_to_hf(cfg)
    if model_type == "gpt_oss":
        return _gpt_oss_to_hf(cfg)
    if model_type == "deepseek_v3":
        return _deepseek_v3_to_hf(cfg)
    architectures = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                     "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                     "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                     "qwen3_5_text": "Qwen3_5ForCausalLM",
                     "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
    head_dim = cfg.head_dim or cfg.model_dim // cfg.num_heads
    rope = _rope_to_hf(cfg.rope_theta, cfg.rope_scaling)
    out: Dict[str, Any] = {
        "architectures": [architectures[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.model_dim,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads, "head_dim": head_dim,
        "intermediate_size": cfg.hidden_dim or 4 * cfg.model_dim, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0,
        "rope_parameters": rope,
        # The older spelling too, for transformers 4.x readers.
        "rope_theta": cfg.rope_theta,
    }
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if model_type == "llama":
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if model_type in ("qwen3", "qwen3_moe"):
        out.update(attention_bias=cfg.qkv_bias)
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        out.update(_qwen_layer_types_to_hf(cfg))
    if model_type in QWEN3_5_TYPES:
        out.update(_qwen3_5_to_hf(cfg))
    if model_type in ("mistral", "mixtral"):
        out.update(sliding_window=cfg.sliding_window)
    return _with_moe_keys(out, cfg, model_type)


def _with_moe_keys(out: Dict[str, Any], cfg: Decoder.Config, model_type: str) -> Dict[str, Any]:
    """``out`` with the keys of ``model_type``'s experts (Mixtral's, Qwen 3 MoE's, Qwen 3.5
    MoE's; none for a dense family)."""
    moe = cfg.moe
    if model_type == "mixtral":
        out.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   intermediate_size=moe.hidden_dim, router_jitter_noise=0.0,
                   router_aux_loss_coef=moe.aux_loss_weight * cfg.num_layers,
                   output_router_logits=moe.aux_loss_weight > 0)
    if model_type == "qwen3_moe":
        out.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.hidden_dim, norm_topk_prob=moe.router.normalize_top_k,
                   decoder_sparse_step=1, mlp_only_layers=[],
                   router_aux_loss_coef=moe.aux_loss_weight * cfg.num_layers,
                   output_router_logits=moe.aux_loss_weight > 0)
    if model_type == "qwen3_5_moe_text":
        del out["intermediate_size"]  # (No dense MLP.)
        out.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.hidden_dim,
                   shared_expert_intermediate_size=moe.shared_hidden_dim,
                   router_aux_loss_coef=moe.aux_loss_weight * cfg.num_layers,
                   output_router_logits=moe.aux_loss_weight > 0)
    return out
