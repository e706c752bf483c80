"""2-D convolution over NHWC images (weights ``[kernel_h, kernel_w, in_channels, out_channels]``)."""

from __future__ import annotations

from typing import Literal, Tuple

import jax

from titanax.config import REQUIRED, Required
from titanax.modules.base_layer import BaseLayer, ParameterSpec, constant
from titanax.modules.initializers import FanAxes


class Conv2D(BaseLayer):
    """``conv(x, weight) + bias`` with stride and padding."""

    class Config(BaseLayer.Config):
        # Input channels.
        input_channels: Required[int] = REQUIRED
        # Output channels.
        output_channels: Required[int] = REQUIRED
        # (height, width) of the kernel.
        kernel_size: Tuple[int, int] = (3, 3)
        # (height, width) stride.
        strides: Tuple[int, int] = (1, 1)
        # "SAME" keeps the spatial size (at stride 1); "VALID" uses no padding.
        padding: Literal["SAME", "VALID"] = "SAME"

    def _create_layer_parameter_specs(self):
        cfg = self.config
        return {
            "weight": ParameterSpec(shape=tuple(cfg.kernel_size) + (cfg.input_channels,
                                                                    cfg.output_channels),
                                    fan_axes=FanAxes(in_axes=(0, 1, 2), out_axes=(3,))),
            "bias": ParameterSpec(shape=(cfg.output_channels,), initializer=constant(0.0),
                                  weight_decay_scale=0.0),
        }

    def forward(self, x):
        cfg = self.config
        y = jax.lax.conv_general_dilated(
            x, self.parameters["weight"].astype(x.dtype), window_strides=cfg.strides,
            padding=cfg.padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y + self.parameters["bias"].astype(y.dtype)
