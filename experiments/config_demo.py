"""A small experiment that runs the config system end to end before the training engine exists.

It fits a vector to a target with any optax optimizer, so registry lookup, overrides
(``--config.optimizer.learning_rate=0.05``), validation, ``config_for_function`` and
``instantiate()`` all do real work. The GPT and MNIST experiments replace it once the engine lands.
"""

from __future__ import annotations

from typing import Optional

import optax

from titanax.config import REQUIRED, Configurable, InstantiableConfig, Required
from titanax.config import config_for_function, register_experiment


class VectorFit(Configurable):
    """Minimises ``mean((x - target)**2)`` from x = 0 and prints the loss as it goes."""

    class Config(Configurable.Config):
        # Length of the vector.
        dim: int = 8
        # Value of every element of the target vector.
        target: float = 1.0
        # Optimizer steps to take.
        steps: Required[int] = REQUIRED
        # Print the loss every this many steps.
        log_every: int = 25
        # Any optax GradientTransformation factory, e.g. config_for_function(optax.sgd).
        optimizer: InstantiableConfig = config_for_function(optax.adam).set(learning_rate=0.1)

    def run(self, *, trainer_dir: Optional[str] = None, cluster=None) -> int:
        del trainer_dir, cluster  # A single-process toy: nothing to save.
        import jax  # pylint: disable=import-outside-toplevel
        import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

        cfg = self.config
        target = jnp.full((cfg.dim,), cfg.target)
        optimizer = cfg.optimizer.instantiate()

        def loss_fn(x):
            return jnp.mean((x - target) ** 2)

        @jax.jit
        def step(x, opt_state):
            loss, grad = jax.value_and_grad(loss_fn)(x)
            updates, opt_state = optimizer.update(grad, opt_state, x)
            return optax.apply_updates(x, updates), opt_state, loss

        x = jnp.zeros((cfg.dim,))
        opt_state = optimizer.init(x)
        for index in range(cfg.steps):
            x, opt_state, loss = step(x, opt_state)
            if index % cfg.log_every == 0 or index == cfg.steps - 1:
                print(f"step {index:5d}  loss {float(loss):.6f}")
        print(f"final loss {float(loss_fn(x)):.6f}")
        return 0


@register_experiment
def config_demo():
    """VectorFit with Adam: the config system end to end (transitional, until the engine lands)."""
    return VectorFit.default_config().set(steps=100)
