"""The gated delta rule: the chunked form equals the token-by-token recurrence (outputs, final
state and every gradient, in float64, for chunk sizes that do and do not divide the sequence,
grouped heads and a starting state); both equal transformers' own Qwen 3.5 implementations;
packed documents never read each other's memory; and the chunked gradient's memory grows
linearly in the sequence."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from titanax.modules.layers.gated_delta_rule import (chunked_gated_delta_rule,
                                                     recurrent_gated_delta_rule)
from tests.numerics import assert_close

pytestmark = pytest.mark.usefixtures("float64_numerics")


def _inputs(*, batch=2, length=37, key_heads=2, heads=4, d_k=8, d_v=6, seed=0,
            dtype=np.float64):
    """Random inputs as a Gated DeltaNet layer makes them: unit keys and queries, decays
    ``g < 0``, write strengths in (0, 1), and a random starting state."""
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    return dict(
        q=unit(rng.normal(size=(batch, length, key_heads, d_k))).astype(dtype),
        k=unit(rng.normal(size=(batch, length, key_heads, d_k))).astype(dtype),
        v=rng.normal(size=(batch, length, heads, d_v)).astype(dtype),
        g=-rng.uniform(0.01, 0.7, size=(batch, length, heads)).astype(dtype),
        beta=rng.uniform(0.05, 0.95, size=(batch, length, heads)).astype(dtype),
        initial_state=rng.normal(size=(batch, heads, d_k, d_v)).astype(dtype))


def _call(rule, inputs, **options):
    x = dict(inputs)
    return rule(x.pop("q"), x.pop("k"), x.pop("v"), x.pop("g"), x.pop("beta"), **x, **options)


def _outputs_state_and_gradients(rule, **options):
    """``rule``'s outputs and final state on ``_inputs()``, and the gradient of a random
    weighting of both with respect to every input -- as numpy, each a compiled program."""
    inputs = _inputs()
    weights = np.random.default_rng(1).normal(size=(2, 37, 4, 6))
    state_weights = np.random.default_rng(2).normal(size=(2, 4, 8, 6))

    def f(tree):
        out, state = _call(rule, tree, **options)
        return jnp.sum(out * weights) + jnp.sum(state * state_weights), (out, state)
    grads, (out, state) = jax.jit(jax.grad(f, has_aux=True))(inputs)
    return np.asarray(out), np.asarray(state), jax.tree_util.tree_map(np.asarray, grads)


@functools.lru_cache(maxsize=None)
def _recurrence():
    """The token-by-token recurrence's (once for every chunk size compared with it)."""
    return _outputs_state_and_gradients(recurrent_gated_delta_rule)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunks_give_the_recurrences_outputs_state_and_gradients(chunk_size):
    """37 tokens: chunks of 5 and 16 leave a part chunk, 64 is one padded chunk, 1 is the
    recurrence itself in the chunked code."""
    want_out, want_state, want = _recurrence()
    got_out, got_state, got = _outputs_state_and_gradients(chunked_gated_delta_rule,
                                                           chunk_size=chunk_size)
    assert got_out.shape == (2, 37, 4, 6) and got_state.shape == (2, 4, 8, 6)
    assert_close(got_out, want_out, what="outputs")
    assert_close(got_state, want_state, what="final state")
    for name in want:
        assert_close(got[name], want[name], what=f"d/d{name}")


