"""The Linen CNN of the ``flax_linen_cnn_fsdp`` experiment (``experiments/flax_linen.py``): plain
Flax Linen, nothing of Titanax in it."""

from typing import Optional, Tuple

import flax.linen as nn
import jax


def _named(*names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class CNN(nn.Module):
    """``CNN(...)(image, train)``: class logits of ``[batch, 28, 28]`` images."""

    num_classes: int = 10
    channels: Tuple[int, int] = (16, 32)
    hidden_dim: int = 128
    # Average BatchNorm's batch statistics over this mesh axis while training (None: each
    # device normalises by its own rows).
    batch_norm_axis: Optional[str] = None

    @nn.compact
    def __call__(self, image, train: bool):
        x = image.reshape(image.shape[0], image.shape[1], image.shape[2], 1)
        for width in self.channels:
            # No bias: BatchNorm subtracts the batch mean right after (its own bias shifts).
            x = nn.Conv(width, (3, 3), use_bias=False,
                        kernel_init=_named(None, None, "in", "out"))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                             axis_name=self.batch_norm_axis if train else None)(x)
            x = nn.avg_pool(jax.nn.relu(x), (2, 2), strides=(2, 2))
        x = jax.nn.relu(nn.Dense(self.hidden_dim, kernel_init=_named("in", "out"))(
            x.reshape(x.shape[0], -1)))
        return nn.Dense(self.num_classes, kernel_init=_named("out", None))(x)
