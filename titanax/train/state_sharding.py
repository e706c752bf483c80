"""State sharding: how params and optimizer state are laid out over the devices, and how an
update runs on them.

The step's third collaborator (DESIGN section 7): the gradient computer returns local gradients,
the reducer reduces them once, and a state-sharding strategy owns everything about the state's
layout -- the optimizer state's specs, its initialisation, the update on this device's part of it.
The Learner owns the arithmetic of the update (clipping, optax); the strategy decides on which
slice of the state it runs.

Every strategy lays the optimizer state out like the params *in global view*: each leaf has its
param's global shape, and where it is split over the ZeRO axis, it is split along a real
dimension (``parallel/state_dims.py``). So a checkpoint's arrays mean the same numbers on every
mesh and under every strategy, and restore anywhere.

Strategies are siblings behind one interface (``StateSharding``); the step asks a strategy for
its gradients' layout, its reduce-scatter dimensions and how the computer sees the params
(``param_gathering``), never which kind it is:

- ``Replicated``: every device holds the whole (TP/PP-local) state; the reducer all-reduces the
  gradients over the data axis.
- ``ShardedOptimizerState`` (ZeRO-1 / ZeRO-2): params replicated over the ZeRO axis, optimizer
  state split over it on each param's chosen dimension. ZeRO-1 keeps the reducer's all-reduce and
  slices each device's part of the gradient; ZeRO-2 has the reducer reduce-scatter the gradients
  into that part. Each device updates its part; the params are all-gathered back.
- ``FullySharded`` (ZeRO-3 / FSDP): the params carry the axis too (the engine added it to their
  specs), so params, gradients and optimizer state are all local shards and the update is the
  replicated one on them; the gradient computer gathers the params where they are used.

Frozen params (``trainable.py``) are stored and gathered like the others, and are nothing else
here: a strategy's gradients, optimizer state and update cover the trainable params only
(``self.trainable`` cuts every param-shaped tree), and the update hands the frozen ones back as
they came.
"""

from __future__ import annotations

import abc
from typing import Any, Optional, Tuple

import jax
import optax
from jax.sharding import PartitionSpec
from optax.transforms._masking import MaskedNode

from titanax.parallel import collectives, rules, state_dims
from titanax.parallel.layout import Layout
from titanax.train import learner as learner_lib
from titanax.train.param_gathering import ParamGathering
from titanax.train.trainable import Trainable

# Saved in checkpoint metadata: under every strategy the optimizer state's global arrays are laid
# out like the params (older checkpoints may say "zero1_flat_chunks", see StateManager).
CHECKPOINT_LAYOUT = {"kind": "param_layout"}


class StateSharding(abc.ABC):
    """How the params and the optimizer state are laid out over the devices, and updated."""

    # The mesh axis the state is split over (None: not split).
    shard_axis: Optional[str] = None
    # Per param, the dimension split over ``shard_axis`` (None: not split anywhere).
    dims: Any = None

    def __init__(self, *, param_specs: Any, trainable: Optional[Trainable] = None):
        self.param_specs = param_specs
        # The params the optimizer trains (None: all).
        self.trainable = trainable if trainable is not None else Trainable(
            mask=jax.tree_util.tree_map(lambda _: True, param_specs,
                                        is_leaf=lambda x: isinstance(x, PartitionSpec)))

    @property
    def trained_param_specs(self) -> Any:
        """The layout of the trainable params."""
        return self.trainable.select(self.param_specs)

    @property
    def grad_specs(self) -> Any:
        """The layout of the reduced gradients, trainable params only (what the reducer plans
        from)."""
        return self.trained_param_specs

    @property
    def update_specs(self) -> Any:
        """The layout of the trainable params' part each device updates (what an optimizer
        that needs whole matrices gathers over: train/muon.py)."""
        return self.trained_param_specs

    @property
    def scatter_dims(self) -> Optional[Any]:
        """Per trainable param, the dimension the reducer reduce-scatters its gradient along
        over ``shard_axis`` (None: no scatter anywhere)."""
        return None

    def param_gathering(self) -> Optional[ParamGathering]:
        """How the gradient computer sees the params whole (None: they are stored whole)."""
        return None

    @property
    def gather_summed_axes(self) -> Any:
        """Per trainable param, the mesh axes its gather's transpose summed (and the gathering
        averaged) its gradient over, when they go beyond the ZeRO axis
        (``ZeRO.Config.also_over``); None: the ZeRO axis alone, or no gather."""
        return None

    @property
    def title(self) -> str:
        """What --explain calls this layout of the state."""
        return "replicated state"

    @property
    def gathers(self) -> Optional[str]:
        """When the params are gathered while the step runs ("per_step" / "per_microbatch"),
        None when they are stored whole."""
        return None

    def opt_state_specs(self, adapter: learner_lib.OptimizerAdapter, local_params: Any) -> Any:
        """Out-specs of the state built on ``local_params`` (ShapeDtypeStructs, local view, all
        params: the state covers the trainable ones)."""
        return _state_specs(adapter, jax.eval_shape(adapter.init,
                                                    self.trainable.select(local_params)),
                            self.trained_param_specs)

    def init(self, adapter: learner_lib.OptimizerAdapter, params: Any) -> Any:
        """The state in local view (inside shard_map) for the trainable part of ``params``."""
        return adapter.init(self.trainable.select(params))

    def update(self, *, learner: learner_lib.Learner, adapter: learner_lib.OptimizerAdapter,
               params: Any, opt_state: Any, grads: Any, norm_squared: jax.Array
               ) -> Tuple[Any, Any, jax.Array]:
        """``(new params, new state, global grad norm)`` from the reduced gradients of the
        trainable params (``params``: all of them; the frozen come back as they are)."""
        trained = self.trainable.select(params)
        new, new_state, norm = self._update_trained(learner=learner, adapter=adapter,
                                                    params=trained, opt_state=opt_state,
                                                    grads=grads, norm_squared=norm_squared)
        return self.trainable.merge(params, new), new_state, norm

    @abc.abstractmethod
    def _update_trained(self, *, learner: learner_lib.Learner,
                        adapter: learner_lib.OptimizerAdapter, params: Any, opt_state: Any,
                        grads: Any, norm_squared: jax.Array) -> Tuple[Any, Any, jax.Array]:
        """``update`` on the trainable params only."""


