"""Tests of Module, InvocationContext and functional(): every context behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from titanax import errors
from titanax.modules import (InvocationContext, Module, OutputCollection, child_context,
                             current_context, functional, scan_in_context, set_current_context)
from titanax.modules.testing import bind
from titanax.parallel import collectives
from titanax.runtime.mesh import MeshSpec


class Scale(Module):
    """``x * w``; records a summary and a state update; draws noise in training."""

    def forward(self, x):
        self.add_summary("mean_in", jnp.mean(x))
        self.add_state_update("count", self.state.get("count", 0) + 1)
        out = x * self.parameters["w"]
        if self.is_training:
            out = out + 0.0 * jax.random.normal(self.prng_key, x.shape)
        return out

    def key_bits(self):
        return jax.random.key_data(self.prng_key)

    def mode(self):
        return self.is_training


class Pair(Module):
    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        self._add_child("first", Scale.default_config())
        self._add_child("second", Scale.default_config())

    def forward(self, x):
        return self.second(self.first(x))

    def twice(self, x):
        return self.first(self.first(x))

    def keys(self, reverse=False):
        if reverse:
            second = self.second.key_bits()
            first = self.first.key_bits()
        else:
            first = self.first.key_bits()
            second = self.second.key_bits()
        return first, second

    def keys_twice(self):
        return self.first.key_bits(), self.first.key_bits()

    def teacher_mode(self):
        outer = self.first.mode()
        with set_current_context(current_context().clone(is_training=False)):
            inner = self.first.mode()
        return outer, inner


PAIR = Pair.default_config().set(name="pair").instantiate()
STATE = {"first": {"w": jnp.float32(2.0)}, "second": {"w": jnp.float32(3.0)}}
KEY = jax.random.PRNGKey(0)


def test_implicit_params_and_outputs_with_paths():
    out, collection = functional(PAIR, KEY, STATE, (jnp.ones(3),), is_training=False)
    np.testing.assert_allclose(out, 6.0)
    assert set(collection.summaries) == {"first", "second"}
    np.testing.assert_allclose(collection.summaries["second"]["mean_in"], 2.0)
    assert collection.state_updates["first"]["count"] == 1


def test_prng_keys_are_name_based_and_independent_of_call_order():
    (a1, b1), _ = functional(PAIR, KEY, STATE, (), method="keys", is_training=True)
    (a2, b2), _ = functional(PAIR, KEY, STATE, {"reverse": True}, method="keys",
                             is_training=True)
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(b1, b2)
    assert not np.array_equal(a1, b1)
    (a3, _), _ = functional(PAIR, jax.random.PRNGKey(1), STATE, (), method="keys",
                            is_training=True)
    assert not np.array_equal(a1, a3)


def test_calling_a_child_twice_shares_params_but_not_keys_or_outputs():
    out, collection = functional(PAIR, KEY, STATE, (jnp.ones(2),), method="twice",
                                 is_training=False)
    np.testing.assert_allclose(out, 4.0)
    assert set(collection.summaries) == {"first", "first_1"}
    np.testing.assert_allclose(collection.summaries["first_1"]["mean_in"], 2.0)
    (k1, k2), _ = functional(PAIR, KEY, STATE, (), method="keys_twice", is_training=True)
    assert not np.array_equal(k1, k2)


def test_is_training_is_inherited_and_can_be_overridden_for_a_sub_call():
    (outer, inner), _ = functional(PAIR, KEY, STATE, (), method="teacher_mode", is_training=True)
    assert outer is True and inner is False


def test_calls_need_a_context_and_the_right_parent():
    with pytest.raises(errors.ModuleError) as info:
        PAIR.first(jnp.ones(1))
    assert "needs an InvocationContext" in info.value.message
    other = Pair.default_config().set(name="other").instantiate()
    with bind(PAIR, STATE):
        with pytest.raises(errors.ModuleError) as info:
            other.first(jnp.ones(1))
    assert "not its parent" in info.value.message
    with pytest.raises(errors.ModuleError):
        _ = PAIR.first.parameters
    with pytest.raises(errors.ModuleError):
        functional(PAIR, None, STATE, (), method="keys", is_training=True)
    with pytest.raises(errors.ModuleError):
        child_context("x")


def test_context_stack_is_restored():
    assert current_context() is None
    with bind(PAIR, STATE) as context:
        assert current_context() is context
        PAIR.forward(jnp.ones(1))
    assert current_context() is None


def test_bind_collects_outputs():
    with bind(PAIR, STATE, prng_key=KEY) as context:
        PAIR.first(jnp.ones(2))
    assert "first" in context.output_collection.summaries


def test_output_collection_is_a_pytree():
    collection = OutputCollection(summaries={"a": jnp.ones(2)})
    doubled = jax.tree_util.tree_map(lambda x: 2 * x, collection)
    np.testing.assert_allclose(doubled.summaries["a"], 2.0)


def _loss(state, x):
    out, _ = functional(PAIR, None, state, (x,), is_training=False)
    return jnp.sum(out)


def test_functional_under_jit_and_grad():
    x = jnp.arange(3.0)
    assert float(jax.jit(_loss)(STATE, x)) == pytest.approx(18.0)
    grads = jax.grad(_loss)(STATE, x)
    np.testing.assert_allclose(grads["first"]["w"], 3.0 * 3.0)  # d/dw1 sum(x*w1*w2) = sum(x)*w2
    np.testing.assert_allclose(grads["second"]["w"], 3.0 * 2.0)


def test_functional_under_checkpoint_and_scan():
    x = jnp.arange(3.0)
    np.testing.assert_allclose(jax.grad(jax.checkpoint(_loss))(STATE, x)["first"]["w"], 9.0)

    def body(carry, scale):
        state = {"first": {"w": scale}, "second": {"w": jnp.float32(1.0)}}
        return carry + _loss(state, x), None

    total, _ = jax.lax.scan(body, 0.0, jnp.array([1.0, 2.0]))
    assert float(total) == pytest.approx(9.0)


def test_functional_under_shard_map():
    mesh = MeshSpec(axes=("data",)).build()

    def local(state, x):
        return collectives.psum(_loss(state, x), "data")

    total = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))(
        STATE, jnp.arange(8.0))
    assert float(total) == pytest.approx(6.0 * 28.0)


class Stack(Module):
    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        self._add_child("layer", Scale.default_config())

    def forward(self, x):
        def body(carry, _):
            return self.layer(carry), None
        out, _ = scan_in_context(body, carry=x, xs=None, child_name="layer", num_iterations=3)
        return out

    def keys(self):
        def body(carry, _):
            return carry, self.layer.key_bits()
        return scan_in_context(body, carry=0, xs=None, child_name="layer", num_iterations=3)[1]


def test_scan_in_context_over_stacked_params():
    stack = Stack.default_config().set(name="stack").instantiate()
    state = {"layer": {"w": jnp.array([2.0, 3.0, 4.0])}}
    out, collection = functional(stack, KEY, state, (jnp.ones(2),), is_training=False)
    np.testing.assert_allclose(out, 24.0)
    np.testing.assert_allclose(collection.summaries["layer"]["mean_in"], [1.0, 2.0, 6.0])
    keys, _ = functional(stack, KEY, state, (), method="keys", is_training=True)
    assert len({tuple(np.asarray(k).ravel()) for k in keys}) == 3


def test_named_scopes_carry_module_paths():
    text = jax.jit(_loss).lower(STATE, jnp.ones(2)).as_text(debug_info=True)
    assert "pair/first" in text and "pair/second" in text


def test_context_clone_resets_call_counts():
    context = InvocationContext(name="x", module=None, state={}, is_training=True, prng_key=None,
                                output_collection=OutputCollection(), child_calls={"a": 2})
    assert context.clone().child_calls == {} and context.clone(name="y").path == "y"
