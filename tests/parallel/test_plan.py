"""Tests of Plan composition, validation against a mesh, and the describe() table."""

import jax
import jax.numpy as jnp
import pytest

from titanax import errors
from titanax.parallel.context_parallel import CP
from titanax.parallel.expert_parallel import EP
from titanax.parallel.plan import DP, PP, TP, Plan, ZeRO
from titanax.runtime.mesh import MeshSpec

MESH = MeshSpec(axes=("data", "model"), shape=(4, 2)).build()
PIPE_MESH = MeshSpec(axes=("data", "pipe"), shape=(2, 4)).build()


def test_composition_from_components_and_from_config():
    plan = Plan(data_parallel=DP(axis="data", accumulate_steps=2), tensor_parallel=TP(axis="model"))
    assert (plan.dp_axis, plan.tp_axis, plan.pp_axis, plan.accumulate_steps) == \
        ("data", "model", None, 2)
    assert plan.roles() == {"data": "data_parallel", "model": "tensor_parallel"}
    cfg = Plan.default_config()
    cfg.data_parallel = DP.default_config()
    assert cfg.instantiate().validate(MeshSpec(axes=("data",)).build()).dp_axis == "data"
    assert isinstance(plan.data_parallel, DP) and plan.zero is None


def test_hsdp_splits_the_batch_over_data_and_the_zero_axis():
    mesh = MeshSpec(axes=("data", "fsdp"), shape=(2, 4)).build()
    plan = Plan(data_parallel=DP(), zero=ZeRO(stage=3, axis="fsdp")).validate(
        mesh, global_batch_size=8)
    assert plan.hsdp and plan.batch_axes == ("data", "fsdp") and plan.batch_axis == ("data", "fsdp")
    assert plan.roles() == {"data": "data_parallel", "fsdp": "zero"}
    assert plan.batch_shards(mesh) == 8
    with pytest.raises(errors.PlanError) as info:  # 2 x 4 batch shards, not 2.
        plan.check_batch_size(4, mesh)
    assert "8 batch shards (mesh axes 'data' x 'fsdp')" in info.value.message
    plain = Plan(data_parallel=DP(), zero=ZeRO(stage=3, axis="data"))
    assert not plain.hsdp and plain.batch_axis == "data"


def test_valid_plans_pass():
    Plan(data_parallel=DP(), tensor_parallel=TP()).validate(MESH, global_batch_size=16)
    Plan(data_parallel=DP(), pipeline_parallel=PP(microbatch_size=2)).validate(
        PIPE_MESH, global_batch_size=16)
    Plan(data_parallel=DP(), zero=ZeRO()).validate(MeshSpec(axes=("data",)).build())
    # Circular runs any M >= S, not only multiples of S (M = 6 for S = 4 here).
    Plan(data_parallel=DP(), pipeline_parallel=PP(schedule="circular", virtual_stages=2)
         ).validate(PIPE_MESH, global_batch_size=12)


@pytest.mark.parametrize("make,path,text", [
    (lambda: Plan(data_parallel=DP(axis="batch"), tensor_parallel=TP()),
     "plan.data_parallel.axis", "mesh axis 'batch', which the mesh does not have"),
    (lambda: Plan(data_parallel=DP()),
     "mesh axis 'model'", "has no role in the plan"),
    (lambda: Plan(data_parallel=DP(), tensor_parallel=TP(), pipeline_parallel=PP(axis="pipe")),
     "plan.pipeline_parallel.axis", "'pipe'"),
    (lambda: Plan(data_parallel=DP(), tensor_parallel=TP(), zero=ZeRO(axis="fsdp")),
     "plan.zero.axis", "mesh axis 'fsdp', which the mesh does not have"),
])
def test_plan_errors_against_the_mesh(make, path, text):
    with pytest.raises(errors.PlanError) as info:
        make().validate(MESH)
    assert info.value.path == path and text in info.value.message


