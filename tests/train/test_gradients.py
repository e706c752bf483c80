"""The gradient computer (train/gradients.py): local gradients, microbatches and summaries."""

import jax
import jax.numpy as jnp

from titanax.modules import functional
from titanax.train.gradients import ModelGradients, flat_summaries
from titanax.train.precision import Precision
from tests.numerics import assert_close
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
    assert_close(one.grads, want, what="gradients")
    assert_close(four.grads, want, what="gradients of 4 microbatches")  # Of equal size.
    assert_close(four.loss, one.loss, what="loss of 4 microbatches")
    assert float(four.aux["num_tokens"]) == float(one.aux["num_tokens"]) == 8 * 16
    assert_close(one.summaries["summaries/loss"], one.loss, what="summarised loss")


def test_summaries_reach_the_step_metrics():
    engine = helpers.summarizing(helpers.gpt_engine(data=4, model_axis=2, accumulate=2))
    engine.fit(data=iter(helpers.text_batches(batch_size=16)), steps=2)
    assert_close([m["summaries/loss"] for m in engine.history],
                 [m["loss"] for m in engine.history], what="summarised losses")


def test_flat_summaries_names_paths_and_averages_stacked_layers():
    tree = {"loss": jnp.float32(2.0), "decoder": {"layer": {"norm": jnp.arange(4.0)}}}
    flat = flat_summaries(tree)
    assert set(flat) == {"summaries/loss", "summaries/decoder/layer/norm"}
    assert float(flat["summaries/decoder/layer/norm"]) == 1.5
