"""A Hugging Face model directory: ``config.json`` and its safetensors weights.

The weights are one ``model.safetensors`` or shards named by ``model.safetensors.index.json``
(``{"weight_map": {tensor: file}}``). Every tensor is served as a view of its file's memory map,
so reading a slice reads only that slice. Errors name the file and what is missing.

A multimodal checkpoint of a family whose language model Titanax implements (Gemma 3's
``gemma3``, Qwen 3.5's ``qwen3_5``: most published ones are) reads as that language model: its
``text_config`` is the config, its language model's tensors are served under the text model's
names, and the vision tower's and projector's are left out (``left_out``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from titanax import errors
from titanax.hf import fp8_blocks
from titanax.hf.safetensors_io import SafetensorsFile
from titanax.io.files import read_json_object

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"

# Multimodal model types -> the model type of their language model (its text_config).
MULTIMODAL = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text",
              "qwen3_5_moe": "qwen3_5_moe_text"}
# Whether their heads are tied when config.json does not say (transformers' class defaults).
MULTIMODAL_TIED = {"gemma3": True, "qwen3_5": False, "qwen3_5_moe": False}
# Where a multimodal checkpoint keeps its language model -> the text model's own names
# (transformers 5 writes Gemma 3's in the older layout, Qwen 3.5's in the newer).
LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."),
                           ("language_model.lm_head.", "lm_head."),
                           ("model.language_model.", "model."), ("lm_head.", "lm_head."))


def read_config(directory: str) -> Dict[str, Any]:
    """The directory's ``config.json``; a missing or unreadable one is an ``HFError``."""
    if not os.path.isdir(directory):
        raise errors.HFError("no such directory", path=directory,
                             suggestion="give the directory of a Hugging Face model (it holds "
                                        "config.json and *.safetensors)")
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise errors.HFError("the directory has no config.json", path=path,
                             suggestion="a Hugging Face model directory (save_pretrained, or a "
                                        "downloaded snapshot) holds config.json")
    return read_json_object(path, error=errors.HFError)


