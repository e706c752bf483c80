"""Which params a Flax module runs through a layer scan (``nnx.scan`` / ``nn.scan``).

A model that stacks its layers keeps each stacked param as one array ``[layers, ...]`` and loops
over the leading dimension with ``lax.scan``. Titanax must know which params those are: FSDP
never splits the layer dimension (the scan slices it) and gathers such a param one layer at a
time inside the loop, where the others are gathered once per forward (``--explain`` says which).

Nothing in a Flax param says it is stacked, so the module is traced once -- abstractly, on the
adapter's example inputs, no arithmetic -- and a param is stacked when it enters a ``scan`` as
one of the arrays the loop slices (its ``xs``), directly or through calls, casts and copies.
A param used only inside a nested scan's body is its parent scan's business, not a stack of its
own.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Set

import jax
from jax.extend import core as jex_core

# Primitives that pass an array on unchanged in layout (the scan still slices its leading dim).
_PASS_THROUGH = frozenset({"convert_element_type", "copy", "copy_p"})
# Params of primitives that hold a sub-jaxpr called with the primitive's own operands.
_CALL_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def scanned_positions(fn: Callable[..., Any], *args: Any) -> Set[int]:
    """Positions among the flattened leaves of ``args`` that enter a ``scan`` as sliced input."""
    closed = jax.make_jaxpr(fn)(*args)
    found: Set[int] = set()
    _walk(closed.jaxpr, {var: index for index, var in enumerate(closed.jaxpr.invars)}, found)
    return found


def _walk(jaxpr: Any, origin: Dict[Any, int], found: Set[int]) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan":
            first_xs = eqn.params["num_consts"] + eqn.params["num_carry"]
            found.update(origin[var] for var in eqn.invars[first_xs:] if _is_var(var)
                         and var in origin)
            continue
        if name in _PASS_THROUGH and eqn.invars and _is_var(eqn.invars[0]) \
                and eqn.invars[0] in origin:
            origin[eqn.outvars[0]] = origin[eqn.invars[0]]
            continue
        for key in _CALL_JAXPR_PARAMS:
            sub = eqn.params.get(key)
            sub = getattr(sub, "jaxpr", sub)  # A ClosedJaxpr holds its Jaxpr.
            if sub is None or not hasattr(sub, "eqns") or len(sub.invars) != len(eqn.invars):
                continue
            inner = {inner_var: origin[var] for inner_var, var in zip(sub.invars, eqn.invars)
                     if _is_var(var) and var in origin}
            if inner:
                _walk(sub, inner, found)


def _is_var(atom: Any) -> bool:
    return isinstance(atom, jex_core.Var)
