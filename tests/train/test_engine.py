"""Engine behaviour: one compile for 100 steps, the recompile guard, bad inputs, hand-written
steps, evaluation, loggers and the explain report."""

import csv
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from titanax import errors
from titanax.parallel import collectives
from titanax.parallel.plan import DP, TP, Plan
from titanax.runtime.mesh import MeshSpec
from titanax.train.engine import Engine
from titanax.train.user_step import step_fn
from tests.numerics import assert_close
from tests.train import helpers


def test_100_steps_compile_the_train_step_once():
    engine = helpers.mnist_engine(data=8)
    batches = helpers.mnist_batches()
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    engine.fit(data=iter([batches[0]]), steps=1)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        engine.fit(data=iter(batches * 5), steps=100)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert engine._train_step.compile_count == 1
    assert compiles == [], f"{len(compiles)} backend compilations during steps 2..100"
    assert int(engine.state.step) == 100


def test_recompile_guard_names_the_changed_input():
    engine = helpers.mnist_engine(data=8)
    batch = helpers.mnist_batches()[0]
    engine.fit(data=iter([batch]), steps=1)
    smaller = {k: v[:32] for k, v in batch.items()}
    with pytest.raises(errors.RecompileError) as info:
        engine.train_step(smaller)
    assert "[1]['image']: (64, 28, 28) float32 -> (32, 28, 28) float32" in info.value.message


def test_batch_not_divisible_by_data_size_times_accumulation():
    engine = helpers.mnist_engine(data=8, accumulate=4)
    engine.init_state()
    batch = {k: v[:48] for k, v in helpers.mnist_batches()[0].items()}
    with pytest.raises(errors.PlanError) as info:
        engine.train_step(batch)
    assert "48 is not divisible by data-axis size 8 x accumulate_steps 4 = 32" in info.value.message


def test_mesh_larger_than_the_device_count():
    engine = Engine(mesh=MeshSpec(axes=("data",), shape=(16,)), plan=Plan(data_parallel=DP()),
                    loggers=[])
    with pytest.raises(errors.MeshError) as info:
        engine.build()
    assert "needs 16 devices but 8 are available" in info.value.message


def _linear_params():
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(4, 2)).astype(np.float32), "b": np.zeros(2, np.float32)}


def _linear_batches(count=5, size=16):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(count, size, 4)).astype(np.float32)
    return [{"x": x[i], "y": x[i] @ np.ones((4, 2), np.float32)} for i in range(count)]


def _loss(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)


def test_a_param_no_tp_rule_matches():
    engine = Engine(mesh=MeshSpec(axes=("data", "model"), shape=(None, 2)),
                    plan=Plan(data_parallel=DP(), tensor_parallel=TP(rules={"w": (None, "model")})),
                    optimizer=optax.sgd(0.1), loggers=[])

    @step_fn
    def train_step(state, batch):
        return state, {}

    with pytest.raises(errors.ShardingError) as info:
        engine.fit(train_step, data=iter(_linear_batches()), steps=1, params=_linear_params())
    assert info.value.path == "b" and "match no sharding rule" in info.value.message


def test_a_collective_on_an_axis_the_plan_does_not_have():
    engine = Engine(mesh=MeshSpec(axes=("data",)), plan=Plan(data_parallel=DP()),
                    optimizer=optax.sgd(0.1), loggers=[])

    @step_fn
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(_loss)(state.params, batch)
        grads = collectives.psum(grads, axis="model")
        return state.apply_gradients(grads=grads), {"loss": loss}

    with pytest.raises(errors.CollectiveError) as info:
        engine.fit(train_step, data=iter(_linear_batches()), steps=1, params=_linear_params())
    assert "'model' does not exist" in info.value.message and "data" in info.value.suggestion


def test_a_step_that_forgets_the_gradient_reduction_is_rejected():
    engine = Engine(mesh=MeshSpec(axes=("data",)), plan=Plan(data_parallel=DP()),
                    optimizer=optax.sgd(0.1), loggers=[])

    @step_fn
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(_loss)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}

    with pytest.raises(errors.StepError) as info:
        engine.fit(train_step, data=iter(_linear_batches()), steps=1, params=_linear_params())
    assert info.value.path == "mesh axis 'data'"
    assert "never reduced" in info.value.message and "pmean" in info.value.suggestion


