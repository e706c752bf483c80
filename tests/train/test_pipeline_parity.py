"""Pipelined GPT training (GPipe, circular, 1F1B over the pipe axis) against the same model on
one device.

Compared on an SGD update -- every parameter -- and the per-step losses, since Adam would hide a
gradient off by the number of stages.
"""

import functools

import numpy as np
import pytest

from titanax.parallel.plan import DP, PP, TP, Plan
from tests.numerics import ADAM, assert_close, assert_identical
from tests.train import helpers

pytestmark = pytest.mark.usefixtures("float64_numerics")

BATCHES = helpers.text_batches(batch_size=8, count=3, uneven=True)


SCHEDULES = ["gpipe", "circular", "1f1b"]


@functools.lru_cache(maxsize=None)
def _reference(layers=2):
    engine = _deep(helpers.gpt_engine(data=1, learner=helpers.sgd(0.5)), layers)
    return helpers.train(engine, BATCHES)


def _schedule(axes, shape, schedule, **changes):
    """``_pipelined`` with the schedule's model: circular runs v=2 slices of 4 layers, S * v = 4
    stages of one layer each on a pipe axis of 2 (the others 2 layers)."""
    if schedule == "circular":
        return _deep(_pipelined(axes, shape, schedule=schedule, virtual_stages=2, **changes), 4)
    return _pipelined(axes, shape, schedule=schedule, **changes)


def _layers(schedule):
    return 4 if schedule == "circular" else 2


def _pipelined(axes, shape, microbatch_size=1, schedule="gpipe", learner="sgd", virtual_stages=1,
               **changes):
    learner = helpers.sgd(0.5) if learner == "sgd" else helpers.adam(1e-2)
    cfg = helpers.gpt_engine(data=1, learner=learner, **changes).config.clone()
    cfg.mesh = helpers.mesh(shape, axes, devices=list(range(int(np.prod(shape)))))
    cfg.plan = Plan.default_config().set(
        data_parallel=DP.default_config(),
        pipeline_parallel=PP.default_config().set(schedule=schedule,
                                                  microbatch_size=microbatch_size,
                                                  virtual_stages=virtual_stages),
        tensor_parallel=TP.default_config() if "model" in axes else None)
    return cfg.instantiate()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("axes,shape", [
    (("data", "pipe"), (1, 2)),
    (("data", "pipe"), (4, 2)),
    (("data", "pipe", "model"), (2, 2, 2)),
], ids=["pp2", "dp4xpp2", "dp2xpp2xtp2"])
def test_sgd_update_matches_one_device(axes, shape, schedule):
    want_losses, want_params = _reference(_layers(schedule))
    engine = _schedule(axes, shape, schedule)
    losses, params = helpers.train(engine, BATCHES)
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params")
    stacked = engine.state.params["decoder"]["layer"]["mlp"]["up"]["weight"]
    if schedule == "circular":  # The view [v, S, L/(vS), ...]: device s holds stages s, S + s.
        assert stacked.shape[:3] == (2, 2, 1) and stacked.sharding.spec[1] == "pipe"
    else:  # Canonical [L, ...].
        assert stacked.shape[0] == 2 and stacked.sharding.spec[0] == "pipe"


def test_pipelined_eval_matches_one_device():
    reference = helpers.gpt_engine(data=1)
    reference.init_state()
    engine = _pipelined(("data", "pipe"), (4, 2))
    engine.init_state()
    want = reference.eval(data=BATCHES[:2])
    got = engine.eval(data=BATCHES[:2])
    assert_close(got["loss"], want["loss"], what="eval loss")
    assert got["count"] == want["count"]


