"""A model whose float16 backward pass overflows at loss scale 1 (for loss-scaling tests).

The loss is computed in float32 and multiplied by a large constant, so the forward pass is finite,
but the gradient flowing back into the float16 activations exceeds float16's maximum (65504).
"""

import jax.numpy as jnp
import numpy as np

from titanax.modules.base_layer import BaseLayer
from titanax.modules.layers.linear import Linear
from titanax.parallel.plan import DP, Plan
from tests.train import helpers

MULTIPLIER = 2e5


class Overflow(BaseLayer):
    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        self._add_child("proj", Linear.default_config().set(input_dim=4, output_dim=2,
                                                            bias=False))

    def forward(self, batch):
        y = self.proj(batch["x"]).astype(jnp.float32)
        loss = MULTIPLIER * jnp.mean(jnp.square(y - batch["y"]))
        return loss, {"num_examples": jnp.float32(batch["x"].shape[0])}


def overflow_batches(count: int = 40):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    y = (x @ np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.0, 0.0]], np.float32))
    return [{"x": x, "y": y}] * count


def overflow_engine(precision, **changes):
    cfg = helpers.Engine.default_config().set(
        mesh=helpers.mesh((8,)),
        plan=Plan.default_config().set(data_parallel=DP.default_config()),
        model=Overflow.default_config().set(name="overflow"),
        learner=helpers.sgd(1e-7), precision=precision, loggers=[], log_every=1000, **changes)
    return cfg.instantiate()
