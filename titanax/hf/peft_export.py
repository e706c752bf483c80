"""A LoRA run's adapters as a PEFT adapter directory: ``adapter_config.json`` +
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base, directory)`` loads
onto the Hugging Face base model.

Each adapted weight's Hugging Face module (``model.layers.{i}.self_attn.q_proj``, ...) gets
``lora_A.weight [r, in]`` and ``lora_B.weight [out, r]`` under ``base_model.model.``. They come
from the same forms that export the weights (``param_map``): A and B are laid out as weights of
their own (``lora.as_weights``: A from the inputs to r, B from r to the outputs) and each form
turns them into ``[out, in]`` tensors as it turns the weight -- so Titanax's gated MLP, one
``[d, 2, hidden]`` weight with an adapter for each half, becomes PEFT's separate ``gate_proj``
and ``up_proj`` adapters, and heads fold back into ``q_proj``'s rows. ``lora_alpha``, ``r`` and
``use_rslora`` carry the scale. GPT-2's ``Conv1D`` modules (stored ``[in, out]``) are not
written here: export such a run merged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Tuple

import jax
import numpy as np

from titanax import errors
from titanax.config import ConfigBase
from titanax.hf import param_map
from titanax.hf.model_configs import hf_config_from_model
from titanax.hf.model_dir import read_config
from titanax.hf.safetensors_io import PlannedTensor, write_file
from titanax.modules import lora
from titanax.modules.models.decoder import is_gpt2

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
# Families whose MLP projection names PEFT's loader (0.18+, under transformers 5) takes for their
# experts' fused weights (peft/utils/transformers_weight_conversion.py): an adapter of a dense
# MLP or a shared expert there would be dropped on load, silently.
EXPERT_RENAMED_TYPES = frozenset({"deepseek_v3", "qwen3_moe"})
EXPERT_RENAMED_NAMES = ("gate_proj", "up_proj", "down_proj")
# Where the multi-token-prediction depths' params sit (no transformers module reads them).
PREDICTION_PREFIX = "prediction/"
# Multimodal base model types -> where AutoModelForCausalLM puts the language model's modules
# when it loads such a directory (transformers 5): a Gemma 3 directory builds
# Gemma3ForConditionalGeneration (``model.language_model.layers...``, a vision tower beside it
# whose attention has q_proj too); a Qwen 3.5 one builds the text model alone
# (Qwen3_5ForCausalLM: ``model.layers...``), as a language model's directory does.
MULTIMODAL_MODULE_PREFIXES = {"gemma3": "model.language_model."}
TEXT_MODEL_PREFIX = "model."


def export_peft(params: Any, *, model_cfg: ConfigBase, specs: Dict[str, Any],
                lora_cfg: ConfigBase, directory: str, base_model: Optional[str] = None) -> str:
    """Writes the PEFT directory of the adapters in ``params`` (a LoRA run's, canonical layout;
    ``specs``: the run's ParameterSpecs) into ``directory`` (new or empty, checked by the
    caller); ``base_model``: the HF directory the run started from (the config names it)."""
    if is_gpt2(model_cfg):
        raise errors.HFError("PEFT adapters for GPT-2's Conv1D modules are not written",
                             path="--format", suggestion="export the run with --format=merged")
    # The base must be a model some HF family computes (the field that is not, named): PEFT
    # loads the adapters onto that family's modules.
    model_type = hf_config_from_model(model_cfg)["model_type"]
    maps = {m.path: m for m in param_map.tensor_maps(model_cfg)}
    _, adapters = lora.split_adapters(params)
    modules: Dict[str, List[_Adapter]] = {}
    for path in lora.adapted_paths(specs):
        tensor_map = maps.get(path)
        if path.startswith(PREDICTION_PREFIX):
            raise errors.HFError(
                f"{path} is a multi-token-prediction depth's weight, and transformers builds no "
                "module for those layers: PEFT would drop its adapter on load",
                path="lora.targets", suggestion="export the run with --format=merged, or leave "
                "the depths out of lora.targets (e.g. '^(?!prediction/).*attn/.*weight$')")
        if tensor_map is None:
            raise errors.HFError(f"{path} has no Hugging Face tensor to attach its adapter to",
                                 path="lora.targets",
                                 suggestion="export the run with --format=merged")
        a, b = (_host(_at(adapters, path + suffix)) for suffix in (lora.A_SUFFIX, lora.B_SUFFIX))
        for name, adapter in _hf_adapters(tensor_map, a, b, spec=_at(specs, path)):
            modules.setdefault(name[:-len(".weight")], []).append(adapter)
    _check_loadable(modules, model_type=model_type)
    modules, targets = _named_in_base(modules, base_model=base_model)
    planned: List[PlannedTensor] = []
    ranks: Dict[str, int] = {}
    for module, parts in modules.items():
        hf_a, hf_b = _joined(parts) if len(parts) > 1 or parts[0].part else (parts[0].a,
                                                                              parts[0].b)
        if len(parts) > 1:
            ranks[module] = hf_a.shape[0]
        for part, value in (("lora_A", hf_a), ("lora_B", hf_b)):
            value = np.ascontiguousarray(value)
            planned.append(PlannedTensor(
                name=f"{PREFIX}{module}.{part}.weight", shape=tuple(value.shape),
                dtype=value.dtype, produce=lambda v=value: v))
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(directory, exist_ok=True)
    write_file(os.path.join(directory, WEIGHTS_FILE), sorted(planned, key=lambda t: t.name),
               write=writer)
    if writer:
        config = adapter_config(lora_cfg, targets, base_model=base_model, ranks=ranks)
        with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
    return directory


def _language_model_prefix(base_model: Optional[str]) -> str:
    """Where the language model's modules sit in what AutoModelForCausalLM builds from
    ``base_model`` ("" unless a multimodal directory nests them). A base whose config.json is
    gone is refused: the names would be a guess, and adapters under wrong names load nowhere
    (PEFT puts fresh ones in their place: the base model, silently)."""
    if not base_model:
        return ""
    config = read_config(base_model)
    return MULTIMODAL_MODULE_PREFIXES.get(config.get("model_type"), "")


def _named_in_base(modules: Dict[str, Any], *, base_model: Optional[str]
                   ) -> Tuple[Dict[str, Any], Any]:
    """``(modules by their names in the base AutoModelForCausalLM builds, PEFT's
    target_modules)``: the module names' last parts, or -- for a language model nested beside
    a vision tower -- a pattern of the language model's, so the tower's modules of the same
    names get no adapter."""
    within = _language_model_prefix(base_model)
    names = sorted({m.rsplit(".", 1)[-1] for m in modules})
    if not within:
        return modules, names
    renamed = {within + m[len(TEXT_MODEL_PREFIX):] if m.startswith(TEXT_MODEL_PREFIX) else m:
               parts for m, parts in modules.items()}
    return renamed, f"{re.escape(within)}.*\\.({'|'.join(names)})"


def _check_loadable(modules: Dict[str, Any], *, model_type: str) -> None:
    renamed = sorted(m for m in modules if m.rsplit(".", 1)[-1] in EXPERT_RENAMED_NAMES)
    if model_type in EXPERT_RENAMED_TYPES and renamed:
        raise errors.HFError(
            f"PEFT loads a {model_type} adapter's {'/'.join(EXPERT_RENAMED_NAMES)} as the "
            f"experts' fused weights, so the adapter of {renamed[0]} would be dropped on load",
            path="lora.targets",
            suggestion="export the run with --format=merged, or train without MLP targets "
                       "(attention's only: --config.lora.targets=\"['(^|/)attn/.*weight$']\")")


def adapter_config(lora_cfg: ConfigBase, target_modules: Any, *,
                   base_model: Optional[str], ranks: Optional[Dict[str, int]] = None
                   ) -> Dict[str, Any]:
    """PEFT's LoraConfig fields for these adapters (``target_modules``: module names, or a
    regular expression PEFT matches whole names with). ``ranks``: the modules whose adapter joins
    several of Titanax's (one HF tensor holding several params), by name, and its rank -- a
    multiple of ``r`` -- with the alpha that keeps ``r``'s scale."""
    ranks = ranks or {}
    times = {m: rank / lora_cfg.rank for m, rank in ranks.items()}
    alphas = {re.escape(m): lora_cfg.alpha * (math.sqrt(k) if lora_cfg.rslora else k)
              for m, k in times.items()}
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank,
            "rank_pattern": {re.escape(m): rank for m, rank in ranks.items()},
            "alpha_pattern": alphas,
            "lora_alpha": lora_cfg.alpha, "lora_dropout": lora_cfg.dropout_rate,
            "use_rslora": lora_cfg.rslora, "target_modules": target_modules, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "base_model_name_or_path": base_model}


