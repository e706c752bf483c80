"""Embeddings: a plain table, and a vocab-parallel table that doubles as a tied LM head.

``VocabParallelEmbedding`` splits the vocabulary (rows) over the TP axis. A lookup gathers the rows
this device holds, zeroes the ids it does not hold, and sums over the axis -- one all-reduce of
``[batch, seq, model_dim]`` (or a reduce-scatter over the sequence under sequence parallelism).
``attend()`` multiplies by the transposed table to produce this device's *slice* of the logits,
which ``vocab_parallel_cross_entropy`` consumes without ever gathering the full vocabulary.

A plan rule may keep the table whole (``{'token_emb/weight': (None, None)}``: a small vocabulary
costs more in collectives than it saves in memory). The layer sees that from its own shard --
every row is here -- and then looks up, attends and lets the loss run without any collective.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from titanax.config import REQUIRED, Required
from titanax.modules.base_layer import BaseLayer, ParameterSpec
from titanax.modules.initializers import FanAxes
from titanax.modules.layers.tensor_parallel import tp_active, tp_rank
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
        # Tensor-parallel axis the vocabulary is split over; None: replicated.
        tp_axis: Optional[str] = None
        # Leave the lookup's result split over the sequence (reduce-scatter, not all-reduce).
        sequence_parallel: bool = False
        # The sequence dimension of the lookup's result.
        sequence_dim: int = 1

    def _create_layer_parameter_specs(self):
        cfg = self.config
        return {"weight": ParameterSpec(shape=(cfg.num_embeddings, cfg.dim),
                                        mesh_axes=(cfg.tp_axis, None),
                                        fan_axes=FanAxes(in_axes=(0,), out_axes=(1,)))}

    def is_split(self) -> bool:
        """Whether this device holds only a slice of the vocabulary (the layout may keep the
        table whole on every device, or the TP axis may be absent or of size 1)."""
        cfg = self.config
        return tp_active(cfg.tp_axis) and \
            self.parameters["weight"].shape[0] < cfg.num_embeddings

    def forward(self, ids):
        cfg = self.config
        table = self.parameters["weight"]
        if not self.is_split():
            if cfg.sequence_parallel and tp_active(cfg.tp_axis):  # Keep this device's part.
                return _sequence_shard(jnp.take(table, ids, axis=0), cfg.tp_axis,
                                       cfg.sequence_dim)
            return jnp.take(table, ids, axis=0)
        rows = table.shape[0]
        local_ids = ids - tp_rank(cfg.tp_axis) * rows
        held = (local_ids >= 0) & (local_ids < rows)
        gathered = jnp.take(table, jnp.where(held, local_ids, 0), axis=0)
        partial = jnp.where(held[..., None], gathered, jnp.zeros_like(gathered))
        if cfg.sequence_parallel:
            return collectives.reduce_scatter(partial, cfg.tp_axis,
                                              scatter_dimension=cfg.sequence_dim)
        return collectives.psum(partial, cfg.tp_axis)

    def attend(self, x):
        """``x @ table.T``: this device's slice of the logits, ``[..., num_embeddings / tp]``."""
        table = self.parameters["weight"]
        return jnp.einsum("...d,vd->...v", x, table.astype(x.dtype))

    def vocab_offset(self):
        """Index of this device's first vocabulary row."""
        return tp_rank(self.config.tp_axis) * self.parameters["weight"].shape[0] \
            if self.is_split() else 0


def _sequence_shard(x, axis: str, dim: int):
    """This TP rank's slice of ``x`` along ``dim`` (the sequence-parallel residual stream)."""
    size = x.shape[dim] // collectives.axis_size(axis)
    return jax.lax.dynamic_slice_in_dim(x, tp_rank(axis) * size, size, axis=dim)
