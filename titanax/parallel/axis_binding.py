"""The axis binding: which mesh axis holds each logical dimension of the model's arrays.

A layer never names a mesh axis. It names the *logical* dimensions of its params and activations
-- ``heads``, ``mlp``, ``vocab``, ``experts``, the ``sequence`` of a row -- and asks the run's
binding which mesh axis (if any) holds each, as MaxText's ``logical_axis_rules`` and AXLearn's
``dim_to_mesh_axis_map`` do. The binding is built once from the plan (``Plan.axis_binding``:
TP binds the head / mlp / vocabulary dimensions, sequence parallelism the residual stream's
sequence, CP a row's sequence, EP the experts, PP the layer stages, ``logical_axis_rules``
override any of them) and reaches layers through the InvocationContext (``self.axis_binding``)
or, while their ParameterSpecs are created, through ``bound(binding)``.

Without a binding (a model used alone) nothing is bound and every layer runs unsplit. Inference
binds no sequence axis (``binding.without(SEQUENCE)``) instead of rebuilding the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Iterator, List, Mapping, Optional, Tuple, Union

import jax

from titanax.parallel import collectives

# The logical dimensions Titanax's layers name.
HEADS = "heads"                  # Attention query heads (TP).
KV_HEADS = "kv_heads"            # Key / value heads (TP, when their count divides it).
MLP = "mlp"                      # Feed-forward hidden features, dense or per expert (TP).
VOCAB = "vocab"                  # Embedding / LM-head rows (TP).
EXPERTS = "experts"              # A mixture of experts' experts (EP).
SEQUENCE = "sequence"            # A row's tokens, split across devices in attention (CP).
RESIDUAL_SEQUENCE = "residual_sequence"  # The residual stream's sequence between blocks (SP).
STAGES = "stages"                # The layer stack's pipeline stages (PP).

# The dimensions that tensor parallelism binds to its axis.
TENSOR_PARALLEL_DIMS = (HEADS, KV_HEADS, MLP, VOCAB)
# Dimensions whose axis does not split a layer's weights in its layout (activations only, or a
# split that layers implement in their own code).
NOT_WEIGHT_DIMS = (SEQUENCE, RESIDUAL_SEQUENCE, EXPERTS, STAGES)


@dataclasses.dataclass(frozen=True)
class AxisBinding:
    """Logical dimension -> mesh axis (or None: whole on every device), and the options of the
    parallel kinds whose code lives in layers."""

    # (logical dimension, mesh axis or None) pairs; a dimension absent is whole (None).
    dims: Tuple[Tuple[str, Optional[str]], ...] = ()
    # How attention's keys cross the SEQUENCE axis: "all_gather", "ring" or "ulysses"
    # (modules/layers/context_attention.py; from plan.context_parallel.strategy).
    context_strategy: str = "all_gather"
    # How many chunks of every row each rank of the SEQUENCE axis holds: 2 under CP's
    # "dual_chunk" load balance (chunks r and 2C-1-r), 1 under "none" (chunk r). Layers whose
    # state runs along the sequence read it (modules/layers/context_delta_rule.py).
    context_pieces: int = 2
    # (mesh axis, devices) of the mesh a plan is checked against (Plan.check_model); empty in
    # the bindings layers run under, which read sizes from their shard_map instead.
    mesh_shape: Tuple[Tuple[str, int], ...] = ()

    @functools.cached_property
    def table(self) -> Mapping[str, Optional[str]]:
        """``dims`` as a dict (made once: every layer call reads it)."""
        return dict(self.dims)

    def axis(self, dim: Optional[str]) -> Optional[str]:
        """The mesh axis bound to ``dim`` (None: unbound, or ``dim`` None)."""
        return self.table.get(dim) if dim is not None else None

    def active(self, dim: Optional[str]) -> Optional[str]:
        """The mesh axis bound to ``dim`` when it splits anything here: a manual axis of the
        current ``shard_map`` with more than one device (else None: the layer runs its unsplit
        code, with no collective)."""
        return active_axis(self.axis(dim))

    def size(self, dim: Optional[str]) -> int:
        """How many devices split ``dim`` on the mesh this binding was checked against (1:
        unbound, or no mesh known): what a layer's ``check_axis_binding`` divides by."""
        axis = self.axis(dim)
        return dict(self.mesh_shape).get(axis, 1) if axis is not None else 1

    def rank(self, dim: Optional[str]) -> Union[int, jax.Array]:
        """This device's index along ``dim``'s axis (0 where it is not active)."""
        axis = self.active(dim)
        return collectives.axis_index(axis) if axis is not None else 0

    def mesh_axes(self, logical: Optional[Tuple[Optional[str], ...]]) -> Optional[Tuple]:
        """A ParameterSpec's mesh axes from its logical dimensions."""
        if logical is None:
            return None
        return tuple(self.axis(name) for name in logical)

    def without(self, *dims: str) -> "AxisBinding":
        """This binding with ``dims`` unbound (inference: no sequence split)."""
        return dataclasses.replace(self, dims=tuple((d, a) for d, a in self.dims if d not in dims))

    def tensor_axes(self) -> Tuple[str, ...]:
        """The mesh axes that split layers' weights: those bound to any dimension but the
        sequence, the experts and the stages (TP's axis, in order of first binding)."""
        axes: List[str] = []
        for dim, axis in self.dims:
            if axis is not None and dim not in NOT_WEIGHT_DIMS and axis not in axes:
                axes.append(axis)
        return tuple(axes)

    def describe(self) -> str:
        """``heads -> model, sequence -> context, ...`` (``--explain``)."""
        parts = [f"{d} -> {a}" for d, a in self.dims if a is not None]
        text = ", ".join(parts) if parts else "nothing bound (every layer runs unsplit)"
        if self.axis(SEQUENCE) is not None:
            text += f"; context strategy {self.context_strategy}"
        return text


