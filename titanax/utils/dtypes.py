"""Float dtypes that are "float32 or wider": where Titanax computes in float32 whatever the
activation dtype (norm statistics, softmax logits, losses, gradient sums), a float64 run keeps
float64.

Down-casting a float64 run there would cap its precision at float32's, and the float64 run is
what tells a layout defect (an error of 1e-3) from reduction-order noise (1e-7 in float32,
1e-16 in float64): ``Precision.Config.float64``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def wide_float(dtype: Any) -> jnp.dtype:
    """float32 for 16-bit (and non-float) dtypes, the dtype itself when it is float32 or wider."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return jnp.dtype(jnp.float32)
    return jnp.dtype(jnp.promote_types(dtype, jnp.float32))


def at_least_float32(x: Any) -> Any:
    """``x`` in ``wide_float(x.dtype)`` (unchanged when it already is)."""
    x = jnp.asarray(x)
    dtype = wide_float(x.dtype)
    return x if x.dtype == dtype else x.astype(dtype)


def lowest(dtype: Any) -> Any:
    """The most negative finite value of ``wide_float(dtype)`` (a masked score)."""
    return jnp.finfo(wide_float(dtype)).min


def fused_attention_fits(dtype: Any) -> bool:
    """Whether attention of ``dtype`` inputs goes to ``jax.nn.dot_product_attention``: on a GPU,
    where it can run cuDNN's fused kernel, and not for float64 (its XLA path rounds through
    float32: 1e-7 off, measured on jax 0.10.2). Elsewhere it would run the same XLA math as the
    written-out attention (``modules/layers/softmax_attention.py``), only laid out worse."""
    import jax  # pylint: disable=import-outside-toplevel
    return jax.default_backend() == "gpu" and jnp.dtype(dtype) != jnp.float64
