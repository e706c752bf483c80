"""An FSDP shard that a Flax module reads as the whole param, gathered where it reads it.

Titanax's own layers read FSDP shards through ``self.parameters`` (``gather_on_use.py``). A Flax
module reads its params its own way -- an NNX module indexes its ``Variable`` (``self.kernel[...]``),
a Linen module asks its scope (``self.param(...)``, which unboxes ``flax.core.meta.AxisMetadata``)
-- so the shard is handed to it as a value that both ways turn into the whole param:

- it is an ``AxisMetadata`` box whose ``unbox()`` gathers (Linen: ``nn.scan`` slices the shard
  inside it and keeps it boxed through the loop, since a box's leaves are what the lifted
  transforms slice);
- indexing it (``value[...]``, what ``Variable.__getitem__`` does) and ``jnp.asarray`` of it
  (``__jax_array__``) gather, and ``shape`` / ``dtype`` / ``ndim`` describe the whole param.

So a param the module reads inside its ``nnx.scan`` / ``nn.scan`` is gathered one layer at a
time inside the loop, and any other at its use. The adapter rematerialises the module's forward
with a policy that never saves a gathered value (``gather_on_use.never_saving_gathered``): the
backward pass gathers again instead of keeping every layer's whole weights.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from flax.core import meta

from titanax.modules.gather_on_use import GatherOnUse
from titanax.parallel import collectives


@jax.tree_util.register_pytree_node_class
class FlaxGatherOnUse(GatherOnUse, meta.AxisMetadata):
    """One param's shard over ``axis`` (see the module docstring); its one leaf is the shard
    (the pytree methods are GatherOnUse's; a subclass needs its own registration)."""

    # --- AxisMetadata (Linen) ----------------------------------------------------------------

    def unbox(self) -> jax.Array:
        return self.gather()

    def replace_boxed(self, val: Any) -> "FlaxGatherOnUse":
        return FlaxGatherOnUse(val, axis=self.axis, dim_from_end=self.dim_from_end)

    def add_axis(self, index: int, params: Any) -> "FlaxGatherOnUse":
        """A transform stacked the shard: its split dimension, counted from the end, stays."""
        del index, params
        return self

    def remove_axis(self, index: int, params: Any) -> "FlaxGatherOnUse":
        del index, params
        return self

    # --- Array-like (NNX Variables) ----------------------------------------------------------

    def __getitem__(self, index: Any) -> jax.Array:
        return self.gather()[index]

    def __jax_array__(self) -> jax.Array:
        return self.gather()

    @property
    def shape(self):
        shape = list(self.shard.shape)
        shape[len(shape) - self.dim_from_end] *= collectives.axis_size(self.axis)
        return tuple(shape)

    @property
    def dtype(self):
        return self.shard.dtype

    @property
    def ndim(self) -> int:
        return self.shard.ndim

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:  # ``if self.scale:`` in Flax's norms asks this.
        return self.shape[0]

    def __getattr__(self, name: str) -> Any:
        """Anything else an array has (``.T``, ``.astype``, ``.reshape``): of the whole param."""
        if name.startswith("__") or name in ("shard", "axis", "dim_from_end"):
            raise AttributeError(name)
        return getattr(self.gather(), name)


def _operator(name: str):
    def apply(self, *others):
        return getattr(self.gather(), name)(*others)
    apply.__name__ = name
    return apply


# Arithmetic on the value (what an NNX Variable's operators forward to it): on the whole param.
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__matmul__",
              "__rmatmul__", "__truediv__", "__rtruediv__", "__pow__", "__rpow__", "__neg__",
              "__pos__", "__abs__", "__iter__"):
    setattr(FlaxGatherOnUse, _name, _operator(_name))


def for_flax(value: Any) -> Any:
    """``value`` with Titanax's ``GatherOnUse`` leaves turned into ones Flax reads whole."""
    return jax.tree_util.tree_map(
        lambda x: FlaxGatherOnUse(x.shard, axis=x.axis, dim_from_end=x.dim_from_end)
        if isinstance(x, GatherOnUse) else x, value,
        is_leaf=lambda x: isinstance(x, GatherOnUse))