@dataclasses.dataclass(frozen=True)
class _Adapter:
    """One Titanax adapter pair as PEFT's tensors of its HF module: ``a`` ``[r, in]``, ``b``
    ``[out, r]`` -- or, where the param is a ``part`` of the module's tensor, ``b`` the part's
    rows only."""

    a: np.ndarray
    b: np.ndarray
    part: Optional[param_map.Part]


def _hf_adapters(tensor_map: param_map.TensorMap, a: np.ndarray, b: np.ndarray, *,
                 spec: Any) -> Iterator[Tuple[str, _Adapter]]:
    """``(HF tensor name, adapter)`` for each layer of one adapted param. B is a weight from
    the rank to the param's outputs, so the param's form turns it as it turns the weight
    (heads folded into rows, RoPE features reordered); A goes from the inputs to the rank, so
    a weight with its inputs first and nothing else beside them (no gate / up pair) gives
    ``A^T``, whatever its form does to outputs."""
    layer_spec = lora.per_layer(spec)
    roles = lora.weight_roles(layer_spec, path=tensor_map.path)
    plain_inputs = not roles.batch and roles.inputs == (0,)
    for layer in range(tensor_map.layers or 1):
        a_layer, b_layer = (x[layer] for x in (a, b)) if tensor_map.layers else (a, b)
        a_weight, b_weight = (np.asarray(x) for x in lora.as_weights(a_layer, b_layer,
                                                                      spec=layer_spec))
        hf_as = ([a_weight.reshape(a_weight.shape[0], -1).T] if plain_inputs
                 else tensor_map.form.to_hf(a_weight))
        for name, hf_a, hf_b in zip(tensor_map.names_for(layer), hf_as,
                                    tensor_map.form.to_hf(b_weight)):
            yield name, _Adapter(a=hf_a, b=hf_b, part=tensor_map.form.part)


def _joined(parts: List[_Adapter]) -> Tuple[np.ndarray, np.ndarray]:
    """One module's adapter from its params' (each a part of the module's tensor): A their As
    stacked (rank ``k r``), B zero but for each part's rows, which read its own rank's
    columns -- the same product, summed, as the params' adapters."""
    rank = parts[0].a.shape[0]
    total = rank * len(parts)
    full = parts[0].part.full_shape
    b = np.zeros(full[:-1] + (total,), parts[0].b.dtype)
    view = b.reshape(parts[0].part.view_shape[:-1] + (total,))
    for k, adapter in enumerate(parts):
        view[adapter.part.index][..., k * rank:(k + 1) * rank] = adapter.b
    return np.concatenate([adapter.a for adapter in parts]), b


def _at(tree: Dict[str, Any], path: str) -> Any:
    for part in path.split("/"):
        tree = tree[part]
    return tree


def _host(value: Any) -> np.ndarray:
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(jax.device_get(value))
