"""State sharding: how the optimizer state is laid out over the devices, and how an update runs.

The step's third collaborator (DESIGN section 7): the gradient computer returns local gradients,
the reducer reduces them once, and a state-sharding strategy owns everything about the optimizer
state's layout -- its specs, its initialisation, the update on this device's part of it, and the
description written into checkpoints so that a restore can tell whether the saved arrays mean the
same thing here. The Learner owns the arithmetic of the update (clipping, optax); the strategy
decides on which slice of the state it runs.

- ``Replicated``: every device holds the whole (TP/PP-local) state; the reducer all-reduces the
  gradients over the data axis.
- ``ZeroFlatChunks`` (ZeRO-1): each param's local gradient is flattened, padded and
  reduce-scattered over the data axis; each device updates its chunk and the params are
  all-gathered back (``zero.py``). The chunks depend on the mesh they were cut for, which
  ``layout()`` records.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import optax
from jax.sharding import PartitionSpec

from titanax.train import learner as learner_lib
from titanax.train import zero


class Replicated:
    """The optimizer state laid out like the params (no sharding over the data axis)."""

    # Whether the reducer all-reduces the gradients over the data axis (ZeRO scatters them).
    reduces_data_gradients = True
    # Whether the state's leaves are shaped like the params (they convert with the params'
    # layout, e.g. the circular schedule's view).
    follows_params = True

    def __init__(self, *, param_specs: Any, data_axis: Optional[str]):
        self.param_specs = param_specs
        self.data_axis = data_axis

    def opt_state_specs(self, adapter: learner_lib.OptimizerAdapter, local_params: Any) -> Any:
        """Out-specs of the state built on ``local_params`` (ShapeDtypeStructs, local view)."""
        return _state_specs(adapter, jax.eval_shape(adapter.init, local_params),
                            self.param_specs)

    def init(self, adapter: learner_lib.OptimizerAdapter, params: Any) -> Any:
        """The state in local view (inside shard_map)."""
        return adapter.init(params)

    def update(self, *, learner: learner_lib.Learner, adapter: learner_lib.OptimizerAdapter,
               params: Any, opt_state: Any, grads: Any, norm_squared: jax.Array
               ) -> Tuple[Any, Any, jax.Array]:
        """``(new params, new state, global grad norm)`` from the reduced gradients."""
        norm = jax.numpy.sqrt(norm_squared)
        new_params, new_state = learner.apply_update(adapter=adapter, grads=grads, norm=norm,
                                                     opt_state=opt_state, params=params)
        return new_params, new_state, norm

    def layout(self, mesh_shape: Mapping[str, int]) -> Dict[str, Any]:
        del mesh_shape
        return {"kind": "param_layout"}


class ZeroFlatChunks(Replicated):
    """ZeRO-1 over ``data_axis``: flat, padded chunks of each TP-local param's state."""

    reduces_data_gradients = False
    follows_params = False

    def __init__(self, *, param_specs: Any, data_axis: str, data_size: int):
        super().__init__(param_specs=param_specs, data_axis=data_axis)
        self.data_size = data_size

    def opt_state_specs(self, adapter: learner_lib.OptimizerAdapter, local_params: Any) -> Any:
        def chunk(s):
            return jax.ShapeDtypeStruct((zero.chunk_size(s.shape, self.data_size),), s.dtype)

        shapes = jax.eval_shape(adapter.init, jax.tree_util.tree_map(chunk, local_params))
        chunk_specs = jax.tree_util.tree_map(lambda s: zero.chunk_spec(s, self.data_axis),
                                             self.param_specs,
                                             is_leaf=lambda x: isinstance(x, PartitionSpec))
        return _state_specs(adapter, shapes, chunk_specs)

    def init(self, adapter: learner_lib.OptimizerAdapter, params: Any) -> Any:
        return adapter.init(jax.tree_util.tree_map(
            lambda p: zero.local_chunk(p, self.data_axis), params))

    def update(self, *, learner, adapter, params, opt_state, grads, norm_squared):
        del norm_squared  # The chunks' norm is summed over the data axis here.
        data_axis = self.data_axis
        grad_chunks = jax.tree_util.tree_map(lambda g: zero.scatter_mean(g, data_axis), grads)
        param_chunks = jax.tree_util.tree_map(lambda p: zero.local_chunk(p, data_axis), params)
        split = learner_lib.split_axes_of(self.param_specs, extra=(data_axis,))
        norm = learner_lib.global_norm(grad_chunks, split)
        new_chunks, new_state = learner.apply_update(adapter=adapter, grads=grad_chunks,
                                                     norm=norm, opt_state=opt_state,
                                                     params=param_chunks)
        new_params = jax.tree_util.tree_map(lambda c, p: zero.gather(c, data_axis, p.shape),
                                            new_chunks, params)
        return new_params, new_state, norm

    def layout(self, mesh_shape: Mapping[str, int]) -> Dict[str, Any]:
        return {"kind": "zero1_flat_chunks",
                "mesh": {str(k): int(v) for k, v in mesh_shape.items()}}


def _state_specs(adapter: learner_lib.OptimizerAdapter, state_shapes: Any, leaf_specs: Any) -> Any:
    """Specs of an optimizer state: each param-like leaf gets its param's entry of
    ``leaf_specs``; counters and other scalars are replicated."""
    return optax.tree_map_params(adapter.tx, lambda _, spec: spec, state_shapes, leaf_specs,
                                 transform_non_params=lambda _: PartitionSpec(),
                                 is_leaf=lambda x: isinstance(x, PartitionSpec))


def for_plan(plan: Any, *, param_specs: Any, mesh_shape: Mapping[str, int]) -> Replicated:
    """The strategy the plan asks for."""
    if plan.zero is not None:
        return ZeroFlatChunks(param_specs=param_specs, data_axis=plan.dp_axis,
                              data_size=int(mesh_shape[plan.dp_axis]))
    return Replicated(param_specs=param_specs, data_axis=plan.dp_axis)
