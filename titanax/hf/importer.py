"""Hugging Face weights -> Titanax params, streamed straight into their shards.

Each param is built with ``jax.make_array_from_callback``: for every device shard the callback
reads only that shard's part of the HF tensor(s) -- one layer at a time for the stacked decoder,
from memory-mapped safetensors -- converts it (``param_map``) and casts it to the param dtype.
No step holds the whole model on the host; the peak is about one layer's tensor and the shards
being filled. Every HF tensor is accounted for: one that is missing, has another shape than
``config.json`` implies, or is left over (a part Titanax's model does not have) is an
``HFError`` naming it.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping, Optional, Tuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from titanax import errors
from titanax.config import ConfigBase
from titanax.hf import param_map
from titanax.hf.model_configs import model_config_from_hf
from titanax.hf.model_dir import CONFIG, ModelDir
from titanax.parallel import rules
from titanax.parallel.sharding import path_string

_log = logging.getLogger("titanax")


# HF tensors that are buffers, not weights (recomputed by the model).
BUFFER_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def model_config(directory: str) -> ConfigBase:
    """The Titanax model config of an HF model directory (of a multimodal one: its language
    model's, said once per directory on the log)."""
    source = ModelDir(directory)
    where = f"{directory.rstrip('/')}/{CONFIG}"
    cfg = model_config_from_hf(source.config, where=where + (": text_config"
                                                             if source.multimodal else ""))
    if source.multimodal and source.directory not in _TOLD_LEFT_OUT:
        _TOLD_LEFT_OUT.add(source.directory)
        _log.warning("%s is a multimodal %s checkpoint: its language model (%s) is loaded; "
                     "its other %d tensors (the vision tower and projector, any MTP head) are "
                     "left out", directory, source.multimodal, source.config["model_type"],
                     len(source.left_out))
    return cfg


# The multimodal directories whose left-out vision parts the log has named.
_TOLD_LEFT_OUT: set = set()


def check_tensor_shapes(directory: str, model_cfg: ConfigBase) -> None:
    """Every tensor ``model_cfg``'s params are made of has the shape ``config.json`` implies --
    read from the safetensors headers, before anything is loaded or compiled. A tensor that is
    missing or has another shape (a vocabulary larger than the embedding's rows, say) is an
    ``HFError`` naming it, its file and the param it feeds; left-over tensors are found when the
    weights load."""
    source = ModelDir(directory)
    model = model_cfg.clone().instantiate()
    leaves = jax.tree_util.tree_flatten_with_path(model.create_parameter_specs_recursively(),
                                                  is_leaf=rules.is_param_leaf)[0]
    shapes = {path_string(p): tuple(leaf.shape) for p, leaf in leaves}
    for tensor_map in param_map.tensor_maps(model_cfg):
        shape = shapes.get(tensor_map.path)
        if shape is None:
            continue
        # The unpadded table (config.json's vocabulary) is what the file must hold.
        per_layer = shape[1:] if tensor_map.layers else shape
        expected = param_map.hf_shapes(tensor_map.form, per_layer)
        for layer in range(tensor_map.layers or 1):
            for name, want in zip(tensor_map.names_for(layer), expected):
                source.tensor(name, expected_shape=want, needed_by=tensor_map.path,
                              dequantize=False)


def import_params(directory: str, *, model_cfg: ConfigBase, parameter_specs: Any, mesh: Mesh,
                  partition_specs: Any, dtype: Any) -> Any:
    """The params of ``model_cfg`` from the HF directory, as global arrays placed with
    ``partition_specs`` on ``mesh`` (the canonical layout: stacks ``[L, ...]``), floating params
    cast to ``dtype``."""
    source = ModelDir(directory)
    maps = {m.path: m for m in param_map.tensor_maps(model_cfg)}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(parameter_specs,
                                                           is_leaf=rules.is_param_leaf)
    spec_leaves = jax.tree_util.tree_leaves(partition_specs,
                                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    paths = [path_string(p) for p, _ in leaves]
    missing = sorted(set(paths) - set(maps))
    if missing:
        raise errors.HFError(f"no Hugging Face tensor is known for param(s) {', '.join(missing)}",
                             path=missing[0], suggestion="import a model of the supported "
                                                         "families as configured from its "
                                                         "config.json")
    out: List[jax.Array] = []
    used: set = set()
    for path, (_, leaf), spec in zip(paths, leaves, spec_leaves):
        tensor_map = maps[path]
        target_dtype = dtype if np.issubdtype(np.dtype(leaf.dtype), np.floating) else leaf.dtype
        reader = _ParamReader(source, tensor_map, tuple(leaf.shape), np.dtype(target_dtype))
        out.append(jax.make_array_from_callback(tuple(leaf.shape), NamedSharding(mesh, spec),
                                                reader.block))
        used.update(reader.names())
    _check_all_used(source, used, model_cfg)
    return jax.tree_util.tree_unflatten(treedef, out)


def _unread_prediction_tensor(name: str, model_cfg: ConfigBase, source: Any) -> bool:
    """A tensor of a checkpoint's multi-token-prediction layers (``model.layers.{i}`` past the
    last layer, as many as its ``num_nextn_predict_layers``: DeepSeek-V3) that the model does
    not read: a depth past its ``mtp_depths`` (transformers reads none), or a depth's copy of
    the embedding or head it shares."""
    config = getattr(source, "config", None) or {}
    depths = int(config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 0)
    parts = name.split(".")
    if not depths or len(parts) < 4 or parts[:2] != ["model", "layers"] or \
            not parts[2].isdigit():
        return False
    depth = int(parts[2]) - model_cfg.num_layers
    if not 0 <= depth < depths:
        return False
    return depth >= getattr(model_cfg, "mtp_depths", 0) or \
        ".".join(parts[3:]) in param_map.PREDICTION_COPIES


def _check_all_used(source: ModelDir, used: set, model_cfg: ConfigBase) -> None:
    tied = getattr(model_cfg, "tie_embeddings", True)  # (GPT-2 has no field: always tied.)
    used = used | source.scales_read  # (The scales of the FP8 weights dequantised.)
    left = sorted(n for n in source.names()
                  if n not in used and not n.endswith(BUFFER_SUFFIXES)
                  and not (tied and n == "lm_head.weight")
                  and not _unread_prediction_tensor(n, model_cfg, source))
    if left:
        raise errors.HFError(
            f"{len(left)} tensor(s) of the checkpoint have no place in the model config.json "
            f"describes: {', '.join(left[:6])}" + (" ..." if len(left) > 6 else ""),
            path=source.directory, suggestion="the config.json and the weights disagree, or the "
                                              "model has parts Titanax does not implement")


class _ParamReader:
    """Fills one param's device shards from its HF tensors."""

    def __init__(self, source: Any, tensor_map: param_map.TensorMap,
                 shape: Tuple[int, ...], dtype: np.dtype):
        self.source, self.map, self.shape, self.dtype = source, tensor_map, shape, dtype
        self._cache: Dict[int, np.ndarray] = {}

    def names(self) -> List[str]:
        layers = range(self.map.layers) if self.map.layers else [0]
        return [n for i in layers for n in self.map.names_for(i)]

    def _layer(self, layer: int) -> np.ndarray:
        """The Titanax array of one layer (or of an unstacked param), a view where it can be.
        The last one is kept: a device's neighbours usually ask for the same layer."""
        if layer in self._cache:
            return self._cache[layer]
        names = self.map.names_for(layer)
        tensors = [self.source.tensor(n, needed_by=self.map.path, dtype=self.dtype)
                   for n in names]
        expected = self.shape[1:] if self.map.layers else self.shape
        try:
            array = self.map.form.to_titanax(tensors)
        except ValueError as e:
            array = None
            reason = str(e)
        else:
            reason = ""
        if array is None or tuple(array.shape) != tuple(expected):
            shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, tensors))
            raise errors.HFError(
                f"{shapes} cannot make Titanax param {self.map.path} of shape "
                f"{tuple(expected)}" + (f" ({reason})" if reason else ""),
                path=self.source.directory,
                suggestion="the config.json and the weights disagree: check that both come "
                           "from the same model")
        self._cache = {layer: array}
        return array

    def block(self, index: Tuple[slice, ...]) -> np.ndarray:
        if not self.map.layers:
            return np.ascontiguousarray(self._layer(0)[index], dtype=self.dtype)
        layers = range(self.map.layers)[index[0]]
        return np.stack([np.asarray(self._layer(i)[index[1:]], dtype=self.dtype)
                         for i in layers])