@pytest.mark.parametrize("key_heads", [4, 2], ids=["one-key-head-per-value-head", "grouped"])
def test_both_forms_equal_transformers_qwen3_5_implementations(key_heads):
    """transformers' own Qwen 3.5 code (its token loop and its chunked form, which compute in
    float32) on the same float32 inputs: within float32's rounding of the outputs' scale."""
    torch = pytest.importorskip("torch")
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    inputs = _inputs(key_heads=key_heads, length=70, dtype=np.float32)
    ours = {"recurrent": _call(recurrent_gated_delta_rule, inputs),
            "chunked": _call(chunked_gated_delta_rule, inputs, chunk_size=32)}
    torch_inputs = {k: torch.tensor(v) for k, v in inputs.items()}
    theirs = {"recurrent": qwen.torch_recurrent_gated_delta_rule(
                  torch_inputs["q"], torch_inputs["k"], torch_inputs["v"], torch_inputs["g"],
                  torch_inputs["beta"], initial_state=torch_inputs["initial_state"],
                  output_final_state=True),
              "chunked": qwen.torch_chunk_gated_delta_rule(
                  torch_inputs["q"], torch_inputs["k"], torch_inputs["v"], torch_inputs["g"],
                  torch_inputs["beta"], chunk_size=32,
                  initial_state=torch_inputs["initial_state"], output_final_state=True)}
    for form, (out, state) in ours.items():
        want_out, want_state = (t.detach().numpy() for t in theirs[form])
        assert out.dtype == jnp.float32 and state.dtype == jnp.float32
        for got, want, what in ((out, want_out, "outputs"), (state, want_state, "state")):
            scale = np.abs(want).max()
            np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 * scale,
                                       err_msg=f"{form} {what}")


def test_packed_documents_are_computed_as_if_alone():
    """Three documents packed in one row (and a row of one): each document's outputs are those
    of the rule run on it alone from an empty state; the final state is the last document's."""
    inputs = _inputs(batch=1, length=40)
    inputs.pop("initial_state")
    bounds = [(0, 11), (11, 30), (30, 40)]
    segments = np.concatenate([np.full(e - s, i) for i, (s, e) in enumerate(bounds)])[None]
    for rule, options in ((recurrent_gated_delta_rule, {}),
                          (chunked_gated_delta_rule, {"chunk_size": 8})):
        packed_out, packed_state = _call(rule, inputs, segment_ids=segments, **options)
        for start, end in bounds:
            alone = {k: v[:, start:end] for k, v in inputs.items()}
            out, state = _call(recurrent_gated_delta_rule, alone)
            assert_close(np.asarray(packed_out[:, start:end]), np.asarray(out),
                         what=f"{rule.__name__} document {start}:{end}")
        assert_close(np.asarray(packed_state), np.asarray(state), what="final state")


def _gradient_temp_bytes(length, chunk_size=64):
    """Temp bytes of the compiled gradient of the chunked rule over ``length`` tokens."""
    shapes = {k: jax.ShapeDtypeStruct(v.shape[:1] + (length,) + v.shape[2:]
                                      if k != "initial_state" else v.shape, jnp.float32)
              for k, v in _inputs(batch=1, length=1, heads=2, key_heads=2, d_k=32,
                                  d_v=32).items()}

    def loss(tree):
        out, state = _call(chunked_gated_delta_rule, tree, chunk_size=chunk_size)
        return jnp.sum(out) + jnp.sum(state)

    compiled = jax.jit(jax.grad(loss)).lower(shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_gradients_memory_grows_linearly_in_the_sequence():
    """Doubling the tokens at most doubles the backward's temp memory (plus slack for fixed
    buffers; measured 1.8x and 1.9x): no [S, S] matrix exists. One chunk as long as the whole
    sequence -- the same code -- grows 4x (measured 3.8x), which is what this test would see."""
    sizes = [_gradient_temp_bytes(n) for n in (1024, 2048, 4096)]
    assert sizes[1] / sizes[0] <= 2.2 and sizes[2] / sizes[1] <= 2.2, sizes
    whole = [_gradient_temp_bytes(n, chunk_size=n) for n in (256, 512)]
    assert whole[1] / whole[0] >= 3.0, whole


def test_a_chunk_size_below_one_is_refused():
    with pytest.raises(ValueError, match="chunk_size"):
        _call(chunked_gated_delta_rule, _inputs(length=4), chunk_size=0)
