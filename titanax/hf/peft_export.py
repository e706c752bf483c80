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

import json
import os
from typing import Any, Dict, List, Optional

import jax
import numpy as np

from titanax import errors
from titanax.config import ConfigBase
from titanax.hf import param_map
from titanax.hf.model_configs import hf_config_from_model
from titanax.hf.safetensors_io import PlannedTensor, write_file
from titanax.modules import lora
from titanax.modules.models.decoder import is_gpt2

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


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
    hf_config_from_model(model_cfg)
    maps = {m.path: m for m in param_map.tensor_maps(model_cfg)}
    _, adapters = lora.split_adapters(params)
    planned: List[PlannedTensor] = []
    modules = set()
    for path in lora.adapted_paths(specs):
        spec = _at(specs, path)
        tensor_map = maps.get(path)
        if tensor_map is None:
            raise errors.HFError(f"{path} has no Hugging Face tensor to attach its adapter to",
                                 path="lora.targets",
                                 suggestion="export the run with --format=merged")
        a, b = (_host(_at(adapters, path + suffix)) for suffix in (lora.A_SUFFIX, lora.B_SUFFIX))
        layer_spec = lora.per_layer(spec)
        for layer in range(tensor_map.layers or 1):
            a_layer, b_layer = (x[layer] for x in (a, b)) if tensor_map.layers else (a, b)
            a_weight, b_weight = (np.asarray(x) for x in lora.as_weights(a_layer, b_layer,
                                                                          spec=layer_spec))
            for name, hf_a, hf_b in zip(tensor_map.names_for(layer),
                                        tensor_map.form.to_hf(a_weight),
                                        tensor_map.form.to_hf(b_weight)):
                module = name[:-len(".weight")]
                modules.add(module.rsplit(".", 1)[-1])
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
        config = adapter_config(lora_cfg, sorted(modules), base_model=base_model)
        with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
    return directory


def adapter_config(lora_cfg: ConfigBase, target_modules: List[str], *,
                   base_model: Optional[str]) -> Dict[str, Any]:
    """PEFT's LoraConfig fields for these adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank,
            "lora_alpha": lora_cfg.alpha, "lora_dropout": lora_cfg.dropout_rate,
            "use_rslora": lora_cfg.rslora, "target_modules": target_modules, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "base_model_name_or_path": base_model}


def _at(tree: Dict[str, Any], path: str) -> Any:
    for part in path.split("/"):
        tree = tree[part]
    return tree


def _host(value: Any) -> np.ndarray:
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(jax.device_get(value))
