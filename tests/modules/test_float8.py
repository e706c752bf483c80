"""FP8 projections (titanax/modules/float8.py) against a written-out emulation in numpy.

The emulation follows the recipe as the docs state it, with ml_dtypes' float8 types: each
operand scaled so its absolute maximum (per tensor, or per row of the contraction) lands on the
float8 type's largest value, rounded to the type (e4m3 forward, the incoming gradient e5m2),
multiplied exactly (float64) and scaled back. The products of float8 values are exact in
float32, so ours differs from it only by float32 summation order: bounded at each entry by
``K x 2^-23`` times the sum of the absolute products (``_bound``). Quantization itself moves
the result far more than that (checked: the float8 result is not the unquantized product).
"""

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.modules import float8
from titanax.observe import dot_operands

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _quantized(t, dtype, axis):
    """``(q as float64, scale)``: the emulation of one operand's quantization."""
    t = np.asarray(t, np.float32)
    top = np.float32(ml_dtypes.finfo(dtype).max)
    amax = np.abs(t).max(axis=axis, keepdims=True) if axis is not None else \
        np.abs(t).max(keepdims=True)
    scale = np.where(amax > 0, amax / top, np.float32(1)).astype(np.float32)
    q = np.clip(t / scale, -top, top).astype(dtype)
    return q.astype(np.float64), scale.astype(np.float64)


def _emulated(x, w, g, *, rowwise):
    """Forward ``x @ w``, and the gradients of ``sum(y * g)``: ``dx = g @ w^T`` and
    ``dw = x^T @ g``, each product of float8 operands quantized along its contraction;
    also each entry's bound on float32 summation order."""
    out = {}
    xq, xs = _quantized(x, E4M3, -1 if rowwise else None)
    wq, ws = _quantized(w, E4M3, -2 if rowwise else None)
    out["y"] = (xq @ wq * xs * ws, np.abs(xq) @ np.abs(wq) * xs * ws)
    gq, gs = _quantized(g, E5M2, -1 if rowwise else None)
    wq, ws = _quantized(w, E4M3, -1 if rowwise else None)
    out["dx"] = (gq @ np.swapaxes(wq, -1, -2) * gs * np.swapaxes(ws, -1, -2),
                 np.abs(gq) @ np.abs(np.swapaxes(wq, -1, -2)) * gs * np.swapaxes(ws, -1, -2))
    xq, xs = _quantized(x, E4M3, -2 if rowwise else None)
    gq, gs = _quantized(g, E5M2, -2 if rowwise else None)
    out["dw"] = (np.swapaxes(xq, -1, -2) @ gq * np.swapaxes(xs, -1, -2) * gs,
                 np.abs(np.swapaxes(xq, -1, -2)) @ np.abs(gq) * np.swapaxes(xs, -1, -2) * gs)
    return out


def _bound(absolute, terms):
    return terms * 2.0 ** -23 * absolute + 1e-30


@pytest.mark.parametrize("rowwise", [False, True], ids=["per tensor", "row-wise"])
@pytest.mark.parametrize("batch", [(), (3,)], ids=["matmul", "batched (experts)"])
def test_matmul_and_its_gradients_equal_the_written_out_emulation(rowwise, batch):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    t, k, n = 12, 40, 24
    # Rows of different magnitudes, so per-row scales differ from the tensor's.
    x = jax.random.normal(keys[0], batch + (t, k)) * jnp.linspace(0.1, 5.0, t)[:, None]
    w = jax.random.normal(keys[1], batch + (k, n)) * 0.05
    g = jax.random.normal(keys[2], batch + (t, n)) * 1e-3
    y, backward = jax.vjp(lambda a, b: float8.matmul(a, b, rowwise), x, w)
    dx, dw = backward(g)
    want = _emulated(np.asarray(x), np.asarray(w), np.asarray(g), rowwise=rowwise)
    for name, got, terms in (("y", y, k), ("dx", dx, n), ("dw", dw, t)):
        value, absolute = want[name]
        error = np.abs(np.asarray(got, np.float64) - value)
        assert np.all(error <= _bound(absolute, terms)), (name, error.max())
    # Quantized: far from the unquantized product (3 mantissa bits: ~1e-2 relative).
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.max(np.abs(np.asarray(y) - exact)) > 1e-3 * np.max(np.abs(exact))


