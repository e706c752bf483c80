"""The transformer feed-forward block: up-projection, GELU, down-projection.

The hidden features are the logical ``mlp`` dimension: where the axis binding splits it (TP),
the up-projection is column-parallel and the down-projection row-parallel, so the only
collective is the down-projection's all-reduce (or reduce-scatter with sequence parallelism).
"""

from __future__ import annotations

from typing import Literal, Optional

import jax

from titanax.config import REQUIRED, Required
from titanax.modules.axis_binding import MLP as MLP_DIM
from titanax.modules.base_layer import BaseLayer
from titanax.modules.initializers import Initializer
from titanax.modules.layers.linear import Linear


class MLP(BaseLayer):
    """``wo(gelu(wi(x)))``."""

    class Config(BaseLayer.Config):
        # Input and output width.
        model_dim: Required[int] = REQUIRED
        # Hidden width (GPT-2: 4 x model_dim).
        hidden_dim: Required[int] = REQUIRED
        # "gelu_tanh" (GPT-2's approximation) or "gelu" (exact).
        activation: Literal["gelu_tanh", "gelu", "relu"] = "gelu_tanh"
        # Initializer of the down-projection's weight; None: the layer's param_init.
        output_param_init: Optional[Initializer.Config] = None

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        self._add_child("wi", Linear.default_config().set(
            input_dim=cfg.model_dim, output_dim=cfg.hidden_dim, output_dim_name=MLP_DIM))
        self._add_child("wo", Linear.default_config().set(
            input_dim=cfg.hidden_dim, output_dim=cfg.model_dim, input_dim_name=MLP_DIM,
            param_init=cfg.output_param_init))

    def forward(self, x):
        activation = self.config.activation
        hidden = self.wi(x)
        if activation == "gelu_tanh":
            hidden = jax.nn.gelu(hidden, approximate=True)
        elif activation == "gelu":
            hidden = jax.nn.gelu(hidden, approximate=False)
        else:
            hidden = jax.nn.relu(hidden)
        return self.wo(hidden)