@pytest.mark.parametrize("pp,batch,text", [
    (dict(microbatch_size=4), 16, "2 microbatches for 4 stages"),       # 8 rows per data shard
    (dict(microbatch_size=3), 16, "do not divide the per-data-shard batch of 8"),
    (dict(schedule="circular", virtual_stages=2), 6, "3 microbatches for 4 stages"),
])
def test_pipeline_checks(pp, batch, text):
    plan = Plan(data_parallel=DP(), pipeline_parallel=PP(**pp))
    with pytest.raises(errors.PlanError) as info:
        plan.validate(PIPE_MESH, global_batch_size=batch)
    assert info.value.path == "plan.pipeline_parallel.microbatch_size"
    assert text in info.value.message


def test_pipeline_bubble_per_schedule():
    """(M, ticks, bubble): GPipe / circular by formula, 1F1B from its table."""
    assert PP(schedule="circular", virtual_stages=2).schedule_numbers(
        num_stages=4, local_batch=8) == (8, 19, 3 / 19)
    assert PP(schedule="gpipe").schedule_numbers(num_stages=4, local_batch=8) == (8, 11, 3 / 11)
    count, ticks, bubble = PP(schedule="1f1b").schedule_numbers(num_stages=4, local_batch=8)
    assert (count, ticks) == (8, 22) and abs(bubble - 3 / 11) < 1e-9


def test_batch_divisibility_names_the_numbers():
    plan = Plan(data_parallel=DP(accumulate_steps=4), tensor_parallel=TP())
    plan.validate(MESH, global_batch_size=32)
    with pytest.raises(errors.PlanError) as info:
        plan.validate(MESH, global_batch_size=24)
    assert "24 is not divisible by data-axis size 4 x accumulate_steps 4 = 16" in info.value.message
    assert info.value.path == "plan.data_parallel.accumulate_steps"
    with pytest.raises(errors.PlanError):
        Plan(data_parallel=DP(), tensor_parallel=TP()).validate(MESH, global_batch_size=2)


@pytest.mark.parametrize("cfg_changes,path,text", [
    (dict(data_parallel=DP.default_config().set(accumulate_steps=0)),
     "data_parallel.accumulate_steps", "must be >= 1"),
    (dict(data_parallel=DP.default_config().set(axis="x"),
          tensor_parallel=TP.default_config().set(axis="x")),
     "tensor_parallel.axis", "already serves data_parallel"),
    (dict(zero=ZeRO.default_config()), "zero", "add data_parallel"),
    (dict(data_parallel=DP.default_config(), tensor_parallel=TP.default_config(),
          zero=ZeRO.default_config().set(axis="model")),
     "zero.axis", "already serves tensor_parallel"),
    (dict(pipeline_parallel=PP.default_config().set(microbatch_size=0)),
     "pipeline_parallel.microbatch_size", "must be >= 1"),
    (dict(pipeline_parallel=PP.default_config().set(schedule="gpipe", virtual_stages=2)),
     "pipeline_parallel.virtual_stages", "need schedule='circular'"),
    (dict(pipeline_parallel=PP.default_config().set(checkpoint_ratio=2.0)),
     "pipeline_parallel.checkpoint_ratio", "must be in [0, 1]"),
    (dict(data_parallel=DP.default_config(), expert_parallel=EP.default_config(),
          zero=ZeRO.default_config().set(stage=1, also_over=("expert",))),
     "zero.also_over", "needs stage=3"),
    (dict(data_parallel=DP.default_config(), expert_parallel=EP.default_config(),
          zero=ZeRO.default_config().set(stage=3, grad_sync="per_step", also_over=("expert",))),
     "zero.also_over", "grad_sync='per_microbatch'"),
    (dict(data_parallel=DP.default_config(), tensor_parallel=TP.default_config(),
          zero=ZeRO.default_config().set(stage=3, also_over=("model",))),
     "zero.also_over", "does not split the batch's rows"),
    (dict(data_parallel=DP.default_config(),
          zero=ZeRO.default_config().set(stage=3, also_over=("data",))),
     "zero.also_over", "is the ZeRO axis itself"),
    (dict(data_parallel=DP.default_config(), expert_parallel=EP.default_config(),
          zero=ZeRO.default_config().set(stage=3, also_over=("expert", "expert"))),
     "zero.also_over", "names a mesh axis twice"),
    (dict(data_parallel=DP.default_config(), expert_parallel=EP.default_config(),
          zero=ZeRO.default_config().set(stage=3, axis="fsdp", also_over=("expert",))),
     "zero.also_over", "HSDP"),
    (dict(data_parallel=DP.default_config(), expert_parallel=EP.default_config(),
          pipeline_parallel=PP.default_config(),
          zero=ZeRO.default_config().set(stage=3, also_over=("expert",))),
     "zero.also_over", "a pipeline's"),
])
def test_config_level_plan_errors_have_paths(cfg_changes, path, text):
    cfg = Plan.default_config().set(**cfg_changes)
    with pytest.raises(errors.ConfigValidationError) as info:
        cfg.validate()
    assert any(p.path == path and text in p.message for p in info.value.problems), info.value


