"""Which batch shards a process feeds, and the global batch built from its rows.

A batch is split along its first dimension over the batch axes (``data``; under HSDP ``data x
fsdp``) into ``num_shards`` equal shards; every other mesh axis holds copies. Which devices hold
shard k is the mesh's arrangement, not the process index: with the model (or pipe) axis inside a
process, each process holds different shards; with it spanning processes, several processes hold
the same shards and must feed the same rows. So a process reads exactly the shards its devices
hold, in shard order (``process_shards``), and ``place_batch`` hands every device its shard's rows
-- an explicit placement that never guesses how a process's rows map onto the global array.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from titanax import errors
from titanax.parallel import sharding


def process_shards(mesh: Mesh, batch_axis: sharding.AxisEntry) -> Tuple[Tuple[int, ...], int]:
    """``(this process's shard indices in increasing order, number of shards)``."""
    num_shards = sharding.axes_size(dict(mesh.shape), batch_axis)
    if batch_axis is None:
        return (0,), 1
    layout = NamedSharding(mesh, PartitionSpec(batch_axis))
    held = {index[0].start or 0 for index in
            layout.addressable_devices_indices_map((num_shards,)).values()}
    return tuple(sorted(held)), num_shards


def place_batch(mesh: Mesh, batch_axis: sharding.AxisEntry, host_batch: Any,
                shards: Sequence[int], num_shards: int, *,
                seq_axis: Optional[str] = None) -> Any:
    """Global arrays from this process's rows: ``shards`` (of ``num_shards``) stacked in order
    along the first dimension of every leaf; scalars are the same on every device. With
    ``seq_axis`` (context parallelism) each device gets its part of every row's sequence too
    (the process holds whole rows)."""
    shards = tuple(shards)
    position = {shard: i for i, shard in enumerate(shards)}
    specs = sharding.shard_batch_specs(host_batch, batch_axis, seq_axis=seq_axis)

    def place(x, spec):
        x = np.asarray(x)
        layout = NamedSharding(mesh, spec)
        if not x.ndim or not len(spec):
            return jax.make_array_from_single_device_arrays(
                x.shape, layout, [jax.device_put(x, d) for d in layout.addressable_devices])
        if x.shape[0] % len(shards):
            raise errors.DataError(
                f"a batch leaf of {x.shape[0]} rows does not split into this process's "
                f"{len(shards)} batch shard(s)", path="batch",
                suggestion="feed whole shards: rows = shards held x global batch / "
                           f"{num_shards} (engine.process_batch_shards())")
        rows = x.shape[0] // len(shards)
        global_shape = (rows * num_shards,) + x.shape[1:]
        arrays = []
        for device, index in layout.addressable_devices_indices_map(global_shape).items():
            local = position[(index[0].start or 0) // rows]
            part = x[local * rows:(local + 1) * rows]
            if len(index) > 1 and x.ndim > 1:  # The device's part of the sequence.
                part = part[:, index[1]]
            arrays.append(jax.device_put(part, device))
        return jax.make_array_from_single_device_arrays(global_shape, layout, arrays)

    return jax.tree_util.tree_map(place, host_batch, specs)


def process_rows(array: jax.Array) -> np.ndarray:
    """This process's rows of a global array split over its first dimension: the shards its
    devices hold, in increasing order, each once (the inverse of ``place_batch``)."""
    pieces = {}
    for shard in array.addressable_shards:
        start = shard.index[0].start or 0 if shard.index else 0
        if start not in pieces:
            pieces[start] = np.asarray(shard.data)
    return np.concatenate([pieces[s] for s in sorted(pieces)]) if len(pieces) > 1 \
        else next(iter(pieces.values()))


def global_rows(local: np.ndarray, shards: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """``(every batch shard's rows of local [rows, k] in shard order, the indices of this
    process's rows in it)``: gathered from every process (a shard several processes hold is
    taken once, from the first)."""
    shards = np.asarray(shards, np.int64)
    per_shard = len(local) // len(shards)
    if jax.process_count() == 1:
        held = {int(s): local[i * per_shard:(i + 1) * per_shard] for i, s in enumerate(shards)}
    else:
        rows, owners = allgathered(local), allgathered(shards)
        held = {}
        for process_rows, process_shards in zip(rows, owners):
            for i, s in enumerate(process_shards):
                held.setdefault(int(s), process_rows[i * per_shard:(i + 1) * per_shard])
    order = sorted(held)
    merged = np.concatenate([held[s] for s in order])
    start = {s: k * per_shard for k, s in enumerate(order)}
    mine = np.concatenate([np.arange(start[int(s)], start[int(s)] + per_shard) for s in shards])
    return merged, mine


def allgathered(values: np.ndarray) -> np.ndarray:
    """Every process's ``values`` stacked on a new first dimension, bit for bit (sent as
    32-bit words: float64 / int64 would go through jax's default float32 / int32)."""
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    values = np.ascontiguousarray(values)
    words = values.view(np.uint32) if values.dtype.itemsize == 8 else values
    gathered = np.asarray(multihost_utils.process_allgather(words))
    return np.ascontiguousarray(gathered).view(values.dtype).reshape(
        (-1,) + values.shape)
