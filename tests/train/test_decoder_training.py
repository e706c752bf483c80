"""The Llama-style decoder trains like one device under every plan part: DP x TP (kv heads kept
whole on TP=4), sequence parallelism, a 1F1B pipeline with TP inside, and FSDP x TP.

SGD with momentum on every param and the per-step losses (Adam would hide a scale error).
"""

import functools

import numpy as np
import pytest

from tests.numerics import assert_close
from tests.train import helpers
from titanax.modules.models.decoder import Decoder
from titanax.parallel.plan import DP, PP, TP, Plan, ZeRO
from titanax.train.engine import Engine

pytestmark = pytest.mark.usefixtures("float64_numerics")

BATCHES = helpers.text_batches(batch_size=16, count=3, uneven=True)
MODEL = dict(name="llama", vocab_size=256, max_seq_len=16, num_layers=2, model_dim=32,
             num_heads=8, num_kv_heads=2, hidden_dim=48, attention_output_bias=True,
             qkv_bias=True, mlp_bias=True)


def _learner():
    learner = helpers.sgd(0.5)
    learner.optimizer.momentum = 0.9
    return learner


def _engine(*, data, model=1, pipe=1, zero=None, sequence_parallel=False, accumulate=1,
            schedule="1f1b"):
    sizes = {"data": data, "pipe": pipe, "model": model}
    axes = tuple(a for a in sizes if a == "data" or sizes[a] > 1)
    plan = Plan.default_config().set(
        data_parallel=DP.default_config().set(accumulate_steps=accumulate),
        tensor_parallel=(TP.default_config().set(sequence_parallel=sequence_parallel)
                         if model > 1 else None),
        pipeline_parallel=(PP.default_config().set(microbatch_size=2, schedule=schedule)
                           if pipe > 1 else None),
        zero=(ZeRO.default_config().set(stage=3, min_shard_size=64, grad_sync="per_step")
              if zero else None))
    cfg = Engine.default_config().set(
        mesh=helpers.mesh(tuple(sizes[a] for a in axes), axes,
                          devices=list(range(data * model * pipe))),
        plan=plan, model=Decoder.default_config().set(**MODEL),
        learner=_learner(), loggers=[], log_every=1000,
        precision=helpers.test_precision())
    return cfg.instantiate()


@functools.lru_cache(maxsize=None)
def _one_device():
    return helpers.train(_engine(data=1), BATCHES)


@pytest.mark.parametrize("layout", [
    dict(data=4, model=2), dict(data=2, model=4), dict(data=2, model=4, sequence_parallel=True),
    dict(data=2, pipe=2, model=2), dict(data=4, model=2, zero=True, accumulate=2)],
    ids=["dp4-tp2", "dp2-tp4-kv-whole", "dp2-tp4-sp", "dp2-pp2-tp2", "fsdp4-tp2-acc2"])
def test_decoder_trains_like_one_device(layout):
    want_losses, want_params = _one_device()
    losses, params = helpers.train(_engine(**layout), BATCHES)
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params after 3 SGD-momentum steps")


def _packed(batches):
    """The batches with every row cut into two documents (segment ids, per-document positions,
    the first document's last target not trained on)."""
    out = []
    for batch in batches:
        rows, length = batch["input_ids"].shape
        # Every row is cut elsewhere: a microbatch given another's layout changes the numbers.
        cuts = 3 + np.arange(rows) % (length - 5)
        index = np.arange(length)[None]
        segment = np.where(index < cuts[:, None], 1, 2)
        positions = np.where(index < cuts[:, None], index, index - cuts[:, None])
        weights = np.ones((rows, length), np.float32)
        weights[np.arange(rows), cuts - 1] = 0.0
        out.append({**batch, "segment_ids": segment.astype(np.int32),
                    "positions": positions.astype(np.int32), "weights": weights})
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_packed_rows_train_like_one_device_through_a_pipeline(schedule):
    """Each microbatch's segment ids and positions reach the stage that runs it."""
    packed = _packed(BATCHES)
    want_losses, want_params = helpers.train(_engine(data=1), packed)
    losses, params = helpers.train(_engine(data=2, pipe=2, model=2, schedule=schedule), packed)
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params")
    unpacked_losses, _ = helpers.train(_engine(data=1), BATCHES)
    assert not np.allclose(unpacked_losses, want_losses, rtol=1e-4)  # The packing mattered.


def test_an_sft_step_reports_the_mean_over_every_completion_token(tmp_path):
    """llama_tiny_sft on DP 4 x TP 2 with two microbatches, on pairs whose completions differ
    widely in length (so shards and microbatches hold very different token counts): the step's
    loss, and its SGD update, are those of the mean over every completion token of the batch --
    computed here one document at a time, unpacked, on one device."""
    import json  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from titanax.config import registry  # pylint: disable=import-outside-toplevel
    from titanax.modules import functional  # pylint: disable=import-outside-toplevel
    path = tmp_path / "pairs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(64):
            answer = "yes" if i % 3 else " ".join(f"word{j}" for j in range(i % 9))
            f.write(json.dumps({"prompt": f"Question {i}: what is {i * 7}?",
                                "completion": f" {answer}."}) + "\n")
    registry.load_config_modules(list(registry.DEFAULT_CONFIG_MODULES))
    cfg = registry.get_config("llama_tiny_sft")
    cfg.train_input.source.files = [str(path)]
    cfg.train_input.source.held_out_fraction = 0.0
    cfg.plan.data_parallel.accumulate_steps = 2
    cfg.set(evalers={}, loggers=[], checkpoint=None, learner=helpers.sgd(1.0),
            precision=helpers.test_precision())
    engine = cfg.instantiate()
    batch = next(iter(cfg.train_input.instantiate()))
    initial = jax.device_get(engine.init_state().params)
    engine.fit(steps=1)
    model = engine.model

    # Each packed document alone: its ids, and which of its targets are trained (completion).
    documents = []
    for row in range(batch["input_ids"].shape[0]):
        for segment in range(1, int(batch["segment_ids"][row].max()) + 1):
            at = batch["segment_ids"][row] == segment
            documents.append((batch["input_ids"][row][at], batch["target_ids"][row][at],
                              batch["weights"][row][at]))
    length = batch["input_ids"].shape[1]
    pad = lambda x: np.pad(x, (0, length - len(x)))  # noqa: E731 (causal: the end is unseen)
    ids = jnp.asarray(np.stack([pad(d[0]) for d in documents]))
    targets = np.stack([pad(d[1]) for d in documents])
    weights = np.stack([pad(d[2]) for d in documents])
    assert weights.sum() < 0.5 * (batch["weights"] >= 0).sum()  # Prompts are not trained.

    def mean_loss(params):
        logits, _ = functional(model, None, params, (ids,), method="logits", is_training=False)
        chosen = jnp.take_along_axis(jax.nn.log_softmax(logits),
                                     jnp.asarray(targets)[..., None], axis=-1)[..., 0]
        return -jnp.sum(chosen * weights) / weights.sum()

    want_loss, want_grads = jax.jit(jax.value_and_grad(mean_loss))(initial)
    assert_close(engine.history[0]["loss"], want_loss, what="the step's loss")
    update = jax.tree_util.tree_map(lambda a, b: np.asarray(b) - np.asarray(a), initial,
                                    jax.device_get(engine.canonical_params()))
    assert_close(update, jax.tree_util.tree_map(lambda g: -np.asarray(g), want_grads),
                 what="the SGD update (-gradient)")
