"""Input: a grain pipeline that turns a random-access source into host-local batches.

The pipeline works on *indices* first -- shuffle (deterministic from (seed, epoch): a new
permutation each epoch), repeat, batch into global batches, keep this process's rows -- and only
then reads records, so each process reads only its own share of every global batch.

Which rows are "its own" is the mesh's decision, not the process index's: the global batch is cut
into ``num_shards`` equal shards along the batch axes, and a process reads the shards its devices
hold (``shards``, from ``Engine.process_batch_shards``), in shard order. When the model or pipe
axis spans processes, several processes hold the same shards and read the same rows. Background
threads prepare ``prefetch`` batches ahead of the training loop. The result is a grain iterator
whose state (the index of the next global batch) is saved with each checkpoint; because every
element is a whole global batch, the same state resumes on every process.

A last batch that does not fill the global batch is dropped, or padded (``last_batch="pad"``):
padding rows repeat a real example and carry ``weights`` 0, which the models' losses and metrics
honour (every batch then carries ``weights``, so shapes never change).
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Literal, Optional, Sequence

import grain
import numpy as np

from titanax import errors
from titanax.config import Configurable, InstantiableConfig, Required, REQUIRED
from titanax.data.tokenizer import Tokenizer


class Input(Configurable):
    """Host-local batches ``{name: [rows of this process's batch shards, ...]}``."""

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
        # How a source that tokenizes text does it (a tokenizer.json or its directory; unset
        # path: bytes). Passed to sources that take a ``tokenizer``.
        tokenizer: Tokenizer.Config = Tokenizer.default_config()

        def _validate_values(self):
            if isinstance(self.global_batch_size, int) and self.global_batch_size < 1:
                yield "global_batch_size", "must be >= 1"
            if self.prefetch < 0:
                yield "prefetch", "must be >= 0"
            if self.read_threads < 1:
                yield "read_threads", f"must be >= 1, got {self.read_threads}"
            if self.num_epochs is not None and self.num_epochs < 1:
                yield "num_epochs", f"must be >= 1 (or None: repeat forever), got {self.num_epochs}"
            if not 0 <= self.seed < 2 ** 32:
                yield "seed", f"must be in [0, 2**32) (grain's shuffle seeds), got {self.seed}"

    def __init__(self, cfg=None, *, source: Any = None, process_index: int = 0,
                 process_count: int = 1, shards: Optional[Sequence[int]] = None,
                 num_shards: Optional[int] = None, **fields):
        """``shards`` of ``num_shards``: the batch shards this process feeds (default: shard
        ``process_index`` of ``process_count``)."""
        super().__init__(cfg, **fields)
        cfg = self.config
        if shards is None:
            shards, num_shards = (process_index,), process_count
        if cfg.global_batch_size % num_shards:
            raise errors.DataError(
                f"global batch {cfg.global_batch_size} does not split into {num_shards} "
                "equal shards (one per data-parallel position on the mesh)",
                path="global_batch_size", suggestion=f"use a multiple of {num_shards}")
        if source is None and cfg.source is None:
            raise errors.DataError("no data source", path="source",
                                   suggestion="set source to a source config, or pass source=")
        self.source = source if source is not None else _instantiate_source(cfg)
        self.shards = tuple(int(s) for s in shards)
        self.num_shards = int(num_shards)
        rows = cfg.global_batch_size // self.num_shards
        # Positions in the global batch of this process's rows, in shard order.
        self.positions = np.concatenate([np.arange(s * rows, (s + 1) * rows)
                                         for s in self.shards])
        self.local_batch_size = len(self.positions)

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
        """This process's rows of a global batch (in "pad" mode positions past a short last
        batch repeat a real example and get weight 0)."""
        if self.config.last_batch != "pad":
            return rows[self.positions], None
        real = self.positions < len(rows)
        # A padding row repeats this process's first real row, or the batch's first.
        filler = self.positions[real][0] if real.any() else 0
        return rows[np.where(real, self.positions, filler)], real.astype(np.float32)

    def _read(self, rows_and_weights) -> Dict[str, np.ndarray]:
        rows, weights = rows_and_weights
        records = [self.source[int(i)] for i in rows]
        batch = {key: np.stack([r[key] for r in records]) for key in records[0]}
        if weights is not None:
            if "weights" in batch:  # Per-token weights of the source (packed rows' masks).
                own = batch["weights"]
                batch["weights"] = own * weights.reshape((-1,) + (1,) * (own.ndim - 1))
            else:
                batch["weights"] = weights
        return batch

    def __iter__(self):
        """A grain iterator (with ``get_state`` / ``set_state``) over host-local batches."""
        cfg = self.config
        options = grain.ReadOptions(num_threads=max(cfg.read_threads, 1),
                                    prefetch_buffer_size=cfg.prefetch)
        return iter(self.dataset().to_iter_dataset(options))


def _instantiate_source(cfg: "Input.Config") -> Any:
    """The configured source; one that tokenizes (takes ``tokenizer=``) gets the input's."""
    klass = getattr(cfg.source, "klass", None)
    if klass is not None and "tokenizer" in inspect.signature(klass.__init__).parameters:
        return cfg.source.instantiate(tokenizer=cfg.tokenizer.instantiate())
    if cfg.tokenizer.path is not None:
        raise errors.DataError(
            f"the source ({getattr(klass, '__name__', type(cfg.source).__name__)}) does not "
            "tokenize text, so tokenizer.path would be ignored", path="tokenizer.path",
            suggestion="use a source that reads documents (PackedDocuments, PackedRows), or "
                       "leave tokenizer.path unset")
    return cfg.source.instantiate()
