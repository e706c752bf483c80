"""Modules: configurable layer trees that read params, PRNG and mode from an InvocationContext."""

from titanax.modules.base_layer import BaseLayer, ParameterSpec, describe_parameter_specs
from titanax.modules.context import (InvocationContext, OutputCollection, child_context,
                                     current_context, set_current_context)
from titanax.modules.module import Module, functional, nowrap, scan_in_context

__all__ = ["BaseLayer", "ParameterSpec", "describe_parameter_specs", "InvocationContext",
           "OutputCollection", "child_context", "current_context", "set_current_context",
           "Module", "functional", "nowrap", "scan_in_context"]
