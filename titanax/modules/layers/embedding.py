"""Embeddings: a plain table, and a vocab-parallel table that doubles as a tied LM head.

``VocabParallelEmbedding`` splits the vocabulary (rows) over the mesh axis the run binds to
``vocab`` (the TP axis). A lookup gathers the rows
this device holds, zeroes the ids it does not hold, and sums over the axis -- one all-reduce of
``[batch, seq, model_dim]`` (or a reduce-scatter over the sequence under sequence parallelism).
``attend()`` multiplies by the transposed table to produce this device's *slice* of the logits,
which ``vocab_parallel_cross_entropy`` consumes without ever gathering the full vocabulary.

A plan rule may keep the table whole (``{'token_emb/weight': (None, None)}``: a small vocabulary
costs more in collectives than it saves in memory). The layer sees that from its own shard --
every row is here -- and then looks up, attends and lets the loss run without any collective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from titanax.config import REQUIRED, Required
from titanax.parallel.axis_binding import RESIDUAL_SEQUENCE, VOCAB
from titanax.modules.base_layer import BaseLayer, ParameterSpec
from titanax.modules.initializers import FanAxes
from titanax.parallel import collectives


class Embedding(BaseLayer):
    """A ``[num_embeddings, dim]`` table, replicated."""

    class Config(BaseLayer.Config):
        # Rows of the table (e.g. positions).
        num_embeddings: Required[int] = REQUIRED
        # Width of each row.
        dim: Required[int] = REQUIRED

    def _create_layer_parameter_specs(self):
        cfg = self.config
        return {"weight": ParameterSpec(shape=(cfg.num_embeddings, cfg.dim),
                                        fan_axes=FanAxes(in_axes=(0,), out_axes=(1,)))}

    def forward(self, ids):
        return jnp.take(self.parameters["weight"], ids, axis=0)


class VocabParallelEmbedding(BaseLayer):
    """Token embedding whose rows (the vocabulary) may be split over the TP axis."""

    class Config(BaseLayer.Config):
        # Rows of the table, i.e. the (padded) vocabulary size; divisible by the TP size.
        num_embeddings: Required[int] = REQUIRED
        # Width of each row.
        dim: Required[int] = REQUIRED
        # The sequence dimension of the lookup's result (left split over it, by a
        # reduce-scatter instead of an all-reduce, where the binding splits the residual
        # stream's sequence).
        sequence_dim: int = 1

    def _create_layer_parameter_specs(self):
        cfg = self.config
        return {"weight": ParameterSpec(shape=(cfg.num_embeddings, cfg.dim),
                                        logical_axes=(VOCAB, None),
                                        fan_axes=FanAxes(in_axes=(0,), out_axes=(1,)))}

    def is_split(self) -> bool:
        """Whether this device holds only a slice of the vocabulary (the layout may keep the
        table whole on every device, or the TP axis may be absent or of size 1)."""
        return self.axis_binding.active(VOCAB) is not None and \
            self.parameters["weight"].shape[0] < self.config.num_embeddings

    def forward(self, ids):
        cfg = self.config
        table = self.parameters["weight"]
        sequence = self.axis_binding.active(RESIDUAL_SEQUENCE)
        if not self.is_split():
            if sequence is not None:  # Keep this device's part.
                return _sequence_shard(jnp.take(table, ids, axis=0), sequence, cfg.sequence_dim)
            return jnp.take(table, ids, axis=0)
        vocab = self.axis_binding.active(VOCAB)
        rows = table.shape[0]
        local_ids = ids - collectives.axis_index(vocab) * rows
        held = (local_ids >= 0) & (local_ids < rows)
        gathered = jnp.take(table, jnp.where(held, local_ids, 0), axis=0)
        partial = jnp.where(held[..., None], gathered, jnp.zeros_like(gathered))
        if sequence is not None:
            return collectives.reduce_scatter(partial, vocab, scatter_dimension=cfg.sequence_dim)
        return collectives.psum(partial, vocab)

    def attend(self, x):
        """``x @ table.T``: this device's slice of the logits, ``[..., num_embeddings / tp]``."""
        table = self.parameters["weight"]
        return jnp.einsum("...d,vd->...v", x, table.astype(x.dtype))

    def local_rows(self) -> int:
        """How many rows of the table this device holds (its slice of the logits' width)."""
        return int(self.parameters["weight"].shape[0])

    def vocab_offset(self):
        """Index of this device's first vocabulary row."""
        return self.axis_binding.rank(VOCAB) * self.parameters["weight"].shape[0] \
            if self.is_split() else 0

    @property
    def vocab_axis(self):
        """The mesh axis this device's slice of the vocabulary is one of (None: whole)."""
        return self.axis_binding.active(VOCAB) if self.is_split() else None


def _sequence_shard(x, axis: str, dim: int):
    """This rank's slice of ``x`` along ``dim`` (the sequence-parallel residual stream)."""
    size = x.shape[dim] // collectives.axis_size(axis)
    return jax.lax.dynamic_slice_in_dim(x, collectives.axis_index(axis) * size, size, axis=dim)
