"""The MNIST classifiers: shapes, loss, accuracy counts, and that they learn a toy task."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from titanax.modules import functional
from titanax.modules.models.classifier import CNNClassifier, MLPClassifier


@pytest.mark.parametrize("cls", [MLPClassifier, CNNClassifier])
def test_classifier_learns_a_separable_toy_task(cls):
    model = cls.default_config().set(name="clf").instantiate()
    params = jax.jit(model.initialize_parameters_recursively)(jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, size=64)
    images = rng.uniform(size=(64, 28, 28)).astype(np.float32) * 0.1
    images[np.arange(64), labels * 2, :] = 1.0  # Class k lights up row 2k.
    batch = {"image": jnp.asarray(images), "label": jnp.asarray(labels)}
    optimizer = optax.adam(3e-3)
    state = optimizer.init(params)

    @jax.jit
    def step(p, s):
        (loss, aux), grads = jax.value_and_grad(
            lambda q: functional(model, None, q, (batch,), is_training=True)[0], has_aux=True)(p)
        updates, s = optimizer.update(grads, s)
        return optax.apply_updates(p, updates), s, loss, aux

    for _ in range(60):
        params, state, loss, aux = step(params, state)
    assert float(aux["num_examples"]) == 64
    assert float(aux["num_correct"]) == 64, float(loss)
    assert float(loss) < 0.1
