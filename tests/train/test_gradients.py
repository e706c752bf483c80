"""The gradient computer (train/gradients.py): local gradients, microbatches and summaries."""

import jax
import jax.numpy as jnp
import numpy as np

from titanax.modules import functional
from titanax.modules.testing import assert_nested_allclose
from titanax.train.gradients import ModelGradients, flat_summaries
from titanax.train.precision import Precision
from tests.train import helpers


def _model_and_params():
    engine = helpers.summarizing(helpers.gpt_engine(data=1))
    engine.init_state()
    return engine.model, jax.device_get(engine.state.params)


def test_microbatched_gradients_equal_the_plain_ones_and_jax_grad():
    model, params = _model_and_params()
    batch = helpers.text_batches(batch_size=8)[0]
    precision = Precision.default_config().instantiate()
    plain = ModelGradients(model=model, precision=precision, mesh_shape={})
    split = ModelGradients(model=model, precision=precision, mesh_shape={},
                           accumulate_steps=4)
    key = jax.random.PRNGKey(0)
    one, four = plain(params, batch, key), split(params, batch, key)
    want = jax.grad(lambda p: functional(model, key, p, (batch,), is_training=True)[0][0])(params)
    assert_nested_allclose(one.grads, want, rtol=1e-5, atol=1e-7)
    assert_nested_allclose(four.grads, want, rtol=1e-4, atol=1e-6)  # Equal-size microbatches.
    np.testing.assert_allclose(float(four.loss), float(one.loss), rtol=1e-5)
    assert float(four.aux["num_tokens"]) == float(one.aux["num_tokens"]) == 8 * 16
    np.testing.assert_allclose(float(one.summaries["summaries/loss"]), float(one.loss), rtol=1e-6)


def test_summaries_reach_the_step_metrics():
    engine = helpers.summarizing(helpers.gpt_engine(data=4, model_axis=2, accumulate=2))
    engine.fit(data=iter(helpers.text_batches(batch_size=16)), steps=2)
    for metrics in engine.history:
        assert abs(metrics["summaries/loss"] - metrics["loss"]) < 1e-5, metrics


def test_flat_summaries_names_paths_and_averages_stacked_layers():
    tree = {"loss": jnp.float32(2.0), "decoder": {"layer": {"norm": jnp.arange(4.0)}}}
    flat = flat_summaries(tree)
    assert set(flat) == {"summaries/loss", "summaries/decoder/layer/norm"}
    assert float(flat["summaries/decoder/layer/norm"]) == 1.5
