"""Image classifiers for MNIST-sized inputs: an MLP and a small CNN.

Both take ``batch = {"image": [batch, 28, 28] or [batch, 784] floats in [0, 1], "label": [batch]
ints, optional "weights": [batch]}`` and return ``(mean cross-entropy, aux)`` with the correct-count
and example count so accuracy can be summed exactly across data shards.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import jax
import jax.numpy as jnp

from titanax.modules.base_layer import BaseLayer
from titanax.modules.initializers import VarianceScaling
from titanax.modules.layers.conv import Conv2D
from titanax.modules.layers.cross_entropy import vocab_parallel_cross_entropy
from titanax.modules.layers.linear import Linear
from titanax.utils.dtypes import at_least_float32


def example_weights(batch: Dict[str, jax.Array]) -> jax.Array:
    weights = batch.get("weights")
    return (jnp.ones(batch["label"].shape, float) if weights is None
            else at_least_float32(weights))


def classification_loss(logits: jax.Array, batch: Dict[str, jax.Array]
                        ) -> Tuple[jax.Array, Dict[str, Any]]:
    """``(mean cross-entropy over batch["label"], aux)``, examples weighted by
    ``batch["weights"]`` (0 for padding); aux has the sums accuracy is computed from."""
    labels = batch["label"]
    weights = example_weights(batch)
    per_example = vocab_parallel_cross_entropy(logits, labels)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(weights.dtype)
    count = jnp.sum(weights)
    loss_sum = jnp.sum(per_example * weights)
    aux = {"loss_sum": loss_sum, "num_examples": count, "num_correct": jnp.sum(correct * weights)}
    return loss_sum / jnp.maximum(count, 1.0), aux


class MLPClassifier(BaseLayer):
    """Flatten, then ``Linear -> ReLU`` per hidden size, then a Linear to the classes."""

    class Config(BaseLayer.Config):
        # Flattened input size (28 x 28 for MNIST).
        input_dim: int = 784
        # Width of each hidden layer.
        hidden_dims: Sequence[int] = (256, 128)
        # Number of classes.
        num_classes: int = 10
        param_init = VarianceScaling.default_config().set(scale=2.0)

        def _validate_values(self):
            for name in ("input_dim", "num_classes"):
                if getattr(self, name) < 1:
                    yield name, f"must be >= 1, got {getattr(self, name)}"
            if any(width < 1 for width in self.hidden_dims):
                yield "hidden_dims", f"every width must be >= 1, got {tuple(self.hidden_dims)}"

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        widths = [cfg.input_dim] + list(cfg.hidden_dims) + [cfg.num_classes]
        self._num_layers = len(widths) - 1
        for index in range(self._num_layers):
            self._add_child(f"dense{index}", Linear.default_config().set(
                input_dim=widths[index], output_dim=widths[index + 1]))

    def logits(self, image: jax.Array) -> jax.Array:
        x = image.reshape(image.shape[0], -1)
        for index in range(self._num_layers):
            x = getattr(self, f"dense{index}")(x)
            if index < self._num_layers - 1:
                x = jax.nn.relu(x)
        return x

    def forward(self, batch):
        return classification_loss(self.logits(batch["image"]), batch)


class CNNClassifier(BaseLayer):
    """Two ``conv 3x3 -> ReLU -> 2x2 average pool`` stages, then a dense head."""

    class Config(BaseLayer.Config):
        # Image height and width (square).
        image_size: int = 28
        # Channels of the two conv stages.
        channels: Tuple[int, int] = (16, 32)
        # Width of the dense layer before the classes.
        hidden_dim: int = 128
        # Number of classes.
        num_classes: int = 10
        param_init = VarianceScaling.default_config().set(scale=2.0)

        def _validate_values(self):
            for name in ("image_size", "hidden_dim", "num_classes"):
                if getattr(self, name) < 1:
                    yield name, f"must be >= 1, got {getattr(self, name)}"
            if any(width < 1 for width in self.channels):
                yield "channels", f"every width must be >= 1, got {tuple(self.channels)}"

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        first, second = cfg.channels
        self._add_child("conv0", Conv2D.default_config().set(input_channels=1,
                                                             output_channels=first))
        self._add_child("conv1", Conv2D.default_config().set(input_channels=first,
                                                             output_channels=second))
        pooled = cfg.image_size // 4
        self._add_child("dense", Linear.default_config().set(
            input_dim=pooled * pooled * second, output_dim=cfg.hidden_dim))
        self._add_child("head", Linear.default_config().set(input_dim=cfg.hidden_dim,
                                                            output_dim=cfg.num_classes))

    def features(self, image: jax.Array) -> jax.Array:
        """The conv part (conv0, conv1): ``[batch, size/4, size/4, channels[1]]``."""
        size = self.config.image_size
        x = image.reshape(image.shape[0], size, size, 1)
        for conv in (self.conv0, self.conv1):
            x = jax.nn.relu(conv(x))
            x = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1),
                                      "VALID") / 4.0
        return x

    def classify(self, features: jax.Array) -> jax.Array:
        """The dense part (dense, head): logits from ``features``."""
        x = jax.nn.relu(self.dense(features.reshape(features.shape[0], -1)))
        return self.head(x)

    def logits(self, image: jax.Array) -> jax.Array:
        return self.classify(self.features(image))

    def loss(self, logits: jax.Array, batch):
        """``(mean cross-entropy, aux)`` of ``logits`` (a pipeline's last stage ends here)."""
        return classification_loss(logits, batch)

    def loss_weight(self, batch) -> jax.Array:
        """What ``loss`` is a mean over: the (weighted) number of examples."""
        return jnp.sum(example_weights(batch))

    def forward(self, batch):
        return self.loss(self.logits(batch["image"]), batch)
