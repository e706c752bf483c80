"""Titanax params -> a Hugging Face model directory that ``from_pretrained`` loads as is.

The directory gets ``config.json`` (``model_configs.hf_config_from_model``), the weights as
safetensors -- one ``model.safetensors``, or shards of at most ``max_shard_bytes`` named by
``model.safetensors.index.json`` -- and, when the model came from an HF directory, that
directory's tokenizer and generation files. Tensors are gathered from the devices one layer at a
time, when the writer reaches them; in a multi-process job every process takes part in each
gather and process 0 writes. A directory that exists and is not empty is refused: an export
never mixes with or overwrites anything.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Dict, List, Optional, Sequence

import jax
import numpy as np

from titanax import errors
from titanax.config import ConfigBase
from titanax.hf import param_map
from titanax.hf.model_configs import hf_config_from_model
from titanax.hf.model_dir import CONFIG, INDEX, MULTIMODAL, SINGLE, language_model_config
from titanax.hf.safetensors_io import PlannedTensor, write_file
from titanax.io.files import new_directory
from titanax.parallel import rules
from titanax.parallel.sharding import path_string

# Files of an HF model directory that describe its tokenizer ...
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
# ... and its generation defaults.
GENERATION_FILES = ("generation_config.json",)
SIDE_FILES = TOKENIZER_FILES + GENERATION_FILES

# Where export_params takes the tokenizer files from by default: the source directory.
FROM_SOURCE = "source"

# HF's default shard size.
DEFAULT_MAX_SHARD_BYTES = 5 * 2 ** 30


def check_target(directory: str) -> str:
    """``directory`` as an absolute path, refused when it holds anything or cannot be made."""
    return new_directory(directory, where="export target", error=errors.HFError)


def export_params(params: Any, *, model_cfg: ConfigBase, directory: str,
                  dtype: Optional[Any] = None, model_type: Optional[str] = None,
                  source_dir: Optional[str] = None,
                  tokenizer_dir: Optional[str] = FROM_SOURCE,
                  chat_template: Optional[str] = None,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Writes the HF directory of ``params`` (canonical layout: stacks ``[L, ...]``; global
    jax arrays or numpy) and returns its path. ``dtype``: of the written floats (default: the
    params'); ``source_dir``: the HF directory the model came from (its token ids and
    generation files are carried over); ``tokenizer_dir``: the directory of the tokenizer the
    weights were trained with, whose files are carried over (default: the source's; None: no
    tokenizer files -- bytes); ``chat_template``: the Jinja template the run rendered its
    conversations with when it configured one (written into tokenizer_config.json, in place of
    any shipped template: transformers then renders chats as the model was trained)."""
    writer = jax.process_index() == 0
    # Checked by the writer only: another process may look after it created the files.
    directory = check_target(directory) if writer else os.path.abspath(directory)
    source_config = _source_config(source_dir)
    extra = {k: source_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
             if k in source_config}
    if not _is_gpt(model_cfg):
        model_type = model_type or source_config.get("model_type")
    config = hf_config_from_model(model_cfg, model_type=model_type, extra=extra)
    planned = _plan(params, model_cfg, dtype)
    config["dtype"] = str(np.dtype(planned[0].dtype)) if planned else "float32"
    config["torch_dtype"] = config["dtype"]  # The name transformers 4.x reads.
    shards = _shards(planned, max_shard_bytes)
    if writer:
        os.makedirs(directory, exist_ok=True)
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        write_file(os.path.join(directory, name), shard, write=writer)
    if writer:
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in planned)},
                     "weight_map": {t.name: n for n, shard in zip(names, shards) for t in shard}}
            _write_json(os.path.join(directory, INDEX), index)
        tokenizer_dir = source_dir if tokenizer_dir == FROM_SOURCE else tokenizer_dir
        _copy_files(source_dir, GENERATION_FILES, directory)
        write_tokenizer(directory, tokenizer_dir=tokenizer_dir, chat_template=chat_template)
        _write_json(os.path.join(directory, CONFIG), config)  # Last: the directory is complete.
    return directory


def write_tokenizer(directory: str, *, tokenizer_dir: Optional[str],
                    chat_template: Optional[str]) -> None:
    """The tokenizer files of ``tokenizer_dir`` (None: none -- bytes) into ``directory``, with
    ``chat_template`` (when given) as their chat template."""
    _copy_files(tokenizer_dir, TOKENIZER_FILES, directory)
    if chat_template is not None and tokenizer_dir:
        _write_chat_template(directory, chat_template)


def _copy_files(origin: Optional[str], names: Sequence[str], directory: str) -> None:
    for name in names if origin else ():
        if os.path.isfile(os.path.join(origin, name)):
            shutil.copyfile(os.path.join(origin, name), os.path.join(directory, name))