def test_layers_that_do_not_split_into_virtual_stages_are_refused():
    from titanax import errors  # pylint: disable=import-outside-toplevel
    cfg = _pipelined(("data", "pipe"), (4, 2), schedule="circular",
                     virtual_stages=2).config.clone()  # 2 layers, 2 x 2 stages.
    with pytest.raises(errors.PlanError) as info:
        cfg.instantiate().build()
    assert info.value.path == "plan.pipeline_parallel.virtual_stages"
    assert "2 layers do not split into 2 stages x 2 virtual stages" in info.value.message


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_accumulation_folds_into_the_microbatches(schedule):
    """accumulate_steps=2 on a per-shard batch of 4: two parts of 2 rows, microbatches of 1,
    M = 4 -- the same SGD update as one device, and one data reduction per step."""
    want_losses, want_params = _reference(_layers(schedule))
    cfg = _schedule(("data", "pipe"), (2, 2), schedule).config.clone()
    cfg.mesh = helpers.mesh((2, 2), ("data", "pipe"), devices=[0, 1, 2, 3])
    cfg.plan.data_parallel.accumulate_steps = 2
    engine = cfg.instantiate()
    losses, params = helpers.train(engine, BATCHES)
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params")
    data_ops = [op for op in engine.collectives() if "data" in op.axes]
    assert len(data_ops) == 1 and not data_ops[0].in_loop


def test_microbatches_must_divide_each_accumulation_part():
    from titanax import errors  # pylint: disable=import-outside-toplevel
    cfg = _pipelined(("data", "pipe"), (2, 2), microbatch_size=2).config.clone()
    cfg.mesh = helpers.mesh((2, 2), ("data", "pipe"), devices=[0, 1, 2, 3])
    cfg.plan.data_parallel.accumulate_steps = 4  # Parts of 1 row: microbatches of 2 do not fit.
    engine = cfg.instantiate()
    with pytest.raises(errors.PlanError) as info:
        engine.fit(data=iter(BATCHES), steps=1)
    assert info.value.path == "plan.pipeline_parallel.microbatch_size"
    assert "each of the 4 accumulation parts (1 rows)" in info.value.message


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_inside_loops_only_pipe_permutes_and_model_collectives(schedule):
    from titanax.observe import hlo  # pylint: disable=import-outside-toplevel
    engine = _schedule(("data", "pipe", "model"), (2, 2, 2), schedule)
    engine.init_state()
    engine.compile(example_batch=BATCHES[0])
    ops = engine.collectives()
    in_loop = [op for op in ops if op.in_loop]
    assert any(op.op == "collective-permute" and op.axes == ("pipe",) for op in in_loop)
    assert all(op.axes in (("pipe",), ("model",)) for op in in_loop), hlo.format_report(in_loop)
    data_ops = [op for op in ops if "data" in op.axes]
    assert len(data_ops) == 1 and not data_ops[0].in_loop, hlo.format_report(ops)


def test_a_pipelined_checkpoint_restores_without_the_pipeline(tmp_path):
    import jax  # pylint: disable=import-outside-toplevel
    from titanax.io.checkpointer import OrbaxCheckpoint  # pylint: disable=import-outside-toplevel
    checkpoint = OrbaxCheckpoint.default_config().set(path=str(tmp_path))
    engine = _pipelined(("data", "pipe"), (4, 2), checkpoint=checkpoint)
    engine.fit(data=iter(BATCHES), steps=2)  # Saved at the end.
    engine.close()
    plain = helpers.gpt_engine(data=8, learner=helpers.sgd(0.5), checkpoint=checkpoint)
    assert plain.restore() and int(plain.state.step) == 2
    assert_identical(jax.device_get(plain.state.params), jax.device_get(engine.state.params))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_zero1_with_a_pipeline_sgd_update_matches_one_device(schedule):
    """ZeRO-1's path (each device updates its slice of every param's state, params all-gathered
    back) under a pipeline."""
    from titanax.parallel.plan import ZeRO  # pylint: disable=import-outside-toplevel
    want_losses, want_params = _reference(_layers(schedule))
    cfg = _schedule(("data", "pipe"), (4, 2), schedule).config.clone()
    cfg.plan.zero = ZeRO.default_config()
    losses, params = helpers.train(cfg.instantiate(), BATCHES)
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_zero1_with_a_pipeline_matches_replicated_adam(schedule):
    from titanax.parallel.plan import ZeRO  # pylint: disable=import-outside-toplevel
    plain = _schedule(("data", "pipe"), (4, 2), schedule, learner=None)
    cfg = plain.config.clone()
    cfg.plan.zero = ZeRO.default_config()
    zero = cfg.instantiate()
    want_losses, want_params = helpers.train(plain, BATCHES)
    losses, params = helpers.train(zero, BATCHES)
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, bound=ADAM, what="params after Adam")


