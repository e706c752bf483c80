"""The gradient reducer: every gradient reduced once per step, in as few collectives as possible.

A plan and an executor. The plan is made once on the host from the final param specs (DESIGN
section 7): ``GradientReducer.buckets``, one ``Bucket`` per collective -- its axes, the gradients
it carries, what it divides them by, the norm's squares riding in it -- printed by
``--explain``. The executor (``reduce``, once per step in local view after the gradient
computer) reduces each bucket and divides; the step's metrics and state updates join the bucket
of their axes (known when the step is traced, from their varying axes), and a token-weighted
step scales the result once at the end.

Each gradient must be summed over every mesh axis its param is replicated on: averaged over the
axes the batch is split over (data; under HSDP also fsdp), summed over the others (a
TP-replicated param collects its gradient from every model rank). Written naively that is one
all-reduce per group of leaves, plus one for each metric, plus one for the global norm's squares and one for the finite
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
import functools
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
             layer_summed: Sequence[str] = (), gather_summed: Any = None
             ) -> "GradientReducer":
        """``param_specs``: the layout of the *reduced* gradients (with ZeRO-2 / FSDP the shard
        axis on the scattered dimension); ``scatter_dims``: a tree like them (None leaves: no
        scatter); ``param_layout``: the params' own specs, when they differ (ZeRO-2);
        ``fold_axes``: see the field (ignored without a data axis); ``layer_summed``: the batch
        axes whose layers sum the gradients of the params split over them (the expert axis;
        see ``layer_summed_axes``); ``gather_summed``: a tree like ``param_specs`` of the axes
        FSDP's gather already summed (and averaged) each gradient over (None: none) -- never a
        layer's sum too."""
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        specs = jax.tree_util.tree_leaves(param_specs, is_leaf=is_spec)
        scatter = ()
        if scatter_dims is not None:
            scatter = tuple(jax.tree_util.tree_structure(param_specs, is_leaf=is_spec)
                            .flatten_up_to(scatter_dims))
        axes = tuple(mesh_shape)
        fold = tuple(fold_axes) if data_axis is not None else ()
        gathered = [()] * len(specs) if gather_summed is None else [
            own or () for own in jax.tree_util.tree_structure(param_specs, is_leaf=is_spec)
            .flatten_up_to(gather_summed)]
        layout = jax.tree_util.tree_leaves(param_layout if param_layout is not None
                                           else param_specs, is_leaf=is_spec)
        whole_over = tuple(a for a in fold if a not in layer_summed)
        split = [a for spec in specs + layout for a in whole_over if a in rules.spec_axes(spec)]
        if split:  # (The transform that folds an axis refuses it first, naming its plan part.)
            raise errors.PlanError(f"a param is split over {split[0]!r}, which the data "
                                   "all-reduce crosses as a batch axis", path="plan",
                                   suggestion=f"keep params whole over {split[0]!r}")

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
                                                 and a in layer_summed and a not in own)
                                           for spec, own in zip(specs, gathered)))

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

    # --- The plan: one bucket per collective, fixed at build time --------------------------------

    @functools.cached_property
    def buckets(self) -> Tuple[Bucket, ...]:
        """Every collective the reduction issues for the gradients, in order (see the module
        docstring): the reduce-scatters into the ZeRO layout, the all-reduces of gradients
        their layer summed over part of the batch axes, the data all-reduce, then one
        all-reduce per set of other axes (the norm's squares riding where they can), and the
        squares that need their own. Metrics and state updates join the bucket of their axes
        when the step runs (or add one of their own)."""
        sizes = dict(self.mesh_shape)
        out: List[Bucket] = [Bucket(kind="reduce-scatter", axes=(self.shard_axis,), grads=(i,),
                                    dim=dim)
                             for i, dim in enumerate(self.scatter_dims) if dim is not None]
        if self.data_axis is not None:
            crossing = [i for i, axes in enumerate(self.split_axes) if self.data_axis not in axes]
            groups: Dict[Tuple[str, ...], List[int]] = {}
            for index in (i for i in crossing if self._summed_by_layer(i)):
                axes = tuple(a for a in self.data_axes if a not in self.layer_summed_axes[index])
                groups.setdefault(axes, []).append(index)
            out += [Bucket(kind="layer-summed", axes=axes, grads=tuple(group),
                           divisor=self.data_size) for axes, group in sorted(groups.items())]
            out.append(Bucket(kind="data", axes=self.data_axes, divisor=self.data_size,
                              grads=tuple(i for i in crossing if not self._summed_by_layer(i))))
        early, late, _ = self._square_groups()
        replicated: Dict[Tuple[str, ...], List[int]] = {}
        for index, axes in enumerate(self.replicated_axes):
            if axes:
                replicated.setdefault(axes, []).append(index)
        for key in sorted(set(replicated) | set(early)):
            out.append(Bucket(kind="other", axes=key, grads=tuple(replicated.get(key, ())),
                              divisor=math.prod(sizes[a] for a in key
                                                if a in self.loss_relation.mean_over),
                              squares=tuple(early.get(key, ()))))
        out += [Bucket(kind="squares", axes=key, squares=tuple(indices))
                for key, indices in sorted(late.items())]
        return tuple(out)

    @functools.cached_property
    def layer_divisions(self) -> Tuple[Tuple[int, int], ...]:
        """``(leaf, divisor)`` of gradients a layer summed over batch axes that no bucket
        divides: their shards' mean."""
        sizes = dict(self.mesh_shape)
        divided = {i for b in self.buckets if b.kind == "layer-summed" for i in b.grads}
        return tuple((i, math.prod(sizes[a] for a in axes))
                     for i, axes in enumerate(self.layer_summed_axes)
                     if axes and i not in divided)

    def describe(self, *, paths: Optional[Sequence[str]] = None) -> str:
        """--explain's lines: one per collective, what it carries and divides by."""
        lines = [f"gradient reduction: {len(self.buckets)} collective(s) for the gradients "
                 "(metrics and state updates ride in the bucket of their axes)"]
        lines += ["  " + bucket.describe(paths) for bucket in self.buckets]
        if self.layer_divisions:
            lines.append(f"  {len(self.layer_divisions)} gradient(s) their layer summed over a "
                         "batch axis: divided by its size, no collective")
        lines.append("  token-weighted steps: gradients, norm and loss x (batch shards / summed "
                     "weight) afterwards (the weight rides as a summed metric)")
        return "\n".join(lines)

    # --- The executor: reduce each bucket, divide ------------------------------------------------

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
        values = _Values.of(grads, mean_metrics=mean_metrics, sum_metrics=sum_metrics,
                            weight=weight, sync_data=sync_data, state_updates=state_updates)
        for bucket in self.buckets:
            if bucket.kind == "reduce-scatter":  # Each device keeps the mean of its part.
                index = bucket.grads[0]
                values.leaves[index] = collectives.reduce_scatter(
                    values.leaves[index], self.shard_axis, "mean", scatter_dimension=bucket.dim)
        if self.data_axis is not None:
            self._reduce_data(values)
        for index, divisor in self.layer_divisions:
            values.leaves[index] = values.leaves[index] / divisor
        norm_squared = self._reduce_other_axes(values)
        return self._reduced(values, norm_squared, sync_data=sync_data)

    def _reduce_data(self, values: "_Values") -> None:
        """The data all-reduce: the gradients that cross it, every synced metric and the state
        updates of params not split over it, in one collective (and the layer-summed
        gradients' own, over the data axes their layer did not sum)."""
        partly = {}
        for bucket in (b for b in self.buckets if b.kind == "layer-summed"):
            reduced = collectives.psum([values.leaves[i] for i in bucket.grads],
                                       sharding.axis_entry(bucket.axes))
            partly.update((i, (r, bucket.divisor)) for i, r in zip(bucket.grads, reduced))
        data = next(b for b in self.buckets if b.kind == "data")
        carried = [i for i, crosses in enumerate(values.synced) if crosses]
        updates = [i for i in sorted(values.updates) if not self.param_split_over_data[i]]
        if data.grads or carried or updates:
            reduced = collectives.psum([values.leaves[i] for i in data.grads]
                                       + [values.metrics[i] for i in carried]
                                       + [values.updates[i] for i in updates],
                                       sharding.axis_entry(data.axes))
            for position, index in enumerate(data.grads):
                values.leaves[index] = reduced[position] / data.divisor
            averaged = all(a in self.loss_relation.mean_over for a in self.data_axes)
            for position, index in enumerate(carried):
                value = reduced[len(data.grads) + position]
                mean = averaged and index < values.mean_count
                values.metrics[index] = value / data.divisor if mean else value
            offset = len(data.grads) + len(carried)
            for position, index in enumerate(updates):
                values.updates[index] = reduced[offset + position] / data.divisor
        for index, (value, divisor) in partly.items():
            values.leaves[index] = value / divisor

    def _reduce_other_axes(self, values: "_Values") -> jax.Array:
        """One all-reduce per set of non-data axes; the norm's squares ride along; returns the
        squared global norm.

        A gradient replicated over axes R is summed over R, and averaged over those of R the
        batch is split over (HSDP's FSDP axis: each device there saw its own rows; the mean
        metrics are averaged there too, the sum metrics summed). A gradient split over axes S
        (and replicated over none) has its squared norm summed over S -- in the same collective
        as the gradients replicated over S, when there are any. Metrics that are identical
        copies over some axes are averaged there, also in that collective, and so are state
        updates over the axes their param is replicated on (copies there: the average leaves
        them unchanged, and makes them invariant).
        """
        relation, sizes = self.loss_relation, dict(self.mesh_shape)
        planned = {b.axes: b for b in self.buckets if b.kind == "other"}
        metric_groups, update_groups = self._value_groups(values)
        norm_parts: List[jax.Array] = []
        for key in sorted(set(planned) | set(metric_groups) | set(update_groups)):
            bucket = planned.get(key, Bucket(kind="other", axes=key))
            metric_indices, update_indices = metric_groups.get(key, []), update_groups.get(key, [])
            payload = ([values.leaves[i] for i in bucket.grads]
                       + [values.metrics[i] for i in metric_indices]
                       + [values.updates[i] for i in update_indices])
            if bucket.squares:
                payload.append(_square_sum([values.leaves[i] for i in bucket.squares]))
            reduced = collectives.psum(payload, key)
            # Partial sums (sum_over) add up; copies count once; over batch axes (mean_over)
            # means are averaged and counts summed.
            batch_split = math.prod(sizes[a] for a in key if a in relation.mean_over)
            copies = math.prod(sizes[a] for a in key
                               if a not in relation.sum_over and a not in relation.mean_over)
            for position, index in enumerate(bucket.grads):
                values.leaves[index] = reduced[position] / bucket.divisor \
                    if bucket.divisor > 1 else reduced[position]
            for position, index in enumerate(metric_indices):
                divisor = copies * (batch_split if index < values.mean_count else 1)
                values.metrics[index] = reduced[len(bucket.grads) + position] / divisor
            offset = len(bucket.grads) + len(metric_indices)
            for position, index in enumerate(update_indices):
                values.updates[index] = reduced[offset + position] / math.prod(
                    sizes[a] for a in key)
            if bucket.squares:
                norm_parts.append(reduced[-1])
        for bucket in (b for b in self.buckets if b.kind == "squares"):
            norm_parts.append(collectives.psum(
                _square_sum([values.leaves[i] for i in bucket.squares]), bucket.axes))
        local = self._square_groups()[2]
        if local:
            norm_parts.append(_square_sum([values.leaves[i] for i in local]))
        return sum(norm_parts) if norm_parts else jnp.float32(0.0)

    def _reduced(self, values: "_Values", norm_squared: jax.Array, *,
                 sync_data: bool) -> Reduced:
        """What the learner gets; token-weighted steps scaled by batch shards / summed weight
        (no trained token anywhere: every sum is 0, and so is the mean)."""
        metrics = dict(zip(values.names, values.metrics))
        total = metrics.pop(_WEIGHT, None)
        leaves = values.leaves
        if values.weighted:
            factor = self.batch_shards / jnp.where(total > 0, total, 1.0)
            leaves = [(at_least_float32(leaf) * factor).astype(leaf.dtype) for leaf in leaves]
            norm_squared = norm_squared * jnp.square(factor)
            if sync_data and "loss" in metrics:
                metrics["loss"] = metrics["loss"] * factor
        return Reduced(grads=jax.tree_util.tree_unflatten(values.treedef, leaves),
                       metrics=metrics, norm_squared=norm_squared, state_updates=values.updates)

    def _summed_by_layer(self, index: int) -> bool:
        """Whether gradient ``index`` was summed over a fold axis by its layer (see
        ``layer_summed_axes``): it then crosses the data all-reduce without that axis."""
        return bool(self.layer_summed_axes) and bool(
            set(self.layer_summed_axes[index]) & set(self.fold_axes))

    def _value_groups(self, values: "_Values"
                      ) -> Tuple[Dict[Tuple[str, ...], List[int]], Dict[Tuple[str, ...], List[int]]]:
        """Indices of the metrics and state updates by the axes each is reduced over outside
        the data axis (known when the step is traced: from the values' varying axes)."""
        relation = self.loss_relation
        metric_groups: Dict[Tuple[str, ...], List[int]] = {}
        for index, value in enumerate(values.metrics):
            # Unsynced metrics stay per batch shard: they cross no batch axis.
            excluded = set(self.data_axes) | (set() if values.synced[index]
                                              else set(relation.mean_over))
            # Over a batch axis every shard's value is its own, varying-typed or not (a token
            # count of sum(ones) is not): psum counts it once per shard.
            varying = set(collectives.varying_axes(value)) | set(relation.mean_over)
            key = tuple(a for a, _ in self.mesh_shape if a in varying and a not in excluded)
            if key:
                metric_groups.setdefault(key, []).append(index)
        update_groups: Dict[Tuple[str, ...], List[int]] = {}
        for index, value in sorted(values.updates.items()):
            varying = collectives.varying_axes(value)
            key = tuple(a for a in self.param_replicated_axes[index] if a in varying)
            if key:
                update_groups.setdefault(key, []).append(index)
        return metric_groups, update_groups

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


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One collective of the reduction (``GradientReducer.buckets``)."""

    # "reduce-scatter" (ZeRO-2 / FSDP per-step), "layer-summed", "data" (the one data
    # all-reduce), "other" (one per set of other axes), "squares" (a norm's own).
    kind: str
    # The mesh axes it crosses.
    axes: Tuple[str, ...]
    # The gradients it carries (flattened param order).
    grads: Tuple[int, ...] = ()
    # What each summed gradient is divided by (1: a sum).
    divisor: int = 1
    # Gradients whose squared norm rides in it, summed into one scalar.
    squares: Tuple[int, ...] = ()
    # The dimension a reduce-scatter splits.
    dim: Optional[int] = None

    def describe(self, paths: Optional[Sequence[str]] = None) -> str:
        what = f"{len(self.grads)} gradient(s)" if self.grads else "no gradient"
        if paths is not None and self.grads:
            shown = [paths[i] for i in self.grads[:3]]
            what += " (" + ", ".join(shown) + (", ..." if len(self.grads) > 3 else "") + ")"
        op = "reduce-scatter (mean)" if self.kind == "reduce-scatter" else "all-reduce"
        text = f"{self.kind}: {op} over {' x '.join(self.axes)}: {what}"
        if self.kind == "reduce-scatter":
            text += f", dimension {self.dim}"
        elif self.grads:
            text += f", / {self.divisor}" if self.divisor > 1 else ", summed"
        if self.squares:
            text += f"; squared norms of {len(self.squares)} split gradient(s)"
        if self.kind == "data":
            text += "; + the metrics and state updates"
        return text


@dataclasses.dataclass
class _Values:
    """What one reduction works on, updated in place bucket by bucket."""

    leaves: List[jax.Array]
    treedef: Any
    names: List[str]
    metrics: List[jax.Array]
    # Per metric: whether it crosses the batch axes (all, or with sync_data=False only the
    # shards' weight, which the gradients need).
    synced: List[bool]
    # How many of the metrics are means (the first ones).
    mean_count: int
    updates: Dict[int, jax.Array]
    weighted: bool

    @classmethod
    def of(cls, grads, *, mean_metrics, sum_metrics, weight, sync_data, state_updates):
        weighted = weight is not None
        if weighted:
            # The plain mean over the shards is then mean(weight x value); divided by
            # mean(weight) afterwards it is the weighted mean.
            if sync_data and "loss" in mean_metrics:
                mean_metrics = {**mean_metrics, "loss": mean_metrics["loss"] * weight}
            sum_metrics = {**sum_metrics, _WEIGHT: weight}
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        names = list(mean_metrics) + list(sum_metrics)
        return cls(leaves=list(leaves), treedef=treedef, names=names,
                   metrics=[mean_metrics[k] for k in mean_metrics]
                   + [sum_metrics[k] for k in sum_metrics],
                   synced=[sync_data or name == _WEIGHT for name in names],
                   mean_count=len(mean_metrics), updates=dict(state_updates or {}),
                   weighted=weighted)


# The name the shards' weight rides under among the metrics (never reported).
_WEIGHT = "__shard_weight__"


def _square_sum(values: Sequence[jax.Array]) -> jax.Array:
    return sum(jnp.sum(jnp.square(at_least_float32(v))) for v in values)
