"""A Hugging Face model directory: ``config.json`` and its safetensors weights.

The weights are one ``model.safetensors`` or shards named by ``model.safetensors.index.json``
(``{"weight_map": {tensor: file}}``). Every tensor is served as a view of its file's memory map,
so reading a slice reads only that slice. Errors name the file and what is missing.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Tuple

import numpy as np

from titanax import errors
from titanax.hf.safetensors_io import SafetensorsFile
from titanax.io.files import read_json_object

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"


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
        self.config = read_config(self.directory)
        self._files: Dict[str, SafetensorsFile] = {}
        # Tensor name -> (file, the name stored in it).
        self._where: Dict[str, Tuple[str, str]] = {
            _canonical_name(name, self.config): (file, name)
            for name, file in self._weight_map().items()}

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
               needed_by: str = "") -> np.ndarray:
        """The tensor as a view of its file; a missing tensor or a shape other than
        ``expected_shape`` is an ``HFError`` naming it, its file and the param it feeds."""
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
        return view

    def tokenizer_path(self) -> Optional[str]:
        path = os.path.join(self.directory, TOKENIZER)
        return path if os.path.isfile(path) else None


def _canonical_name(name: str, config: Dict[str, Any]) -> str:
    """The published GPT-2 checkpoints store ``GPT2Model``'s names (``h.0.attn...``,
    ``wte.weight``); ``GPT2LMHeadModel`` saves them under ``transformer.``: both read alike."""
    if config.get("model_type") == "gpt2" and not name.startswith(("transformer.", "lm_head")):
        return f"transformer.{name}"
    return name
