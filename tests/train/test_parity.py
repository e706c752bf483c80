"""Parity of the engine's step with one device: losses *and* gradients (via SGD steps).

Adam normalises away a wrong gradient scale (a factor of the data or TP size, say), so every
comparison here also checks an SGD update, where the params move by exactly -lr * gradient.
Everything runs in float64 (``tests/numerics.py``): a correct layout agrees to ~1e-14, a wrong
one is off by 1e-3 or more, and the bound (1e-9) is far from both on any CPU.
"""

import functools

import jax
import numpy as np
import pytest

from tests.numerics import assert_close
from tests.train import helpers

pytestmark = pytest.mark.usefixtures("float64_numerics")


def _delta(before, after):
    return jax.tree_util.tree_map(lambda a, b: b - a, before, after)


def _initial_losses_final(engine, batches):
    """(initial params, per-step losses, final params) of training ``engine`` on ``batches``."""
    initial = jax.tree_util.tree_map(np.asarray, jax.device_get(engine.init_state().params))
    losses, params = helpers.train(engine, batches)
    return initial, losses, params


@functools.lru_cache(maxsize=None)
def _mnist_run(data: int, accumulate: int, optimizer: str, steps: int):
    learner = helpers.sgd(0.5) if optimizer == "sgd" else helpers.adam(1e-3)
    engine = helpers.mnist_engine(data=data, accumulate=accumulate, learner=learner)
    return _initial_losses_final(engine, helpers.mnist_batches()[:steps])


def test_mnist_dp_8_devices_matches_1_device_over_20_steps():
    _, losses_1, _ = _mnist_run(1, 1, "adam", 20)
    _, losses_8, _ = _mnist_run(8, 1, "adam", 20)
    assert len(losses_1) == len(losses_8) == 20
    assert_close(losses_8, losses_1, what="Adam losses")
    assert losses_1[-1] < losses_1[0]  # It trains.


def test_mnist_dp_gradients_match_1_device():
    initial, _, params_1 = _mnist_run(1, 1, "sgd", 1)
    _, _, params_8 = _mnist_run(8, 1, "sgd", 1)
    assert_close(_delta(initial, params_8), _delta(initial, params_1), what="SGD updates")


def test_accumulation_4_matches_1():
    _, losses_1, _ = _mnist_run(8, 1, "adam", 20)
    _, losses_4, _ = _mnist_run(8, 4, "adam", 20)
    assert_close(losses_4, losses_1, what="Adam losses")
    initial, _, sgd_1 = _mnist_run(8, 1, "sgd", 1)
    _, _, sgd_4 = _mnist_run(8, 4, "sgd", 1)
    assert_close(_delta(initial, sgd_4), _delta(initial, sgd_1), what="SGD updates")


@functools.lru_cache(maxsize=None)
def _gpt_run(data: int, model_axis: int, optimizer: str, steps: int):
    learner = helpers.sgd(1.0) if optimizer == "sgd" else helpers.adam(3e-3)
    engine = helpers.gpt_engine(data=data, model_axis=model_axis, learner=learner)
    return _initial_losses_final(engine, helpers.text_batches(uneven=True)[:steps])


def test_gpt_dp_tp_4x2_matches_1_device_over_10_steps():
    _, losses_1, _ = _gpt_run(1, 1, "adam", 10)
    _, losses_tp, _ = _gpt_run(4, 2, "adam", 10)
    assert_close(losses_tp, losses_1, what="Adam losses")
    assert losses_1[-1] < losses_1[0]


def test_gpt_dp_tp_sgd_step_matches_1_device():
    initial, _, params_1 = _gpt_run(1, 1, "sgd", 1)
    _, _, params_tp = _gpt_run(4, 2, "sgd", 1)
    assert_close(_delta(initial, params_tp), _delta(initial, params_1), what="SGD updates")


def test_zero1_matches_replicated_optimizer_after_5_steps():
    _, losses_rep, params_rep = _mnist_run(8, 1, "adam", 5)
    engine = helpers.mnist_engine(data=8, learner=helpers.adam(1e-3), zero=True)
    losses_zero, params_zero = helpers.train(engine, helpers.mnist_batches()[:5])
    assert_close(losses_zero, losses_rep, what="Adam losses")
    assert_close(params_zero, params_rep, what="params after Adam")


def test_zero1_sgd_with_momentum_matches_replicated():
    learner = helpers.sgd(0.5)
    learner.optimizer.momentum = 0.9
    runs = []
    for zero in (False, True):
        engine = helpers.mnist_engine(data=8, learner=learner.clone(), zero=zero)
        runs.append(helpers.train(engine, helpers.mnist_batches()[:3])[1])
    assert_close(runs[1], runs[0], what="params after SGD with momentum")


def test_zero1_optimizer_state_is_split_over_the_data_axis():
    """With no size threshold every param with a dimension divisible by 8 has its moments split
    (only the [10] output bias stays whole: its 80 bytes of moments fit in the 1% margin)."""
    replicated = helpers.mnist_engine(data=8)
    replicated.init_state()
    sharded = helpers.mnist_engine(data=8, zero=True, zero_options={"min_shard_size": 0})
    sharded.init_state()

    def bytes_on_device_0(tree):
        total = 0
        for leaf in jax.tree_util.tree_leaves(tree):
            total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device.id == 0)
        return total

    full = bytes_on_device_0(replicated.state.opt_state)
    split = bytes_on_device_0(sharded.state.opt_state)
    assert split <= full / 8 * 1.01, (split, full)


def test_fp16_loss_scaling_trains_where_plain_fp16_overflows():
    from titanax import errors  # pylint: disable=import-outside-toplevel
    from tests.train.overflow_model import overflow_batches, overflow_engine
    plain = overflow_engine(helpers.fp16_precision(loss_scaling=False), nan_policy="stop")
    with pytest.raises(errors.NonFiniteError) as info:
        plain.fit(data=iter(overflow_batches()), steps=40)
    assert "step" in info.value.message
    scaled = overflow_engine(helpers.fp16_precision(loss_scaling=True), nan_policy="stop")
    scaled.fit(data=iter(overflow_batches()), steps=40)
    history = scaled.history
    assert all(np.isfinite(h["loss"]) for h in history)
    assert history[0]["update_applied"] == 0.0  # The first steps overflow and are skipped...
    assert history[-1]["update_applied"] == 1.0  # ...until the scale is small enough.
    assert history[-1]["loss_scale"] < 1.0
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    params = jax.device_get(scaled.state.params)
    assert all(np.all(np.isfinite(p)) for p in jax.tree_util.tree_leaves(params))