@pytest.mark.usefixtures("fusion_emitters")  # Circular among the schedules.
def test_dropout_masks_do_not_depend_on_the_schedule_or_the_stage_count():
    """Each layer's key comes from the microbatch and its index in the whole stack: GPipe over
    2 stages of 2 layers, circular over 2 x 2 of 1 and 1F1B over 4 of 1 drop the same units
    (on one data shard: each shard draws its own masks, so the data size must be the same)."""
    runs = []
    for schedule, shape in [("gpipe", (1, 2)), ("circular", (1, 2)), ("1f1b", (1, 4))]:
        engine = _deep(_pipelined(("data", "pipe"), shape, schedule=schedule,
                                  virtual_stages=2 if schedule == "circular" else 1), 4)
        cfg = engine.config.clone()
        cfg.model.dropout_rate = 0.2
        runs.append(helpers.train(cfg.instantiate(), BATCHES))
    (gpipe_losses, gpipe_params) = runs[0]
    for losses, params in runs[1:]:
        assert_close(losses, gpipe_losses, what="losses")
        assert_close(params, gpipe_params, what="params")
    _, no_dropout = _reference(4)
    assert not np.allclose(gpipe_params["token_emb"]["weight"], no_dropout["token_emb"]["weight"],
                           atol=1e-5)  # Dropout did act.


def test_a_checkpoint_of_4_stages_restores_onto_2(tmp_path):
    import jax  # pylint: disable=import-outside-toplevel
    from titanax.io.checkpointer import OrbaxCheckpoint  # pylint: disable=import-outside-toplevel
    checkpoint = OrbaxCheckpoint.default_config().set(path=str(tmp_path))

    def four_layers(engine):
        cfg = engine.config.clone()
        cfg.model.num_layers = 4
        return cfg.instantiate()

    four = four_layers(_pipelined(("data", "pipe"), (2, 4), schedule="1f1b",
                                  checkpoint=checkpoint))
    four.fit(data=iter(BATCHES), steps=2)
    four.close()
    two = four_layers(_pipelined(("data", "pipe"), (4, 2), schedule="1f1b",
                                 checkpoint=checkpoint))
    assert two.restore() and int(two.state.step) == 2
    assert_identical(jax.device_get(two.state.params), jax.device_get(four.state.params))
    assert two.state.params["decoder"]["layer"]["input_norm"]["scale"].sharding.spec[0] == "pipe"


def test_a_pipelined_run_resumes_bit_identically(tmp_path):
    import jax  # pylint: disable=import-outside-toplevel
    from titanax.io.checkpointer import OrbaxCheckpoint  # pylint: disable=import-outside-toplevel

    def engine(path):
        return _pipelined(("data", "pipe"), (4, 2), schedule="1f1b", learner="adam",
                          checkpoint=OrbaxCheckpoint.default_config().set(path=str(path)))

    straight = engine(tmp_path / "straight")
    straight.fit(data=iter(BATCHES), steps=3)
    first = engine(tmp_path / "resumed")
    first.fit(data=iter(BATCHES[:2]), steps=2)
    first.close()
    second = engine(tmp_path / "resumed")
    second.fit(data=iter(BATCHES[2:]), steps=3)
    assert second.restored_from.endswith("/2")
    assert_identical(jax.device_get(second.state.params),
                     jax.device_get(straight.state.params))


def test_explain_and_metrics_show_the_pipeline():
    engine = _pipelined(("data", "pipe"), (4, 2), schedule="1f1b")
    engine.fit(data=iter(BATCHES), steps=1)
    text = engine.explain()
    assert "pipeline: schedule 1f1b, 2 stages on axis 'pipe', 1 of 2 layers per stage" in text
    assert "microbatches M = 2 of 1 per data shard" in text and "bubble" in text
    assert "decoder/layer/mlp/up/weight" in text and "P('pipe'" in text  # Plan.describe().


def test_explain_shows_the_circular_view():
    engine = _schedule(("data", "pipe"), (4, 2), "circular")
    engine.init_state()
    engine.compile(example_batch=BATCHES[0])
    engine._local_batch_rows = 2  # pylint: disable=protected-access
    text = engine.explain()
    assert "2 virtual stages per device" in text and "held as [2, 2, 1, ...]" in text
    assert "5 ticks per step; bubble 20.0%" in text  # (S-1)/(vM+S-1) = 1/5.
    row = next(line for line in text.splitlines() if line.startswith("decoder/layer/mlp/up/w"))
    assert "  (2, 2, 1, " in row and "P(None, 'pipe'" in row and "  (2, 1, 1, " in row


