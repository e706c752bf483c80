"""Multi-token prediction (DeepSeek-V3, section 2.2): extra depths that each predict one token
further ahead, keeping the causal chain, trained beside the next-token loss.

Depth ``k`` (1 .. D) reads the previous depth's representation ``h^{k-1}`` of token ``i`` (the
main stack's output before its final norm for ``k = 1``) and the embedding of token ``i + k``,
and predicts token ``i + k + 1`` through the model's own embedding and LM head::

    h'^k_i = W_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]   (W_k: 2 x width -> width)
    h^k    = Block_k(h'^k)                                        (a decoder block, causal)
    L_k    = 1/T x sum over i of -log softmax(Head(RMSNorm_k(h^k_i)))[t_{i+k+1}]
    loss   = L_main + weight / D x sum_k L_k

``T`` is what the next-token loss ``L_main`` is a mean over (its targets' summed weights), as in
the paper's formula: a position whose token ``i + k + 1`` lies past the row or in another
document (packed rows), or whose target weight is 0, adds nothing to ``L_k``'s sum. Each depth's ``L_k`` is reported as the
metric ``mtp_loss/<k>``; the reported ``loss`` stays the next-token one (comparable with runs
without the depths, as MoE's balancing terms), while the gradient is that of the whole sum.
Evaluation (``is_training`` false) runs no depth.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Tuple

import jax
import jax.numpy as jnp

from titanax.config import REQUIRED, Required
from titanax.modules.base_layer import BaseLayer
from titanax.modules.layers.decoder_block import DecoderBlock
from titanax.modules.layers.linear import Linear
from titanax.modules.layers.norm import RMSNorm
from titanax.utils.dtypes import at_least_float32

# The metric each depth's loss is reported as (``mtp_loss/1`` ...): a summary of the model's
# root under train/objective.OBJECTIVE_METRICS.
DEPTH_METRIC = "mtp_loss"


class TokenPrediction(BaseLayer):
    """One depth: ``forward(hidden, embedded)`` -> the depth's representation ``h^k`` and its
    final-normed form."""

    class Config(BaseLayer.Config):
        # Residual-stream width (the model's).
        model_dim: Required[int] = REQUIRED
        # Its three norms (DeepSeek-V3: RMSNorm; the model's final norm's kind).
        norm: BaseLayer.Config = RMSNorm.default_config()
        # The depth's decoder block (DeepSeek-V3: a layer of the main stack's kind, experts
        # and all).
        block: Required[DecoderBlock.Config] = REQUIRED

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        norm = cfg.norm.clone(input_dim=cfg.model_dim)
        self._add_child("embedding_norm", norm)  # (HF enorm)
        self._add_child("hidden_norm", norm.clone())  # (HF hnorm)
        self._add_child("project", Linear.default_config().set(  # (HF eh_proj)
            input_dim=2 * cfg.model_dim, output_dim=cfg.model_dim, bias=False))
        self._add_child("block", cfg.block.clone(model_dim=cfg.model_dim))
        self._add_child("output_norm", norm.clone())  # (HF shared_head.norm)

    def forward(self, hidden: jax.Array, embedded: jax.Array, *, places: int,
                **layer_inputs) -> Tuple[jax.Array, jax.Array]:
        """``hidden``: ``h^{k-1}`` ``[batch, seq, model_dim]``; ``embedded``: the embeddings of
        the tokens ``places`` (``k``) ahead; ``layer_inputs``: packed rows' ``segment_ids`` /
        ``positions``, as the stack's. Returns ``(h^k, output_norm(h^k))``: what the next depth
        reads, what the LM head reads. A mixture of experts in the block routes only the
        positions with a target ``k`` places on in their document (the paper's depth runs on
        the sequence less its last ``k`` tokens): the rest would count in its balance terms
        and its choosing bias's loads, and take capacity. (On packed rows each document drops
        its last ``k``: data shards then route different counts, and those terms are means
        over the shards -- router.py.)"""
        joined = jnp.concatenate([self.embedding_norm(embedded), self.hidden_norm(hidden)],
                                 axis=-1)
        routed = has_target(hidden.shape[:2], layer_inputs.get("segment_ids"), places=places)
        hidden = self.block(self.project(joined), routed=routed, **layer_inputs)
        return hidden, self.output_norm(hidden)


class TokenPredictions(BaseLayer):
    """The depths in order (children ``"0" .. "D-1"``; HF layer ``num_layers + k - 1`` is
    depth ``k``): ``forward(hidden, embedded)`` -> every depth's final-normed output."""

    class Config(BaseLayer.Config):
        # One depth (each its own params).
        depth: Required[TokenPrediction.Config] = REQUIRED
        # How many tokens ahead past the next the model learns to predict (D).
        num_depths: int = 1

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        for index in range(self.config.num_depths):
            self._add_child(str(index), self.config.depth)

    def forward(self, hidden: jax.Array, embedded: List[jax.Array],
                **layer_inputs) -> List[jax.Array]:
        """``hidden``: the main stack's output before its final norm; ``embedded[k - 1]``: the
        embeddings of the tokens ``k`` places ahead. Returns each depth's ``output_norm(h^k)``
        (what the LM head reads)."""
        outputs = []
        for index in range(self.config.num_depths):
            hidden, normed = self._children[str(index)](hidden, embedded[index],
                                                        places=index + 1, **layer_inputs)
            outputs.append(normed)
        return outputs


