"""LayerNorm and RMSNorm (statistics in float32 -- or wider -- whatever the activation dtype)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from titanax.config import REQUIRED, Required
from titanax.modules.base_layer import BaseLayer, ParameterSpec, constant
from titanax.utils.dtypes import at_least_float32


class LayerNorm(BaseLayer):
    """``(x - mean) / sqrt(var + eps) * scale + bias`` over the last dimension."""

    class Config(BaseLayer.Config):
        # Size of the normalised (last) dimension.
        input_dim: Required[int] = REQUIRED
        # Added to the variance (GPT-2: 1e-5).
        eps: float = 1e-5
        # Learn a bias.
        bias: bool = True

    def _create_layer_parameter_specs(self):
        cfg = self.config
        specs = {"scale": ParameterSpec(shape=(cfg.input_dim,), initializer=constant(1.0),
                                        weight_decay_scale=0.0)}
        if cfg.bias:
            specs["bias"] = ParameterSpec(shape=(cfg.input_dim,), initializer=constant(0.0),
                                          weight_decay_scale=0.0)
        return specs

    def forward(self, x):
        cfg = self.config
        x32 = at_least_float32(x)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + cfg.eps) * self.parameters["scale"]
        if cfg.bias:
            y = y + self.parameters["bias"]
        return y.astype(x.dtype)


class RMSNorm(BaseLayer):
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last dimension."""

    class Config(BaseLayer.Config):
        # Size of the normalised (last) dimension.
        input_dim: Required[int] = REQUIRED
        # Added to the mean square.
        eps: float = 1e-6
        # The param is the scale's offset from 1: x / rms(x) * (1 + param), the param starting
        # at 0 (Gemma's and Qwen 3.5's "zero-centered" RMSNorm).
        zero_centered: bool = False

    def _create_layer_parameter_specs(self):
        start = 0.0 if self.config.zero_centered else 1.0
        return {"scale": ParameterSpec(shape=(self.config.input_dim,),
                                       initializer=constant(start), weight_decay_scale=0.0)}

    def forward(self, x):
        x32 = at_least_float32(x)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
                                + self.config.eps)
        scale = self.parameters["scale"]
        if self.config.zero_centered:
            scale = 1.0 + scale.astype(y.dtype)
        return (y * scale).astype(x.dtype)
