"""The gradient reducer: every gradient reduced once per step, in as few collectives as possible.

Planned once on the host from the final param specs (DESIGN section 7), run once per step in
local view after the gradient computer. Each gradient must be summed over every mesh axis its
param is replicated on: averaged over the axes the batch is split over (data; under HSDP also
fsdp), summed over the others (a TP-replicated param collects its gradient from every model rank). Written naively that is one all-reduce per group of
leaves, plus one for each metric, plus one for the global norm's squares and one for the finite
check: six small collectives where two suffice. The reducer issues

1. **one** all-reduce over the data axis carrying every gradient *and* the step's metrics (the
   loss averaged, the counts summed) -- the only data-axis collective of the step, except under
   expert parallelism: there the experts' gradients, split over the expert axis and already
   summed over it by the layers' all-to-alls (``layer_summed_axes``), cross the data axis alone
   in a second all-reduce, while the rest cross data x expert in the first;
2. per set of other axes (for a data x model mesh: one, over ``model``), **one** all-reduce
   carrying the gradients replicated there, the squared norms of the gradients split there, and
   the metrics that are identical copies there (averaged, which leaves their value unchanged).

The global gradient norm then needs no collective of its own, and neither does the finite check:
after these two reductions the loss and the norm are the same on every device.

When the gradient computer weighted each shard's loss by its trained tokens (gradients.py), the
shards' weights ride in these same collectives as one more summed metric, and the averaged
gradients, norm and loss are divided by the mean weight afterwards: token-weighted, with no
collective of its own.

With ZeRO-2 and FSDP ``grad_sync="per_step"`` the state is split along a real dimension of each
param over the ZeRO axis, and those gradients are reduce-scattered into that layout first (one
reduce-scatter each, instead of their part of step 1). A gradient split over the data axis (its
layout names it: scattered, or an FSDP gradient whose gather's transpose already reduced it) is
not summed there: each device holds its own part; its squared norm is summed over the data axis
with its other split axes. How the metrics are reduced follows the gradient computer's declared
``LossRelation``: averaged over ``mean_over`` axes, summed over ``sum_over`` axes, and copies
elsewhere counted once.

Under HSDP the batch is split over ``data`` *and* the ZeRO axis (``fsdp``), but only ``data`` is
the reducer's data axis: the gradients sharded over ``fsdp`` (reduce-scattered there, or by the
gathers' transposes) cross ``data`` in step 1 as their ``fsdp`` parts, and the few left whole are
averaged over ``fsdp`` in step 2's collective, like any other axis they are replicated on -- so
``data`` is still crossed once per step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from titanax import errors
from titanax.parallel import collectives, rules, sharding
from titanax.train.gradients import LossRelation
from titanax.utils.dtypes import at_least_float32


@dataclasses.dataclass(frozen=True)
class Reduced:
    """What the reducer hands the learner."""

    grads: Any
    # Metrics reduced over the data axis (averaged or summed) and made identical elsewhere.
    metrics: Dict[str, jax.Array]
    # The squared global L2 norm of the reduced gradients.
    norm_squared: jax.Array
    # State updates averaged over the axes their param is replicated on, by flattened param
    # index (empty when the model wrote none).
    state_updates: Dict[int, jax.Array] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class GradientReducer:
    """Which axes each gradient is reduced over, fixed at build time."""

    # Mesh axis name -> size, in mesh order.
    mesh_shape: Tuple[Tuple[str, int], ...]
    data_axis: Optional[str]
    # Per leaf (flattened param order): the non-data axes its param is replicated on.
    replicated_axes: Tuple[Tuple[str, ...], ...]
    # Per leaf: the axes its param is split over.
    split_axes: Tuple[Tuple[str, ...], ...]
    # Per leaf: the dimension its gradient is reduce-scattered along over ``shard_axis`` (the
    # ZeRO-2 / FSDP layout; the leaf's spec then names the axis) or None. Empty: no scatter.
    scatter_dims: Tuple[Optional[int], ...] = ()
    shard_axis: Optional[str] = None
    # Per leaf: whether the *param* (not its gradient) is split over the data axis, and the
    # non-data axes the param is replicated on. A state update is averaged over the axes its
    # param is replicated on, even where ZeRO-2 scatters the param's gradient.
    param_split_over_data: Tuple[bool, ...] = ()
    param_replicated_axes: Tuple[Tuple[str, ...], ...] = ()
    # How the loss (and the other mean metrics) relate to the one-device loss, per axis.
    loss_relation: LossRelation = LossRelation()
    # Batch axes every param is replicated on (context parallelism's) that the data-axis
    # all-reduce crosses too, for the gradients it carries: one all-reduce over data x context
    # instead of one over each. (A gradient split over the data axis meets them in step 2.)
    fold_axes: Tuple[str, ...] = ()
    # Per leaf: the batch axes its gradient is split over *and already summed over* by the
    # layer's own collectives (an expert's, over the expert axis: the all-to-alls' transposes
    # bring every rank's tokens' contributions to the expert's rank). Such a gradient crosses
    # the data all-reduce without them, and is divided like one summed there. Empty: none.
    layer_summed_axes: Tuple[Tuple[str, ...], ...] = ()

    @classmethod
    def plan(cls, *, param_specs: Any, mesh_shape: Mapping[str, int],
             data_axis: Optional[str], loss_relation: Optional[LossRelation] = None,
             scatter_dims: Any = None, shard_axis: Optional[str] = None,
             param_layout: Any = None, fold_axes: Sequence[str] = (),
             layer_summed: Sequence[str] = ()) -> "GradientReducer":
        """``param_specs``: the layout of the *reduced* gradients (with ZeRO-2 / FSDP the shard
        axis on the scattered dimension); ``scatter_dims``: a tree like them (None leaves: no
        scatter); ``param_layout``: the params' own specs, when they differ (ZeRO-2);
        ``fold_axes``: see the field (ignored without a data axis); ``layer_summed``: the batch
        axes whose layers sum the gradients of the params split over them (the expert axis;
        see ``layer_summed_axes``)."""
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        specs = jax.tree_util.tree_leaves(param_specs, is_leaf=is_spec)
        scatter = ()
        if scatter_dims is not None:
            scatter = tuple(jax.tree_util.tree_structure(param_specs, is_leaf=is_spec)
                            .flatten_up_to(scatter_dims))
        axes = tuple(mesh_shape)
        fold = tuple(fold_axes) if data_axis is not None else ()
        layout = jax.tree_util.tree_leaves(param_layout if param_layout is not None
                                           else param_specs, is_leaf=is_spec)
        whole_over = tuple(a for a in fold if a not in layer_summed)
        if any(a in rules.spec_axes(spec) for spec in specs + layout for a in whole_over):
            raise errors.PlanError(f"a param is split over {whole_over}, which the data "
                                   "all-reduce crosses as a batch axis",
                                   path="plan.context_parallel",
                                   suggestion="keep params whole over the context axis")

        def others(spec) -> Tuple[str, ...]:
            """The axes a leaf of ``spec`` is reduced over after the data all-reduce."""
            skip = {data_axis} | (set(fold) if data_axis not in rules.spec_axes(spec) else set())
            return tuple(a for a in axes if a not in rules.spec_axes(spec) and a not in skip)

        replicated, split = [], []
        for spec in specs:
            split.append(tuple(a for a in axes if a in set(rules.spec_axes(spec))))
            replicated.append(others(spec))
        relation = loss_relation or LossRelation(mean_over=(data_axis,) if data_axis else ())
        return cls(mesh_shape=tuple(mesh_shape.items()), data_axis=data_axis,
                   replicated_axes=tuple(replicated), split_axes=tuple(split),
                   loss_relation=relation, scatter_dims=scatter, shard_axis=shard_axis,
                   param_split_over_data=tuple(data_axis in rules.spec_axes(spec)
                                               for spec in layout),
                   param_replicated_axes=tuple(others(spec) for spec in layout),
                   fold_axes=fold,
                   layer_summed_axes=tuple(tuple(a for a in axes if a in rules.spec_axes(spec)
                                                 and a in layer_summed) for spec in specs))

    @property
    def data_size(self) -> int:
        """The devices the data all-reduce spans (data, and the fold axes)."""
        sizes = dict(self.mesh_shape)
        return math.prod(sizes[a] for a in self.data_axes)

    @property
    def data_axes(self) -> Tuple[str, ...]:
        """What the data all-reduce crosses: the data axis and the fold axes."""
        return ((self.data_axis,) if self.data_axis else ()) + self.fold_axes

    @property
    def batch_shards(self) -> int:
        """How many shards the batch is split into (the product of the mean_over axes)."""
        sizes = dict(self.mesh_shape)
        return math.prod(sizes[a] for a in self.loss_relation.mean_over if a in sizes)

    def reduce(self, grads: Any, *, mean_metrics: Dict[str, jax.Array],
               sum_metrics: Dict[str, jax.Array], weight: Optional[jax.Array] = None,
               sync_data: bool = True,
               state_updates: Optional[Mapping[int, jax.Array]] = None) -> Reduced:
        """Reduces ``grads`` and the step's metrics (see the module docstring).

        ``mean_metrics`` are averaged over the data axis (the loss), ``sum_metrics`` summed
        (token counts). With ``sync_data=False`` metrics do not cross the data axis.
        ``weight``: when the gradient computer weighted this device's loss (``grads`` are then
        the gradients of weight x loss, gradients.py): the shards are averaged by weight -- the
        plain mean below divided by the mean weight, which rides in the collectives already
        there -- so the loss and the gradients are the mean over every trained token, however
        unevenly the shards hold them. None: every shard weighs the same.
        ``state_updates`` (``{flattened param index: new value}``, state_updates.py) are averaged
        over every axis their param is replicated on -- always, whatever ``sync_data`` says,
        since every copy of a param must stay equal -- riding in the same collectives.
        """
        weighted = weight is not None
        if weighted:
            # The plain mean over the shards below is then mean(weight x value); divided by
            # mean(weight) afterwards it is the weighted mean.
            if sync_data and "loss" in mean_metrics:
                mean_metrics = {**mean_metrics, "loss": mean_metrics["loss"] * weight}
            sum_metrics = {**sum_metrics, _WEIGHT: weight}
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        metric_names = list(mean_metrics) + list(sum_metrics)
        metrics = [mean_metrics[k] for k in mean_metrics] + [sum_metrics[k] for k in sum_metrics]
        # Which metrics cross the batch axes: all of them, or (sync_data=False) only the
        # shards' weight, which the gradients need.
        synced = [sync_data or name == _WEIGHT for name in metric_names]
        updates = dict(state_updates or {})
        leaves = list(leaves)
        for index, dim in enumerate(self.scatter_dims):
            if dim is not None:  # Each device keeps the mean of its part.
                leaves[index] = collectives.reduce_scatter(leaves[index], self.shard_axis, "mean",
                                                           scatter_dimension=dim)
        data = self.data_axis
        # Gradients divided like the data all-reduce's (their layer summed the rest).
        divided_with_data: set = set()
        if data is not None:
            # Gradients split over the data axis (scattered above, or FSDP's, whose gather's
            # transpose reduced them) already hold their own part: only the others cross here.
            crossing = [i for i, axes in enumerate(self.split_axes) if data not in axes]
            # A gradient its layer summed over a fold axis crosses the rest in its own
            # all-reduce (experts': the data axis alone).
            summed = [i for i in crossing if not self._summed_by_layer(i)]
            partly = [i for i in crossing if self._summed_by_layer(i)]
            carried = [i for i, crosses in enumerate(synced) if crosses]
            averaged_updates = [i for i in sorted(updates)
                                if not self.param_split_over_data[i]]
            partly_reduced = self._psum_by_axes(leaves, partly)
            divided_with_data.update(partly)
            if summed or carried or averaged_updates:
                reduced = collectives.psum([leaves[i] for i in summed]
                                           + [metrics[i] for i in carried]
                                           + [updates[i] for i in averaged_updates],
                                           sharding.axis_entry(self.data_axes))
                size = self.data_size
                # Divided by the size (a constant XLA folds into the optimizer update and the
                # norm's reduction); a token weight's factor follows step 2. Dividing here by the
                # summed weight instead (a runtime scalar) wrote each gradient out twice more:
                # the divide, and the norm's square after it.
                for position, index in enumerate(summed):
                    leaves[index] = reduced[position] / size
                averaged = all(a in self.loss_relation.mean_over for a in self.data_axes)
                for position, index in enumerate(carried):
                    value = reduced[len(summed) + position]
                    mean = averaged and index < len(mean_metrics)
                    metrics[index] = value / size if mean else value
                offset = len(summed) + len(carried)
                for position, index in enumerate(averaged_updates):
                    updates[index] = reduced[offset + position] / size
            for index, value in partly_reduced.items():
                leaves[index] = value / self.data_size
        sizes = dict(self.mesh_shape)
        for index, axes in enumerate(self.layer_summed_axes):
            if axes and index not in divided_with_data:
                # Summed over these batch axes by its layer, reduced over no more of them
                # here: their shards' mean.
                leaves[index] = leaves[index] / math.prod(sizes[a] for a in axes)
        leaves, metrics, updates, norm_squared = self._reduce_other_axes(
            leaves, metrics, updates, mean_metric_count=len(mean_metrics), synced=synced)
        out_metrics = dict(zip(metric_names, metrics))
        out_metrics.pop(_WEIGHT, None)
        if weighted:
            total = dict(zip(metric_names, metrics))[_WEIGHT]
            # No trained token anywhere: every sum is 0, and so is the mean.
            factor = self.batch_shards / jnp.where(total > 0, total, 1.0)
            leaves = [(at_least_float32(leaf) * factor).astype(leaf.dtype) for leaf in leaves]
            norm_squared = norm_squared * jnp.square(factor)
            if sync_data and "loss" in out_metrics:
                out_metrics["loss"] = out_metrics["loss"] * factor
        return Reduced(grads=jax.tree_util.tree_unflatten(treedef, leaves),
                       metrics=out_metrics, norm_squared=norm_squared,
                       state_updates=updates)

    def _summed_by_layer(self, index: int) -> bool:
        """Whether gradient ``index`` was summed over a fold axis by its layer (see
        ``layer_summed_axes``): it then crosses the data all-reduce without that axis."""
        return bool(self.layer_summed_axes) and bool(
            set(self.layer_summed_axes[index]) & set(self.fold_axes))

    def _psum_by_axes(self, leaves: List[jax.Array], indices: Sequence[int]
                      ) -> Dict[int, jax.Array]:
        """Leaves ``indices`` summed over the data all-reduce's axes less those their layer
        summed them over: one all-reduce per set of axes."""
        groups: Dict[Tuple[str, ...], List[int]] = {}
        for index in indices:
            axes = tuple(a for a in self.data_axes if a not in self.layer_summed_axes[index])
            groups.setdefault(axes, []).append(index)
        out: Dict[int, jax.Array] = {}
        for axes, group in sorted(groups.items()):
            reduced = collectives.psum([leaves[i] for i in group], sharding.axis_entry(axes))
            out.update(zip(group, reduced))
        return out

    def _reduce_other_axes(self, leaves: List[jax.Array], metrics: List[jax.Array],
                           updates: Dict[int, jax.Array], *, mean_metric_count: int,
                           synced: Sequence[bool]):
        """One all-reduce per set of non-data axes; the norm's squares ride along.

        A gradient replicated over axes R is summed over R, and averaged over those of R the
        batch is split over (HSDP's FSDP axis: each device there saw its own rows; the mean
        metrics are averaged there too, the sum metrics summed). A gradient split over axes S (and
        replicated over none) has its squared norm summed over S -- in the same collective as
        the gradients replicated over S, when there are any. Metrics that are identical copies
        over some axes are averaged there, also in that collective, and so are state updates over
        the axes their param is replicated on (copies there: the average leaves them unchanged,
        and makes them invariant).
        """
        relation = self.loss_relation
        out, out_metrics, out_updates = list(leaves), list(metrics), dict(updates)
        grad_groups, metric_groups, update_groups = self._groups(metrics, updates,
                                                                 synced=synced)
        early_squares, late_squares, local_squares = self._square_groups()
        norm_parts: List[jax.Array] = []
        sizes = dict(self.mesh_shape)
        for key in sorted(set(grad_groups) | set(metric_groups) | set(early_squares)
                          | set(update_groups)):
            grad_indices = grad_groups.get(key, [])
            metric_indices = metric_groups.get(key, [])
            update_indices = update_groups.get(key, [])
            payload = ([out[i] for i in grad_indices] + [out_metrics[i] for i in metric_indices]
                       + [out_updates[i] for i in update_indices])
            if key in early_squares:
                payload.append(_square_sum([out[i] for i in early_squares[key]]))
            reduced = collectives.psum(payload, key)
            # Partial sums (sum_over) add up; copies count once; over batch axes (mean_over)
            # means are averaged and counts summed.
            batch_split = math.prod(sizes[a] for a in key if a in relation.mean_over)
            copies = math.prod(sizes[a] for a in key
                               if a not in relation.sum_over and a not in relation.mean_over)
            for position, index in enumerate(grad_indices):
                out[index] = reduced[position] / batch_split if batch_split > 1 \
                    else reduced[position]
            for position, index in enumerate(metric_indices):
                divisor = copies * (batch_split if index < mean_metric_count else 1)
                out_metrics[index] = reduced[len(grad_indices) + position] / divisor
            offset = len(grad_indices) + len(metric_indices)
            for position, index in enumerate(update_indices):
                out_updates[index] = reduced[offset + position] / math.prod(sizes[a] for a in key)
            if key in early_squares:
                norm_parts.append(reduced[-1])
        for key, indices in sorted(late_squares.items()):
            norm_parts.append(collectives.psum(_square_sum([out[i] for i in indices]), key))
        if local_squares:
            norm_parts.append(_square_sum([out[i] for i in local_squares]))
        norm_squared = sum(norm_parts) if norm_parts else jnp.float32(0.0)
        return out, out_metrics, out_updates, norm_squared


    def _groups(self, metrics: List[jax.Array], updates: Dict[int, jax.Array], *,
                synced: Sequence[bool]) -> Tuple[Dict[Tuple[str, ...], List[int]], ...]:
        """Indices of the gradients, metrics and state updates, by the axes each is reduced
        over outside the data axis (``synced[i]``: metric i crosses the batch axes)."""
        relation = self.loss_relation
        grad_groups: Dict[Tuple[str, ...], List[int]] = {}
        for index, axes in enumerate(self.replicated_axes):
            if axes:
                grad_groups.setdefault(axes, []).append(index)
        metric_groups: Dict[Tuple[str, ...], List[int]] = {}
        for index, value in enumerate(metrics):
            # Unsynced metrics stay per batch shard: they cross no batch axis.
            metric_excluded = set(self.data_axes) | (set() if synced[index]
                                                     else set(relation.mean_over))
            # Over a batch axis every shard's value is its own, varying-typed or not (a token
            # count of sum(ones) is not): psum counts it once per shard.
            varying = set(collectives.varying_axes(value)) | set(relation.mean_over)
            key = tuple(a for a, _ in self.mesh_shape if a in varying and a not in metric_excluded)
            if key:
                metric_groups.setdefault(key, []).append(index)
        update_groups: Dict[Tuple[str, ...], List[int]] = {}
        for index, value in sorted(updates.items()):
            varying = collectives.varying_axes(value)
            key = tuple(a for a in self.param_replicated_axes[index] if a in varying)
            if key:
                update_groups.setdefault(key, []).append(index)
        return grad_groups, metric_groups, update_groups

    def _square_groups(self):
        """``(early, late, local)``: gradients only split (not replicated) can have their
        squares summed before any reduction of theirs (``early``, by split axes); the rest need
        their own reduction first (``late``); unsplit ones need none (``local``)."""
        early: Dict[Tuple[str, ...], List[int]] = {}
        late: Dict[Tuple[str, ...], List[int]] = {}
        local: List[int] = []
        for index, split in enumerate(self.split_axes):
            if not split:
                local.append(index)
            elif not self.replicated_axes[index]:
                early.setdefault(split, []).append(index)
            else:
                late.setdefault(split, []).append(index)
        return early, late, local


# The name the shards' weight rides under among the metrics (never reported).
_WEIGHT = "__shard_weight__"


def _square_sum(values: Sequence[jax.Array]) -> jax.Array:
    return sum(jnp.sum(jnp.square(at_least_float32(v))) for v in values)
