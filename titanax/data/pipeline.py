"""Input: a grain pipeline that turns a random-access source into host-local batches.

The pipeline works on *indices* first -- shuffle (deterministic from (seed, epoch): a new
permutation each epoch), repeat, batch into global batches, keep this process's rows -- and only
then reads records, so each process reads only its own share of every global batch. Background
threads prepare ``prefetch`` batches ahead of the training loop. The result is a grain iterator
whose state (the index of the next global batch) is saved with each checkpoint; because every
element is a whole global batch, the same state resumes on every process.

A last batch that does not fill the global batch is dropped, or padded (``last_batch="pad"``):
padding rows repeat a real example and carry ``weights`` 0, which the models' losses and metrics
honour (every batch then carries ``weights``, so shapes never change).
"""

from __future__ import annotations

from typing import Any, Dict, Literal, Optional

import grain
import numpy as np

from titanax import errors
from titanax.config import Configurable, InstantiableConfig, Required, REQUIRED


class Input(Configurable):
    """Host-local batches ``{name: [global_batch_size / num_processes, ...]}``."""

    class Config(Configurable.Config):
        # The data source: a config of a Configurable with __len__ and __getitem__ (None when a
        # source object is passed to the constructor).
        source: Optional[InstantiableConfig] = None
        # Examples per step over all processes.
        global_batch_size: Required[int] = REQUIRED
        # Shuffle with a permutation drawn from (seed, epoch).
        shuffle: bool = True
        # Seed of the shuffle.
        seed: int = 0
        # Passes over the data; None: repeat forever.
        num_epochs: Optional[int] = None
        # A last batch that is not full: "drop" it, or "pad" it (padding rows get weights 0).
        last_batch: Literal["drop", "pad"] = "drop"
        # Batches prepared ahead by background threads.
        prefetch: int = 2
        # Threads reading records.
        read_threads: int = 2

        def _validate_values(self):
            if isinstance(self.global_batch_size, int) and self.global_batch_size < 1:
                yield "global_batch_size", "must be >= 1"
            if self.prefetch < 0:
                yield "prefetch", "must be >= 0"

    def __init__(self, cfg=None, *, source: Any = None, process_index: int = 0,
                 process_count: int = 1, **fields):
        super().__init__(cfg, **fields)
        cfg = self.config
        if cfg.global_batch_size % process_count:
            raise errors.DataError(
                f"global batch {cfg.global_batch_size} does not split over {process_count} "
                "processes", path="global_batch_size",
                suggestion=f"use a multiple of {process_count}")
        if source is None and cfg.source is None:
            raise errors.DataError("no data source", path="source",
                                   suggestion="set source to a source config, or pass source=")
        self.source = source if source is not None else cfg.source.instantiate()
        self.process_index = process_index
        self.process_count = process_count
        self.local_batch_size = cfg.global_batch_size // process_count

    def dataset(self) -> grain.MapDataset:
        cfg = self.config
        if len(self.source) < cfg.global_batch_size:
            raise errors.DataError(
                f"the source has {len(self.source)} examples, fewer than one global batch of "
                f"{cfg.global_batch_size}", path="global_batch_size",
                suggestion="use a smaller batch or more data")
        indices = grain.MapDataset.range(len(self.source))
        if cfg.shuffle:
            indices = indices.shuffle(seed=cfg.seed)
        indices = indices.repeat(cfg.num_epochs)
        batches = indices.batch(cfg.global_batch_size,
                                drop_remainder=cfg.last_batch == "drop")
        return batches.map(self._own_rows).map(self._read)

    def _own_rows(self, rows: np.ndarray):
        """This process's rows of a global batch (padded to full size in "pad" mode)."""
        start = self.process_index * self.local_batch_size
        own = rows[start:start + self.local_batch_size]
        if self.config.last_batch != "pad":
            return own, None
        weights = np.zeros(self.local_batch_size, np.float32)
        weights[:len(own)] = 1.0
        filler = own[0] if len(own) else rows[0]
        padded = np.concatenate([own, np.full(self.local_batch_size - len(own), filler,
                                              own.dtype if len(own) else rows.dtype)])
        return padded, weights

    def _read(self, rows_and_weights) -> Dict[str, np.ndarray]:
        rows, weights = rows_and_weights
        records = [self.source[int(i)] for i in rows]
        batch = {key: np.stack([r[key] for r in records]) for key in records[0]}
        if weights is not None:
            batch["weights"] = weights
        return batch

    def __iter__(self):
        """A grain iterator (with ``get_state`` / ``set_state``) over host-local batches."""
        cfg = self.config
        options = grain.ReadOptions(num_threads=max(cfg.read_threads, 1),
                                    prefetch_buffer_size=cfg.prefetch)
        return iter(self.dataset().to_iter_dataset(options))
