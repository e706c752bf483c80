"""The plan's logical axis rules: a param's named dimensions put the ZeRO / FSDP split there, the
TP axis into the param's layout, None keeps them whole; rules for names no param uses, and axes
that cannot split a param, are refused."""

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from titanax import errors
from titanax.modules.base_layer import ParameterSpec
from titanax.parallel.plan import DP, PP, TP, Plan, ZeRO
from titanax.runtime.mesh import MeshSpec

# A stacked kernel [layers, embed, mlp] and a table [vocab, embed], named as a Flax model
# names them.
SPECS = {
    "blocks": {"kernel": ParameterSpec(shape=(2, 64, 256), dtype=jnp.float32, stacked_dims=1,
                                       logical_axes=("layers", "embed", "mlp"))},
    "table": ParameterSpec(shape=(512, 64), dtype=jnp.float32, logical_axes=("vocab", "embed")),
}
DATA = MeshSpec(axes=("data",), shape=(8,)).build()


def _layout(rules, mesh=DATA, **parts):
    plan = Plan(data_parallel=DP(), logical_axis_rules=rules, **parts)
    return plan.layout(SPECS, mesh)


def _specs(tree):
    """The specs without trailing Nones (``P(None, 'data', None)`` is ``P(None, 'data')``)."""
    if isinstance(tree, dict):
        return {k: _specs(v) for k, v in tree.items()}
    entries = list(tree)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def test_the_zero_axis_goes_on_the_named_dimension():
    # Without the rules FSDP takes the largest dimension (mlp: 256, vocab: 512) ...
    default = _layout({}, zero=ZeRO(stage=3, min_shard_size=0))
    assert _specs(default.param_specs) == {"blocks": {"kernel": P(None, None, "data")},
                                   "table": P("data")}
    # ... with them, the one named embed; the history says a rule was applied.
    layout = _layout({"embed": "data", "mlp": None, "layers": None, "vocab": None},
                     zero=ZeRO(stage=3, min_shard_size=0))
    assert _specs(layout.param_specs) == {"blocks": {"kernel": P(None, "data")},
                                  "table": P(None, "data")}
    assert layout.history[0] == "logical axis rules"
    # ZeRO-1 splits the optimizer state there (the params stay whole).
    zero1 = _layout({"embed": "data"}, zero=ZeRO(stage=1, min_shard_size=0))
    assert zero1.state_dims == {"blocks": {"kernel": 1}, "table": 1}
    assert _specs(zero1.param_specs) == {"blocks": {"kernel": P()}, "table": P()}


def test_without_zero_the_data_axis_asks_for_nothing():
    layout = _layout({"embed": "data"})
    assert _specs(layout.param_specs) == {"blocks": {"kernel": P()}, "table": P()}


def test_named_dimensions_without_a_mesh_axis_stay_whole_under_zero():
    # The stacked dimension cannot carry the axis (the layer scan slices it), and the rules
    # keep embed and mlp whole (no rule): the kernel stays whole; so does the table, whose
    # vocab is mapped to None.
    layout = _layout({"layers": "data", "vocab": None}, zero=ZeRO(stage=3, min_shard_size=0))
    assert _specs(layout.param_specs) == {"blocks": {"kernel": P()}, "table": P()}
    # A dimension without a name is still ZeRO's to choose.
    unnamed = {"w": ParameterSpec(shape=(64, 256), dtype=jnp.float32,
                                  logical_axes=("embed", None))}
    plan = Plan(data_parallel=DP(), zero=ZeRO(stage=3, min_shard_size=0),
                logical_axis_rules={"embed": None})
    assert _specs(plan.layout(unnamed, DATA).param_specs) == {"w": P(None, "data")}


def test_the_tp_axis_becomes_the_declared_layout():
    mesh = MeshSpec(axes=("data", "model"), shape=(4, 2)).build()
    layout = _layout({"mlp": "model", "vocab": "model"}, mesh=mesh, tensor_parallel=TP())
    assert _specs(layout.layer_specs) == {"blocks": {"kernel": P(None, None, "model")},
                                  "table": P("model")}


@pytest.mark.parametrize("rules,mesh,parts,text", [
    ({"embd": "data"}, DATA, {}, "did you mean 'embed'"),
    ({"embed": "fsdp"}, DATA, {}, "which the mesh does not have"),
    ({"embed": "pipe"}, MeshSpec(axes=("data", "pipe"), shape=(4, 2)).build(),
     {"pipeline_parallel": PP()}, "serves pipeline_parallel"),
], ids=["unknown_name", "missing_axis", "pipe_axis"])
def test_refusals_name_the_rule(rules, mesh, parts, text):
    with pytest.raises(errors.PlanError) as raised:
        _layout(rules, mesh=mesh, **parts)
    assert text in str(raised.value) and f"plan.logical_axis_rules[{next(iter(rules))!r}]" in \
        str(raised.value)


