"""Frozen models an objective holds beside the trained one: a reference (preference losses,
GRPO's and KTO's KL) or a teacher (distillation).

A frozen model lives under its own top-level key of the params (``reference``, ``teacher``):
laid out by the same plan, stored, checkpointed and restored with the run, never trained. It is
one of

* a copy of the starting weights (the default);
* the weights of another Hugging Face directory (``reference_from`` / ``teacher_from``) of the
  same architecture (a teacher: of its own, sharing the vocabulary);
* with a model converter that adds params (LoRA), the model before conversion -- its adapters
  off -- and no second copy at all.

``call_frozen`` runs one of the model's primitives with a frozen model's weights inside the
objective's loss: evaluation mode, no gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Dict, Optional, Tuple

import jax

from titanax import errors
from titanax.modules import converters as converters_lib
from titanax.modules.base_layer import ParameterSpec
from titanax.modules.module import functional


def frozen_copy_specs(specs: Any) -> Any:
    """``specs`` with every param frozen (the ParameterSpecs of a frozen copy)."""
    return jax.tree_util.tree_map(lambda s: dataclasses.replace(s, trainable=False), specs,
                                  is_leaf=lambda x: isinstance(x, ParameterSpec))


def holds_copy(*, directory: Optional[str], run: Any) -> bool:
    """Whether a reference is held as params of its own: another directory's weights, or a copy
    of the starting weights unless a converter's base (LoRA's adapters off) is it."""
    return directory is not None or not run.converters


def check_hf_directory(directory: Optional[str], *, path: str, what: str) -> None:
    """A directory given for a frozen model must be a Hugging Face model directory."""
    if directory is not None and not os.path.isfile(os.path.join(directory, "config.json")):
        raise errors.ConfigError(
            f"{directory} is not a Hugging Face model directory (no config.json)", path=path,
            suggestion=f"give the directory of the {what} (config.json and *.safetensors)")


def frozen_values(*, key: str, directory: Optional[str], start: Dict[str, Any],
                  run: Any) -> Any:
    """The frozen model's weights in the run's shards: the HF ``directory``'s, or a copy of
    ``start`` (the model's own starting params)."""
    if directory is not None:
        return run.frozen_from_hf(directory, key=key)
    return jax.tree_util.tree_map(lambda x: x.copy(), start)  # (The step donates the params.)


def call_frozen(model: Any, *, key: Optional[str], method: str, inputs: Any,
                converters: Any = ()) -> Any:
    """``model.<method>(*inputs)`` with the frozen weights under ``key`` of the params being
    traced (None: the model itself before its converters -- LoRA's base), evaluation mode,
    without gradient. Runs inside the objective's loss (the model's context)."""
    params = model.parameters
    own = params.get(key) if key is not None and isinstance(params, dict) else None
    call = functools.partial(functional, model, None, own if own is not None else params,
                             inputs, method=method, is_training=False)
    if own is not None:
        values, _ = call()
    else:
        with converters_lib.base_scopes(converters):
            values, _ = call()
    return jax.lax.stop_gradient(values)


class FrozenModel:
    """One frozen model of an objective (a reference, a teacher): its params key, where its
    weights come from, and how the objective's loss calls it. Made by the objective from its
    config; ``setup`` once the run is known (at the objective's check)."""

    def __init__(self, *, key: str, directory: Optional[str], path: str, what: str):
        # The params key it is held under; the HF directory of its weights (None: the starting
        # weights); the config path of that directory (errors name it); what it is, in words.
        self.key, self.directory, self.path, self.what = key, directory, path, what
        self.converters: Tuple[Any, ...] = ()
        self.holds_copy = False

    def setup(self, run: Any, *, needed: bool) -> None:
        """Checks the directory and decides whether params of its own are held: when
        ``needed``, unless a model converter's base (LoRA's adapters off) is the model. (An
        objective refuses a directory it does not need, in its own words.)"""
        check_hf_directory(self.directory, path=self.path, what=self.what)
        self.converters = tuple(run.converters)
        self.holds_copy = needed and holds_copy(directory=self.directory, run=run)

    def specs(self, model_specs: Any) -> Dict[str, Any]:
        """``{key: frozen specs}`` when it holds params of its own, else empty."""
        return {self.key: frozen_copy_specs(model_specs)} if self.holds_copy else {}

    def params(self, *, start: Dict[str, Any], run: Any) -> Dict[str, Any]:
        """``{key: its weights}`` for a fresh run starting at ``start``, else empty."""
        if not self.holds_copy:
            return {}
        return {self.key: frozen_values(key=self.key, directory=self.directory, start=start,
                                        run=run)}

    def call(self, model: Any, *, method: str, inputs: Any) -> Any:
        """``model.<method>(*inputs)`` of the frozen model, no gradient (``call_frozen``)."""
        return call_frozen(model, key=self.key, method=method, inputs=inputs,
                           converters=self.converters)

    def describe(self) -> str:
        if self.directory is not None:
            return self.directory
        return (f"the starting weights (a frozen copy under params/{self.key})" if self.holds_copy
                else "the base model, its adapters off")
