"""Linear layer, split over whatever mesh axes the run binds to its input or output dimension.

Weights are stored ``[input_dim, output_dim]``. The layer names the logical dimension of each
(``input_dim_name`` / ``output_dim_name``: ``"mlp"``, ``"heads"``, ...) and asks the axis binding
(parallel/axis_binding.py) which mesh axis holds it:

* output dimension bound (column-parallel): each device computes its slice of the outputs, no
  collective; with the residual stream split over the sequence (sequence parallelism) the input
  arrives split and is all-gathered first.
* input dimension bound (row-parallel): each device computes a partial sum of the outputs,
  completed by a ``psum`` -- or, under sequence parallelism, a reduce-scatter that leaves each
  device its slice of the sequence. The bias is added after the reduction, once.
"""

from __future__ import annotations

from typing import Optional


from titanax.config import REQUIRED, Required
from titanax.parallel.axis_binding import RESIDUAL_SEQUENCE
from titanax.modules import projection
from titanax.modules.base_layer import BaseLayer, ParameterSpec, constant
from titanax.modules.initializers import FanAxes
from titanax.parallel import collectives


class Linear(BaseLayer):
    """``y = x @ weight + bias`` over the last dimension of ``x``."""

    ADAPTABLE_WEIGHTS = ("weight",)

    class Config(BaseLayer.Config):
        # Input features (global).
        input_dim: Required[int] = REQUIRED
        # Output features (global).
        output_dim: Required[int] = REQUIRED
        # Add a bias.
        bias: bool = True
        # Logical name of the input features (e.g. "mlp": the layer is row-parallel wherever
        # the binding splits it); None: never split. At most one of the two is named.
        input_dim_name: Optional[str] = None
        # Logical name of the output features (column-parallel where split); None: never split.
        output_dim_name: Optional[str] = None
        # Which dimension of the activations is the sequence (for sequence parallelism).
        sequence_dim: int = 1

        def _validate_values(self):
            if self.input_dim_name is not None and self.output_dim_name is not None:
                yield "output_dim_name", ("a linear layer splits its input or its output "
                                          "features, not both: name one")

    def _create_layer_parameter_specs(self):
        cfg = self.config
        specs = {"weight": ParameterSpec(shape=(cfg.input_dim, cfg.output_dim),
                                         logical_axes=(cfg.input_dim_name, cfg.output_dim_name),
                                         fan_axes=FanAxes(in_axes=(0,), out_axes=(1,)))}
        if cfg.bias:
            specs["bias"] = ParameterSpec(shape=(cfg.output_dim,),
                                          logical_axes=(cfg.output_dim_name,),
                                          initializer=constant(0.0), weight_decay_scale=0.0)
        return specs

    def forward(self, x):
        cfg = self.config
        params = self.parameters
        binding = self.axis_binding
        column, row = binding.active(cfg.output_dim_name), binding.active(cfg.input_dim_name)
        sequence = binding.active(RESIDUAL_SEQUENCE)
        if column is not None and sequence is not None:
            x = collectives.all_gather(x, sequence, axis_index=cfg.sequence_dim)
        # One [tokens, in] x [in, out] matmul rather than an einsum batched over the leading
        # dims: the backward then hands the bias reduction, the weight gradient and the input
        # gradient the same [tokens, out] array. Batched, XLA:CPU re-fused the norm backward
        # feeding that gradient into each of the three (3% of a GPT step; step_speed.py).
        tokens = x.reshape((-1, x.shape[-1]))
        y = projection.project(self, "td,df->tf", tokens, "weight")
        y = y.reshape(x.shape[:-1] + (y.shape[-1],))
        if row is not None:
            if sequence is not None:
                y = collectives.reduce_scatter(y, row, scatter_dimension=cfg.sequence_dim)
            else:
                y = collectives.psum(y, row)
        if cfg.bias:
            y = y + params["bias"].astype(y.dtype)
        return y