class ModelDir:
    """The config and the tensors of one HF model directory."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        config = read_config(self.directory)
        # The multimodal model type whose language model this is (None: a language model).
        self.multimodal: Optional[str] = None
        if config.get("model_type") in MULTIMODAL:
            self.multimodal = config["model_type"]
            config = language_model_config(config, where=os.path.join(self.directory, CONFIG))
        self.config = config
        # The (out, in) block of FP8 weights (None: unquantised): hf/fp8_blocks.py.
        self.fp8_block = fp8_blocks.block_size(config)
        # The scales of the FP8 weights read so far (what the importer counts as used).
        self.scales_read: set = set()
        self._files: Dict[str, SafetensorsFile] = {}
        # Tensor name -> (file, the name stored in it); a multimodal checkpoint's other parts
        # by their stored names.
        self._where: Dict[str, Tuple[str, str]] = {}
        self.left_out: List[str] = []
        for name, file in self._weight_map().items():
            canonical = _canonical_name(name, self.config, multimodal=self.multimodal)
            if canonical is None:
                self.left_out.append(name)
            else:
                self._where[canonical] = (file, name)

    def _weight_map(self) -> Dict[str, str]:
        index = os.path.join(self.directory, INDEX)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise errors.HFError(f"cannot read its weight_map: {e}", path=index,
                                     suggestion="fix or replace the index file") from e
            for file in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(self.directory, file)):
                    raise errors.HFError(f"the index names {file}, which is missing",
                                         path=os.path.join(self.directory, file),
                                         suggestion="copy every shard the index names")
            return dict(weight_map)
        single = os.path.join(self.directory, SINGLE)
        if os.path.isfile(single):
            return {name: SINGLE for name in self._file(SINGLE).names()}
        others = sorted(f for f in os.listdir(self.directory) if f.endswith(".bin"))
        raise errors.HFError(
            "the directory has no model.safetensors and no model.safetensors.index.json"
            + (f" (it has {', '.join(others)}: PyTorch pickles, which Titanax does not load)"
               if others else ""), path=self.directory,
            suggestion="save the model with safetensors (save_pretrained does by default)")

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            self._files[name] = SafetensorsFile(os.path.join(self.directory, name))
        return self._files[name]

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self):
        return self._where.keys()

    def tensor(self, name: str, *, expected_shape: Optional[Tuple[int, ...]] = None,
               needed_by: str = "", dequantize: bool = True,
               dtype: np.dtype = np.float32) -> np.ndarray:
        """The tensor as a view of its file (an FP8 weight dequantised -- into ``dtype``, the
        param's where an importer reads it: a layer's stack of them is then as large as the
        param's share, not float32's -- unless not ``dequantize``: a shape check); a missing
        tensor or a shape other than ``expected_shape`` is an ``HFError`` naming it, its file
        and the param it feeds."""
        if name not in self._where:
            raise errors.HFError(
                f"tensor {name!r} is missing" + (f" (Titanax param {needed_by})"
                                                 if needed_by else ""),
                path=self.directory,
                suggestion="the config.json and the weights disagree: check that both come "
                           "from the same model")
        file_name, stored = self._where[name]
        file = self._file(file_name)
        view = file.view(stored)
        if expected_shape is not None and tuple(view.shape) != tuple(expected_shape):
            raise errors.HFError(
                f"tensor {name!r} has shape {tuple(view.shape)}; config.json implies "
                f"{tuple(expected_shape)}" + (f" (Titanax param {needed_by})" if needed_by
                                              else ""),
                path=file.path, suggestion="the config.json and the weights disagree: check "
                                           "that both come from the same model")
        if view.dtype == fp8_blocks.FP8:
            scales = self._scales(name, view, file_path=file.path)
            if dequantize:
                self.scales_read.add(name + fp8_blocks.SCALE_SUFFIX)
                return fp8_blocks.dequantized(view, scales, block=self.fp8_block, dtype=dtype)
        return view

    def _scales(self, name: str, weight: np.ndarray, *, file_path: str) -> np.ndarray:
        """The block scales of an FP8 weight (a view), their shape checked."""
        if self.fp8_block is None or weight.ndim != 2:
            why = ("config.json names no FP8 block quantisation (quantization_config) for it"
                   if self.fp8_block is None else "FP8 blocks are read for 2-D weights only")
            raise errors.HFError(
                f"tensor {name!r} is stored in FP8 ({tuple(weight.shape)}), but {why}",
                path=file_path, suggestion="the config.json and the weights disagree: check "
                                           "that both come from the same model")
        return self.tensor(name + fp8_blocks.SCALE_SUFFIX, needed_by=f"the scales of {name}",
                           expected_shape=fp8_blocks.scales_shape(weight.shape,
                                                                  block=self.fp8_block))

    def tokenizer_path(self) -> Optional[str]:
        path = os.path.join(self.directory, TOKENIZER)
        return path if os.path.isfile(path) else None


def language_model_config(config: Dict[str, Any], *, where: str) -> Dict[str, Any]:
    """A multimodal ``config.json``'s language model config: its ``text_config`` (with the
    top-level ``tie_word_embeddings``, which the multimodal model's head follows)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise errors.HFError(f"a {config['model_type']} config without a text_config",
                             path=f"{where}: text_config",
                             suggestion="a multimodal directory written by transformers has one")
    text = dict(text)
    text.setdefault("model_type", MULTIMODAL[config["model_type"]])
    # The multimodal model's head is tied as its own config says (by default: Gemma 3's tied,
    # Qwen 3.5's not).
    text["tie_word_embeddings"] = config.get("tie_word_embeddings",
                                             MULTIMODAL_TIED[config["model_type"]])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # (Gemma 3 keeps them here.)
        if text.get(key) is None and config.get(key) is not None:
            text[key] = config[key]
    return text


def _canonical_name(name: str, config: Dict[str, Any], *,
                    multimodal: Optional[str] = None) -> Optional[str]:
    """The published GPT-2 checkpoints store ``GPT2Model``'s names (``h.0.attn...``,
    ``wte.weight``); ``GPT2LMHeadModel`` saves them under ``transformer.``: both read alike.
    A multimodal checkpoint's language model tensors read as the text model's; its other
    tensors (the vision tower, the projector) are None."""
    if multimodal is not None:
        for prefix, canonical in LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                return canonical + name[len(prefix):]
        return None
    if config.get("model_type") == "gpt2" and not name.startswith(("transformer.", "lm_head")):
        return f"transformer.{name}"
    return name
