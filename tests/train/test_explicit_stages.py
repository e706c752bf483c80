"""The seed's explicit stages: a 2-stage toy CNN (conv stage, dense stage) through the pipeline.

Compared with the same CNN trained on one device: per-step losses and an SGD update of every
param, for GPipe and 1F1B, with and without data parallelism.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import titanax as tx
from titanax import errors
from titanax.modules import functional
from titanax.modules.models.classifier import CNNClassifier
from titanax.parallel.plan import DP, PP, Plan
from titanax.train.engine import Engine
from tests.numerics import assert_close
from tests.train import helpers

pytestmark = pytest.mark.usefixtures("float64_numerics")

CNN = CNNClassifier.default_config().set(name="cnn", image_size=8, channels=(4, 8),
                                          hidden_dim=16)
BATCHES = [{"image": b["image"][:, 2:26:3, 2:26:3], "label": b["label"]}  # 8 x 8 images.
           for b in helpers.mnist_batches(batch_size=8, count=3)]


def cnn_stages(model):
    """Stage 0: the conv part on the batch's images; stage 1: the dense part -> logits."""
    def conv(params, batch):
        return functional(model, None, params, (batch["image"],), method="features",
                          is_training=True)[0]

    def dense(params, features):
        return functional(model, None, params, (features,), method="classify",
                          is_training=True)[0]

    return [tx.Stage(name="conv", param_filter=["conv*"], fwd=conv),
            tx.Stage(name="dense", param_filter=["dense/*", "head/*"], fwd=dense)]


def _engine(shape=None, schedule="1f1b", stages=None, microbatch_size=1, **changes):
    model = CNN.instantiate()
    plan = Plan.default_config().set(data_parallel=DP.default_config())
    axes = ("data",)
    if shape is not None:
        axes = ("data", "pipe")
        plan.pipeline_parallel = PP.default_config().set(
            axis="pipe", schedule=schedule, microbatch_size=microbatch_size,
            stages=stages if stages is not None else cnn_stages(model))
    size = int(np.prod(shape)) if shape else 1
    return Engine.default_config().set(
        mesh=helpers.mesh(shape or (1,), axes, devices=list(range(size))), plan=plan,
        model=CNN, learner=helpers.sgd(0.5), loggers=[],
        **helpers.with_test_precision(changes)).instantiate()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("shape", [(1, 2), (4, 2)], ids=["pp2", "dp4xpp2"])
def test_a_two_stage_cnn_matches_one_device(shape, schedule):
    want_losses, want_params = helpers.train(_engine(), BATCHES)
    engine = _engine(shape, schedule)
    losses, params = helpers.train(engine, BATCHES)
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params")
    # One data reduction, outside any loop; inside loops only pipe permutes.
    ops = engine.collectives()
    assert all(op.axes == ("pipe",) for op in ops if op.in_loop)
    data_ops = [op for op in ops if "data" in op.axes]
    assert len(data_ops) == (1 if shape[0] > 1 else 0) and not any(op.in_loop for op in data_ops)


def test_example_weights_give_the_weighted_loss():
    """The model's loss_weight (weighted examples) combines the microbatches, not a count."""
    batches = [dict(b, weights=np.array([1, 0, 1, 1, 0, 0, 1, 1], np.float32))
               for b in BATCHES[:2]]
    want_losses, want_params = helpers.train(_engine(), batches)
    losses, params = helpers.train(_engine((1, 2), "gpipe", microbatch_size=2), batches)
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params")


def test_explain_lists_the_stages():
    engine = _engine((4, 2), "gpipe")
    engine.fit(data=iter(BATCHES), steps=1)
    text = engine.explain()
    assert "2 explicit stages on axis 'pipe'" in text
    assert "stage 0 'conv': 4 params" in text and "stage 1 'dense': 4 params" in text


def test_imperative_engine_with_the_seed_api():
    model = CNN.instantiate()
    engine = tx.Engine(
        mesh=tx.MeshSpec(axes=("data", "pipe"), shape=(4, 2)),
        plan=tx.Plan(data_parallel=tx.DP(axis="data"),
                     pipeline_parallel=tx.PP(axis="pipe", stages=cnn_stages(model),
                                             microbatch_size=1)),
        model=CNN, learner=helpers.sgd(0.5), loggers=[],
        precision=tx.Precision(float64=helpers.float64_mode()))
    losses, _ = helpers.train(engine, BATCHES)
    reference = _engine()
    want_losses, _ = helpers.train(reference, BATCHES)
    assert_close(losses, want_losses, what="losses")
    got, want = engine.eval(data=BATCHES[:2]), reference.eval(data=BATCHES[:2])
    assert_close(got["loss"], want["loss"], what="eval loss")
    assert got["accuracy"] == want["accuracy"]


@pytest.mark.parametrize("stages,path,text", [
    (lambda m: cnn_stages(m)[:1], "plan.pipeline_parallel.stages", "1 stages for a pipe axis"),
    (lambda m: [cnn_stages(m)[0], tx.Stage(name="dense", param_filter=["dense/*"],
                                           fwd=cnn_stages(m)[1].fwd)],
     "plan.pipeline_parallel.stages", "belong to no stage: head/bias"),
    (lambda m: [tx.Stage(name="conv", param_filter=["conv*"], fwd=lambda p, b: b["label"]),
                cnn_stages(m)[1]], "plan.pipeline_parallel.stages[0]",
     "must return one float array"),
])
def test_bad_stages_are_refused_naming_the_stage(stages, path, text):
    engine = _engine((1, 2), stages=stages(CNN.instantiate()))
    with pytest.raises(errors.PlanError) as info:
        engine.fit(data=iter(BATCHES), steps=1)
    assert info.value.path == path and text in info.value.message


def test_a_stage_filter_must_be_a_list_of_globs():
    with pytest.raises(errors.PlanError) as info:
        tx.Stage(name="conv", param_filter="conv*", fwd=lambda p, x: x)
    assert info.value.path == "plan.pipeline_parallel.stages['conv'].param_filter"


def test_fractional_checkpoint_ratio_is_refused_for_explicit_stages():
    engine = _engine((1, 2), "gpipe")
    cfg = engine.config.clone()
    cfg.plan.pipeline_parallel.checkpoint_ratio = 0.5
    with pytest.raises(errors.PlanError) as info:
        cfg.instantiate().build()
    assert info.value.path == "plan.pipeline_parallel.checkpoint_ratio"


def test_state_updates_in_the_loss_are_refused_not_dropped():
    class CountingCNN(CNNClassifier):
        def loss(self, outputs, batch):
            self.add_state_update("seen", jnp.float32(1.0))
            return super().loss(outputs, batch)

    cfg = _engine((1, 2)).config.clone()
    cfg.model.klass = CountingCNN
    with pytest.raises(errors.ModuleError) as info:
        cfg.instantiate().fit(data=iter(BATCHES), steps=1)
    assert "(seen)" in info.value.message and info.value.path.endswith("CountingCNN.loss")
