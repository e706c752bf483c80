"""What both peers share with each other (and nothing with Titanax): the model's sizes, the
optimizer, and the batch layout.

The sizes are read off a Titanax param tree's *shapes* only, so a peer never needs Titanax's config
classes; the one number the shapes cannot tell is the real vocabulary size (the table may be
padded), which the caller passes when it differs from the table's rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

DATA, MODEL = "data", "model"
BATCH_KEYS = ("input_ids", "target_ids")
# Stacks up to this deep run as straight-line code, deeper ones under a scan -- what a user who
# measured would write: unrolled, 4 layers of this GPT take ~0.8x the scanned step's time on
# CPU, while compile time grows with depth.
UNROLL_UP_TO = 12


@dataclasses.dataclass(frozen=True)
class GPTSizes:
    """A GPT-2's sizes: ``padded_vocab`` table rows; ids >= ``vocab_size`` are never predicted."""

    vocab_size: int
    padded_vocab: int
    max_seq_len: int
    num_layers: int
    model_dim: int
    num_heads: int
    hidden_dim: int
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.model_dim // self.num_heads

    @classmethod
    def of_titanax(cls, params: Mapping[str, Any], *, vocab_size: Optional[int] = None,
                   norm_eps: float = 1e-5) -> "GPTSizes":
        layer = params["decoder"]["layer"]
        num_layers, model_dim, _, num_heads, _ = np.shape(layer["attn"]["qkv_weight"])
        padded_vocab = np.shape(params["token_emb"]["weight"])[0]
        return cls(vocab_size=vocab_size or padded_vocab, padded_vocab=padded_vocab,
                   max_seq_len=np.shape(params["pos_emb"]["weight"])[0], num_layers=num_layers,
                   model_dim=model_dim, num_heads=num_heads,
                   hidden_dim=np.shape(layer["mlp"]["up"]["weight"])[-1], norm_eps=norm_eps)


def make_optimizer(*, kind: str, learning_rate: float, weight_decay: float,
                   decay_mask: Any) -> optax.GradientTransformation:
    """AdamW as Titanax defines it (Adam, then decoupled decay on ``decay_mask`` leaves, then
    -lr), or plain SGD (for checking gradient scale: Adam hides a constant factor)."""
    if kind == "adamw":
        return optax.chain(optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
                           optax.add_decayed_weights(weight_decay, mask=decay_mask),
                           optax.scale_by_learning_rate(learning_rate))
    if kind == "sgd":
        return optax.chain(optax.add_decayed_weights(weight_decay, mask=decay_mask),
                           optax.scale_by_learning_rate(learning_rate))
    raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {kind!r}")


def check_setup(*, mesh: jax.sharding.Mesh, accumulate_steps: int) -> None:
    if tuple(mesh.axis_names) != (DATA, MODEL):
        raise ValueError(f"peers need a mesh with axes ('data', 'model'), got {mesh.axis_names}")
    if accumulate_steps < 1:
        raise ValueError(f"accumulate_steps must be >= 1, got {accumulate_steps}")


def check_batch(batch: Mapping[str, Any], *, mesh: jax.sharding.Mesh,
                accumulate_steps: int) -> None:
    if "weights" in batch:
        raise ValueError("peers compute the unweighted token mean; drop batch['weights']")
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}")
    rows = np.shape(batch["input_ids"])[0]
    if rows % (mesh.shape[DATA] * accumulate_steps):
        raise ValueError(f"batch of {rows} rows does not split over data={mesh.shape[DATA]} x "
                         f"{accumulate_steps} microbatches")


def place_batch(batch: Mapping[str, Any], *, mesh: jax.sharding.Mesh) -> dict:
    """The batch's token arrays on ``mesh``, rows split over 'data' (what ``step_fn`` expects)."""
    sharding = NamedSharding(mesh, P(DATA))
    return {k: jax.device_put(np.asarray(batch[k]) if not isinstance(batch[k], jax.Array)
                              else batch[k], sharding) for k in BATCH_KEYS}
