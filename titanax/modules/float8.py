"""FP8 matmuls for the model's projections (``--config.precision.fp8=True``).

Inside ``scope(...)`` every projection a layer computes with ``einsum`` below (the linear
layers, attention's q/k/v/o, the MLP's matrices, the experts' batched ones -- not the dropless
experts' ``ragged_dot``, refused instead: ``projection.py``, ``moe.py``) multiplies
float8 operands: the activations and the weights in ``float8_e4m3fn`` forward (3 mantissa
bits, range 448), the gradient flowing back in ``float8_e5m2`` (2 mantissa bits, range 57344:
gradients need range more than precision), each product accumulated in float32 and scaled
back. Master weights, the optimizer and every other op (norms, softmax, the loss) stay as the
precision policy has them: this is TorchTitan's Float8 linear and Transformer Engine's recipe,
with *current* scaling -- each operand's scale is computed from the operand itself, on the
step that uses it (its absolute maximum over the max of the float8 type), so there is no
scale history to carry between steps or to checkpoint, and a resumed run quantizes exactly as
an uninterrupted one.

Scaling is per tensor by default -- per the part of it a device holds: under tensor or data
parallelism each device scales its own shard, as TorchTitan's per-rank activations are --
or, with ``rowwise``, per row of the contraction: each row of the left operand and each
column of the right one has its own scale (finer, less loss from one outlier; the backward
products re-quantize along their own contraction dimension).

XLA is handed ``dot_general`` on float8 operands with a float32 result. XLA:CPU computes such
a dot by upcasting after its optimizations (the numbers are the float8 values', the speed is
not); a GPU with float8 tensor cores (Hopper and later) keeps them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import threading
from typing import Iterator, Optional, Tuple

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.config import Configurable

FORWARD = jnp.float8_e4m3fn
BACKWARD = jnp.float8_e5m2
# The compute dtype whose projections go through float8 (float32 activations, which a layer
# keeps on purpose -- a gate's logits -- stay as they are).
QUANTIZED_INPUT = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Float8Settings:
    """How the scope quantizes."""

    # Scales per row of the contraction instead of per tensor.
    rowwise: bool = False


_STATE = threading.local()


def current() -> Optional[Float8Settings]:
    return getattr(_STATE, "settings", None)


@contextlib.contextmanager
def scope(settings: Optional[Float8Settings]) -> Iterator[None]:
    """Projections traced inside run in float8 as ``settings`` says (None: as they are)."""
    previous = current()
    _STATE.settings = settings
    try:
        yield
    finally:
        _STATE.settings = previous


# --- Quantization ------------------------------------------------------------------------------


def quantize(t: jax.Array, dtype, *, contraction: Optional[int]) -> Tuple[jax.Array, jax.Array]:
    """``(q, scale)`` with ``q * scale ~ t`` and ``q`` in the float8 ``dtype``: the scale maps
    ``t``'s absolute maximum -- over the whole tensor, or (``contraction``: an axis) over that
    axis, one scale per row of the other axes -- onto the float8 type's largest value. An
    all-zero row gets scale 1 (its values are 0 either way)."""
    top = float(jnp.finfo(dtype).max)
    wide = t.astype(jnp.float32)
    axes = tuple(range(t.ndim)) if contraction is None else (contraction,)
    amax = jnp.max(jnp.abs(wide), axis=axes, keepdims=True)
    # (An amax below top x float32's smallest normal would give a subnormal scale that XLA
    # flushes to 0; such a tensor is 0 in float8 whatever its scale.)
    scale = jnp.where(amax > top * jnp.finfo(jnp.float32).tiny, amax / top, 1.0)
    q = jnp.clip(wide / scale, -top, top).astype(dtype)
    return q, scale


def _dot(a: jax.Array, b: jax.Array, contract: Tuple[int, int], *, out=jnp.float32
         ) -> jax.Array:
    """``a [B.., M, K]`` with ``b [B.., K, N]`` (or the dims ``contract`` names), batched over
    the leading dims both share, accumulated in float32 and returned in ``out``."""
    batch = tuple(range(a.ndim - 2))
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), (batch, batch)),
                               preferred_element_type=out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x: jax.Array, w: jax.Array, rowwise: bool) -> jax.Array:
    """``x [B.., T, K] @ w [B.., K, N]`` in float8 (e4m3 operands), in ``x``'s dtype; its
    gradients are float8 products too (the incoming gradient in e5m2)."""
    return _forward(x, w, rowwise)


def _forward(x: jax.Array, w: jax.Array, rowwise: bool) -> jax.Array:
    xq, x_scale = quantize(x, FORWARD, contraction=x.ndim - 1 if rowwise else None)
    wq, w_scale = quantize(w, FORWARD, contraction=w.ndim - 2 if rowwise else None)
    # The dot's result in x's dtype (bfloat16): what a remat policy that saves dots keeps is
    # then as large as the bfloat16 product's, not twice that in float32.
    y = _dot(xq, wq, (x.ndim - 1, w.ndim - 2), out=x.dtype)
    return (y.astype(jnp.float32) * x_scale * w_scale).astype(x.dtype)


def _matmul_forward(x, w, rowwise):
    return _forward(x, w, rowwise), (x, w)


def _matmul_backward(rowwise, saved, g):
    """``dx = g @ w^T`` (contraction over N) and ``dw = x^T @ g`` (over T), each operand
    quantized along the dimension its product contracts."""
    x, w = saved
    last = g.ndim - 1
    gq, g_scale = quantize(g, BACKWARD, contraction=last if rowwise else None)
    wq, w_scale = quantize(w, FORWARD, contraction=last if rowwise else None)
    dx = _dot(gq, wq, (last, last)) * g_scale * jnp.swapaxes(w_scale, -1, -2)
    xq, x_scale = quantize(x, FORWARD, contraction=last - 1 if rowwise else None)
    gq_t, g_scale_t = (quantize(g, BACKWARD, contraction=last - 1) if rowwise
                       else (gq, g_scale))
    dw = _dot(xq, gq_t, (last - 1, last - 1)) * jnp.swapaxes(x_scale, -1, -2) * g_scale_t
    return dx.astype(x.dtype), dw.astype(w.dtype)


matmul.defvjp(_matmul_forward, _matmul_backward)


# --- Projections written as einsums ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Projection:
    """An einsum ``x, w -> y`` read as a (batched) matmul: ``batch`` letters lead both operands
    and the result, ``x``'s last letters are contracted with ``w``'s first (after the batch),
    and the result is batch, x's other letters, w's other letters."""

    batch: str
    rows: str
    contracted: str
    columns: str


@functools.lru_cache(maxsize=None)
def _read(equation: str, x_ndim: int, w_ndim: int) -> Optional[_Projection]:
    if equation.count(",") != 1 or equation.count("->") != 1:
        return None
    lhs, rest = equation.replace(" ", "").split(",")
    rhs, out = rest.split("->")
    if "..." in lhs:
        free = "".join(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation)
        fill = free[:x_ndim - (len(lhs) - 3)]
        lhs, out = lhs.replace("...", fill), out.replace("...", fill)
    if "..." in rhs or not re.fullmatch(r"[A-Za-z]+", lhs + rhs + out) or \
            len(lhs) != x_ndim or len(rhs) != w_ndim:
        return None
    batch = "".join(c for c in lhs if c in rhs and c in out)
    contracted = "".join(c for c in lhs if c in rhs and c not in out)
    rows = "".join(c for c in lhs if c not in rhs)
    columns = "".join(c for c in rhs if c not in lhs)
    if lhs != batch + rows + contracted or rhs != batch + contracted + columns or \
            out != batch + rows + columns or not contracted:
        return None
    return _Projection(batch=batch, rows=rows, contracted=contracted, columns=columns)


def einsum(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.einsum(equation, x, w)`` -- in float8 inside a ``scope`` where ``x`` is in the
    compute dtype (bfloat16). ``equation`` must read as a projection (``_Projection``); one
    that does not is refused inside a scope rather than computed in bfloat16 unnoticed."""
    settings = current()
    if settings is None or x.dtype != QUANTIZED_INPUT:
        return jnp.einsum(equation, x, w)
    form = _read(equation, x.ndim, w.ndim)
    if form is None:
        raise errors.ModuleError(
            f"the projection {equation!r} (input {tuple(x.shape)}, weight {tuple(w.shape)}) is "
            "not a (batched) matmul of the input's last dimensions with the weight's first: "
            "FP8 cannot compute it", path="precision.fp8",
            suggestion="write the product as x[batch.., rows.., in..] x w[batch.., in.., "
                       "out..], or leave precision.fp8 off")
    nb, nr, nk = len(form.batch), len(form.rows), len(form.contracted)
    batch_shape = x.shape[:nb]
    rows_shape, columns_shape = x.shape[nb:nb + nr], w.shape[nb + nk:]
    x2 = x.reshape(batch_shape + (math.prod(rows_shape), math.prod(x.shape[nb + nr:])))
    w2 = w.reshape(batch_shape + (math.prod(w.shape[nb:nb + nk]), math.prod(columns_shape)))
    y = matmul(x2, w2, settings.rowwise)
    return y.reshape(batch_shape + rows_shape + columns_shape)


