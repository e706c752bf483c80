"""The compiled step's communication, checked on its HLO (DESIGN section 3's invariant)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from titanax.modules.models.decoder import gpt_config
from titanax.observe import hlo
from titanax.parallel import collectives
from titanax.parallel.plan import DP, TP, Plan
from titanax.runtime.mesh import MeshSpec
from titanax.train.engine import Engine
from tests.numerics import assert_close
from tests.train import helpers


@functools.lru_cache(maxsize=None)
def _compiled(kind: str):
    if kind == "dp8_acc4":
        engine = helpers.gpt_engine(data=8, accumulate=4)
        batch = helpers.text_batches(batch_size=32)[0]
    else:
        engine = helpers.gpt_engine(data=4, model_axis=2, accumulate=4)
        batch = helpers.text_batches(batch_size=16)[0]
    engine.init_state()
    engine.compile(example_batch=batch)
    return engine, engine.collectives(), engine._train_step.latest.as_text()


def test_dp8_accumulate4_reduces_gradients_once_outside_every_loop():
    engine, ops, text = _compiled("dp8_acc4")
    assert " while(" in text, "the microbatch/layer loops were expected in the HLO"
    data_ops = [op for op in ops if "data" in op.axes]
    assert data_ops and not any(op.in_loop for op in data_ops)
    param_bytes = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(
        jax.device_get(engine.state.params)))
    gradient_reductions = [op for op in data_ops if op.op == "all-reduce"
                           and op.bytes >= param_bytes / 2]
    assert len(gradient_reductions) == 1, hlo.format_report(ops)
    assert gradient_reductions[0].bytes >= param_bytes


def test_dp_tp_only_model_axis_collectives_inside_loops():
    _, ops, _ = _compiled("dp4_tp2_acc4")
    in_loop = [op for op in ops if op.in_loop]
    assert in_loop, "TP activation collectives should run inside the layer/microbatch loops"
    assert all(op.axes == ("model",) for op in in_loop), hlo.format_report(in_loop)
    assert any("data" in op.axes for op in ops)


def test_dp_tp_step_crosses_the_data_axis_once_and_the_model_axis_once_after_the_loop():
    """The reducer's promise: one data all-reduce carrying every gradient and the metrics, one
    model all-reduce carrying TP-replicated gradients, the norm's squares and the metrics."""
    engine, ops, _ = _compiled("dp4_tp2_acc4")
    data_ops = [op for op in ops if "data" in op.axes]
    assert len(data_ops) == 1 and data_ops[0].axes == ("data",), hlo.format_report(ops)
    local_bytes = sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(engine.state.params)
                      for s in leaf.addressable_shards if s.device == jax.devices()[0])
    assert data_ops[0].bytes >= local_bytes  # All gradients (and the metrics) in one.
    after_loop = [op for op in ops if not op.in_loop and "transpose" not in op.source
                  and "jvp" not in op.source]
    assert [op.axes for op in after_loop] == [("data",), ("model",)], hlo.format_report(ops)


def test_report_catches_a_per_microbatch_reduction():
    """Negative control: grads of *replicated* params inside a scan all-reduce every microbatch."""
    mesh = MeshSpec(axes=("data",)).build()

    def naive(w, xs):
        def body(acc, x):
            return acc + jax.grad(lambda v: jnp.sum((x @ v) ** 2))(w), None
        grads, _ = jax.lax.scan(body, collectives.cast_varying(jnp.zeros_like(w), "data"), xs)
        return collectives.pmean(grads, "data")

    fn = jax.jit(jax.shard_map(naive, mesh=mesh, in_specs=(P(), P(None, "data")),
                               out_specs=P()))
    text = fn.lower(jnp.ones((4, 4)), jnp.ones((4, 8, 4))).compile().as_text()
    ops = hlo.collectives_report(text, mesh)
    assert any(op.in_loop and op.axes == ("data",) for op in ops), hlo.format_report(ops)


