"""Muon (train/muon.py, optimizers.muon): its updates equal ``optax.contrib.muon``'s (AdamW with
Nesterov momentum for what is not a matrix) on one device, in float64, for every kind of
matrix a model has -- a plain weight, a projection to heads (``D x (H * Dh)``), a tall one, a
stack of layers, a mixture's experts, a fused gate/up -- and its bad inputs are refused by
name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from titanax import errors
from titanax.train import optimizers
from titanax.train.param_layouts import ParamLayout
from tests.numerics import assert_close

pytestmark = pytest.mark.usefixtures("float64_numerics")

# name -> (shape, fan-in dims, fan-out dims); no fan dims: AdamW's.
PARAMS = {
    "dense/weight": ((8, 12), (0,), (1,)),
    "attn/q_weight": ((8, 2, 4), (0,), (1, 2)),
    "down/weight": ((12, 4), (0,), (1,)),
    "layer/mlp/gate_up_weight": ((2, 8, 2, 6), (1,), (3,)),
    "experts/down_weight": ((3, 4, 6), (1,), (2,)),
    "token_emb/weight": ((16, 8), (0,), (1,)),
    "attn/q_bias": ((2, 4), (0,), (1,)),
    "norm/scale": ((8,), (), ()),
}
MUON = ("dense/weight", "attn/q_weight", "down/weight", "layer/mlp/gate_up_weight",
        "experts/down_weight")


def _layouts():
    return {name: ParamLayout(path=name, shape=shape, fan_in=fan_in, fan_out=fan_out,
                              split=((),) * len(shape))
            for name, (shape, fan_in, fan_out) in PARAMS.items()}


def _optax_dimension_numbers():
    return {name: (optax.contrib.MuonDimensionNumbers(reduction_axis=PARAMS[name][1],
                                                      output_axis=PARAMS[name][2])
                   if name in MUON else None) for name in PARAMS}


def _trees(seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(PARAMS))
    return {name: jax.random.normal(key, PARAMS[name][0], jnp.float64)
            for key, name in zip(keys, PARAMS)}


def _run(tx, steps=3):
    params = _trees(0)
    state = tx.init(params)
    for step in range(steps):
        updates, state = tx.update(_trees(step + 1), state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("nesterov,consistent_rms", [(True, None), (False, None), (True, 0.2)])
def test_updates_equal_optax_contrib_muon(nesterov, consistent_rms):
    # (Our Muon takes its matrices from the default patterns: the embedding and the bias are
    # AdamW's, as the None entries tell optax.)
    ours = optimizers.muon(0.02, beta=0.9, ns_steps=5, nesterov=nesterov, weight_decay=0.1,
                           consistent_rms=consistent_rms, adam_learning_rate=3e-3,
                           adam_b1=0.8, adam_b2=0.99, adam_eps=1e-8, adam_weight_decay=0.01,
                           decay_scales={name: 1.0 for name in PARAMS},
                           param_layouts=_layouts())
    reference = optax.contrib.muon(0.02, beta=0.9, ns_steps=5, nesterov=nesterov,
                                   weight_decay=0.1, consistent_rms=consistent_rms,
                                   adam_learning_rate=3e-3, adam_b1=0.8, adam_b2=0.99, eps=1e-8,
                                   adam_weight_decay=0.01,
                                   muon_weight_dimension_numbers=_optax_dimension_numbers())
    got, want = _run(ours), _run(reference)
    assert_close(got, want, what="params after 3 Muon steps")
    start = _trees(0)
    # (The check can fail: every param moved, the matrices by Muon's sized steps.)
    assert all(float(jnp.max(jnp.abs(got[n] - start[n]))) > 1e-3 for n in PARAMS)


def test_a_matrix_update_is_orthogonal_and_a_muon_patterns_non_matrix_is_refused():
    tx = optimizers.muon(1.0, beta=0.0, ns_steps=5, nesterov=False,
                         matrices=(r"dense/weight$",), param_layouts=_layouts())
    params = _trees(0)
    updates, _ = tx.update(_trees(1), tx.init(params), params)
    # Muon's iteration leaves singular values within about (0.7, 1.2), not exactly 1; the
    # update is scaled by sqrt(fan_out / fan_in) = sqrt(12 / 8).
    singular = np.linalg.svd(np.asarray(-updates["dense/weight"]) / np.sqrt(12 / 8),
                             compute_uv=False)
    assert singular.min() > 0.6 and singular.max() < 1.25, singular
    with pytest.raises(errors.ConfigError, match="norm/scale .*not a matrix"):
        optimizers.muon(0.02, matrices=(r"scale$",), param_layouts=_layouts())
    with pytest.raises(errors.ConfigError, match="Muon would train nothing"):
        optimizers.muon(0.02, matrices=(r"nothing$",), param_layouts=_layouts())


def _model_layouts(experiment):
    """The ParamLayouts of an experiment's model on one device (no param split)."""
    from jax.sharding import PartitionSpec  # pylint: disable=import-outside-toplevel
    from titanax.config import registry  # pylint: disable=import-outside-toplevel
    from titanax.modules.base_layer import ParameterSpec  # pylint: disable=import-outside-toplevel
    from titanax.train.param_layouts import param_layouts  # pylint: disable=import-outside-toplevel
    registry.load_config_modules(list(registry.DEFAULT_CONFIG_MODULES))
    model = registry.get_config(experiment).model.set(name="m").instantiate(parent=None)
    specs = model.create_parameter_specs_recursively()
    partitions = jax.tree_util.tree_map(lambda _: PartitionSpec(), specs,
                                        is_leaf=lambda x: isinstance(x, ParameterSpec))
    return param_layouts(parameter_specs=specs, update_specs=partitions,
                         mesh_shape={"data": 1})


def test_a_fused_projections_parts_and_a_stacks_biases_are_not_one_matrix():
    """GPT's fused q/k/v ``[L, D, 3, H, Dh]`` is 3 matrices per layer (as the separate
    projections of a Llama are), not one ``D x 3HDh``; a stack's biases, whose fan axes the
    stack inferred, are not matrices: a pattern naming them is refused."""
    layouts = _model_layouts("gpt_tiny_dp")["decoder"]["layer"]["attn"]
    qkv = layouts["qkv_weight"]
    assert (qkv.fan_in, qkv.fan_out) == ((1,), (3, 4)), qkv
    assert layouts["qkv_bias"].is_matrix is False
    with pytest.raises(errors.ConfigError, match="attn/qkv_bias .* not a matrix"):
        optimizers.muon(0.02, matrices=(r"attn/qkv_",),
                        param_layouts=_model_layouts("gpt_tiny_dp"))
    # (The default patterns leave the embeddings, heads and routers to AdamW.)
    oss = _model_layouts("gpt_oss_tiny")
    labels = optimizers.muon_lib.matrix_labels(oss, matrices=optimizers.muon_lib.DEFAULT_MATRICES,
                                               not_matrices=optimizers.muon_lib.DEFAULT_NOT_MATRICES)
    mlp = labels["decoder"]["layer"]["0"]["mlp"]
    assert (mlp["router"]["weight"], mlp["gate_up_weight"], labels["lm_head"]["weight"]) == \
        ("adam", "muon", "adam")