def test_gpipe_when_the_stages_do_not_divide_the_microbatches():
    batches = helpers.text_batches(batch_size=6, count=2)  # M = 3 microbatches for 2 stages.
    want_losses, want_params = helpers.train(helpers.gpt_engine(data=1, learner=helpers.sgd(0.5)),
                                             batches)
    losses, params = helpers.train(_pipelined(("data", "pipe"), (1, 2), microbatch_size=2),
                                   batches)
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params")


def _deep(engine_or_cfg, layers=8):
    cfg = engine_or_cfg.config.clone()
    cfg.model.num_layers = layers
    return cfg.instantiate()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("batch_size", [8, 12], ids=["M8", "M12"])
def test_four_stages_of_two_layers_match_one_device(schedule, batch_size):
    """S=4 runs 1F1B's middle stages; M=4 (batch 8 on 2 data shards) and M=6 (batch 12, not a
    multiple of S) take both of GPipe's head paths and circular's (v=2: 8 stages of 1 layer)
    ring buffer with M = S and M > S."""
    batches = helpers.text_batches(batch_size=batch_size, count=2, uneven=True)
    want_losses, want_params = helpers.train(_deep(helpers.gpt_engine(
        data=1, learner=helpers.sgd(0.5))), batches)
    engine = _deep(_pipelined(("data", "pipe"), (2, 4), schedule=schedule,
                              virtual_stages=2 if schedule == "circular" else 1))
    losses, params = helpers.train(engine, batches)
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_padding_weights_give_the_token_weighted_loss(schedule):
    batches = [dict(b, weights=np.array([1, 1, 1, 0, 1, 0, 0, 1], np.float32))
               for b in BATCHES[:2]]
    want_losses, want_params = helpers.train(_deep(helpers.gpt_engine(
        data=1, learner=helpers.sgd(0.5)), _layers(schedule)), batches)
    losses, params = helpers.train(_schedule(("data", "pipe"), (1, 2), schedule), batches)
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fp16_with_loss_scaling_trains_through_the_pipeline(schedule):
    cfg = _schedule(("data", "pipe"), (4, 2), schedule, learner="adam").config.clone()
    cfg.precision = helpers.fp16_precision(loss_scaling=True)
    cfg.precision.initial_loss_scale = 2.0 ** 10
    engine = cfg.instantiate()
    losses, _ = helpers.train(engine, BATCHES)
    assert all(np.isfinite(losses)) and engine.history[-1]["update_applied"] == 1.0


def test_a_circular_checkpoint_is_canonical_and_restores_anywhere(tmp_path):
    """Saved from the view [v, S, L/(vS), ...]: restores without a pipeline and under 1F1B with
    identical params, and a 1F1B checkpoint restores into the circular view."""
    import jax  # pylint: disable=import-outside-toplevel
    from titanax.io.checkpointer import OrbaxCheckpoint  # pylint: disable=import-outside-toplevel

    def checkpoint(name):
        return OrbaxCheckpoint.default_config().set(path=str(tmp_path / name))

    circular = _schedule(("data", "pipe"), (4, 2), "circular", learner="adam",
                         checkpoint=checkpoint("circular"))
    circular.fit(data=iter(BATCHES), steps=2)
    circular.close()
    want = jax.device_get(circular.canonical_params())
    plain = _deep(helpers.gpt_engine(data=8, learner=helpers.adam(1e-2),
                                     checkpoint=checkpoint("circular")), 4)
    assert plain.restore() and int(plain.state.step) == 2
    assert_identical(jax.device_get(plain.state.params), want)
    ofob = _deep(_pipelined(("data", "pipe"), (2, 4), schedule="1f1b", learner="adam",
                            checkpoint=checkpoint("circular")), 4)
    assert ofob.restore()
    assert_identical(jax.device_get(ofob.state.params), want)
    # And back: a 1F1B run's checkpoint continues under circular exactly like under 1F1B.
    ofob.fit(data=iter(BATCHES), steps=3)
    ofob.save(force=True)
    ofob.close()
    back = _schedule(("data", "pipe"), (4, 2), "circular", learner="adam",
                     checkpoint=checkpoint("circular"))
    assert back.restore() and int(back.state.step) == 3
    assert_identical(jax.device_get(back.canonical_params()), jax.device_get(ofob.state.params))
    steps = [dict(b) for b in BATCHES]
    ofob.fit(data=iter(steps), steps=5)
    back.fit(data=iter(steps), steps=5)
    assert_close([h["loss"] for h in back.history[-2:]], [h["loss"] for h in ofob.history[-2:]],
                 what="losses after the restore")