def shifted(values: jax.Array, places: int, fill: Any = 0) -> jax.Array:
    """``values[:, i + places]`` at ``i`` (``fill`` past the row's end)."""
    places = min(places, values.shape[1])  # (A depth past the row's length: all fill.)
    pad = jnp.full(values.shape[:1] + (places,) + values.shape[2:], fill, values.dtype)
    return jnp.concatenate([values[:, places:], pad], axis=1)


def has_target(shape: Tuple[int, int], segment_ids: Any, *, places: int) -> jax.Array:
    """``[batch, seq]`` booleans: whether position ``i`` has a token ``places`` further on in
    its row and its document."""
    inside = jnp.arange(shape[1]) < shape[1] - places
    if segment_ids is None:
        return jnp.broadcast_to(inside, shape)
    return inside & (shifted(segment_ids, places, fill=-1) == segment_ids)


def depth_weights(weights: jax.Array, segment_ids: Any, places: int) -> jax.Array:
    """Per position ``i``, the weight of the target ``places`` tokens further on: its own
    target weight there, 0 past the row or across a document boundary."""
    ahead = shifted(weights, places)
    return ahead * has_target(weights.shape[:2], segment_ids, places=places).astype(ahead.dtype)


@dataclasses.dataclass(frozen=True)
class ExtraHeads:
    """Inputs the LM head reads beyond the next-token ones, and what their token losses add to
    the objective: ``hidden[i]`` (final-normed, ``[batch, seq, model_dim]``) predicts
    ``targets[i]``; ``loss_sum(per_token)`` (their per-token losses, in order) is the summed
    term the gradient follows (``CausalLanguageModel.extra_heads``). The model runs one head
    pass over the next-token inputs and these together: one gradient of the head's table."""

    hidden: List[jax.Array]
    targets: List[jax.Array]
    loss_sum: Callable[[List[jax.Array]], jax.Array]


def prediction_heads(model: Any, hidden: jax.Array, batch: Dict[str, jax.Array], *,
                     weights: jax.Array, token_embeddings: jax.Array,
                     loss_weight: float) -> ExtraHeads:
    """``model.prediction``'s depths run on ``hidden`` (the main stack's output before the final
    norm) as ``ExtraHeads``: depth ``k``'s final-normed output and the targets ``k`` places
    on; its loss sum is ``loss_weight / D x (L_1 + ... + L_D)`` times the next-token count
    (the paper's ``1/T``), each ``L_k`` written as the metric ``mtp_loss/<k>``. Called in the
    model's own context. ``weights``: per target token of the batch (``token_weights``);
    ``token_embeddings``: ``model.embed`` of its ``input_ids`` -- each depth reads them ``k``
    places on, so the table is looked up (and its gradient scattered) once for the model and
    every depth."""
    from titanax.modules.models.language_model import document_inputs  # (Circular.)
    from titanax.train.objective import OBJECTIVE_METRICS  # pylint: disable=import-outside-toplevel
    depths = model.prediction.config.num_depths
    embedded = [shifted(token_embeddings, k) for k in range(1, depths + 1)]
    outputs = model.prediction(hidden, embedded, **document_inputs(batch))
    count = jnp.maximum(jnp.sum(weights), 1.0)

    def loss_sum(per_token: List[jax.Array]) -> jax.Array:
        sums = []
        for k, losses in enumerate(per_token, start=1):
            counted = depth_weights(weights, batch.get("segment_ids"), k)
            total = jnp.sum(at_least_float32(losses) * counted)
            model.add_summary(f"{OBJECTIVE_METRICS}/{DEPTH_METRIC}/{k}",
                              jax.lax.stop_gradient(total / count))
            sums.append(total)
        return loss_weight / depths * sum(sums)

    return ExtraHeads(hidden=list(outputs),
                      targets=[shifted(batch["target_ids"], k) for k in range(1, depths + 1)],
                      loss_sum=loss_sum)