def test_a_model_without_logical_names_refuses_rules_that_split():
    plain = {"w": ParameterSpec(shape=(8, 8), dtype=jnp.float32)}
    with pytest.raises(errors.PlanError, match="no param of this model names any logical axis"):
        Plan(data_parallel=DP(), logical_axis_rules={"embed": "data"}).layout(plain, DATA)
    # A rule that keeps a name whole asks for nothing: a model without it is fine.
    Plan(data_parallel=DP(), logical_axis_rules={"embed": None}).layout(plain, DATA)


def test_the_data_axis_under_hsdp_is_refused():
    mesh = MeshSpec(axes=("data", "fsdp"), shape=(2, 4)).build()
    with pytest.raises(errors.PlanError) as raised:
        _layout({"embed": "data"}, mesh=mesh, zero=ZeRO(stage=3, axis="fsdp"))
    assert "copies of the state under HSDP" in str(raised.value) and "'fsdp'" in str(raised.value)
    assert _specs(_layout({"embed": "fsdp"}, mesh=mesh, zero=ZeRO(
        stage=3, axis="fsdp", min_shard_size=0)).param_specs)["table"] == P(None, "fsdp")


def test_rules_reach_a_decoders_stacked_params_on_their_own_dimensions():
    """Titanax's layers name their dimensions too (a Repeat stack's first one unnamed): a rule
    puts the ZeRO split on the named dimension, another keeps the vocabulary whole under TP."""
    from titanax.parallel import axis_binding  # pylint: disable=import-outside-toplevel
    from titanax.modules.models.decoder import Decoder  # pylint: disable=import-outside-toplevel
    model = Decoder.default_config().set(name="d", vocab_size=64, max_seq_len=16, num_layers=2,
                                         model_dim=32, num_heads=4, num_kv_heads=2,
                                         hidden_dim=64).instantiate()
    plan = Plan(data_parallel=DP(), zero=ZeRO(stage=3, min_shard_size=0),
                logical_axis_rules={"mlp": "data"})
    with axis_binding.bound(plan.axis_binding()):
        layout = plan.layout(model.create_parameter_specs_recursively(), DATA)
    mlp = _specs(layout.param_specs)["decoder"]["layer"]["mlp"]
    assert mlp["gate_up_weight"] == P(None, None, None, "data"), mlp  # [L, D, 2, F]: on F.
    assert mlp["down"]["weight"] == P(None, "data"), mlp              # [L, F, D]: on F.
    # Kept whole by a rule, F leaves the split to an unnamed dimension: D, not F (a name on
    # the wrong dimension would keep the "2" whole and let the split land on F).
    whole = Plan(data_parallel=DP(), zero=ZeRO(stage=3, min_shard_size=0),
                 logical_axis_rules={"mlp": None})
    with axis_binding.bound(whole.axis_binding()):
        kept = whole.layout(model.create_parameter_specs_recursively(), DATA)
    assert _specs(kept.param_specs)["decoder"]["layer"]["mlp"]["gate_up_weight"] == \
        P(None, "data"), kept.param_specs
    mesh = MeshSpec(axes=("data", "model"), shape=(4, 2)).build()
    tp = Plan(data_parallel=DP(), tensor_parallel=TP(), logical_axis_rules={"vocab": None})
    with axis_binding.bound(tp.axis_binding()):
        specs = _specs(tp.layout(model.create_parameter_specs_recursively(), mesh).param_specs)
    assert specs["token_emb"]["weight"] == P() and specs["lm_head"]["weight"] == P()
    assert specs["decoder"]["layer"]["attn"]["q_weight"] == P(None, None, "model")


def test_rules_cannot_move_what_a_plan_part_splits_nor_split_kv_heads_under_whole_queries():
    from titanax.modules.models.decoder import Decoder  # pylint: disable=import-outside-toplevel
    for name in ("sequence", "residual_sequence", "experts", "stages"):
        with pytest.raises(errors.ConfigError) as raised:
            Plan(data_parallel=DP(), logical_axis_rules={name: None})
        assert f"logical_axis_rules[{name!r}]" in str(raised.value)
    model = Decoder.default_config().set(name="d", vocab_size=64, max_seq_len=16, num_layers=2,
                                         model_dim=32, num_heads=4, num_kv_heads=2,
                                         hidden_dim=64).instantiate()
    mesh = MeshSpec(axes=("data", "model"), shape=(4, 2)).build()
    plan = Plan(data_parallel=DP(), tensor_parallel=TP(), logical_axis_rules={"heads": None})
    with pytest.raises(errors.PlanError) as raised:
        plan.check_model(model, mesh)
    assert raised.value.path == "plan.logical_axis_rules['heads']"
    Plan(data_parallel=DP(), tensor_parallel=TP(),
         logical_axis_rules={"heads": None, "kv_heads": None}).check_model(model, mesh)
