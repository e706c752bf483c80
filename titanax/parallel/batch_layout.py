"""Where a batch lives: its rows and its sequence over the mesh, and what that asks of the reducer.

The batch's half of the layout (``Layout.batch``): built by the plan's parts like the params'
half -- data parallelism splits the rows over the data axis (and the ZeRO axis under HSDP),
expert parallelism over the expert axis too, context parallelism each row's sequence over the
context axis -- and read by the inputs (where each process's rows go, in what order), the step
builder (the batch's specs, the axes the loss is a token-weighted mean over) and the reducer
(batch axes its data all-reduce crosses as well, gradients a layer already summed). None of them
names a parallel kind: a new one that splits the batch adds its axes here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Protocol, Tuple

from jax.sharding import PartitionSpec

from titanax.parallel import sharding


class SequenceOrder(Protocol):
    """How a split sequence is cut and ordered on the host (context parallelism's CP part)."""

    def chunks(self, size: int) -> int:
        """How many equal chunks a row is cut into on an axis of ``size`` devices."""

    def prepare(self, batch: Mapping[str, Any], *, size: int) -> Any:
        """The host batch in the order its sequence is split in (positions added)."""


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """The rows' and the sequence's mesh axes, and what the reduction needs to know of them."""

    # The mesh axes the rows are split over, outermost first (data; data x fsdp under HSDP;
    # and the expert axis, whose ranks route their own rows' tokens).
    row_axes: Tuple[str, ...] = ()
    # The mesh axis each row's sequence is split over (None: whole rows).
    sequence_axis: Optional[str] = None
    # How the sequence is cut and ordered on the host (None: contiguous, as it comes).
    sequence_order: Optional[SequenceOrder] = None
    # The data-parallel axis: the reducer's one data all-reduce crosses it.
    data_axis: Optional[str] = None
    # Batch axes every param is replicated on that the data all-reduce crosses too (the
    # sequence's; the expert axis, for the params not split over it).
    fold_axes: Tuple[str, ...] = ()
    # Batch axes whose layers already sum the gradients of the params split over them (the
    # experts', over the expert axis: the all-to-alls' transposes).
    layer_summed_axes: Tuple[str, ...] = ()

    @property
    def token_axes(self) -> Tuple[str, ...]:
        """Every axis the batch's tokens are split over: the loss is a token-weighted mean over
        them."""
        return self.row_axes + ((self.sequence_axis,) if self.sequence_axis else ())

    @property
    def row_entry(self) -> sharding.AxisEntry:
        """``row_axes`` as one spec entry / collective axis argument."""
        return sharding.axis_entry(self.row_axes)

    def specs(self, batch: Any) -> Any:
        """A PartitionSpec per leaf: rows (first dimension) over the row axes, the sequence
        (second) over the sequence axis."""
        return sharding.shard_batch_specs(batch, self.row_entry, seq_axis=self.sequence_axis)

    def row_spec(self) -> PartitionSpec:
        """Arrays split by rows only (prompts, generated tokens)."""
        return PartitionSpec(self.row_entry)

    def prepared(self, host_batch: Any, mesh_shape: Mapping[str, int]) -> Any:
        """A host batch in the order it is split in (the sequence's, when it is)."""
        if self.sequence_order is None or self.sequence_axis is None:
            return host_batch
        return self.sequence_order.prepare(host_batch, size=mesh_shape[self.sequence_axis])

    def sequence_chunks(self, mesh_shape: Mapping[str, int]) -> int:
        """How many equal chunks every row must cut into (1: whole rows)."""
        if self.sequence_axis is None:
            return 1
        size = mesh_shape[self.sequence_axis]
        return self.sequence_order.chunks(size) if self.sequence_order is not None else size

    def without(self, dropped: Tuple[str, ...]) -> "BatchLayout":
        """This layout with the mesh axes ``dropped`` (size 1) removed everywhere."""
        keep = lambda axes: tuple(a for a in axes if a not in dropped)  # noqa: E731
        return dataclasses.replace(
            self, row_axes=keep(self.row_axes),
            sequence_axis=None if self.sequence_axis in dropped else self.sequence_axis,
            data_axis=None if self.data_axis in dropped else self.data_axis,
            fold_axes=keep(self.fold_axes), layer_summed_axes=keep(self.layer_summed_axes))


@dataclasses.dataclass(frozen=True)
class BatchRows:
    """The layout pipeline's transform of data parallelism: the rows over the data axis (and,
    under HSDP, the ZeRO axis too: each device of a ZeRO group runs its own rows)."""

    row_axes: Tuple[str, ...]
    data_axis: Optional[str]
    name: str = "rows split"

    def apply(self, layout):
        batch = dataclasses.replace(layout.batch, row_axes=self.row_axes,
                                    data_axis=self.data_axis)
        return layout.evolve(self.name, batch=batch)
