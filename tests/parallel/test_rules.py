"""Tests of sharding rules: patterns, first match, replicated, unmatched, fit checks."""

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from titanax import errors
from titanax.parallel import rules as R
from titanax.parallel.plan import DP, TP, Plan

MESH_SHAPE = {"data": 4, "model": 2}


@pytest.mark.parametrize("pattern,path,matches", [
    ("decoder/*/weight", "decoder/mlp/weight", True),
    ("decoder/*/weight", "decoder/mlp/wi/weight", False),
    ("**/weight", "decoder/mlp/wi/weight", True),
    ("**/weight", "weight", True),
    ("decoder/**", "decoder/a/b", True),
    ("decoder/**", "decoder", True),
    ("decoder/**/qkv/*", "decoder/layers/attn/qkv/weight", True),
    ("decoder/**/qkv/*", "decoder/qkv/weight", True),
    ("attn/qkv/weight", "decoder/attn/qkv/weight", False),
    ("layer_?/w", "layer_3/w", True),
    ("re:.*/(wi|wo)/weight", "decoder/mlp/wo/weight", True),
    ("re:.*/(wi|wo)/weight", "decoder/mlp/wx/weight", False),
    ("a.b", "axb", False),
])
def test_pattern_matching(pattern, path, matches):
    assert R.Rule(pattern, ()).matches(path) is matches


def test_bad_regex():
    with pytest.raises(errors.ShardingError) as info:
        R.compile_pattern("re:(")
    assert info.value.path == "rule 're:('"


def test_first_match_wins_and_explicit_replicated():
    rules = R.normalize_rules({"**/wi/weight": (None, "model"), "**/weight": ("model", None),
                               "**/bias": (None,)})
    specs = R.resolve_specs({"mlp/wi/weight": (8, 4), "mlp/wo/weight": (4, 8), "mlp/wi/bias": (4,)},
                            rules, {}, MESH_SHAPE, undeclared_replicated=False)
    assert specs == {"mlp/wi/weight": P(None, "model"), "mlp/wo/weight": P("model", None),
                     "mlp/wi/bias": P(None)}


def test_unmatched_params_are_all_listed_with_rules_tried():
    rules = R.normalize_rules([("**/qkv/weight", (None, "model"))])
    with pytest.raises(errors.ShardingError) as info:
        R.resolve_specs({"a/qkv/weight": (4, 4), "a/ln/scale": (4,), "emb/weight": (8, 4)},
                        rules, {}, MESH_SHAPE, undeclared_replicated=False)
    assert "2 param(s)" in info.value.message
    assert "a/ln/scale, emb/weight" in info.value.message
    assert "'**/qkv/weight'" in info.value.message


@pytest.mark.parametrize("spec,shape,text", [
    (("model", None), (3, 4), "dimension 0 (size 3) of shape (3, 4) is not divisible by 2"),
    ((("data", "model"),), (12,), "not divisible by 8"),
    ((None, None, "model"), (4, 4), "has 3 entries but the param has rank 2"),
    (("pipe",), (4,), "mesh axis 'pipe', which the mesh does not have"),
    (("model", "model"), (4, 4), "uses mesh axis 'model' twice"),
])
def test_spec_that_does_not_fit_names_param_and_rule(spec, shape, text):
    rules = R.normalize_rules({"w": spec})
    with pytest.raises(errors.ShardingError) as info:
        R.resolve_specs({"w": shape}, rules, {}, MESH_SHAPE, undeclared_replicated=False)
    assert text in info.value.message and info.value.path == "w"
    assert "rule 'w'" in info.value.message


def test_bad_rule_values():
    with pytest.raises(errors.ShardingError):
        R.normalize_rules({"w": "model"})


@dataclasses.dataclass
class FakeParameterSpec:
    shape: Tuple[int, ...]
    dtype: object = jnp.float32
    mesh_axes: Optional[Tuple] = None


def test_build_param_specs_combines_rules_and_layer_defaults():
    mesh = jax.make_mesh((4, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params = {"attn": {"qkv": FakeParameterSpec((8, 12), mesh_axes=(None, "model"))},
              "mlp": {"wi": FakeParameterSpec((8, 16), mesh_axes=(None, "model"))},
              "norm": {"scale": FakeParameterSpec((8,), mesh_axes=(None,))},
              "other": jax.ShapeDtypeStruct((4,), jnp.float32)}
    tp_plan = Plan(data_parallel=DP(), tensor_parallel=TP(rules={"mlp/wi": ("model", None),
                                                                 "other": (None,)}))
    specs = R.build_param_specs(params, tp_plan, mesh)
    assert specs == {"attn": {"qkv": P(None, "model")}, "mlp": {"wi": P("model", None)},
                     "norm": {"scale": P(None)}, "other": P(None)}
    with pytest.raises(errors.ShardingError) as info:
        R.build_param_specs(params, Plan(data_parallel=DP(), tensor_parallel=TP()), mesh)
    assert info.value.path == "other"
    dp_only = R.build_param_specs(params, Plan(data_parallel=DP()), mesh)
    assert dp_only["other"] == P() and dp_only["attn"]["qkv"] == P(None, "model")


def test_local_shape_and_spec_axes():
    assert R.local_shape((8, 6), P(("data", "model"), None), MESH_SHAPE) == (1, 6)
    assert R.spec_axes(P(("data", "model"), None, "x")) == ("data", "model", "x")