UNBOUND = AxisBinding()


def active_axis(axis: Optional[str]) -> Optional[str]:
    """``axis`` when it is a manual mesh axis here of more than one device, else None."""
    if axis is not None and axis in collectives.manual_axes() and collectives.axis_size(axis) > 1:
        return axis
    return None


class _Scope(threading.local):
    def __init__(self):
        super().__init__()
        self.bindings: List[AxisBinding] = []


_SCOPE = _Scope()


# The binding of the innermost module call, if any: set by modules/context.py (the module
# system sits above this file; it tells the binding where calls keep theirs).
_CALL_BINDING: List = [lambda: None]


def look_up_call_bindings_with(lookup) -> None:
    """``lookup() -> Optional[AxisBinding]``: the innermost module call's binding (the module
    system registers it once)."""
    _CALL_BINDING[0] = lookup


def current_binding() -> AxisBinding:
    """The binding of the innermost module call, else of the innermost ``bound`` block, else
    ``UNBOUND``."""
    binding = _CALL_BINDING[0]()
    if binding is not None:
        return binding
    return _SCOPE.bindings[-1] if _SCOPE.bindings else UNBOUND


def scope_binding() -> Optional[AxisBinding]:
    """The innermost ``bound`` block's binding (None outside any): a root module call's."""
    return _SCOPE.bindings[-1] if _SCOPE.bindings else None


@contextlib.contextmanager
def bound(binding: Optional[AxisBinding]) -> Iterator[AxisBinding]:
    """Makes ``binding`` the one layers see in the ``with`` block: module calls rooted in it
    carry it in their InvocationContext, and ParameterSpecs created in it take their mesh axes
    from it."""
    binding = binding if binding is not None else UNBOUND
    _SCOPE.bindings.append(binding)
    try:
        yield binding
    finally:
        _SCOPE.bindings.pop()