class StateDict:
    """A state dict of numpy arrays (HF names) as a tensor source, like a ``ModelDir``."""

    def __init__(self, tensors: Mapping[str, np.ndarray], *, where: str = "state dict"):
        self.tensors, self.directory = dict(tensors), where

    def names(self):
        return self.tensors.keys()

    def tensor(self, name: str, *, needed_by: str = "",
               dtype: Optional[np.dtype] = None) -> np.ndarray:  # pylint: disable=unused-argument
        """(``dtype``: read by a directory's FP8 weights only; these are cast per slice.)"""
        if name not in self.tensors:
            raise errors.HFError(f"tensor {name!r} is missing" + (
                f" (Titanax param {needed_by})" if needed_by else ""), path=name,
                suggestion="the model config and the state dict disagree: check their sizes")
        return np.asarray(self.tensors[name])


def params_from_state_dict(tensors: Mapping[str, np.ndarray], model_cfg: ConfigBase
                           ) -> Dict[str, Any]:
    """Titanax params (numpy) from an HF state dict held in memory (``torch`` tensors turned
    into numpy, or arrays from any file): the same maps and checks as a directory import.
    GPT-2 state dicts may drop the ``transformer.`` prefix (``GPT2Model``'s names)."""
    if not any(name.startswith(("transformer.", "model.")) for name in tensors):
        tensors = {f"transformer.{k}": v for k, v in tensors.items()}
    source = StateDict(tensors)
    model = model_cfg.instantiate()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        model.create_parameter_specs_recursively(), is_leaf=rules.is_param_leaf)
    maps = {m.path: m for m in param_map.tensor_maps(model_cfg)}
    out = []
    for key_path, leaf in leaves:
        reader = _ParamReader(source, maps[path_string(key_path)], tuple(leaf.shape),
                              np.dtype(np.float32))
        out.append(reader.block(tuple(slice(None) for _ in leaf.shape)))
    return jax.tree_util.tree_unflatten(treedef, out)