# --- The model converter (modules/converters.py) -----------------------------------------------


class Float8(Configurable):
    """FP8 projections as a model converter: no params added, none frozen; the step is traced
    in its ``scope``. Built from ``precision.fp8`` / ``precision.fp8_rowwise``."""

    class Config(Configurable.Config):
        # Scale per row of each contraction instead of per tensor.
        rowwise: bool = False

    def check_model(self, model) -> None:
        """Refused where no layer of the model computes its projections through
        ``projection.py`` (a hand-written step, an adapted Flax module): FP8 would change
        nothing, silently."""
        if model is None or not model.adaptable_weight_paths():
            what = ("a hand-written step has none" if model is None else
                    f"{type(model).__qualname__}'s layers compute their own products (none "
                    "goes through Titanax's projections)")
            raise errors.ConfigError(f"FP8 computes the model's projections in float8; {what}",
                                     path="precision.fp8",
                                     suggestion="use a Titanax decoder model, or leave "
                                                "precision.fp8 off")

    @staticmethod
    def convert_specs(specs, *, model):
        del model
        return specs

    def scope(self):
        return scope(Float8Settings(rowwise=self.config.rowwise))

    @staticmethod
    def base_scope():
        # (A frozen reference computes as the policy does: in float8 too.)
        return contextlib.nullcontext()

    @staticmethod
    def split_added(tree):
        return tree, {}

    @staticmethod
    def join_added(base, added):
        del added
        return base

    frozen_dtype = None