class Replicated(StateSharding):
    """The optimizer state laid out like the params (no sharding over the data axis)."""

    def _update_trained(self, *, learner, adapter, params, opt_state, grads, norm_squared):
        return _update_as_stored(learner, adapter, params, opt_state, grads, norm_squared)


class ShardedOptimizerState(StateSharding):
    """ZeRO-1 (``scatter_gradients=False``) or ZeRO-2 over ``axis``, on the dims ``dims``."""

    def __init__(self, *, param_specs: Any, axis: str, axis_size: int, dims: Any,
                 scatter_gradients: bool, trainable: Optional[Trainable] = None):
        super().__init__(param_specs=param_specs, trainable=trainable)
        self.shard_axis = axis
        self.axis_size = axis_size
        self.dims = dims
        self.scatter_gradients = scatter_gradients
        # The trainable params' optimizer state (and ZeRO-2 gradient) layout, and split dims.
        self.state_leaf_specs = self.trainable.select(state_dims.add_axis(param_specs, dims, axis))
        self.trained_dims = self.trainable.select(dims)

    @property
    def title(self) -> str:
        return f"ZeRO-{2 if self.scatter_gradients else 1} over {self.shard_axis!r}"

    @property
    def grad_specs(self) -> Any:
        return self.state_leaf_specs if self.scatter_gradients else self.trained_param_specs

    @property
    def update_specs(self) -> Any:
        return self.state_leaf_specs

    @property
    def scatter_dims(self) -> Optional[Any]:
        return self.trained_dims if self.scatter_gradients else None

    def opt_state_specs(self, adapter, local_params):
        return _state_specs(adapter, jax.eval_shape(
            adapter.init, self._part_shapes(self.trainable.select(local_params))),
            self.state_leaf_specs)

    def _part_shapes(self, local_params: Any) -> Any:
        def part(s, dim):
            if dim is None:
                return s
            shape = list(s.shape)
            shape[dim] //= self.axis_size
            return jax.ShapeDtypeStruct(tuple(shape), s.dtype)

        return jax.tree_util.tree_map(part, local_params, self.trained_dims)

    def init(self, adapter, params):
        return adapter.init(self._local_part(self.trainable.select(params)))

    def _local_part(self, tree: Any) -> Any:
        """This device's part of values identical over the axis (trainable params, ZeRO-1
        gradients)."""
        axis = self.shard_axis

        def part(x, dim):
            if dim is None:
                return x
            size = x.shape[dim] // collectives.axis_size(axis)
            return jax.lax.dynamic_slice_in_dim(x, collectives.axis_index(axis) * size, size,
                                                axis=dim)

        return jax.tree_util.tree_map(part, tree, self.trained_dims)

    def _update_trained(self, *, learner, adapter, params, opt_state, grads, norm_squared):
        norm = jax.numpy.sqrt(norm_squared)
        grad_parts = grads if self.scatter_gradients else self._local_part(grads)
        new_parts, new_state = learner.apply_update(adapter=adapter, grads=grad_parts, norm=norm,
                                                    opt_state=opt_state,
                                                    params=self._local_part(params))
        axis = self.shard_axis
        new_params = jax.tree_util.tree_map(
            lambda new, dim: new if dim is None else collectives.all_gather(
                new, axis, axis_index=dim, invariant=True), new_parts, self.trained_dims)
        return new_params, new_state, norm


