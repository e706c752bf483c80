"""Precision policy: what dtype params are stored in, what dtype the model computes in, and
dynamic loss scaling for float16.

``float64=True`` stores and computes everything in float64 (jax's ``jax_enable_x64`` must be on):
not for training, for numerical checks -- a sharded step and a one-device step then agree to
~1e-12 where float32 leaves them ~1e-6 apart by summation order alone, so a layout defect (1e-3
and more) stands out on any CPU.

``bfloat16=True`` computes in bfloat16; ``enable_x32_params=True`` keeps float32 master params
(cast to the compute dtype for each forward pass, so gradients and the optimizer update are
float32). float16 needs loss scaling: its range tops out at 65504 and small gradients flush to
zero, so the loss is multiplied by a scale before differentiation and the gradients divided by it
after; a step whose gradients overflow is skipped and the scale halved, and after
``growth_interval`` good steps the scale doubles.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.config import Configurable


class Precision(Configurable):
    """Mixed-precision settings (the seed's ``Precision``)."""

    class Config(Configurable.Config):
        # Compute in bfloat16.
        bfloat16: bool = False
        # Compute in float16 (use with loss_scaling).
        fp16: bool = False
        # Params and compute in float64 (numerical checks; needs jax_enable_x64, e.g. inside
        # ``with jax.enable_x64(True):``).
        float64: bool = False
        # Compute the model's projections (linear layers, attention's and the MLP's and
        # experts' matrices) in float8: e4m3 operands forward, the gradient in e5m2, scaled per
        # tensor from the tensor itself (current scaling; modules/float8.py). Needs bfloat16.
        fp8: bool = False
        # With fp8: one scale per row of each contraction instead of per tensor.
        fp8_rowwise: bool = False
        # Dynamic loss scaling (required with fp16; harmless otherwise).
        loss_scaling: bool = False
        # Accept fp16 without loss scaling anyway (e.g. to show why it is needed); by default such
        # a config is refused, since it typically turns the loss into NaN within a few steps.
        allow_unscaled_fp16: bool = False
        # Keep params (and the optimizer update) in float32 while computing in 16 bits. Always
        # on with fp16: float16 optimizer arithmetic breaks (Adam's second moment of a 1e-4
        # gradient is below float16's smallest number, and eps=1e-8 rounds to 0: the update is
        # inf), so float16 runs keep float32 master params, as every AMP recipe does.
        enable_x32_params: bool = False
        # First loss scale.
        initial_loss_scale: float = 2.0 ** 15
        # Good steps before the loss scale doubles.
        growth_interval: int = 2000
        # The scale never drops below this (below 1 when even unscaled gradients overflow).
        min_loss_scale: float = 2.0 ** -16

        def _validate_values(self):
            if self.bfloat16 and self.fp16:
                yield "fp16", "choose bfloat16 or fp16, not both"
            if self.float64 and (self.bfloat16 or self.fp16):
                yield "float64", "float64 computes in float64: not with bfloat16 or fp16"
            if self.fp8 and not self.bfloat16:
                yield "fp8", ("float8 projections quantize bfloat16 activations: set "
                              "bfloat16=true with fp8 (fp16 and float64 do not combine with it)")
            if self.fp8_rowwise and not self.fp8:
                yield "fp8_rowwise", "chooses how fp8 scales: set fp8=true as well"
            if self.fp16 and not self.loss_scaling and not self.allow_unscaled_fp16:
                yield "loss_scaling", ("float16 needs loss scaling: without it small gradients "
                                       "flush to zero and large ones overflow within steps; set "
                                       "loss_scaling=true (or allow_unscaled_fp16=true to "
                                       "accept that)")
            if not (math.isfinite(self.initial_loss_scale) and self.initial_loss_scale > 0):
                yield "initial_loss_scale", f"must be a finite number > 0, got " \
                                            f"{self.initial_loss_scale}"
            if not (math.isfinite(self.min_loss_scale) and self.min_loss_scale > 0):
                yield "min_loss_scale", f"must be a finite number > 0, got {self.min_loss_scale}"
            elif math.isfinite(self.initial_loss_scale) and \
                    self.min_loss_scale > self.initial_loss_scale:
                yield "min_loss_scale", (f"must not exceed initial_loss_scale "
                                         f"({self.initial_loss_scale}), got {self.min_loss_scale}")
            if self.growth_interval < 1:
                yield "growth_interval", f"must be >= 1, got {self.growth_interval}"

    def __init__(self, cfg=None, **fields):
        super().__init__(cfg, **fields)
        if self.config.float64 and not jax.config.jax_enable_x64:
            raise errors.ConfigError(
                "float64 needs jax's 64-bit mode, which is off", path="precision.float64",
                suggestion="run inside `with jax.enable_x64(True):` (or set JAX_ENABLE_X64=1), "
                           "or leave float64 off")

    @property
    def compute_dtype(self) -> jnp.dtype:
        cfg = self.config
        return jnp.dtype(jnp.bfloat16 if cfg.bfloat16 else jnp.float16 if cfg.fp16
                         else jnp.float64 if cfg.float64 else jnp.float32)

    @property
    def param_dtype(self) -> jnp.dtype:
        """Storage dtype of params: float32 with enable_x32_params, and always with fp16."""
        if self.config.enable_x32_params or self.config.fp16:
            return jnp.dtype(jnp.float32)
        return self.compute_dtype

    def cast_params_for_storage(self, params: Any) -> Any:
        return _cast_floats(params, self.param_dtype)

    def cast_for_compute(self, tree: Any) -> Any:
        """Float leaves to the compute dtype (integers, e.g. token ids, untouched)."""
        return _cast_floats(tree, self.compute_dtype)

    def initial_scale_state(self) -> Optional[dict]:
        if not self.config.loss_scaling:
            return None
        return {"scale": jnp.float32(self.config.initial_loss_scale),
                "good_steps": jnp.int32(0)}

    def next_scale_state(self, state: dict, grads_finite: jax.Array) -> dict:
        """Halve on overflow; double after growth_interval good steps."""
        good = jnp.where(grads_finite, state["good_steps"] + 1, 0)
        grow = good >= self.config.growth_interval
        scale = jnp.where(grads_finite, jnp.where(grow, state["scale"] * 2.0, state["scale"]),
                          jnp.maximum(state["scale"] / 2.0,
                                      self.config.min_loss_scale))
        return {"scale": scale, "good_steps": jnp.where(grow, 0, good).astype(jnp.int32)}


def _cast_floats(tree: Any, dtype) -> Any:
    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x
    return jax.tree_util.tree_map(cast, tree)
