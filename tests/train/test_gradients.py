"""The gradient computer (train/gradients.py): local gradients, microbatches and summaries."""

import pytest
import jax
import jax.numpy as jnp

from titanax.modules import functional
from titanax.modules.context import VectorSummary, expand_vector_metrics
from titanax.train.gradients import ModelGradients, flat_summaries
from tests.numerics import assert_close
from tests.train import helpers

pytestmark = pytest.mark.usefixtures("float64_numerics")


def _model_and_params():
    engine = helpers.summarizing(helpers.gpt_engine(data=1))
    engine.init_state()
    return engine.model, jax.device_get(engine.state.params)


def test_microbatched_gradients_equal_the_plain_ones_and_jax_grad():
    model, params = _model_and_params()
    batch = helpers.text_batches(batch_size=8)[0]
    precision = helpers.test_precision().instantiate()
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
    """A stacked summary is averaged over its layers and kept per layer (a pipeline stage, which
    holds a slice of the stack, asks for the average only, and gets no vector summary); a vector
    summary stays a vector until reduced, then reports its largest and smallest element, per
    layer too."""
    norm = "summaries/decoder/layer/norm"
    tree = {"loss": jnp.float32(2.0), "decoder": {"layer": {"norm": jnp.arange(4.0)}}}
    flat = flat_summaries(tree)
    assert set(flat) == {"summaries/loss", norm} | {f"{norm}/layer_{i}" for i in range(4)}
    assert float(flat[norm]) == 1.5 and float(flat[f"{norm}/layer_2"]) == 2.0
    assert set(flat_summaries(tree, per_layer=False)) == {"summaries/loss", norm}
    loads = VectorSummary(jnp.array([[0.5, 1.5, 1.0], [1.0, 1.0, 1.0]]))
    flat = flat_summaries({"moe": {"load": loads}})
    assert flat["summaries/moe/load"].shape == (2, 3)
    assert "summaries/moe/load" not in flat_summaries({"moe": {"load": loads}}, per_layer=False)
    expanded = expand_vector_metrics({"loss": jnp.float32(1.0), **flat})
    assert set(expanded) == {"loss", "summaries/moe/load/max", "summaries/moe/load/min"} | {
        f"summaries/moe/load/layer_{i}/{end}" for i in range(2) for end in ("max", "min")}
    assert float(expanded["summaries/moe/load/max"]) == 1.25  # Mean over layers of 1.5, 1.0.
    assert float(expanded["summaries/moe/load/layer_0/min"]) == 0.5