def _seed_style_run(data: int):
    engine = Engine(mesh=MeshSpec(devices=list(range(data)), axes=("data",)),
                    plan=Plan(data_parallel=DP(axis="data")), optimizer=optax.sgd(0.1),
                    loggers=[])

    @step_fn
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(_loss)(state.params, batch)
        grads = collectives.pmean(grads, axis="data")
        return state.apply_gradients(grads=grads), {"loss": loss}

    engine.fit(train_step, data=iter(_linear_batches()), steps=5, params=_linear_params())
    return [h["loss"] for h in engine.history], jax.device_get(engine.state.params)


def test_hand_written_step_matches_one_device_and_plain_jax():
    losses_8, params_8 = _seed_style_run(8)
    losses_1, params_1 = _seed_style_run(1)
    assert_close(losses_8, losses_1, what="losses")
    params = _linear_params()
    for batch in _linear_batches():  # The same SGD in plain jax.
        grads = jax.grad(_loss)(params, batch)
        params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    assert_close(dict(params_8), params, what="params")


def test_eval_loggers_and_explain(tmp_path):
    from titanax.observe.loggers import CSV, Basic, TensorBoard  # pylint: disable=import-outside-toplevel
    engine = helpers.mnist_engine(data=8)
    engine.trainer_dir = str(tmp_path)
    engine._loggers = [Basic(trainer_dir=str(tmp_path)), CSV(trainer_dir=str(tmp_path)),
                       TensorBoard(trainer_dir=str(tmp_path))]
    engine.fit(data=iter(helpers.mnist_batches()), steps=4)
    metrics = engine.eval(data=helpers.mnist_batches()[:3])
    assert set(metrics) >= {"loss", "accuracy", "count"} and metrics["count"] == 192
    for logger in engine.loggers():
        logger.log_dict({"eval/accuracy": metrics["accuracy"]}, 4)
        logger.close()
    with open(tmp_path / "metrics.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [row["step"] for row in rows] == ["0", "4", "4"]  # One table, one header.
    assert rows[0]["compile_time_s"] and not rows[0]["loss"]
    assert rows[1]["loss"] and rows[1]["grad_norm"] and not rows[1]["eval/accuracy"]
    assert float(rows[2]["eval/accuracy"]) == metrics["accuracy"]
    assert any(name.startswith("events.out.tfevents")
               for name in os.listdir(tmp_path / "tensorboard"))
    text = engine.explain()
    assert "mesh data=8" in text and "dense0/weight" in text and "all-reduce  data" in text


def test_nan_policy_skip_keeps_the_state():
    from tests.train.overflow_model import overflow_batches, overflow_engine  # pylint: disable=import-outside-toplevel
    engine = overflow_engine(helpers.fp16_precision(loss_scaling=False), nan_policy="skip")
    before = jax.device_get(engine.init_state().params)
    engine.fit(data=iter(overflow_batches()), steps=3)
    assert [h["update_applied"] for h in engine.history] == [0.0, 0.0, 0.0]
    after = jax.device_get(engine.state.params)
    np.testing.assert_array_equal(after["proj"]["weight"], before["proj"]["weight"])


def test_unsynced_metrics_report_data_shard_0():
    from titanax.modules import functional  # pylint: disable=import-outside-toplevel
    from titanax.parallel.plan import DP as DataParallel  # pylint: disable=import-outside-toplevel
    cfg = helpers.mnist_engine(data=8).config.clone()
    cfg.plan.data_parallel = DataParallel.default_config().set(sync_metrics=False)
    unsynced = cfg.instantiate()
    initial = jax.device_get(unsynced.init_state().params)
    batch = helpers.mnist_batches()[0]
    unsynced.fit(data=iter([batch]), steps=1)
    shard_0 = {k: v[:8] for k, v in batch.items()}  # The rows of data-axis position 0.
    (want, _), _ = functional(unsynced.model, None, initial, (shard_0,), is_training=False)
    assert unsynced.history[0]["aux/num_examples"] == 8.0  # One shard's examples, not 64.
    assert_close(unsynced.history[0]["loss"], want, what="data shard 0's loss")


def test_dropout_masks_differ_across_data_shards():
    from titanax.modules.base_layer import BaseLayer  # pylint: disable=import-outside-toplevel
    from titanax.modules.layers.dropout import Dropout  # pylint: disable=import-outside-toplevel
    from titanax.parallel.plan import DP as DataParallel  # pylint: disable=import-outside-toplevel

    class Probe(BaseLayer):
        def __init__(self, cfg=None, *, parent=None, **fields):
            super().__init__(cfg, parent=parent, **fields)
            self._add_child("drop", Dropout.default_config().set(rate=0.5))

        def _create_layer_parameter_specs(self):
            from titanax.modules import ParameterSpec  # pylint: disable=import-outside-toplevel
            return {"w": ParameterSpec(shape=(1,))}

        def forward(self, batch):
            kept = self.drop(jnp.ones_like(batch["x"]))[0, :20]
            # Weighting element i by 2**-i makes the sum encode the mask bit by bit.
            code = jnp.sum(kept * 2.0 ** -jnp.arange(20, dtype=jnp.float32))
            return code + 0.0 * self.parameters["w"][0], {}

    cfg = helpers.mnist_engine(data=8).config.clone()
    cfg.model = Probe.default_config().set(name="probe")
    cfg.plan.data_parallel = DataParallel.default_config().set(sync_metrics=False)
    engine = cfg.instantiate()
    engine.init_state()
    metrics = jax.device_get(engine.train_step({"x": np.ones((8, 64), np.float32)}))
    per_shard = np.asarray(metrics["loss"]).reshape(-1)
    assert per_shard.shape == (8,)
    assert len(set(per_shard.tolist())) == 8, per_shard  # Identical inputs, 8 different masks.


def test_pipeline_plans_the_engine_cannot_run_are_refused():
    from titanax.parallel.plan import PP  # pylint: disable=import-outside-toplevel
    cfg = helpers.mnist_engine(data=8).config.clone()
    cfg.mesh = helpers.mesh((4, 2), ("data", "pipe"))
    for pp in (PP.default_config(), PP.default_config().set(schedule="circular",
                                                             virtual_stages=2)):
        cfg.plan.pipeline_parallel = pp  # An MLP has no stacked layers to split.
        with pytest.raises(errors.PlanError) as info:
            cfg.instantiate().build()
        assert info.value.path == "plan.pipeline_parallel.stacked_layers"


def test_plan_that_forbids_reduce_scatter_refuses_sequence_parallelism():
    cfg = helpers.gpt_engine(data=4, model_axis=2).config.clone()
    cfg.plan.tensor_parallel.sequence_parallel = True
    cfg.instantiate().build()  # Allowed by default.
    cfg.plan.tensor_parallel.prefer_reduce_scatter = False
    with pytest.raises(errors.ConfigError) as info:
        cfg.instantiate().build()
    assert "plan.tensor_parallel.sequence_parallel" in str(info.value)


def _linear_engine():
    return Engine(mesh=MeshSpec(axes=("data",)), plan=Plan(data_parallel=DP()),
                  optimizer=optax.sgd(0.1), loggers=[])


def _bad_steps():
    def grads_of(state, batch):
        loss, grads = jax.value_and_grad(_loss)(state.params, batch)
        return loss, collectives.pmean(grads, axis="data")

    def only_metrics(state, batch):
        loss, _ = grads_of(state, batch)
        return {"loss": loss}

    def state_and_loss(state, batch):
        loss, grads = grads_of(state, batch)
        return state.apply_gradients(grads=grads), loss

    def only_state(state, batch):
        _, grads = grads_of(state, batch)
        return state.apply_gradients(grads=grads)

    def vector_metric(state, batch):
        loss, grads = grads_of(state, batch)
        return state.apply_gradients(grads=grads), {"loss": loss, "per_row": batch["x"][:, 0]}

    return {"a dict": (only_metrics, "returned a dict"),
            "(state, loss)": (state_and_loss, "metrics are a jax.Array"),
            "the state": (only_state, "returned a TrainState"),
            "a vector metric": (vector_metric, "metric 'per_row' has shape")}


@pytest.mark.parametrize("case", ["a dict", "(state, loss)", "the state", "a vector metric"])
def test_a_step_returning_the_wrong_things_is_a_step_error(case):
    fn, message = _bad_steps()[case]
    with pytest.raises(errors.StepError) as info:
        _linear_engine().fit(step_fn(fn), data=iter(_linear_batches()), steps=1,
                             params=_linear_params())
    assert message in info.value.message and fn.__qualname__ in info.value.path
    assert "apply_gradients" in info.value.suggestion or "jnp.mean" in info.value.suggestion


@pytest.mark.parametrize("steps", [-5, 2.5])
def test_fit_refuses_a_negative_or_fractional_step_count(steps):
    with pytest.raises(errors.StepError) as info:
        _linear_engine().fit(data=iter(_linear_batches()), steps=steps, params=_linear_params())
    assert info.value.path == "fit(steps=...)" and repr(steps) in info.value.message


def test_an_eval_batch_that_does_not_split_fails_before_the_first_step():
    from titanax.data.pipeline import Input  # pylint: disable=import-outside-toplevel
    from titanax.data.sources import MNIST  # pylint: disable=import-outside-toplevel
    from titanax.train.evaler import Evaler  # pylint: disable=import-outside-toplevel
    mnist = lambda batch: Input.default_config().set(  # noqa: E731
        source=MNIST.default_config(), global_batch_size=batch)
    engine = helpers.mnist_engine(data=8, train_input=mnist(64), max_steps=5, evalers={
        "test": Evaler.default_config().set(input=mnist(12), every_n_steps=5)})
    with pytest.raises(errors.PlanError) as info:
        engine.fit()
    assert info.value.path == "evalers['test'].input.global_batch_size"
    assert engine.state is None and not engine.history  # Nothing was spent on training.


def test_an_evaler_with_fewer_rows_than_its_batches_reads_them_once(tmp_path, caplog):
    """20 held-out rows, num_batches=5 of 16: one pass of 2 batches (the last padded), every
    trained token counted once -- not 80 rows with some counted twice."""
    import json  # pylint: disable=import-outside-toplevel
    from titanax.data.packed import PackedDocuments  # pylint: disable=import-outside-toplevel
    from titanax.data.pipeline import Input  # pylint: disable=import-outside-toplevel
    from titanax.train.evaler import Evaler  # pylint: disable=import-outside-toplevel
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"held out {i:02d}."}) + "\n"
                            for i in range(20)))
    source = PackedDocuments.default_config().set(files=[str(path)], seq_len=16, pack=False,
                                                  held_out_fraction=0.0)
    evaler = Evaler.default_config().set(
        input=Input.default_config().set(source=source, global_batch_size=16), num_batches=5)
    caplog.set_level("INFO", logger="titanax")  # (Information, not a warning.)
    engine = helpers.gpt_engine(data=8, evalers={"heldout": evaler})
    engine.fit(data=iter(helpers.text_batches(batch_size=16, count=1)), steps=1)
    results = engine.run_evalers(1, only_due=False)
    assert results["heldout"]["count"] == source.instantiate().report.trained_tokens == 20 * 11
    assert "fewer than num_batches=5 x 16: evaluating one pass (2 batch(es)" in caplog.text
    # More rows than num_batches reads: the rows left unscored are counted in a warning, once,
    # when the run starts (before any evaluation).
    caplog.clear()
    fewer = helpers.gpt_engine(data=8, evalers={"heldout": evaler.clone(num_batches=1)})
    fewer.fit(data=iter(helpers.text_batches(batch_size=16, count=1)), steps=1)
    at_start = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    for step in (1, 2):
        assert fewer.run_evalers(step, only_due=False)["heldout"]["count"] == 16 * 11
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == at_start == ["evalers['heldout'] scores 16 of its 20 held-out rows (num_batches=1 x "
                      "global_batch_size 16); evalers['heldout'].num_batches=None scores them "
                      "all, in one pass"], warned


def test_a_hand_written_step_under_a_split_state_or_a_pipeline_is_refused():
    @step_fn
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(_loss)(state.params, batch)
        return state.apply_gradients(grads=collectives.pmean(grads, axis="data")), {"loss": loss}

    with pytest.raises(errors.PlanError, match="ZeRO / FSDP lay out") as info:
        helpers.gpt_engine(data=8, zero=True).fit(train_step, data=iter(_linear_batches()),
                                                  steps=1)
    assert info.value.path == "plan.zero"
    from titanax.parallel.plan import PP  # pylint: disable=import-outside-toplevel
    cfg = helpers.gpt_engine(data=4).config.clone()
    cfg.mesh = helpers.mesh((4, 2), ("data", "pipe"))
    cfg.plan.pipeline_parallel = PP.default_config()
    with pytest.raises(errors.PlanError, match="cannot run a pipeline") as info:
        cfg.instantiate().fit(train_step, data=iter(_linear_batches()), steps=1)
    assert info.value.path == "plan.pipeline_parallel"