def test_iota_and_mesh_replica_group_formats():
    mesh = MeshSpec(axes=("data", "model"), shape=(4, 2)).build()
    text = "\n".join([
        "ENTRY %main (p: f32[8]) -> f32[8] {",
        "  %a = f32[8]{0} all-reduce(%p), replica_groups=[4,2]<=[8], to_apply=%add",
        "  %b = f32[8]{0} all-reduce(%a), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add",
        "  %c = f32[8]{0} all-reduce(%b), replica_groups=mesh['data'=4,'model'=2] {'data'}",
        "  ROOT %d = f32[8]{0} collective-permute(%c), source_target_pairs={{0,2},{2,4},{4,6}}",
        "}"])
    ops = hlo.collectives_report(text, mesh)
    assert [op.axes for op in ops] == [("model",), ("data",), ("data",), ("data",)]
    assert all(op.bytes == 32 and not op.in_loop for op in ops)


def _tp_engine(*, data: int, model: int, rules=None):
    """The tiny GPT of helpers.gpt_engine with TP declared in the plan only (no model.tp_axis)."""
    cfg = Engine.default_config().set(
        mesh=helpers.mesh((data, model), ("data", "model")),
        plan=Plan.default_config().set(
            data_parallel=DP.default_config(),
            tensor_parallel=TP.default_config().set(rules=rules or {})),
        model=gpt_config().set(name="gpt", vocab_size=256, max_seq_len=16, num_layers=2,
                                       model_dim=32, num_heads=4),
        learner=helpers.sgd(0.1), loggers=[], log_every=1000)
    engine = cfg.instantiate()
    engine.init_state()
    engine.compile(example_batch=helpers.text_batches(batch_size=16)[0])
    return engine


def test_a_size_1_model_axis_compiles_to_the_data_parallel_step():
    """TP declared on data=8 x model=1: no collective over the size-1 axis, and exactly the
    collectives of the same model without TP."""
    with_tp = _tp_engine(data=8, model=1).collectives()
    assert with_tp and not any("model" in op.axes for op in with_tp), hlo.format_report(with_tp)
    plain = helpers.gpt_engine(data=8)
    plain.init_state()
    plain.compile(example_batch=helpers.text_batches(batch_size=16)[0])
    assert sorted((op.op, op.axes) for op in with_tp) == \
        sorted((op.op, op.axes) for op in plain.collectives())


def test_a_replicated_embedding_and_head_by_rule_move_nothing_for_the_vocabulary():
    """A rule keeping the (tied) embedding / head whole on every device removes the vocab-
    parallel collectives; the step still trains like one device."""
    split = _tp_engine(data=4, model=2)
    whole = _tp_engine(data=4, model=2, rules={"**/token_emb/weight": (None, None)})
    assert tuple(whole.param_specs["token_emb"]["weight"]) in ((), (None, None))
    vocab_ops = [op for op in split.collectives() if "token_emb" in op.layer]
    assert vocab_ops, hlo.format_report(split.collectives())
    assert not [op for op in whole.collectives() if "token_emb" in op.layer], \
        hlo.format_report(whole.collectives())
    model_ops = lambda e: [op for op in e.collectives() if op.axes == ("model",)]  # noqa: E731
    assert len(model_ops(whole)) < len(model_ops(split))
    batch = helpers.text_batches(batch_size=16)[0]
    losses = [float(engine.train_step(batch)["loss"]) for engine in (split, whole)]
    assert_close(losses[1], losses[0], what="loss with the head split and whole")


def test_every_collective_names_its_layer_and_pass():
    _, ops, _ = _compiled("dp4_tp2_acc4")
    assert all(op.pass_name in ("forward", "backward", "step") for op in ops)
    assert all(op.layer for op in ops), hlo.format_report(ops)
    passes = {(op.pass_name, "/".join(op.layer.split("/")[:2])) for op in ops}
    assert {("forward", "gpt/decoder"), ("backward", "gpt/decoder"),
            ("forward", "gpt/token_emb")} <= passes, passes
    reductions = [op for op in ops if "data" in op.axes]
    assert [op.layer for op in reductions] == ["gradient_reduction"], hlo.format_report(ops)
    assert "gradient_reduction" in hlo.format_report(ops)
