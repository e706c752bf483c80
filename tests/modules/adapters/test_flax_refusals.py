"""What the Flax adapters refuse, each with an error naming the module and what to do: tensor
parallelism on a module without collectives, a factory that returns no Flax module, variables
that change between init and a call, a logical axis rule for a name no param uses, context
parallelism (a Flax attention sees its own chunk only); and the RNG streams and train / eval
flags they feed."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from titanax import errors
from titanax.config import config_for_function
from titanax.modules import FlaxLinen, FlaxNNX
from titanax.modules.adapters.objectives import ClassificationLoss, ReturnedLoss
from titanax.modules.testing import bind
from titanax.parallel.context_parallel import CP
from titanax.parallel.plan import TP
from titanax_experiments import flax_nnx
from tests.modules.adapters import flax_runs
from tests.train import helpers


def _tp_engine(model, **rules):
    return flax_runs.engine(model, mesh=helpers.mesh((4, 2), ("data", "model")),
                            plan=flax_runs.plan().set(tensor_parallel=TP.default_config(),
                                                      logical_axis_rules=rules))


def test_tensor_parallelism_is_refused_without_collectives():
    """The NNX GPT calls no collective over the TP axis (its trace on its shards shows none);
    the Megatron MLP does (on shards it sizes by the axis) and is let through; a Linen module
    never is (Linen checks param shapes)."""
    with pytest.raises(errors.PlanError) as raised:
        _tp_engine(flax_runs.nnx_model()).build()
    message = str(raised.value)
    assert "plan.tensor_parallel" in message and "flax_nnx.make_gpt" in message
    assert "calls no collective over the tensor-parallel axis 'model'" in message
    megatron = _tp_engine(flax_runs.megatron_model(), mlp="model").build()
    assert megatron.layout.axis_binding.tensor_axes() == ("model",)
    with pytest.raises(errors.PlanError) as raised:
        _tp_engine(flax_runs.linen_model()).build()
    assert "plan.tensor_parallel" in str(raised.value) and "FlaxNNX" in str(raised.value)


def make_not_a_module(rngs=None):
    del rngs
    return {"kernel": np.zeros(3)}


def make_a_dict():
    return {"kernel": np.zeros(3)}


def make_linen_dense():
    return nn.Dense(4)


@pytest.mark.parametrize("adapter,factory,expected", [
    (FlaxNNX, make_not_a_module, "not a flax.nnx.Module"),
    (FlaxLinen, make_a_dict, "not a flax.linen.Module"),
], ids=["nnx_dict", "linen_dict"])
def test_a_factory_that_makes_no_flax_module_is_refused(adapter, factory, expected):
    cfg = adapter.default_config().set(name="m", module=config_for_function(factory),
                                       example_inputs={"input_ids": "int32[2,8]"})
    with pytest.raises(errors.ModuleError) as raised:
        cfg.instantiate().create_parameter_specs_recursively()
    assert expected in str(raised.value) and "model.module" in str(raised.value)
    assert factory.__name__ in str(raised.value)


@pytest.mark.parametrize("adapter,factory,expected", [
    (FlaxLinen, flax_nnx.make_gpt, "an NNX module goes in titanax.modules.FlaxNNX"),
    (FlaxNNX, make_linen_dense, "takes no 'rngs' argument"),
], ids=["linen_given_nnx_factory", "nnx_given_linen_factory"])
def test_a_factory_for_the_other_adapter_is_named_before_anything_is_built(adapter, factory,
                                                                          expected):
    cfg = adapter.default_config().set(name="m", module=config_for_function(factory),
                                       example_inputs={"input_ids": "int32[2,8]"})
    with pytest.raises(errors.ConfigError) as raised:
        cfg.validate(prefix="model")
    assert "model.module" in str(raised.value) and expected in str(raised.value)


class GrowsOnCall(nnx.Module):
    """Makes a Param on its first call (lazy init): its variables change under the adapter."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        if not hasattr(self, "late"):
            self.late = nnx.Param(jnp.ones((4,)))
        return self.dense(x) * self.late[...]


def make_grows_on_call(*, rngs: nnx.Rngs):
    return GrowsOnCall(rngs=rngs)


class FlattenDense(nn.Module):
    """Its kernel's shape follows the input's: an input of another shape than the init's asks
    for another param."""

    @nn.compact
    def __call__(self, image):
        return nn.Dense(10)(image.reshape(image.shape[0], -1))


def make_flatten_dense():
    return FlattenDense()


def test_variables_that_change_between_init_and_a_call_are_refused():
    nnx_cfg = FlaxNNX.default_config().set(
        name="grows", module=config_for_function(make_grows_on_call), inputs=("x",),
        example_inputs={"x": "float32[2,4]"})
    with pytest.raises(errors.ModuleError) as raised:
        nnx_cfg.instantiate().create_parameter_specs_recursively()
    assert "changed the structure of its variables" in str(raised.value)
    assert "new: late" in str(raised.value) and "make_grows_on_call" in str(raised.value)

    linen_cfg = FlaxLinen.default_config().set(
        name="flat", module=config_for_function(make_flatten_dense), inputs=("image",),
        example_inputs={"image": "float32[2,14,14]"}, loss=ClassificationLoss.default_config())
    engine = flax_runs.engine(linen_cfg)
    engine.init_state()
    with pytest.raises(errors.ModuleError) as raised:
        engine.train_step(flax_runs.image_batches()[0])  # 28 x 28 images, not the example's.
    message = str(raised.value)
    assert "asked for variables its init did not make, or of other shapes" in message
    assert "make_flatten_dense" in message and "model.example_inputs" in message