def test_describe_table_for_dp_tp():
    params = {"emb": {"weight": jax.ShapeDtypeStruct((64, 32), jnp.float32)},
              "mlp": {"wi": {"weight": jax.ShapeDtypeStruct((32, 128), jnp.float32)},
                      "wo": {"weight": jax.ShapeDtypeStruct((128, 32), jnp.bfloat16)}}}
    plan = Plan(data_parallel=DP(), tensor_parallel=TP(rules={
        "emb/weight": ("model", None), "**/wi/weight": (None, "model"),
        "**/wo/weight": ("model", None)}))
    lines = plan.describe(params, MESH).splitlines()
    assert lines[0] == ("plan over mesh data=4 (data_parallel), model=2 (tensor_parallel); "
                        "accumulate_steps=1")
    assert lines[1].split() == ["param", "global", "shape", "spec", "local", "shape",
                                "bytes/device"]
    row = {line.split()[0]: line for line in lines[2:-1]}
    assert "P(None, 'model')" in row["mlp/wi/weight"] and "(32, 64)" in row["mlp/wi/weight"]
    assert "8.0 KiB" in row["mlp/wi/weight"] and "4.0 KiB" in row["mlp/wo/weight"]
    assert lines[-1] == "total: 3 params, 32.0 KiB global, 16.0 KiB per device"


def _tp_plan(axis="model"):
    return Plan(data_parallel=DP.default_config(),
                tensor_parallel=TP.default_config().set(axis=axis) if axis else None)


def test_the_axis_binding_is_built_once_from_the_plan():
    """Layers name logical dimensions; the plan says which mesh axis holds each: TP binds the
    heads, kv heads, mlp and vocabulary (the residual stream's sequence too with sequence
    parallelism), CP a row's sequence, EP the experts, PP the stages; logical axis rules to
    the TP axis or None override; without TP nothing is split."""
    binding = Plan(data_parallel=DP(), tensor_parallel=TP(axis="tensor", sequence_parallel=True),
                   context_parallel=CP(axis="context", strategy="ring"),
                   logical_axis_rules={"vocab": None}).axis_binding()
    assert binding.table == {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
                             "vocab": None, "residual_sequence": "tensor",
                             "sequence": "context"}
    assert binding.context_strategy == "ring" and binding.tensor_axes() == ("tensor",)
    assert binding.without("sequence").axis("sequence") is None
    assert not any(_tp_plan(None).axis_binding().table.values())
    # No model config names a mesh axis: a GPT is the same config under any plan.
    from titanax.modules.models.decoder import gpt_config  # pylint: disable=import-outside-toplevel
    fields = set(gpt_config().keys())
    assert not fields & {"tp_axis", "sequence_parallel", "cp_axis", "cp_strategy", "ep_axis"}
