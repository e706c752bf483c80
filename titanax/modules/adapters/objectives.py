"""What an adapted model's outputs are trained on: the loss of a Flax module's outputs.

A Titanax model's ``forward(batch)`` returns ``(loss, aux)``; a Flax module returns whatever its
author chose -- usually logits. An objective turns the module's outputs and the batch into the
Titanax pair, with the counts the engine needs: ``aux["loss_sum"]`` and what the loss is a mean
over (``num_tokens`` / ``num_examples``), so shards and microbatches with different numbers of
trained tokens average exactly (train/gradients.py), and ``loss_weight(batch)`` (that count,
for a pipeline's microbatches). Each also declares the limits of the ids it reads
(``input_limits``), checked on the host before a batch reaches the device.

Every objective is a Configurable: ``--config.model.loss.vocab_size=...`` overrides it.
"""

from __future__ import annotations

from typing import Any, Dict, Literal, Optional, Tuple

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.config import Configurable
from titanax.modules.input_limits import InputLimit
from titanax.modules.layers.cross_entropy import vocab_parallel_cross_entropy
from titanax.modules.models.classifier import classification_loss, example_weights
from titanax.modules.models.language_model import token_mean, token_weights

Batch = Dict[str, jax.Array]


class Objective(Configurable):
    """``objective(outputs, batch) -> (loss, aux)``; see the module docstring."""

    def __call__(self, outputs: Any, batch: Batch) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        raise NotImplementedError

    def loss_weight(self, batch: Batch) -> jax.Array:
        """What the loss of ``batch`` is a mean over."""
        raise NotImplementedError

    def input_limits(self, *, field_prefix: str) -> Dict[str, InputLimit]:
        """Limits of the batch entries it reads; ``field_prefix`` is this objective's config
        path below the model (``loss``), for the error."""
        del field_prefix
        return {}


class CausalLMLoss(Objective):
    """The module returns next-token logits ``[batch, seq, vocab]``: mean cross-entropy over
    ``batch["target_ids"]``, tokens weighted by ``batch["weights"]`` (optional, per token or per
    example)."""

    class Config(Objective.Config):
        # The real vocabulary: logits of ids at or past it (a table padded for speed) never win,
        # and every batch's ids are checked below it on the host. None: the logits' width, no
        # host check.
        vocab_size: Optional[int] = None
        # The longest sequence the module can take (a position table's size), checked on the
        # host. None: no check.
        max_seq_len: Optional[int] = None

        def _validate_values(self):
            for name in ("vocab_size", "max_seq_len"):
                value = getattr(self, name)
                if value is not None and value < 1:
                    yield name, f"must be >= 1 (or None), got {value}"

    def __call__(self, outputs, batch):
        return token_mean(vocab_parallel_cross_entropy(outputs, batch["target_ids"],
                                                       vocab_size=self.config.vocab_size), batch)

    def loss_weight(self, batch):
        return jnp.sum(token_weights(batch, batch["target_ids"].shape))

    def input_limits(self, *, field_prefix):
        cfg = self.config
        limit = InputLimit(num_ids=cfg.vocab_size, num_ids_field=f"{field_prefix}.vocab_size",
                           max_length=cfg.max_seq_len,
                           max_length_field=f"{field_prefix}.max_seq_len")
        return {"input_ids": limit, "target_ids": limit}


class ClassificationLoss(Objective):
    """The module returns class logits ``[batch, classes]``: mean cross-entropy over
    ``batch["label"]``, examples weighted by ``batch["weights"]``; aux has the correct count
    (accuracy)."""

    class Config(Objective.Config):
        # Number of classes: every batch's labels are checked below it on the host. None: no
        # check.
        num_classes: Optional[int] = None

        def _validate_values(self):
            if self.num_classes is not None and self.num_classes < 1:
                yield "num_classes", f"must be >= 1 (or None), got {self.num_classes}"

    def __call__(self, outputs, batch):
        return classification_loss(outputs, batch)

    def loss_weight(self, batch):
        return jnp.sum(example_weights(batch))

    def input_limits(self, *, field_prefix):
        if self.config.num_classes is None:
            return {}
        return {"label": InputLimit(num_ids=self.config.num_classes,
                                    num_ids_field=f"{field_prefix}.num_classes")}


class ReturnedLoss(Objective):
    """The module returns its own mean loss (a scalar); it is a mean over every target token
    (``count="tokens"``: ``batch["target_ids"]``'s size) or every example (``"examples"``).
    The module sees no ``weights``: a batch with padding needs an objective that weighs it."""

    class Config(Objective.Config):
        # What the module's loss is a mean over.
        count: Literal["tokens", "examples"] = "tokens"

    def __call__(self, outputs, batch):
        if batch.get("weights") is not None:
            raise errors.DataError(
                "the batch weighs its rows or tokens (batch['weights']: padding, or an SFT "
                "mask), which a module that returns its own mean loss never sees",
                path="model.loss", suggestion="return logits from the module and train them "
                "with CausalLMLoss / ClassificationLoss, which weigh them")
        loss = jnp.asarray(outputs, jnp.float32)
        count = self.loss_weight(batch)
        name = "num_tokens" if self.config.count == "tokens" else "num_examples"
        return loss, {"loss_sum": loss * count, name: count}

    def loss_weight(self, batch):
        if self.config.count == "tokens":
            return jnp.asarray(batch["target_ids"].size, jnp.float32)
        return jnp.asarray(jax.tree_util.tree_leaves(batch)[0].shape[0], jnp.float32)