def test_a_rule_for_a_logical_axis_no_param_names_is_refused():
    plan = flax_runs.plan(zero=3).set(logical_axis_rules={"embd": "data"})
    with pytest.raises(errors.PlanError) as raised:
        flax_runs.engine(flax_runs.nnx_model(), plan=plan).build()
    message = str(raised.value)
    assert "plan.logical_axis_rules['embd']" in message and "did you mean 'embed'" in message
    plan = flax_runs.plan().set(logical_axis_rules={"embed": "pipe"})
    with pytest.raises(errors.PlanError, match="mesh does not have"):
        flax_runs.engine(flax_runs.nnx_model(), plan=plan).build()


@pytest.mark.parametrize("field,value,expected", [
    ("example_inputs", {"input_ids": "int32[2,x]"}, "example_inputs['input_ids']"),
    ("example_inputs", {"ids": "int32[2,8]"}, "has no example of input 'input_ids'"),
    ("inputs", (), "name at least one batch entry"),
    ("dtype", "bfloat16", "the Flax module makes its own params"),
])
def test_bad_adapter_fields_are_named(field, value, expected):
    cfg = flax_runs.nnx_model()
    with pytest.raises(errors.ConfigError) as raised:
        cfg.set(**{field: value}).validate()
    assert expected in str(raised.value)


def _dropout_outputs(adapter_cfg, batch, keys, is_training):
    model = adapter_cfg.instantiate()
    params = model.initialize_parameters_recursively(flax_runs.init_key())
    outputs = []
    for key in keys:
        with bind(model, params, prng_key=key, is_training=is_training):
            outputs.append(np.asarray(model.forward(batch)[0]))
    return outputs


def test_the_run_key_feeds_dropout_and_is_training_switches_it():
    model = flax_runs.nnx_model()
    model.module.dropout_rate = 0.5
    batch = {k: jnp.asarray(v) for k, v in flax_runs.text_batches()[0].items()}
    keys = [jax.random.PRNGKey(1), jax.random.PRNGKey(1), jax.random.PRNGKey(2)]
    first, again, other = _dropout_outputs(model, batch, keys, is_training=True)
    assert first == again and first != other  # The call's key decides the masks.
    evaluated = _dropout_outputs(model, batch, keys[:2], is_training=False)
    model.module.dropout_rate = 0.0
    undropped = _dropout_outputs(model, batch, keys[:1], is_training=False)
    assert evaluated[0] == evaluated[1] == undropped[0]  # No dropout in evaluation.
    assert abs(first - undropped[0]) > 1e-5  # Dropout moved the loss (rounding: ~1e-7).


def test_context_parallelism_is_refused_for_a_module_without_cp_attention():
    plan = flax_runs.plan().set(context_parallel=CP.default_config())
    with pytest.raises(errors.PlanError) as raised:
        flax_runs.engine(flax_runs.nnx_model(), mesh=helpers.mesh((4, 2), ("data", "context")),
                         plan=plan).build()
    assert "plan.context_parallel" in str(raised.value)
    assert "adapted Flax module" in str(raised.value)


class ModeKeyword(nnx.Module):
    """Dropout switched by its call's own keyword (no train() / eval() attribute)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x, *, deterministic: bool):
        y = self.dense(x)
        return y if deterministic else nnx.Dropout(0.5, rngs=self.rngs)(y)


def make_mode_keyword(*, rngs: nnx.Rngs):
    return ModeKeyword(rngs=rngs)


def test_the_calls_own_mode_keyword_gets_the_mode():
    cfg = FlaxNNX.default_config().set(
        name="kw", module=config_for_function(make_mode_keyword), inputs=("x",),
        example_inputs={"x": "float32[2,4]"},
        loss=ReturnedLoss.default_config().set(count="examples"))
    model = cfg.instantiate()
    assert model.mode_argument == "deterministic"
    values = helpers.flat(model.initialize_parameters_recursively(flax_runs.init_key()))
    x = jnp.ones((2, 4))
    outputs = {is_training: model._run(  # pylint: disable=protected-access
        values, model._full_call(is_training), (x,),  # pylint: disable=protected-access
        is_training=is_training, key=jax.random.PRNGKey(1))[0] for is_training in (True, False)}
    assert not np.allclose(outputs[True], outputs[False])  # Dropout only when training.
    plain = nnx.merge(*nnx.split(make_mode_keyword(rngs=nnx.Rngs(flax_runs.init_key()))))
    np.testing.assert_allclose(outputs[False], plain(x, deterministic=True), rtol=1e-6)