def _write_chat_template(directory: str, template: str) -> None:
    """``template`` as the exported tokenizer's only one: in its tokenizer_config.json (a shipped
    chat_template.jinja would take precedence in transformers: removed)."""
    path = os.path.join(directory, "tokenizer_config.json")
    config = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    config["chat_template"] = template
    _write_json(path, config)
    for shipped in ("chat_template.jinja", "chat_template.json"):
        if os.path.isfile(os.path.join(directory, shipped)):
            os.remove(os.path.join(directory, shipped))


def _is_gpt(cfg: ConfigBase) -> bool:
    from titanax.modules.models.decoder import is_gpt2  # pylint: disable=import-outside-toplevel
    return is_gpt2(cfg)


def _source_config(source_dir: Optional[str]) -> Dict[str, Any]:
    if not source_dir or not os.path.isfile(os.path.join(source_dir, CONFIG)):
        return {}
    with open(os.path.join(source_dir, CONFIG), encoding="utf-8") as f:
        config = json.load(f)
    if isinstance(config, dict) and config.get("model_type") in MULTIMODAL:
        # (A multimodal source exports as its language model: the text model's token ids.)
        config = language_model_config(config, where=os.path.join(source_dir, CONFIG))
    return config


def _write_json(path: str, value: Any) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)


def _plan(params: Any, model_cfg: ConfigBase, dtype: Optional[Any]) -> List[PlannedTensor]:
    """Every HF tensor, in the order HF names sort, with the function that produces it."""
    leaves = dict((path_string(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=rules.is_param_leaf)[0])
    planned: List[PlannedTensor] = []
    shared: Dict[str, list] = {}  # HF name -> [(part, producer, dtype)] of the params it holds
    for tensor_map in param_map.tensor_maps(model_cfg) + param_map.prediction_copies(model_cfg):
        if tensor_map.path not in leaves:
            raise errors.HFError(f"the params have no {tensor_map.path}", path=tensor_map.path,
                                 suggestion="export params of the model the config describes")
        leaf = leaves[tensor_map.path]
        out_dtype = np.dtype(dtype or leaf.dtype)
        layer_of = _LayerFetcher(leaf, tensor_map)
        layer_shape = tuple(leaf.shape[1:]) if tensor_map.layers else tuple(leaf.shape)
        # Shapes from a never-touched array (np.empty does not commit memory).
        shapes = [t.shape for t in tensor_map.form.to_hf(np.empty(layer_shape, np.uint8))]
        for layer in range(tensor_map.layers or 1):
            for k, (name, shape) in enumerate(zip(tensor_map.names_for(layer), shapes)):
                produce = _producer(layer_of, layer, k)
                if tensor_map.form.part is not None:
                    shared.setdefault(name, []).append((tensor_map.form.part, produce,
                                                        out_dtype))
                    continue
                planned.append(PlannedTensor(name=name, shape=tuple(shape), dtype=out_dtype,
                                             produce=produce))
    planned += [_assembled(name, parts) for name, parts in shared.items()]
    return sorted(planned, key=lambda t: _natural_key(t.name))


def _assembled(name: str, parts: list) -> PlannedTensor:
    """An HF tensor several params share (``param_map.Part``), written whole: each param's part
    placed where it came from. Parts that do not fill it exactly are refused (a tensor with
    zeros where weights belong would load and be wrong)."""
    full_shape = parts[0][0].full_shape
    covered = np.zeros(full_shape, np.int8)
    for part, _, _ in parts:
        covered.reshape(part.view_shape)[part.index] += 1
    if not (covered == 1).all():
        raise errors.HFError(f"the params meant to make {name} do not fill it exactly once",
                             path=name, suggestion="a Titanax defect in hf/param_map.py: "
                                                   "please report it")

    def produce():
        full = np.zeros(full_shape, parts[0][2])
        for part, part_producer, _ in parts:
            full.reshape(part.view_shape)[part.index] = part_producer()
        return full

    return PlannedTensor(name=name, shape=tuple(full_shape), dtype=parts[0][2], produce=produce)


def _producer(layer_of: "_LayerFetcher", layer: int, k: int) -> Callable[[], np.ndarray]:
    return lambda: layer_of.hf_tensors(layer)[k]


class _LayerFetcher:
    """One param's HF tensors, gathered to the host one layer at a time (the last one kept:
    gate and up come from the same layer)."""

    def __init__(self, leaf: Any, tensor_map: param_map.TensorMap):
        self.leaf, self.map = leaf, tensor_map
        self._last: Optional[tuple] = None

    def hf_tensors(self, layer: int) -> List[np.ndarray]:
        if self._last is None or self._last[0] != layer:
            value = self.leaf[layer] if self.map.layers else self.leaf
            self._last = (layer, self.map.form.to_hf(_to_host(value)))
        return self._last[1]


def _to_host(value: Any) -> np.ndarray:
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(jax.device_get(value))


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def _shards(planned: List[PlannedTensor], max_bytes: int) -> List[List[PlannedTensor]]:
    shards: List[List[PlannedTensor]] = [[]]
    size = 0
    for tensor in planned:
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards

