"""Input: a grain pipeline that turns a random-access source into host-local batches.

The pipeline works on *indices* first -- shuffle (deterministic from the seed, a new permutation
each epoch), repeat, batch into global batches, keep this process's rows -- and only then reads
records, so each process reads only its own share of every global batch. The result is a grain
iterator, whose state can be saved and restored with a checkpoint.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional

import grain
import numpy as np

from titanax import errors
from titanax.config import REQUIRED, Configurable, InstantiableConfig, Required


class Input(Configurable):
    """Host-local batches ``{name: [global_batch_size / num_processes, ...]}``."""

    class Config(Configurable.Config):
        # The data source: a config of a Configurable with __len__ and __getitem__.
        source: Required[InstantiableConfig] = REQUIRED
        # Examples per step over all processes.
        global_batch_size: Required[int] = REQUIRED
        # Shuffle with a permutation drawn from (seed, epoch).
        shuffle: bool = True
        # Seed of the shuffle.
        seed: int = 0
        # Passes over the data; None: repeat forever.
        num_epochs: Optional[int] = None
        # Drop a last batch that is not full (else it is an error; padding comes with resume
        # support).
        drop_remainder: bool = True

        def _validate_values(self):
            if isinstance(self.global_batch_size, int) and self.global_batch_size < 1:
                yield "global_batch_size", "must be >= 1"

    def __init__(self, cfg=None, *, process_index: int = 0, process_count: int = 1, **fields):
        super().__init__(cfg, **fields)
        cfg = self.config
        if cfg.global_batch_size % process_count:
            raise errors.DataError(
                f"global batch {cfg.global_batch_size} does not split over {process_count} "
                "processes", path="global_batch_size",
                suggestion=f"use a multiple of {process_count}")
        self.source = cfg.source.instantiate()
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
        batches = indices.batch(cfg.global_batch_size, drop_remainder=cfg.drop_remainder)
        start = self.process_index * self.local_batch_size
        own = batches.map(lambda rows: rows[start:start + self.local_batch_size])
        return own.map(self._read)

    def _read(self, rows: np.ndarray) -> Dict[str, np.ndarray]:
        records = [self.source[int(i)] for i in rows]
        return {key: np.stack([r[key] for r in records]) for key in records[0]}

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        return iter(self.dataset().to_iter_dataset())

    def batches_per_epoch(self) -> int:
        return len(self.source) // self.config.global_batch_size


def first_batch(data: Any) -> Dict[str, np.ndarray]:
    return next(iter(data))