class FullySharded(StateSharding):
    """ZeRO-3 / FSDP over ``axis``: the params' specs carry it; everything is a local shard, and
    the update is the replicated one on the shards.

    ``grad_sync="per_step"`` gathers the params once before the step's microbatch loop, so the
    gradients come back whole and the reducer reduce-scatters them (``scatter_dims``);
    ``"per_microbatch"`` gathers each layer where it runs and autodiff reduce-scatters."""

    def __init__(self, *, param_specs: Any, axis: str, axis_size: int, dims: Any,
                 grad_sync: str, trainable: Optional[Trainable] = None, axes: Any = None,
                 mesh_shape: Tuple[Tuple[str, int], ...] = ()):
        super().__init__(param_specs=param_specs, trainable=trainable)
        self.shard_axis = axis
        self.axis_size = axis_size
        self.dims = dims
        self.grad_sync = grad_sync
        # Per param, its split's mesh axes (``Layout.state_axes``; None: ``axis`` alone).
        self.axes = axes
        self.mesh_shape = mesh_shape

    @property
    def title(self) -> str:
        also = sorted({a for own in jax.tree_util.tree_leaves(
            self.axes, is_leaf=lambda x: isinstance(x, tuple)) if isinstance(own, tuple)
            for a in own[1:]})
        over = " x ".join(repr(a) for a in [self.shard_axis] + also)
        return f"ZeRO-3 over {over}, grad_sync={self.grad_sync}"

    @property
    def gathers(self) -> Optional[str]:
        return self.grad_sync

    @property
    def scatter_dims(self) -> Optional[Any]:
        return self.trainable.select(self.dims) if self.grad_sync == "per_step" else None

    @property
    def gather_summed_axes(self) -> Any:
        return None if self.axes is None else self.trainable.select(self.axes)

    def param_gathering(self) -> Optional[ParamGathering]:
        return ParamGathering(axis=self.shard_axis, axis_size=self.axis_size, dims=self.dims,
                              per_microbatch=self.grad_sync == "per_microbatch",
                              axes=self.axes, mesh_shape=self.mesh_shape)

    def _update_trained(self, *, learner, adapter, params, opt_state, grads, norm_squared):
        return _update_as_stored(learner, adapter, params, opt_state, grads, norm_squared)


def _update_as_stored(learner, adapter, params, opt_state, grads, norm_squared):
    """The update on the state exactly as each device stores it: the whole (TP/PP-local) state,
    or FSDP's shards (their gradients are reduced into the same shards)."""
    norm = jax.numpy.sqrt(norm_squared)
    new_params, new_state = learner.apply_update(adapter=adapter, grads=grads, norm=norm,
                                                 opt_state=opt_state, params=params)
    return new_params, new_state, norm


def _state_specs(adapter: learner_lib.OptimizerAdapter, state_shapes: Any, leaf_specs: Any) -> Any:
    """Specs of an optimizer state: each param-like leaf gets its param's entry of
    ``leaf_specs``; counters and other scalars are replicated."""
    # (A part of ``optax.partition``'s state holds MaskedNode for the params of the other
    # parts (Muon's matrices, AdamW's rest): it stays in the specs.)
    return optax.tree_map_params(
        adapter.tx, lambda value, spec: value if isinstance(value, MaskedNode) else spec,
        state_shapes, leaf_specs, transform_non_params=lambda _: PartitionSpec(),
        is_leaf=lambda x: isinstance(x, (PartitionSpec, MaskedNode)))


def for_layout(layout: Layout, *, zero: Any) -> StateSharding:
    """The strategy for ``layout`` (the state split its ``StateSplit`` transform chose; which
    params are trainable, from their specs) and the plan's ZeRO part (``zero``: its config;
    None: replicated)."""
    trainable = Trainable.from_specs(layout.parameter_specs, is_leaf=rules.is_param_leaf)
    if zero is None or layout.state_axis is None:
        return Replicated(param_specs=layout.param_specs, trainable=trainable)
    size = int(layout.mesh_shape[layout.state_axis])
    if layout.params_sharded:
        return FullySharded(param_specs=layout.param_specs, axis=layout.state_axis,
                            axis_size=size, dims=layout.state_dims, grad_sync=zero.grad_sync,
                            trainable=trainable, axes=layout.state_axes,
                            mesh_shape=layout.mesh_axes)
    return ShardedOptimizerState(param_specs=layout.param_specs, axis=layout.state_axis,
                                 axis_size=size, dims=layout.state_dims,
                                 scatter_gradients=zero.stage == 2, trainable=trainable)