def test_a_zero_operand_quantizes_to_zero_with_scale_one():
    q, scale = float8.quantize(jnp.zeros((4, 3)), float8.FORWARD, contraction=None)
    assert np.all(np.asarray(q, np.float32) == 0) and float(scale.squeeze()) == 1.0
    q, scale = float8.quantize(jnp.asarray([[0.0, 0.0], [3.0, -6.0]]), float8.FORWARD,
                               contraction=1)
    # (XLA may divide by the constant 448 as a multiplication by its inverse: one rounding.)
    np.testing.assert_allclose(np.asarray(scale).ravel(), [1.0, 6.0 / 448.0], rtol=2.0 ** -23)
    np.testing.assert_array_equal(np.asarray(q, np.float32), [[0, 0], [224, -448]])


EQUATIONS = [
    # (equation, x shape, w shape, x reshaped [.., T, K], w reshaped [.., K, N])
    ("bsd,dhk->bshk", (2, 5, 8), (8, 3, 4), (10, 8), (8, 12)),
    ("...d,dtf->...tf", (2, 5, 8), (8, 2, 6), (10, 8), (8, 12)),
    ("bsr,rhk->bshk", (2, 5, 4), (4, 2, 3), (10, 4), (4, 6)),
    ("end,edtf->entf", (3, 5, 8), (3, 8, 2, 6), (3, 5, 8), (3, 8, 12)),
]


@pytest.mark.parametrize("equation,x_shape,w_shape,x2,w2", EQUATIONS,
                         ids=[e[0] for e in EQUATIONS])
def test_the_layers_projections_are_read_as_matmuls(equation, x_shape, w_shape, x2, w2):
    x = jax.random.normal(jax.random.PRNGKey(1), x_shape).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(2), w_shape).astype(jnp.bfloat16)
    with float8.scope(float8.Float8Settings()):
        got = float8.einsum(equation, x, w)
        # float32 activations (a layer's deliberately wide ones) are not quantized.
        wide = float8.einsum(equation, x.astype(jnp.float32), w.astype(jnp.float32))
    want_shape = jnp.einsum(equation, x, w).shape
    by_hand = float8.matmul(x.reshape(x2), w.reshape(w2), False).reshape(want_shape)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(by_hand, np.float32))
    np.testing.assert_array_equal(
        np.asarray(wide), np.asarray(jnp.einsum(equation, x.astype(jnp.float32),
                                                w.astype(jnp.float32))))
    # Outside a scope: the plain einsum.
    np.testing.assert_array_equal(np.asarray(float8.einsum(equation, x, w), np.float32),
                                  np.asarray(jnp.einsum(equation, x, w), np.float32))


def test_a_product_that_is_no_projection_is_refused_inside_a_scope():
    """A weight contracted on its last dimension, and operands whose ranks the equation does
    not name (jnp.einsum refuses those; a reshape into a matmul would not)."""
    x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((6, 8), jnp.bfloat16)
    with float8.scope(float8.Float8Settings()):
        with pytest.raises(errors.ModuleError, match="'sd,hd->sh' .*is not a .*matmul"):
            float8.einsum("sd,hd->sh", x, w)
        with pytest.raises(errors.ModuleError, match=r"'td,df->tf' \(input \(2, 3, 8\)"):
            float8.einsum("td,df->tf", jnp.ones((2, 3, 8), jnp.bfloat16),
                          jnp.ones((24, 5), jnp.bfloat16))


def test_xla_is_handed_float8_dots_forward_and_backward():
    """The lowered program (before any backend pass): e4m3 x e4m3 forward, e5m2 gradient with
    the e4m3 weight (dx) and the e4m3 input with the e5m2 gradient (dw)."""
    x = jnp.ones((2, 5, 8), jnp.bfloat16)
    w = jnp.ones((8, 3, 4), jnp.bfloat16)

    def loss(a, b):
        with float8.scope(float8.Float8Settings()):
            return jnp.sum(float8.einsum("bsd,dhk->bshk", a, b).astype(jnp.float32))

    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    assert dot_operands.dot_operand_types(text) == {
        ("f8E4M3FN", "f8E4M3FN"): 1, ("f8E5M2", "f8E4M3FN"): 1, ("f8E4M3FN", "f8E5M2"): 1}
    assert dot_operands.float8_dots(text) == (3, 3)
