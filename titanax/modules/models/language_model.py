"""What every causal language model here shares: logits, the loss, input limits, pipeline parts.

A model built as *embed -> a ``Repeat`` stack (child ``decoder``) -> ``final_norm`` -> an LM head*
(GPT-2, and the Llama / Qwen / Mistral ``Decoder``) subclasses ``CausalLanguageModel`` and
supplies ``embed(input_ids)`` and ``head()``: the vocab-parallel table whose ``attend`` gives this
device's slice of the logits (the token embedding when tied, a separate head otherwise). The loss
is a vocab-parallel cross-entropy that never gathers the logits; ``batch["weights"]`` weights
tokens or examples.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from titanax.modules.base_layer import BaseLayer
from titanax.modules.input_limits import InputLimit
from titanax.modules.layers.chunked_loss import chunk_length, chunked_token_losses
from titanax.modules.layers.cross_entropy import (vocab_parallel_cross_entropy,
                                                  vocab_parallel_scores)
from titanax.modules.layers.embedding import VocabParallelEmbedding
from titanax.modules.layers.moe import add_moe_objective
from titanax.parallel.axis_binding import RESIDUAL_SEQUENCE
from titanax.modules.module import nowrap
from titanax.modules.pipeline_parts import StackedStages
from titanax.parallel import collectives
from titanax.utils.dtypes import at_least_float32

# What a language model's validation says of a vocab_size left unset with nothing to take it from
# (a run sets it from its train input: train/inputs.vocab_from_train_input).
UNSET_VOCABULARY = ("unset (None) and no train input declares a vocabulary to take it from: set "
                    "it to the tokenizer's size")


class CausalLanguageModel(BaseLayer):
    """``forward(batch)`` returns ``(mean next-token cross-entropy, aux)``."""

    class Config(BaseLayer.Config):
        # Tokens per chunk of the LM head and loss (layers/chunked_loss.py: the full logits
        # never exist); None: as many as keep one chunk's logits within 2^24 elements (all the
        # tokens, unchunked, at small vocabularies).
        loss_chunk_tokens: Optional[int] = None

        def _validate_values(self):
            if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 1:
                yield "loss_chunk_tokens", f"must be >= 1 (or None), got {self.loss_chunk_tokens}"

    def embed(self, input_ids: jax.Array, positions: Optional[jax.Array] = None) -> jax.Array:
        """What enters the decoder stack, ``[batch, seq, model_dim]`` (seq-split under SP);
        ``positions`` ``[batch, seq]``: each token's place in its document (packed rows)."""
        raise NotImplementedError

    @nowrap
    def head(self) -> VocabParallelEmbedding:
        """The table the logits are read from (``attend``)."""
        raise NotImplementedError

    @nowrap
    def attention_width(self) -> int:
        """Heads x head width of one attention (the query / context width)."""
        raise NotImplementedError

    @nowrap
    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token by the usual analytic count (PaLM, appendix B): 6 x the
        params each token multiplies by -- every param except the embedding lookups (a tied
        table counts once, as the head) -- plus the attention's ``12 x layers x width x seq``
        (the full seq x seq scores and their use, forward and backward). The params are counted
        as the model has them (a mixture of experts' routed ones by the share a token uses), so
        grouped-query attention's narrower k/v projections and SwiGLU's three matrices are what
        they are, not ``12 D^2`` per layer."""
        specs = self.create_parameter_specs_recursively()
        lookups = {"pos_emb"} | ({"token_emb"} if self.head() is not self.token_emb else set())
        # A routed expert's weights count by the share each token uses (top_k / E).
        multiplied = sum(math.prod(spec.shape) * getattr(spec, "active_fraction", 1.0)
                         for name, sub in specs.items()
                         if name not in lookups for spec in jax.tree_util.tree_leaves(
                             sub, is_leaf=lambda x: hasattr(x, "shape")))
        return 6.0 * multiplied + 12.0 * self.config.num_layers * self.attention_width() * seq_len

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.config.vocab_pad_multiple
        return -(-self.config.vocab_size // multiple) * multiple

    def _split_sequence(self) -> bool:
        """Whether the residual stream is split over the sequence here (sequence parallelism)."""
        return self.axis_binding.active(RESIDUAL_SEQUENCE) is not None

    def hidden_states(self, input_ids: jax.Array, segment_ids: Optional[jax.Array] = None,
                      positions: Optional[jax.Array] = None) -> jax.Array:
        """The final-normed residual stream ``[batch, seq, model_dim]`` (seq-split under SP)."""
        documents = document_inputs({"segment_ids": segment_ids, "positions": positions})
        embedded = self.stack_head(self.embed(input_ids, positions), **documents)
        decoded = self.decoder(embedded, **documents)
        return self.final_norm(self.stack_tail(decoded, **documents))

    def stack_head(self, embedded: jax.Array, **layer_inputs) -> jax.Array:
        """The layers before the repeated stack, run on the embeddings (Decoder: dense first
        layers); none here. A pipeline's first stage runs them with the embedding
        (``embed_batch``)."""
        del layer_inputs
        return embedded

    def stack_tail(self, decoded: jax.Array, **layer_inputs) -> jax.Array:
        """The layers after the repeated stack, run on its output (Decoder: the first layers of
        a pattern the depth ends part-way through); none here. A pipeline's last stage runs them
        with the head (``head_loss``)."""
        del layer_inputs
        return decoded

    def _whole_sequence(self, hidden: jax.Array) -> jax.Array:
        """``hidden`` with its sequence whole (gathered where sequence parallelism split it)."""
        if self._split_sequence():
            hidden = collectives.all_gather(hidden, self.axis_binding.active(RESIDUAL_SEQUENCE),
                                            axis_index=1)
        return hidden

    def _logits_of(self, hidden: jax.Array) -> jax.Array:
        return self.head().attend(self._whole_sequence(hidden))

    def logits(self, input_ids: jax.Array, segment_ids: Optional[jax.Array] = None,
               positions: Optional[jax.Array] = None) -> jax.Array:
        """Full logits ``[batch, seq, vocab_size]`` (gathered over TP: for eval and tests);
        with ``segment_ids`` / ``positions``, of packed rows (see ``document_inputs``)."""
        return self.full_logits(self._logits_of(self.hidden_states(input_ids, segment_ids,
                                                                   positions)))

    def full_logits(self, local_logits: jax.Array) -> jax.Array:
        """This device's slice of the (padded) vocabulary -> the whole real vocabulary."""
        vocab = self.head().vocab_axis
        if vocab is not None:
            local_logits = collectives.all_gather(local_logits, vocab,
                                                  axis_index=local_logits.ndim - 1)
        return local_logits[..., :self.config.vocab_size]

    def forward(self, batch: Dict[str, jax.Array]) -> Tuple[jax.Array, Dict[str, Any]]:
        """Mean next-token cross-entropy over ``batch["target_ids"]``.

        ``batch["weights"]`` (optional, ``[batch, seq]`` or ``[batch]``) weights each token or
        example (0 for padding).
        ``batch["segment_ids"]`` / ``batch["positions"]`` (optional, ``[batch, seq]``): packed
        rows -- attention never crosses a document and positions restart in each one.
        Returns ``(loss, aux)`` with ``aux["loss_sum"]`` and ``aux["num_tokens"]`` so a caller can
        average exactly over several shards.
        """
        loss, aux = self.head_loss(self.decoder(self.embed_batch(batch),
                                                **document_inputs(batch)), batch)
        # Mixture-of-experts layers' balancing terms join the gradient, not the reported loss.
        return add_moe_objective(loss, self.collected_outputs()), aux

    def head_loss(self, decoded: jax.Array, batch: Dict[str, jax.Array]
                  ) -> Tuple[jax.Array, Dict[str, Any]]:
        """The stack's tail, final norm, LM head and loss of the decoder's output (what a
        pipeline's last stage runs); returns ``(loss, aux)`` as ``forward`` does."""
        tail = self.stack_tail(decoded, **document_inputs(batch))
        hidden, targets = self.final_norm(tail), batch["target_ids"]
        extra = self.extra_heads(tail, batch, weights=token_weights(batch, targets.shape))
        if extra is None:
            return token_mean(self.token_losses(hidden, targets), batch)
        # One head pass over the next-token inputs and the extra ones, side by side.
        per_token = jnp.split(self.token_losses(
            jnp.concatenate([hidden] + extra.hidden, axis=1),
            jnp.concatenate([targets] + extra.targets, axis=1)), 1 + len(extra.hidden), axis=1)
        term = extra.loss_sum(per_token[1:])
        return token_mean(per_token[0], batch,
                          gradient_only_sum=term - jax.lax.stop_gradient(term))

    def extra_heads(self, hidden: jax.Array, batch: Dict[str, jax.Array], *,
                    weights: jax.Array) -> Optional[Any]:
        """What else the LM head reads in training beyond the next-token inputs, from the
        stack's output before the final norm (``hidden``): a ``token_prediction.ExtraHeads``
        whose loss sum the gradient follows, with value 0 (the reported loss stays the
        next-token one). None here (Decoder: its multi-token-prediction depths).
        ``weights``: per target token."""
        del hidden, batch, weights
        return None

    def token_losses(self, hidden: jax.Array, target_ids: jax.Array, *,
                     temperature: Optional[float] = None) -> jax.Array:
        """Per-token ``-log p(target)`` ``[batch, seq]`` from the final-normed residual stream,
        the LM head and cross-entropy run in chunks of tokens (``loss_chunk_tokens``): the full
        logits are never held. Negated, the targets' log-probabilities. ``temperature``: of
        the logits divided by it (a sampler's distribution)."""
        head = self.head()
        hidden = self._whole_sequence(hidden)

        def loss_of_chunk(hidden_chunk, targets_chunk):
            logits = head.attend(hidden_chunk)
            if temperature is not None:  # (In float32, as the sampler divides them.)
                logits = at_least_float32(logits) / temperature
            return vocab_parallel_cross_entropy(
                logits, targets_chunk, vocab_axis=head.vocab_axis,
                vocab_offset=head.vocab_offset(), vocab_size=self.config.vocab_size)

        chunk = chunk_length(tokens=int(target_ids.size), local_vocab=head.local_rows(),
                             requested=self.config.loss_chunk_tokens)
        return chunked_token_losses(hidden, target_ids, loss_of_chunk=loss_of_chunk, chunk=chunk)

    @nowrap
    def input_limits(self) -> Dict[str, InputLimit]:
        """Ids below vocab_size, at most max_seq_len positions (checked on the host) of its
        rows' ``input_ids`` and ``target_ids`` (an objective maps them to the fields it reads:
        train/objective.py)."""
        cfg = self.config
        limit = InputLimit(num_ids=cfg.vocab_size, num_ids_field="vocab_size",
                           max_length=cfg.max_seq_len, max_length_field="max_seq_len")
        return {name: limit for name in ("input_ids", "target_ids")}

    # --- Primitives objectives are written on (titanax/objectives/) ------------------------------

    def token_logps(self, input_ids: jax.Array, target_ids: jax.Array,
                    segment_ids: Optional[jax.Array] = None,
                    positions: Optional[jax.Array] = None,
                    temperature: Optional[float] = None) -> jax.Array:
        """Per target, its log-prob given what precedes it (of the logits divided by
        ``temperature``), float32 or wider; ``segment_ids`` / ``positions`` as ``forward``'s."""
        hidden = self.hidden_states(input_ids, segment_ids, positions)
        return -at_least_float32(self.token_losses(hidden, target_ids, temperature=temperature))

    def final_hidden(self, input_ids: jax.Array, segment_ids: Optional[jax.Array] = None,
                     positions: Optional[jax.Array] = None) -> jax.Array:
        """The final-normed residual stream ``[batch, seq, model_dim]``, its sequence whole:
        what the LM head reads (``head_logits``; a distillation runs both models' heads in
        chunks of it)."""
        return self._whole_sequence(self.hidden_states(input_ids, segment_ids, positions))

    def head_logits(self, hidden: jax.Array) -> jax.Array:
        """This device's slice of the (padded) vocabulary's logits of ``hidden`` ``[...,
        model_dim]`` (``head().vocab_offset()`` is its first id)."""
        return self.head().attend(hidden)

    def token_scores(self, input_ids: jax.Array, target_ids: jax.Array) -> jax.Array:
        """``[batch, seq, 2]``: per target, its log-prob given what precedes it and whether
        greedy decoding would choose it (1.0 / 0.0) -- what an evaluation harness asks of a
        continuation -- the head run in chunks (the full logits are never held)."""
        head = self.head()
        hidden = self._whole_sequence(self.hidden_states(input_ids))

        def scores_of_chunk(hidden_chunk, targets_chunk):
            loss, greedy = vocab_parallel_scores(
                head.attend(hidden_chunk), targets_chunk, vocab_axis=head.vocab_axis,
                vocab_offset=head.vocab_offset(), vocab_size=self.config.vocab_size)
            return jnp.stack([-loss, greedy.astype(loss.dtype)], axis=-1)

        chunk = chunk_length(tokens=int(target_ids.size), local_vocab=head.local_rows(),
                             requested=self.config.loss_chunk_tokens)
        return chunked_token_losses(hidden, target_ids, loss_of_chunk=scores_of_chunk,
                                    chunk=chunk)

    def sequence_logps(self, input_ids: jax.Array, target_ids: jax.Array,
                       weights: jax.Array) -> jax.Array:
        """Per row, the summed log-probs of its weighted targets (a completion's log-prob
        given what precedes each of its tokens), float32 or wider."""
        return jnp.sum(self.token_logps(input_ids, target_ids) * at_least_float32(weights),
                       axis=-1)

    # --- Pipeline parallelism: how the model splits into stages (modules/pipeline_parts.py) -----

    @nowrap
    def pipeline_parts(self, *, num_stages: int, virtual_stages: int, checkpoint_ratio: float,
                       schedule: str) -> StackedStages:
        """Embedding -> the decoder stack cut into equal stages -> final norm, head and loss."""
        return StackedStages(model=self, num_stages=num_stages, virtual_stages=virtual_stages,
                             checkpoint_ratio=checkpoint_ratio, schedule=schedule)

    def embed_batch(self, batch: Dict[str, jax.Array]) -> jax.Array:
        """What enters the first stage: ``embed`` of the batch's ``input_ids`` (at its
        ``positions``, when the rows are packed), through the layers before the stack."""
        return self.stack_head(self.embed(batch["input_ids"], batch.get("positions")),
                               **document_inputs(batch))

    @staticmethod
    def stack_inputs(batch: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
        """What every layer of the stack reads besides the residual stream (a pipeline stage
        passes it with each microbatch)."""
        return document_inputs(batch)

    def loss_weight(self, batch: Dict[str, jax.Array]) -> jax.Array:
        """What ``forward``'s loss is a mean over: the (weighted) number of target tokens."""
        return jnp.sum(token_weights(batch, batch["target_ids"].shape))


def document_inputs(batch: Dict[str, Any]) -> Dict[str, jax.Array]:
    """The packed-row inputs of the layers: ``segment_ids`` (``[batch, seq]``, the document each
    token belongs to; attention stays inside it) and ``positions`` (its place in that document:
    RoPE rotates by it). Absent: one document per row, positions ``0 .. seq-1``."""
    return {k: batch[k] for k in ("segment_ids", "positions") if batch.get(k) is not None}


def token_mean(per_token: jax.Array, batch: Dict[str, jax.Array], *,
               gradient_only_sum: Optional[jax.Array] = None
               ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """``(mean of per_token over the trained tokens, aux)``: tokens weighted by
    ``batch["weights"]``, with ``aux["loss_sum"]`` and ``aux["num_tokens"]`` (the loss of an
    all-padding shard is 0, not 0/0). ``gradient_only_sum``: a summed term the gradient
    follows, value 0 (``CausalLanguageModel.extra_heads``)."""
    weights = token_weights(batch, per_token.shape)
    loss_sum = jnp.sum(per_token * weights)
    if gradient_only_sum is not None:
        loss_sum = loss_sum + gradient_only_sum.astype(loss_sum.dtype)
    num_tokens = jnp.sum(weights)
    return loss_sum / jnp.maximum(num_tokens, 1.0), {"loss_sum": loss_sum,
                                                     "num_tokens": num_tokens}


def token_weights(batch: Dict[str, jax.Array], shape) -> jax.Array:
    """Per target token, its weight: ``batch["weights"]`` per token or per example (a padded last
    batch: every token of the example), 1 without weights."""
    weights = batch.get("weights")
    if weights is None:  # (jax's default float: float32, float64 in its 64-bit mode.)
        return jnp.ones(shape, float)
    weights = at_least_float32(weights)
    return jnp.broadcast_to(weights.reshape(weights.shape + (1,) * (len(shape) - weights.ndim)),
                            shape)
