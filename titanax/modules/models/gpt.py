"""GPT-2, top to bottom.

The architecture is exactly GPT-2's: learned token and position embeddings, a stack of pre-LN
transformer blocks (LayerNorm eps 1e-5, GELU with the tanh approximation, fused QKV), a final
LayerNorm, and an LM head tied to the token embedding. Sizes run from a tiny CPU model to GPT-2
small (124M: 12 layers, 768 wide, 12 heads) and beyond.

Under a plan with tensor parallelism the same model runs tensor-parallel in local view inside
``shard_map``: the axis binding puts the vocabulary (embedding rows = LM-head columns), attention
heads and MLP hidden features on the TP axis; the loss is a vocab-parallel cross-entropy that
never gathers the logits. With sequence parallelism (``plan.tensor_parallel.sequence_parallel``)
the residual stream between blocks is also split over the sequence.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from titanax.modules.axis_binding import RESIDUAL_SEQUENCE
from titanax.modules.layers.attention import refuse_split_attention_dropout
from titanax.modules.initializers import Normal
from titanax.modules.layers.dropout import Dropout
from titanax.modules.layers.embedding import Embedding, VocabParallelEmbedding
from titanax.modules.layers.norm import LayerNorm
from titanax.modules.layers.repeat import Repeat
from titanax.modules.layers.transformer import TransformerBlock
from titanax.modules.models.language_model import UNSET_VOCABULARY, CausalLanguageModel
from titanax.modules.module import nowrap


class GPT(CausalLanguageModel):
    """A GPT-2 language model. ``forward(batch)`` returns ``(loss, aux)``."""

    class Config(CausalLanguageModel.Config):
        # Real vocabulary size (GPT-2: 50257; bytes: 256). None: the size the run's train input
        # declares (its tokenizer's), set when the run starts.
        vocab_size: Optional[int] = 50257
        # The embedding table is padded to a multiple of this (e.g. 128 for fast matmuls; it
        # must make the table divisible by the TP size). Padding ids never get probability.
        vocab_pad_multiple: int = 1
        # Longest sequence (rows of the position table).
        max_seq_len: int = 1024
        # Transformer blocks.
        num_layers: int = 12
        # Residual-stream width.
        model_dim: int = 768
        # Attention heads per block.
        num_heads: int = 12
        # MLP hidden width; None: 4 x model_dim.
        hidden_dim: Optional[int] = None
        # Dropout on embeddings and residual branches (GPT-2: 0.1; training only).
        dropout_rate: float = 0.0
        # Dropout on attention probabilities (training only).
        attention_dropout_rate: float = 0.0
        # LayerNorm epsilon.
        norm_eps: float = 1e-5
        # jax.checkpoint policy per block in training (None: keep activations).
        layer_remat_policy: Optional[str] = None
        # Trace the blocks one after another instead of a lax.scan over them; None: unrolled up
        # to 12 layers, scanned beyond (measured: see Repeat.Config.unroll).
        unroll_layers: Optional[bool] = None

        def _validate_values(self):
            if self.vocab_size is None:
                yield "vocab_size", UNSET_VOCABULARY
            for name in ("vocab_size", "max_seq_len", "num_layers", "model_dim", "num_heads"):
                value = getattr(self, name)
                if isinstance(value, int) and value < 1:
                    yield name, f"must be >= 1, got {value}"
            if self.hidden_dim is not None and self.hidden_dim < 1:
                yield "hidden_dim", f"must be >= 1 (or None: 4 x model_dim), got {self.hidden_dim}"
            for name in ("dropout_rate", "attention_dropout_rate"):
                value = getattr(self, name)
                if not 0.0 <= value < 1.0:
                    yield name, f"must be in [0, 1), got {value}"
            if self.norm_eps <= 0:
                yield "norm_eps", f"must be > 0, got {self.norm_eps}"
            if isinstance(self.model_dim, int) and isinstance(self.num_heads, int) \
                    and self.num_heads > 0 and self.model_dim > 0 and self.model_dim % self.num_heads:
                yield "num_heads", f"must divide model_dim={self.model_dim}"
            if self.vocab_pad_multiple < 1:
                yield "vocab_pad_multiple", "must be >= 1"

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        self._add_child("token_emb", VocabParallelEmbedding.default_config().set(
            num_embeddings=self.padded_vocab_size, dim=cfg.model_dim))
        self._add_child("pos_emb", Embedding.default_config().set(
            num_embeddings=cfg.max_seq_len, dim=cfg.model_dim))
        self._add_child("emb_dropout", Dropout.default_config().set(
            rate=cfg.dropout_rate, split_dims=(RESIDUAL_SEQUENCE,)))
        block = TransformerBlock.default_config().set(
            model_dim=cfg.model_dim, num_heads=cfg.num_heads,
            hidden_dim=cfg.hidden_dim or 4 * cfg.model_dim, dropout_rate=cfg.dropout_rate,
            attention_dropout_rate=cfg.attention_dropout_rate, norm_eps=cfg.norm_eps,
            # GPT-2 scales the init of residual-stream projections by 1/sqrt(2 x layers).
            output_param_init=Normal.default_config().set(
                stddev=0.02 / math.sqrt(2 * cfg.num_layers)))
        self._add_child("decoder", Repeat.default_config().set(
            layer=block, num_layers=cfg.num_layers, layer_remat_policy=cfg.layer_remat_policy,
            unroll=cfg.unroll_layers))
        self._add_child("final_norm", LayerNorm.default_config().set(
            input_dim=cfg.model_dim, eps=cfg.norm_eps))

    @nowrap
    def check_axis_binding(self, binding, *, path):
        # The model's own field (its blocks' attention takes it from here).
        refuse_split_attention_dropout(self.config.attention_dropout_rate, binding, path=path)
        super().check_axis_binding(binding, path=path)

    @nowrap
    def head(self) -> VocabParallelEmbedding:
        """GPT-2's LM head is its token embedding (tied)."""
        return self.token_emb

    @nowrap
    def attention_width(self) -> int:
        return self.config.model_dim

    def embed(self, input_ids: jax.Array, positions: Optional[jax.Array] = None) -> jax.Array:
        """Token + position embeddings (and dropout): the decoder's input ``[batch, seq, D]``.
        ``positions`` (packed rows: each token's place in its document) pick the position rows;
        by default ``0 .. seq-1``."""
        x = self.token_emb(input_ids)
        length = x.shape[1]
        if positions is not None:
            if self._split_sequence():  # This rank's part of the sequence.
                positions = jax.lax.dynamic_slice_in_dim(
                    positions, self.axis_binding.rank(RESIDUAL_SEQUENCE) * length, length,
                    axis=1)
            return self.emb_dropout(x + self.pos_emb(positions))
        start = self.axis_binding.rank(RESIDUAL_SEQUENCE) * length if self._split_sequence() \
            else 0
        x = x + self.pos_emb(start + jnp.arange(length))
        return self.emb_dropout(x)


def gpt2_config(size: str, **overrides) -> GPT.Config:
    """Standard GPT-2 sizes: "small" (124M), "medium" (350M), "large" (774M), "xl" (1.5B)."""
    shapes = {"small": (12, 768, 12), "medium": (24, 1024, 16), "large": (36, 1280, 20),
              "xl": (48, 1600, 25)}
    if size not in shapes:
        raise ValueError(f"unknown GPT-2 size {size!r}; one of {', '.join(shapes)}")
    num_layers, model_dim, num_heads = shapes[size]
    return GPT.default_config().set(name="gpt", num_layers=num_layers, model_dim=model_dim,
                                    num_heads=num_heads, **overrides)
