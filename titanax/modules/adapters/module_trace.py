"""What one abstract trace of a Flax module shows: the params it scans over, the axes it
communicates over.

Nothing in a Flax param says it is stacked, and nothing in a module says it calls collectives.
So the adapter traces the module once (``jax.make_jaxpr``: shapes only, no arithmetic) on its
example inputs and reads the program:

- a param is **stacked** when it enters a ``scan`` as one of the arrays the loop slices (its
  ``xs``), directly or through calls, casts and copies -- what ``nnx.scan`` / ``nn.scan`` over a
  layer stack compile to. FSDP never splits the layer dimension (the scan slices it) and gathers
  such a param one layer at a time inside the loop. A param used only inside a nested scan's body
  is its parent scan's business, not a stack of its own.
- the module **communicates** over a mesh axis when the program holds a collective over it
  (``psum``, ``all_gather``, ...: what ``titanax.parallel.collectives`` emit). Tensor parallelism
  splits a module's weights only when it joins the pieces itself.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, Iterator, Set

from jax.extend import core as jex_core

# Primitives that pass an array on unchanged in layout (the scan still slices its leading dim).
_PASS_THROUGH = frozenset({"convert_element_type", "copy", "copy_p"})
# Params of primitives that hold a sub-jaxpr called with the primitive's own operands.
_CALL_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Primitives that move data between devices (their names contain one of these).
_COMMUNICATING = ("psum", "pmax", "pmin", "all_gather", "reduce_scatter", "ppermute",
                  "all_to_all", "pbroadcast")


def scanned_positions(closed_jaxpr: Any) -> Set[int]:
    """Positions among the program's inputs that enter a ``scan`` as sliced input."""
    found: Set[int] = set()
    jaxpr = closed_jaxpr.jaxpr
    _walk_scans(jaxpr, {var: index for index, var in enumerate(jaxpr.invars)}, found)
    return found


def communicated_axes(closed_jaxpr: Any) -> FrozenSet[str]:
    """The mesh axes any collective of the program (sub-programs included) runs over."""
    axes: Set[str] = set()
    for eqn in _all_eqns(closed_jaxpr.jaxpr):
        if any(word in eqn.primitive.name for word in _COMMUNICATING):
            for key in ("axes", "axis_name"):
                value = eqn.params.get(key)
                names = value if isinstance(value, (tuple, list, frozenset, set)) else (value,)
                axes.update(name for name in names if isinstance(name, str))
    return frozenset(axes)


def _all_eqns(jaxpr: Any) -> Iterator[Any]:
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # A ClosedJaxpr holds its Jaxpr.
                if hasattr(sub, "eqns"):
                    yield from _all_eqns(sub)


def _walk_scans(jaxpr: Any, origin: Dict[Any, int], found: Set[int]) -> None:
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
            sub = getattr(sub, "jaxpr", sub)
            if sub is None or not hasattr(sub, "eqns") or len(sub.invars) != len(eqn.invars):
                continue
            inner = {inner_var: origin[var] for inner_var, var in zip(sub.invars, eqn.invars)
                     if _is_var(var) and var in origin}
            if inner:
                _walk_scans(sub, inner, found)


def _is_var(atom: Any) -> bool:
    return isinstance(atom, jex_core.Var)
