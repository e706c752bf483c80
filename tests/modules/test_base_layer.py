"""Tests of BaseLayer: cascading dtype/param_init, spec trees, init under jit, remat, layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from titanax import errors
from titanax.modules import BaseLayer, ParameterSpec, functional
from titanax.parallel import axis_binding
from titanax.modules.initializers import Constant, Normal, VarianceScaling
from titanax.modules.base_layer import draw_param, param_path
from titanax.modules.context import name_key
from titanax.modules.layers.layer_group import LayerGroup
from titanax.modules.layers.linear import Linear
from titanax.modules.layers.mlp import MLP
from titanax.runtime.mesh import MeshSpec
from titanax.parallel.plan import TP, Plan
from tests.numerics import assert_close

TP_BINDING = Plan(tensor_parallel=TP(axis="model")).axis_binding()


class Tower(BaseLayer):
    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        self._add_child("mlp", MLP.default_config().set(model_dim=8, hidden_dim=16, gated=False,
                                                        bias=True))
        self._add_child("head", Linear.default_config().set(input_dim=8, output_dim=4,
                                                            dtype="float32"))

    def _create_layer_parameter_specs(self):
        return {"gain": ParameterSpec(shape=(8,), initializer=Constant.default_config().set(
            value=1.5).instantiate())}

    def forward(self, x):
        return self.head(self.mlp(x) * self.parameters["gain"])


def _tower(**changes):
    return Tower.default_config().set(name="tower", **changes).instantiate()


def test_dtype_and_param_init_cascade_to_children_unless_set():
    tower = _tower(dtype="bfloat16", param_init=Normal.default_config().set(stddev=0.5))
    specs = tower.create_parameter_specs_recursively()
    assert specs["mlp"]["up"]["weight"].dtype == jnp.bfloat16
    assert specs["head"]["weight"].dtype == jnp.float32  # Set explicitly on the child.
    assert specs["mlp"]["down"]["weight"].initializer.config.stddev == 0.5
    assert specs["gain"].initializer.config.value == 1.5
    assert tower.mlp.config.dtype == "bfloat16"


def test_spec_tree_has_global_shapes_and_declared_layouts():
    # The layers name logical dimensions; the binding in force gives their mesh axes.
    with axis_binding.bound(TP_BINDING):
        specs = _tower().create_parameter_specs_recursively()
        assert _tower().param_partition_specs()["mlp"]["up"]["bias"] == P("model")
    assert specs["mlp"]["up"]["weight"].shape == (8, 16)
    assert specs["mlp"]["up"]["weight"].logical_axes == (None, "mlp")
    assert specs["mlp"]["up"]["weight"].mesh_axes == (None, "model")
    assert specs["mlp"]["down"]["weight"].mesh_axes == ("model", None)
    assert specs["mlp"]["down"]["bias"].mesh_axes == (None,)
    assert specs["mlp"]["up"]["bias"].weight_decay_scale == 0.0
    # Without a binding nothing is split.
    assert _tower().create_parameter_specs_recursively()["mlp"]["up"]["weight"].mesh_axes == \
        (None, None)


def test_initialisation_is_deterministic_name_based_and_jit_shardable():
    tower = _tower()
    first = tower.initialize_parameters_recursively(jax.random.PRNGKey(0))
    again = jax.jit(tower.initialize_parameters_recursively)(jax.random.PRNGKey(0))
    assert_close(first["mlp"]["up"]["weight"], again["mlp"]["up"]["weight"],
                 what="jitted init")
    assert not np.allclose(first["mlp"]["up"]["weight"][:, :8], first["mlp"]["down"]["weight"][:8])
    np.testing.assert_allclose(first["gain"], 1.5)
    np.testing.assert_allclose(first["mlp"]["up"]["bias"], 0.0)
    assert abs(float(np.std(first["mlp"]["up"]["weight"])) - 0.02) < 0.01
    mesh = MeshSpec(axes=("data", "model"), shape=(None, 2)).build()
    with axis_binding.bound(TP_BINDING):
        shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s),
                                           tower.param_partition_specs())
    sharded = jax.jit(tower.initialize_parameters_recursively, out_shardings=shardings)(
        jax.random.PRNGKey(0))
    assert sharded["mlp"]["up"]["weight"].sharding.spec == P(None, "model")
    assert sharded["mlp"]["up"]["weight"].addressable_shards[0].data.shape == (8, 8)
    assert_close(sharded["mlp"]["up"]["weight"], first["mlp"]["up"]["weight"],
                 what="sharded init")


@pytest.mark.parametrize("key", [jax.random.PRNGKey(4), jax.random.key(4, impl="rbg")],
                         ids=["threefry", "rbg"])
def test_params_of_one_kind_drawn_together_are_each_keys_own_draw(key):
    """``initialize_parameters_recursively`` draws params alike in initializer, shape and dtype
    by one ``vmap`` over their keys: each param is the draw of its own path's key alone (within
    one rounding of the normal's inverse error function, compiled in another program), and no
    two params of a kind are the same draw -- also with a generator whose vmap would draw the
    whole batch from one key (rbg: drawn one at a time)."""
    model = LayerGroup.default_config().set(name="stack", layers=[
        Linear.default_config().set(input_dim=8, output_dim=8, dtype="float32")
        for _ in range(3)] + [
        Linear.default_config().set(input_dim=8, output_dim=4, dtype="float32")]).instantiate()
    got = jax.jit(model.initialize_parameters_recursively)(key)
    specs = model.create_parameter_specs_recursively()
    leaves = jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, ParameterSpec))
    for path, spec in leaves:
        alone = jax.jit(lambda k, spec=spec: draw_param(spec, k))(
            name_key(key, param_path("stack", path)))
        value = got
        for entry in path:
            value = value[entry.key]
        assert_close(np.asarray(value), np.asarray(alone), bound=1e-6, scale="leaf",
                     what=jax.tree_util.keystr(path))
    weights = [np.asarray(got[str(i)]["weight"]) for i in range(3)]
    assert all(np.std(w) > 0 for w in weights)
    assert not np.array_equal(weights[0], weights[1]) and not np.array_equal(weights[1],
                                                                             weights[2])


def test_variance_scaling_uses_fan_axes():
    layer = Linear.default_config().set(
        name="l", input_dim=400, output_dim=300,
        param_init=VarianceScaling.default_config().set(scale=2.0)).instantiate()
    weight = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))["weight"]
    assert abs(float(np.std(weight)) - np.sqrt(2.0 / 400)) < 0.005


def test_remat_gives_the_same_values_and_gradients():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8))
    plain, remat = _tower(), _tower(remat_policy="nothing_saveable")
    params = plain.initialize_parameters_recursively(jax.random.PRNGKey(0))

    def loss(layer, p):
        return jnp.sum(functional(layer, jax.random.PRNGKey(2), p, (x,), is_training=True)[0] ** 2)

    g1 = jax.grad(lambda p: loss(plain, p))(params)
    g2 = jax.grad(lambda p: loss(remat, p))(params)
    assert_close(g1, g2, what="gradients with remat")
    assert "remat" in str(jax.make_jaxpr(jax.grad(lambda p: loss(remat, p)))(params))
    assert "remat" not in str(jax.make_jaxpr(jax.grad(lambda p: loss(plain, p)))(params))


def test_bad_layer_configs_are_reported_with_paths():
    cfg = Tower.default_config().set(dtype="float33", remat_policy="sometimes")
    with pytest.raises(errors.ConfigValidationError) as info:
        cfg.validate()
    assert {p.path for p in info.value.problems} == {"dtype", "remat_policy"}
