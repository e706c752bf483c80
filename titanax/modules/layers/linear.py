"""Linear layer, with column- and row-parallel modes.

Weights are stored ``[input_dim, output_dim]``.

* ``parallel="column"``: output features are split over the TP axis. The forward pass needs no
  collective (each device computes its slice of the outputs); with sequence parallelism the input
  arrives split over the sequence and is all-gathered first.
* ``parallel="row"``: input features are split. Each device computes a partial sum of the
  outputs, completed by a ``psum`` -- or, with sequence parallelism, a reduce-scatter that leaves
  each device its slice of the sequence. The bias is added after the reduction, once.
"""

from __future__ import annotations

from typing import Literal, Optional

import jax.numpy as jnp

from titanax.config import REQUIRED, Required
from titanax.modules.base_layer import BaseLayer, ParameterSpec, constant
from titanax.modules.initializers import FanAxes
from titanax.modules.layers.tensor_parallel import tp_active
from titanax.parallel import collectives


class Linear(BaseLayer):
    """``y = x @ weight + bias`` over the last dimension of ``x``."""

    class Config(BaseLayer.Config):
        # Input features (global).
        input_dim: Required[int] = REQUIRED
        # Output features (global).
        output_dim: Required[int] = REQUIRED
        # Add a bias.
        bias: bool = True
        # Tensor-parallel mesh axis; None: never split.
        tp_axis: Optional[str] = None
        # "none": unsplit; "column": output features split; "row": input features split.
        parallel: Literal["none", "column", "row"] = "none"
        # Sequence parallelism: activations outside this layer are split over the sequence on
        # the TP axis (column: all-gather the input first; row: reduce-scatter the output).
        sequence_parallel: bool = False
        # Which dimension of the activations is the sequence (for sequence parallelism).
        sequence_dim: int = 1

    def _create_layer_parameter_specs(self):
        cfg = self.config
        tp = cfg.tp_axis if cfg.parallel != "none" else None
        weight_axes = {"none": (None, None), "column": (None, tp), "row": (tp, None)}[cfg.parallel]
        specs = {"weight": ParameterSpec(shape=(cfg.input_dim, cfg.output_dim),
                                         mesh_axes=weight_axes,
                                         fan_axes=FanAxes(in_axes=(0,), out_axes=(1,)))}
        if cfg.bias:
            specs["bias"] = ParameterSpec(shape=(cfg.output_dim,),
                                          mesh_axes=(tp if cfg.parallel == "column" else None,),
                                          initializer=constant(0.0), weight_decay_scale=0.0)
        return specs

    def forward(self, x):
        cfg = self.config
        params = self.parameters
        active = cfg.parallel != "none" and tp_active(cfg.tp_axis)
        if active and cfg.parallel == "column" and cfg.sequence_parallel:
            x = collectives.all_gather(x, cfg.tp_axis, axis_index=cfg.sequence_dim)
        y = jnp.einsum("...i,io->...o", x, params["weight"].astype(x.dtype))
        if active and cfg.parallel == "row":
            if cfg.sequence_parallel:
                y = collectives.reduce_scatter(y, cfg.tp_axis, scatter_dimension=cfg.sequence_dim)
            else:
                y = collectives.psum(y, cfg.tp_axis)
        if cfg.bias:
            y = y + params["bias"].astype(y.dtype)
        return y
