"""An experiment whose every checkpoint save fails at once (loaded with
--config_module=tests.io.failing_save_experiment): its model holds a param with no elements,
which Orbax refuses to write."""

import jax
import jax.numpy as jnp

from titanax.config import register_experiment
from titanax.modules.base_layer import BaseLayer, ParameterSpec
from titanax_experiments.mnist import mnist_dp


class WithAnEmptyParam(BaseLayer):
    """A linear classifier, plus a param of shape (0,) that only its loss reads."""

    def _create_layer_parameter_specs(self):
        return {"w": ParameterSpec(shape=(784, 10)), "empty": ParameterSpec(shape=(0,))}

    def forward(self, batch):
        logits = batch["image"].reshape(batch["image"].shape[0], -1) @ self.parameters["w"]
        picked = jnp.take_along_axis(logits, batch["label"][:, None], axis=-1)
        loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked[:, 0])
        loss = loss + jnp.sum(self.parameters["empty"])
        return loss, {"num_examples": jnp.asarray(logits.shape[0], jnp.float32)}


@register_experiment
def failing_save():
    """mnist_dp with a model whose checkpoint save fails."""
    cfg = mnist_dp()
    cfg.model = WithAnEmptyParam.default_config().set(name="empty")
    cfg.evalers = {}
    return cfg
