"""Modules: configurable layer trees that read params, PRNG and mode from an InvocationContext."""

from titanax.modules.base_layer import BaseLayer, ParameterSpec, describe_parameter_specs
from titanax.modules.context import (InvocationContext, OutputCollection, child_context,
                                     current_context, set_current_context)
from titanax.modules.module import Module, functional, nowrap, scan_in_context

# The Flax adapters import flax: loaded on first use (``titanax.modules.FlaxNNX``).
_LAZY = {"FlaxNNX": "titanax.modules.adapters.flax_nnx",
         "FlaxLinen": "titanax.modules.adapters.flax_linen"}


def __getattr__(name):
    if name in _LAZY:
        import importlib  # pylint: disable=import-outside-toplevel
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'titanax.modules' has no attribute {name!r}")


__all__ = ["FlaxNNX", "FlaxLinen", "BaseLayer", "ParameterSpec", "describe_parameter_specs", "InvocationContext",
           "OutputCollection", "child_context", "current_context", "set_current_context",
           "Module", "functional", "nowrap", "scan_in_context"]