def params_as_numpy(directory: str, model_cfg: Optional[ConfigBase] = None, *,
                    dtype: Any = np.float32) -> Dict[str, Any]:
    """Every param as a numpy array of ``dtype`` on the host (tests and small models only)."""
    cfg = model_cfg or model_config(directory)
    model = cfg.instantiate()
    specs = model.create_parameter_specs_recursively()
    mesh = Mesh(np.array(jax.devices()[:1]), ("one",))
    params = import_params(directory, model_cfg=cfg, parameter_specs=specs, mesh=mesh,
                           partition_specs=jax.tree_util.tree_map(
                               lambda _: jax.sharding.PartitionSpec(), specs,
                               is_leaf=rules.is_param_leaf), dtype=dtype)
    return jax.tree_util.tree_map(np.asarray, params)




def params_for_engine(engine: Any, directory: str) -> Any:
    """The params of the HF directory in ``engine``'s canonical layout (restorable into any
    layout of that engine: ``engine.init_state(params=...)`` takes them). The engine's model
    config must be the one the directory describes (``model_config``)."""
    engine.build()
    model_cfg = engine.model.config
    # What the model converters add (LoRA's adapters) and the objective's frozen models are not
    # in the directory (the engine adds them).
    partition_specs = engine.own_params(engine.layout.canonical_param_specs)
    return import_params(directory, model_cfg=model_cfg,
                         parameter_specs=engine.model.create_parameter_specs_recursively(),
                         mesh=engine.mesh, partition_specs=partition_specs,
                         dtype=engine.precision.param_dtype)
