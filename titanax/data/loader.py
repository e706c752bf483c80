"""ShardedDataLoader: the seed's imperative name for an Input over a plain dataset.

``ShardedDataLoader(dataset, dp_axis_size, prefetch, global_shuffle, seed, batch_size=...)`` takes
anything with ``__len__`` and ``__getitem__`` returning dicts of arrays and yields this process's
rows of each global batch, shuffled from the seed, with a checkpointable iterator state.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import jax

from titanax import errors
from titanax.data.pipeline import Input

_log = logging.getLogger("titanax")


class ShardedDataLoader:
    """Host-local batches of a random-access dataset, ready for ``Engine.fit``."""

    def __init__(self, dataset: Any, dp_axis_size: int, prefetch: int = 2,
                 global_shuffle: bool = True, seed: Optional[int] = None, *, batch_size: int,
                 last_batch: str = "drop", num_epochs: Optional[int] = None,
                 engine: Any = None):
        """``engine``: read the batch shards its mesh gives this process
        (``Engine.process_batch_shards``); without one, shard ``process_index`` of
        ``process_count`` (right when each process holds its own data-parallel shards)."""
        if batch_size % dp_axis_size:
            raise errors.DataError(
                f"batch size {batch_size} is not divisible by the data-parallel size "
                f"{dp_axis_size}", path="batch_size",
                suggestion=f"use a multiple of {dp_axis_size}")
        cfg = Input.default_config().set(global_batch_size=batch_size, shuffle=global_shuffle,
                                         seed=seed or 0, prefetch=prefetch, last_batch=last_batch,
                                         num_epochs=num_epochs)
        if engine is not None:
            shards, num_shards = engine.build().process_batch_shards()
            self.input = cfg.instantiate(source=dataset, shards=shards, num_shards=num_shards)
        else:
            if jax.process_count() > 1:
                _log.warning("ShardedDataLoader without engine=: process %d reads rows by its "
                             "index; when the model or pipe axis spans processes the mesh needs "
                             "other rows -- pass engine= to follow the mesh",
                             jax.process_index())
            self.input = cfg.instantiate(source=dataset, process_index=jax.process_index(),
                                         process_count=jax.process_count())

    def __iter__(self):
        return iter(self.input)
