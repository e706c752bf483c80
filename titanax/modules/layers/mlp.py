"""The decoder family's feed-forward block: ``down(act(up(x)))`` (GPT-2), or gated:
``down(act(gate(x)) * up(x))`` (SwiGLU: Llama, Qwen, Mistral).

Gated, the gate and up projections are one weight ``[model_dim, 2, hidden_dim]`` (``[:, 0]`` is
Hugging Face's ``gate_proj``, ``[:, 1]`` its ``up_proj``, both stored ``[in, out]``): one matmul,
and under sequence parallelism one all-gather of the input instead of two. Ungated, ``up`` is a
``Linear`` (GPT-2's ``c_fc``).

The hidden features are the logical ``mlp`` dimension: where the axis binding splits it (TP) the
up projection is column-parallel and ``down`` a row-parallel ``Linear``, so the only collective
is ``down``'s all-reduce (a reduce-scatter under sequence parallelism).
"""

from __future__ import annotations

from typing import Literal, Optional

import jax
import jax.numpy as jnp

from titanax.config import REQUIRED, Required
from titanax.parallel.axis_binding import MLP as MLP_DIM, RESIDUAL_SEQUENCE
from titanax.modules import projection
from titanax.modules.base_layer import BaseLayer, ParameterSpec, constant
from titanax.modules.initializers import FanAxes, Initializer
from titanax.modules.layers.linear import Linear
from titanax.parallel import collectives

ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False),
               "relu": jax.nn.relu}


class MLP(BaseLayer):
    """``down(act(up(x)))``, or with ``gated`` ``down(act(gate(x)) * up(x))``."""

    ADAPTABLE_WEIGHTS = ("gate_up_weight",)

    class Config(BaseLayer.Config):
        # Input and output width.
        model_dim: Required[int] = REQUIRED
        # Hidden width (HF intermediate_size; GPT-2: 4 x model_dim).
        hidden_dim: Required[int] = REQUIRED
        # A gate multiplies the activation (SwiGLU / GeGLU); False: GPT-2's plain MLP.
        gated: bool = True
        # The activation: "silu" (SwiGLU), "gelu_tanh" (GPT-2's gelu_new; gated: GeGLU),
        # "gelu" (exact) or "relu".
        activation: Literal["silu", "gelu_tanh", "gelu", "relu"] = "silu"
        # Biases on the projections (GPT-2; HF mlp_bias).
        bias: bool = False
        # Initializer of the down-projection's weight; None: the layer's param_init.
        output_param_init: Optional[Initializer.Config] = None

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        if not cfg.gated:
            self._add_child("up", Linear.default_config().set(
                input_dim=cfg.model_dim, output_dim=cfg.hidden_dim, bias=cfg.bias,
                output_dim_name=MLP_DIM))
        self._add_child("down", Linear.default_config().set(
            input_dim=cfg.hidden_dim, output_dim=cfg.model_dim, bias=cfg.bias,
            input_dim_name=MLP_DIM, param_init=cfg.output_param_init))

    def _create_layer_parameter_specs(self):
        cfg = self.config
        if not cfg.gated:
            return {}
        specs = {"gate_up_weight": ParameterSpec(
            shape=(cfg.model_dim, 2, cfg.hidden_dim), logical_axes=(None, None, MLP_DIM),
            fan_axes=FanAxes(in_axes=(0,), out_axes=(2,)))}
        if cfg.bias:
            specs["gate_up_bias"] = ParameterSpec(shape=(2, cfg.hidden_dim),
                                                  logical_axes=(None, MLP_DIM),
                                                  initializer=constant(0.0),
                                                  weight_decay_scale=0.0)
        return specs

    def forward(self, x):
        cfg = self.config
        activation = ACTIVATIONS[cfg.activation]
        if not cfg.gated:  # (The up Linear all-gathers a sequence-split input itself.)
            return self.down(activation(self.up(x)))
        params = self.parameters
        # A split sequence meets split hidden features: gathered here, scattered by down.
        sequence = self.axis_binding.active(RESIDUAL_SEQUENCE)
        if sequence is not None and self.axis_binding.active(MLP_DIM) is not None:
            x = collectives.all_gather(x, sequence, axis_index=1)
        gate_up = projection.project(self, "...d,dtf->...tf", x, "gate_up_weight")
        if cfg.bias:
            gate_up = gate_up + params["gate_up_bias"].astype(x.dtype)
        return self.down(activation(gate_up[..., 0, :]) * gate_up[..., 1, :])