@pytest.mark.parametrize("schedule,ratio", [("gpipe", 0.5), ("gpipe", 1.0), ("circular", 0.5),
                                            ("circular", 1.0)])
def test_checkpoint_ratio_recomputes_without_changing_the_update(schedule, ratio):
    """gpipe 0.5: the first of each stage's 2 layers under jax.checkpoint; circular 0.5 rounds
    up to its 1 layer per slice; 1: the whole tick. The update is the same, the compiled step's
    temp memory lower than without remat."""
    want_losses, want_params = _reference(4)

    def engine_with(value):
        engine = _deep(_pipelined(("data", "pipe"), (4, 2), schedule=schedule,
                                  virtual_stages=2 if schedule == "circular" else 1), 4)
        cfg = engine.config.clone()
        cfg.plan.pipeline_parallel.checkpoint_ratio = value
        return cfg.instantiate()

    engine = engine_with(ratio)
    losses, params = helpers.train(engine, BATCHES)
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params")
    plain = engine_with(0.0)
    plain.init_state()

    def temp(e):
        return e.compile(example_batch=BATCHES[0]).latest.memory_analysis().temp_size_in_bytes

    assert temp(engine) < temp(plain)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_layer_summaries_reach_the_metrics(schedule):
    """A head that writes add_summary("loss"): under every schedule it arrives in the metrics as
    it does without a pipeline (the mean over microbatches, summed over the pipe ranks). Every
    token trains: a summary is a plain mean of per-microbatch values, not token-weighted."""
    batches = helpers.text_batches(batch_size=8, count=3)
    reference = helpers.summarizing(_deep(helpers.gpt_engine(data=4, learner=helpers.sgd(0.5)),
                                          _layers(schedule)))
    helpers.train(reference, batches)
    engine = helpers.summarizing(_schedule(("data", "pipe"), (4, 2), schedule))
    helpers.train(engine, batches)
    want = [h["summaries/loss"] for h in reference.history]
    got = [h["summaries/loss"] for h in engine.history]
    assert_close(got, want, what="summarised losses")


def test_zero1_with_circular_resumes_exactly_under_either_schedule(tmp_path):
    """ZeRO-1's state is split along real dimensions of the circular view and saved in the
    canonical layout: the same plan resumes exactly, and so does a 1F1B run on the same mesh
    (its state equals the circular run's, converted to [L, ...])."""
    import jax  # pylint: disable=import-outside-toplevel
    from titanax.io.checkpointer import OrbaxCheckpoint  # pylint: disable=import-outside-toplevel
    from titanax.parallel.plan import ZeRO  # pylint: disable=import-outside-toplevel
    checkpoint = OrbaxCheckpoint.default_config().set(path=str(tmp_path))

    def zero(schedule):
        engine = _schedule(("data", "pipe"), (4, 2), schedule, learner="adam",
                           checkpoint=checkpoint.clone())
        cfg = engine.config.clone()
        cfg.plan.zero = ZeRO.default_config().set(min_shard_size=0)
        if schedule != "circular":
            cfg.model.num_layers = 4
        return cfg.instantiate()

    first = zero("circular")
    first.fit(data=iter(BATCHES), steps=2)
    first.close()
    canonical = first.states.canonical_state(first.state)
    again = zero("circular")
    assert again.restore() and int(again.state.step) == 2
    assert_identical(jax.device_get(again.state.opt_state),
                     jax.device_get(first.state.opt_state))
    other = zero("1f1b")
    assert other.restore() and int(other.state.step) == 2
    assert_identical(jax.device_get(other.state.opt_state),
                     jax.device_get(canonical.opt_state))
    assert_identical(jax.device_get(other.state.params),
                     jax.device_get(first.canonical_params()))
