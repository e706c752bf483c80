"""How a gradient computer sees FSDP's sharded params whole (``state_sharding.FullySharded``).

``per_microbatch``: the params are wrapped in ``GatherOnUse`` and each layer gathers its own where
it runs; the transpose of each gather reduce-scatters (sums) that layer's gradient, so the
unwrapped gradients are divided by the axis size (a mean, as over the data axis). Otherwise
(``per_step``) everything is gathered once, before the microbatch loop, and the whole gradients
are left to the reducer's reduce-scatter.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Tuple

import jax

from titanax.modules import gather_on_use
from titanax.parallel import collectives


@dataclasses.dataclass(frozen=True)
class ParamGathering:
    """Gathers params stored split over ``axis`` (on the dimensions ``dims``) for their use."""

    axis: str
    axis_size: int
    # Per param, the dimension split over ``axis`` (None: stored whole).
    dims: Any
    per_microbatch: bool
    # Per param, the mesh axes that dimension is split over (``Layout.state_axes``: ``axis``
    # and the ZeRO config's ``also_over`` ones); None: ``axis`` alone for every param.
    axes: Any = None
    # Mesh axis -> size (for the axes of ``axes``).
    mesh_shape: Tuple[Tuple[str, int], ...] = ()

    def for_use(self, params: Any) -> Any:
        """The params as the model sees them: wrapped (``per_microbatch``) or all gathered."""
        return self.wrap(params) if self.per_microbatch else self.gather_all(params)

    def gather_all(self, params: Any) -> Any:
        """Every param whole: each gathered over its own axes (``axes``; else ``axis``)."""
        def one(p, d, own=None):
            if d is None:
                return p
            return collectives.all_gather(p, gather_on_use.split_axes(own, axis=self.axis),
                                          axis_index=d)

        return jax.tree_util.tree_map(one, params, self.dims,
                                      *(() if self.axes is None else (self.axes,)))

    def wrap(self, params: Any) -> Any:
        return gather_on_use.wrap(params, self.dims, axis=self.axis, axes=self.axes)

    def unwrap_gradients(self, grads: Any) -> Any:
        """The gathers' transposes summed each gradient over its axes: their mean."""
        sizes = dict(self.mesh_shape)

        def mean(g):
            if not gather_on_use.is_gather_on_use(g):
                return g
            axes = g.axis if isinstance(g.axis, tuple) else (g.axis,)
            return g.shard / (math.prod(sizes[a] for a in axes) if sizes else self.axis_size)

        return jax.tree_util.tree_map(mean, grads, is_leaf=gather_on_use.is_gather_on_use)
