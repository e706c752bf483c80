"""State updates (train/state_updates.py): running statistics written with add_state_update
reach the train state, averaged like the one-device run would compute them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from titanax import errors
from titanax.modules import functional
from titanax.modules.base_layer import ParameterSpec, constant
from titanax.observe import hlo
from titanax.parallel.plan import PP, Plan
from tests.numerics import assert_close
from titanax.utils.dtypes import at_least_float32
from tests.train import helpers

pytestmark = pytest.mark.usefixtures("float64_numerics")

MOMENTUM = 0.75
LEARNING_RATE = 0.5


class RunningStatsGPT(helpers.Decoder):
    """A GPT that keeps three non-trained statistics of its head: a running mean of the final
    hidden features (replicated over TP), a running mean of its logits (split over the vocab,
    i.e. over TP like the head) and a count of training forwards."""

    def _create_layer_parameter_specs(self):
        cfg = self.config
        return {
            "feature_mean": ParameterSpec(shape=(cfg.model_dim,), initializer=constant(0.0),
                                          weight_decay_scale=0.0),
            "logit_mean": ParameterSpec(shape=(self.padded_vocab_size,),
                                        logical_axes=("vocab",), initializer=constant(0.0),
                                        weight_decay_scale=0.0),
            "forwards": ParameterSpec(shape=(), initializer=constant(0.0),
                                      weight_decay_scale=0.0),
        }

    def head_loss(self, decoded, batch):
        hidden = at_least_float32(jax.lax.stop_gradient(self.final_norm(decoded)))
        logits = at_least_float32(jax.lax.stop_gradient(self._logits_of(hidden)))
        old = self.parameters
        self.add_state_update("feature_mean", MOMENTUM * old["feature_mean"]
                              + (1 - MOMENTUM) * jnp.mean(hidden, axis=(0, 1)))
        self.add_state_update("logit_mean", MOMENTUM * old["logit_mean"]
                              + (1 - MOMENTUM) * jnp.mean(logits, axis=(0, 1)))
        self.add_state_update("forwards", old["forwards"] + 1.0)
        return super().head_loss(decoded, batch)


def _engine(**kwargs):
    engine = helpers.gpt_engine(learner=helpers.sgd(LEARNING_RATE), **kwargs)
    cfg = engine.config.clone()
    cfg.model.klass = RunningStatsGPT
    return cfg.instantiate()


def _one_device_reference(model, params, batches):
    """Plain jax on one device: SGD on the trained params; the statistics of the whole batch
    (features and logits computed by separate forward calls), mixed in by hand."""
    params = jax.tree_util.tree_map(np.asarray, params)
    for batch in batches:
        def loss_fn(p):
            return functional(model, None, p, (batch,), is_training=True)[0][0]

        grads = jax.grad(loss_fn)(params)
        hidden = functional(model, None, params, (batch["input_ids"],), method="hidden_states",
                            is_training=False)[0]
        logits = functional(model, None, params, (batch["input_ids"],), method="logits",
                            is_training=False)[0]
        new = jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE * g, params, grads)
        new["feature_mean"] = (MOMENTUM * params["feature_mean"]
                               + (1 - MOMENTUM) * np.mean(hidden, axis=(0, 1)))
        vocab = logits.shape[-1]
        logit_mean = np.array(params["logit_mean"])
        logit_mean[:vocab] = (MOMENTUM * logit_mean[:vocab]
                              + (1 - MOMENTUM) * np.mean(logits, axis=(0, 1)))
        new["logit_mean"] = logit_mean
        new["forwards"] = params["forwards"] + 1.0
        params = jax.tree_util.tree_map(np.asarray, new)
    return params


@pytest.mark.parametrize("data,model_axis,accumulate,zero,fsdp",
                         [(4, 1, 1, False, 1), (4, 2, 2, False, 1), (2, 2, 1, 1, 1),
                          (4, 1, 1, 2, 1), (2, 1, 1, 2, 2)],
                         ids=["dp4", "dp4xtp2-acc2", "zero1-2x2", "zero2-dp4", "hsdp-zero2-2x2"])
def test_running_statistics_match_the_one_device_run(data, model_axis, accumulate, zero, fsdp):
    batches = helpers.text_batches(batch_size=8)[:2]
    engine = _engine(data=data, model_axis=model_axis, accumulate=accumulate, zero=zero,
                     fsdp=fsdp)
    engine.init_state()
    start = jax.tree_util.tree_map(np.asarray, jax.device_get(engine.state.params))
    _, params = helpers.train(engine, batches)
    reference_model = _engine(data=1).build().model
    want = _one_device_reference(reference_model, start, batches)
    vocab = reference_model.config.vocab_size
    np.testing.assert_array_equal(params["forwards"], 2.0)
    assert_close(params["feature_mean"], want["feature_mean"], what="feature means")
    assert_close(params["logit_mean"][:vocab], want["logit_mean"][:vocab], what="logit means")
    assert np.abs(params["feature_mean"]).max() > 1e-2  # The statistics really moved.
    trained = ("decoder", "token_emb", "final_norm")  # SGD parity.
    assert_close({k: params[k] for k in trained}, {k: want[k] for k in trained},
                 what="trained params")


def test_a_state_update_for_no_param_is_refused_with_its_path():
    class Stray(helpers.Decoder):
        def head_loss(self, decoded, batch):
            self.add_state_update("seen", jnp.float32(1.0))
            return super().head_loss(decoded, batch)

    engine = helpers.gpt_engine(data=1)
    cfg = engine.config.clone()
    cfg.model.klass = Stray
    with pytest.raises(errors.ModuleError) as caught:
        cfg.instantiate().fit(data=iter(helpers.text_batches(batch_size=8)), steps=1)
    assert "'seen'" in caught.value.message and caught.value.path.endswith("Stray.forward")


def test_a_state_update_of_the_wrong_shape_is_refused():
    class WrongShape(RunningStatsGPT):
        def head_loss(self, decoded, batch):
            loss_aux = super().head_loss(decoded, batch)
            self.add_state_update("forwards", jnp.zeros((2,)))
            return loss_aux

    engine = _engine(data=1)
    cfg = engine.config.clone()
    cfg.model.klass = WrongShape
    with pytest.raises(errors.ModuleError) as caught:
        cfg.instantiate().fit(data=iter(helpers.text_batches(batch_size=8)), steps=1)
    assert "'forwards'" in caught.value.message and "(2,)" in caught.value.message


def test_a_zero2_scattered_gradient_leaves_the_state_update_averaged_over_data():
    """ZeRO-2 splits logit_mean's optimizer state (and gradient) over the data axis, not the
    param: its state update is still the mean over every data shard (checked in the parity case
    zero2-dp4 above); here the layout that makes that case meaningful."""
    engine = _engine(data=4, zero=2)
    engine.build()
    assert engine.layout.state_dims["logit_mean"] == 0
    assert "data" not in tuple(engine.param_specs["logit_mean"])


def test_under_fsdp_a_sharded_state_update_is_refused_saying_how_to_keep_it_whole():
    engine = _engine(data=4, zero=3)
    with pytest.raises(errors.ModuleError) as caught:
        engine.fit(data=iter(helpers.text_batches(batch_size=8)), steps=1)
    assert "'logit_mean'" in caught.value.message
    assert "dim_overrides" in caught.value.suggestion and "'logit_mean': None" in \
        caught.value.suggestion
    cfg = engine.config.clone()
    cfg.plan.zero.dim_overrides = {"logit_mean": None}
    cfg.instantiate().fit(data=iter(helpers.text_batches(batch_size=8)), steps=1)


def test_state_updates_ride_the_steps_two_reductions():
    """No collective of their own: the statistics cross the data axis in the one data
    all-reduce of the step, and the model axis in the reducer's one model all-reduce."""
    engine = _engine(data=4, model_axis=2, accumulate=2)
    engine.init_state()
    engine.compile(example_batch=helpers.text_batches(batch_size=8)[0])
    ops = engine.collectives()
    after_loop = [op for op in ops if not op.in_loop and "transpose" not in op.source
                  and "jvp" not in op.source]
    assert [op.axes for op in after_loop] == [("data",), ("model",)], hlo.format_report(ops)


def test_a_pipeline_refuses_state_updates_instead_of_dropping_them():
    cfg = _engine(data=1).config.clone()
    cfg.mesh = helpers.mesh((2,), ("pipe",), devices=[0, 1])
    cfg.plan = Plan.default_config().set(
        pipeline_parallel=PP.default_config().set(schedule="gpipe", microbatch_size=4))
    with pytest.raises(errors.ModuleError) as caught:
        cfg.instantiate().fit(data=iter(helpers.text_batches(batch_size=8)), steps=1)
    assert "pipeline" in caught.value.message and "feature_mean" in caught.value.message
