"""GatherOnUse: a param shard that a layer sees whole, gathered where the layer reads it.

Under FSDP (ZeRO-3) every device stores one slice of a param, along one real dimension, over the
FSDP axis. The gradient computer hands the model its params wrapped in ``GatherOnUse``; a layer
reading ``self.parameters`` gets the whole (TP-local) param, all-gathered at that moment. Inside
a ``Repeat`` scan that is one layer at a time, and autodiff turns each gather into the
reduce-scatter of that layer's gradient -- the ZeRO-3 schedule, written by nobody.

The gathered value must not outlive its layer: a rematerialisation policy that saved it would
keep every layer's full weights for the backward pass and FSDP would save nothing (DESIGN 7.2).
Every gathered value is named ``GATHERED``, and ``never_saving_gathered`` turns any policy into
one that recomputes the gather in the backward pass instead (the scan and the layers' own remat
use it whenever the state holds a ``GatherOnUse``).

The wrapper is a pytree node whose one leaf is the shard, so casts, ``tree_map``, ``scan``
slicing of stacked layers and ``grad`` all see the shard; the dimension is counted from the end,
so slicing leading (stacked-layer) dimensions keeps it right.
"""

from __future__ import annotations

from typing import Any, Callable, FrozenSet, Optional, Sequence, Tuple, Union

import jax
from jax.ad_checkpoint import checkpoint_name

from titanax.modules.saved_values import keeping_exchanges
from titanax.parallel import collectives

# The name every gathered param carries in the jaxpr (for remat policies).
GATHERED = "titanax_fsdp_gathered"


@jax.tree_util.register_pytree_node_class
class GatherOnUse:
    """One param's shard over ``axis``, split on dimension ``ndim - dim_from_end``."""

    def __init__(self, shard: Any, *, axis: str, dim_from_end: int):
        self.shard = shard
        self.axis = axis
        self.dim_from_end = dim_from_end

    def gather(self) -> jax.Array:
        """The whole param (concatenated over ``axis``), named ``GATHERED``."""
        whole = collectives.all_gather(self.shard, self.axis,
                                       axis_index=self.shard.ndim - self.dim_from_end)
        return checkpoint_name(whole, GATHERED)

    def tree_flatten(self):
        return (self.shard,), (self.axis, self.dim_from_end)

    @classmethod
    def tree_unflatten(cls, aux, children):
        axis, dim_from_end = aux
        return cls(children[0], axis=axis, dim_from_end=dim_from_end)

    def __repr__(self) -> str:
        shape = getattr(self.shard, "shape", None)
        return f"GatherOnUse(shard={shape}, axis={self.axis!r}, dim=-{self.dim_from_end})"


def is_gather_on_use(x: Any) -> bool:
    return isinstance(x, GatherOnUse)


def gathered_axes(tree: Any) -> FrozenSet[str]:
    """The mesh axes the wrapped leaves of ``tree`` gather over (empty: FSDP's gather on use is
    off here)."""
    return frozenset(a for x in jax.tree_util.tree_leaves(tree, is_leaf=is_gather_on_use)
                     if is_gather_on_use(x)
                     for a in (x.axis if isinstance(x.axis, tuple) else (x.axis,)))


def gathered(state: Any) -> Any:
    """``state`` (a layer's dict) with its own wrapped params gathered; child dicts untouched."""
    if not isinstance(state, dict) or not any(is_gather_on_use(v) for v in state.values()):
        return state
    return {k: v.gather() if is_gather_on_use(v) else v for k, v in state.items()}


def wrap(params: Any, dims: Any, *, axis: str, axes: Any = None) -> Any:
    """``params`` (local shards) with each sharded leaf wrapped; ``dims`` from
    ``parallel.state_dims.choose_dims_and_axes`` (None: a whole param, left as it is); ``axes``:
    per param, the mesh axes it is split over (from the same call; None: ``axis``)."""
    def one(p, d, own=None):
        if d is None:
            return p
        return GatherOnUse(p, axis=split_axes(own, axis=axis), dim_from_end=p.ndim - d)

    return jax.tree_util.tree_map(one, params, dims, *(() if axes is None else (axes,)))


def split_axes(own: Optional[Sequence[str]], *, axis: str) -> Union[str, Tuple[str, ...]]:
    """The axis name a collective takes for a param split over ``own`` (None: ``axis``)."""
    if own is None:
        return axis
    return own[0] if len(own) == 1 else tuple(own)


def never_saving_gathered(policy: Optional[Callable], axes: FrozenSet[str]) -> Callable:
    """``policy`` restricted so that no param gathered over ``axes`` is saved for backward.

    A policy sees primitives, not where their inputs came from: "save anything except the
    gathered values" would still save the all-gather's own output, and any reshape of a gathered
    weight. So all-gathers over ``axes`` (and the named value) are never saved -- other gathers,
    e.g. sequence-parallel activations over the TP axis, are the policy's to decide -- and with
    no policy of the layer's own the base is ``dots_with_no_batch_dims_saveable`` (keep the
    matmul outputs, recompute the elementwise rest), which saves nothing derived from the
    weights alone."""
    base = policy or keeping_exchanges(jax.checkpoint_policies.dots_with_no_batch_dims_saveable)

    def combined(prim, *args, **params):
        if prim.name.startswith("all_gather"):
            names = params.get("axis_name", ())
            names = names if isinstance(names, (tuple, list)) else (names,)
            if axes.intersection(names):
                return False
        if prim.name == "name" and params.get("name") == GATHERED:
            return False
        return base(prim, *args, **params)

    return combined
