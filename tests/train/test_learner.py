"""Learner, optimizers, precision policy and PRNG streams."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from titanax import errors
from titanax.config import config_for_function
from titanax.train import learner as learner_lib
from titanax.train import optimizers, prng
from titanax.train.precision import Precision
from tests.numerics import assert_close


def test_optimizer_adapter_matches_plain_optax():
    params = {"w": jnp.arange(4.0), "b": jnp.ones(2)}
    grads = {"w": jnp.full(4, 0.5), "b": jnp.array([1.0, -1.0])}
    tx = optax.adamw(0.1, weight_decay=0.01)
    adapter = learner_lib.OptimizerAdapter(tx)
    ours = adapter.update(grads, adapter.init(params), params)[0]
    theirs = tx.update(grads, tx.init(params), params)[0]
    assert_close(ours, theirs, what="updates")


def test_adamw_decay_is_scaled_per_param_and_matches_optax_where_full():
    params = {"w": jnp.arange(1.0, 5.0), "b": jnp.ones(4)}
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    ours = optimizers.adamw(0.1, weight_decay=0.5, decay_scales={"w": 1.0, "b": 0.0})
    reference = optax.adamw(0.1, weight_decay=0.5, mask={"w": True, "b": False})
    got = ours.update(grads, ours.init(params), params)[0]
    want = reference.update(grads, reference.init(params), params)[0]
    assert_close(got, want, what="updates")
    half = optimizers.adamw(0.1, weight_decay=0.5, decay_scales={"w": 0.5, "b": 0.0})
    got_half = half.update(grads, half.init(params), params)[0]
    assert_close(got_half["w"] - got["w"], 0.1 * 0.25 * params["w"], what="half the decay")


def test_adam_moments_stored_in_bfloat16_follow_optax_to_their_rounding():
    """``moments_dtype="bfloat16"`` (DeepSeek-V3's AdamW states, b2 0.95): moments stored in
    bfloat16, the update computed in float32 -- over five steps within bfloat16's rounding of
    optax's float32 AdamW, a state of optax's structure; after a spike the second moment falls
    back to the gradients' square (a bfloat16 moment with b2 0.999 would not: refused by
    name, as float16 moments are)."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64,)), jnp.float32)}
    ours = optimizers.adamw(0.01, b2=0.95, weight_decay=0.1, moments_dtype="bfloat16",
                            decay_scales={"w": 1.0})
    reference = optax.adamw(0.01, b2=0.95, weight_decay=0.1)
    state, reference_state = ours.init(params), reference.init(params)
    for step in range(5):
        grads = {"w": jnp.asarray(rng.normal(size=(64,)) * 10.0 ** -step, jnp.float32)}
        got, state = ours.update(grads, state, params)
        want, reference_state = reference.update(grads, reference_state, params)
        # bfloat16 keeps 8 bits: each moment within 2^-8 of its own size, the update too.
        assert_close(got, want, bound=2.0 ** -7, what=f"update {step}")
    adam = state[0]
    assert adam.mu["w"].dtype == jnp.bfloat16 and adam.nu["w"].dtype == jnp.bfloat16
    assert int(adam.count) == 5 and float(jnp.min(adam.nu["w"])) > 0
    spike = ours.update({"w": jnp.full(64, 0.1)}, state, params)[1]
    small = {"w": jnp.full(64, 0.01, jnp.float32)}
    for _ in range(400):
        _, spike = ours.update(small, spike, params)
    # The fixed point's bound: within 2^-8 / (1 - b2) of g^2 = 1e-4.
    assert float(jnp.max(spike[0].nu["w"])) <= 1e-4 * (1 + 2.0 ** -8 / 0.05)
    for changes in (dict(moments_dtype="float16"), dict(moments_dtype="bfloat16", b2=0.999)):
        with pytest.raises(errors.ConfigError, match="moments_dtype|b2"):
            config_for_function(optimizers.adamw).set(learning_rate=0.1, **changes).validate()


def test_lion_and_sgd_momentum():
    params = {"w": jnp.zeros(3)}
    grads = {"w": jnp.array([1.0, -2.0, 0.0])}
    lion = optimizers.lion(0.1)
    assert_close(lion.update(grads, lion.init(params), params)[0]["w"], [-0.1, 0.1, 0.0])
    sgd = optimizers.sgd(0.1, momentum=0.9)
    state = sgd.init(params)
    first, state = sgd.update(grads, state, params)
    second, _ = sgd.update(grads, state, params)
    assert_close(second["w"], 1.9 * first["w"], what="second momentum step")


def test_warmup_cosine_schedule():
    schedule = optimizers.warmup_cosine(peak_value=1.0, warmup_steps=10, decay_steps=110,
                                        end_value=0.1)
    assert float(schedule(0)) == 0.0
    assert float(schedule(10)) == pytest.approx(1.0)
    assert float(schedule(110)) == pytest.approx(0.1)
    learner = learner_lib.Learner.default_config().set(optimizer=config_for_function(
        optimizers.adamw).set(learning_rate=config_for_function(optimizers.warmup_cosine).set(
            peak_value=1.0, warmup_steps=10, decay_steps=110))).instantiate()
    assert float(learner.learning_rate(jnp.int32(5))) == pytest.approx(0.5)


def test_learner_passes_decay_scales_only_to_factories_that_take_them():
    learner = learner_lib.Learner.default_config().set(
        optimizer=config_for_function(optax.sgd).set(learning_rate=0.1)).instantiate()
    adapter = learner.build({"w": 0.0})
    assert isinstance(adapter.tx, optax.GradientTransformation)


def test_clip_by_norm_scales_to_the_max_norm():
    """(The global norm itself is the reducer's: tests/train/test_reducer.py.)"""
    clipped = learner_lib.clip_by_norm({"x": jnp.array([3.0, 4.0])}, jnp.float32(5.0), 1.0)
    assert_close(clipped["x"], [0.6, 0.8], what="clipped")
    assert learner_lib.clip_by_norm({"x": 1.0}, jnp.float32(5.0), None) == {"x": 1.0}


def test_precision_dtypes_and_loss_scale_updates():
    bf16 = Precision(bfloat16=True, enable_x32_params=True)
    assert bf16.compute_dtype == jnp.bfloat16 and bf16.param_dtype == jnp.float32
    cast = bf16.cast_for_compute({"x": jnp.ones(2), "ids": jnp.ones(2, jnp.int32)})
    assert cast["x"].dtype == jnp.bfloat16 and cast["ids"].dtype == jnp.int32
    assert Precision(bfloat16=True).param_dtype == jnp.bfloat16
    fp16 = Precision(fp16=True, loss_scaling=True, initial_loss_scale=8.0, growth_interval=2)
    state = fp16.initial_scale_state()
    state = fp16.next_scale_state(state, jnp.bool_(False))
    assert float(state["scale"]) == 4.0 and int(state["good_steps"]) == 0
    state = fp16.next_scale_state(fp16.next_scale_state(state, jnp.bool_(True)), jnp.bool_(True))
    assert float(state["scale"]) == 8.0 and int(state["good_steps"]) == 0
    assert Precision().initial_scale_state() is None


def test_prng_streams_are_named_and_independent():
    streams = prng.streams(0)
    assert set(streams) == {"init", "dropout", "data"}
    np.testing.assert_array_equal(prng.stream_key(0, "dropout"), streams["dropout"])
    assert not np.array_equal(streams["init"], streams["dropout"])
    assert not np.array_equal(prng.stream_key(1, "init"), streams["init"])
    np.testing.assert_array_equal(prng.per_process(streams["data"]),
                                  jax.random.fold_in(streams["data"], 0))
