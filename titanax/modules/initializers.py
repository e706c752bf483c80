"""Parameter initializers: small Configurables that map (key, shape, dtype) to an array.

They are configs so that a model's initialisation is visible in its ``debug_string()`` and can be
overridden from the command line (``--config.model.param_init.stddev=0.01``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from titanax.config import Configurable


class Initializer(Configurable):
    """Base class: ``init(key, shape, dtype, fan_axes) -> array``."""

    def init(self, key: jax.Array, shape: Tuple[int, ...], dtype, *,
             fan_axes: Optional["FanAxes"] = None) -> jax.Array:
        raise NotImplementedError(type(self).__qualname__)


class Constant(Initializer):
    """Every element equals ``value`` (biases: 0, norm scales: 1)."""

    class Config(Initializer.Config):
        # The value of every element.
        value: float = 0.0

        def _validate_values(self):
            if not math.isfinite(self.value):
                yield "value", f"must be finite, got {self.value}"

    def init(self, key, shape, dtype, *, fan_axes=None):
        del key, fan_axes
        return jnp.full(shape, self.config.value, dtype)


class Normal(Initializer):
    """Normal(0, stddev), optionally truncated at two standard deviations."""

    class Config(Initializer.Config):
        # Standard deviation (GPT-2 uses 0.02).
        stddev: float = 0.02
        # Truncate at +-2 stddev.
        truncated: bool = False

        def _validate_values(self):
            if not (math.isfinite(self.stddev) and self.stddev >= 0):
                yield "stddev", f"must be a finite number >= 0, got {self.stddev}"

    def init(self, key, shape, dtype, *, fan_axes=None):
        del fan_axes
        cfg = self.config
        if cfg.truncated:
            return (jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
                    * cfg.stddev).astype(dtype)
        return (jax.random.normal(key, shape, jnp.float32) * cfg.stddev).astype(dtype)


class FanAxes:
    """Which dimensions of a weight are its inputs (fan-in) and outputs (fan-out)."""

    def __init__(self, *, in_axes: Sequence[int], out_axes: Sequence[int],
                 groups: Sequence[int] = (), declared: bool = True):
        self.in_axes = tuple(in_axes)
        self.out_axes = tuple(out_axes)
        # Fan-out dimensions that stack independent matrices (a fused q/k/v projection's 3):
        # counted in the fan for initialisation, a batch of matrices for Muon (train/muon.py).
        self.groups = tuple(groups)
        # False: inferred for a param whose layer named none (a stack's bias, a norm): not a
        # weight matrix, whatever its rank.
        self.declared = declared

    def shifted(self, offset: int) -> "FanAxes":
        """The same axes ``offset`` dimensions later (a stack's leading dimensions added)."""
        return FanAxes(in_axes=[a + offset for a in self.in_axes],
                       out_axes=[a + offset for a in self.out_axes],
                       groups=[a + offset for a in self.groups], declared=self.declared)

    def fan_in(self, shape) -> int:
        return math.prod(shape[a] for a in self.in_axes)

    def fan_out(self, shape) -> int:
        return math.prod(shape[a] for a in self.out_axes)

    def __repr__(self) -> str:
        return f"FanAxes(in={self.in_axes}, out={self.out_axes})"


class VarianceScaling(Initializer):
    """Normal with variance ``scale / fan`` (fan-in by default: LeCun / He style)."""

    class Config(Initializer.Config):
        # Variance numerator (1.0: LeCun normal; 2.0: He normal).
        scale: float = 1.0
        # Which fan divides the variance: "fan_in", "fan_out" or "fan_avg".
        mode: str = "fan_in"

        def _validate_values(self):
            if self.mode not in ("fan_in", "fan_out", "fan_avg"):
                yield "mode", f"must be fan_in, fan_out or fan_avg, got {self.mode!r}"
            if not (math.isfinite(self.scale) and self.scale > 0):
                yield "scale", f"must be a finite number > 0, got {self.scale}"

    def init(self, key, shape, dtype, *, fan_axes=None):
        cfg = self.config
        if fan_axes is None:  # Default: last dimension is the output, the rest inputs.
            fan_axes = FanAxes(in_axes=range(len(shape) - 1), out_axes=(len(shape) - 1,))
        fan_in, fan_out = fan_axes.fan_in(shape), fan_axes.fan_out(shape)
        fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[cfg.mode]
        stddev = math.sqrt(cfg.scale / max(fan, 1))
        return (jax.random.normal(key, shape, jnp.float32) * stddev).astype(dtype)
