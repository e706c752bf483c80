"""Repeat: N copies of a layer with params stacked on a leading axis, run by ``lax.scan``.

Compiling one layer body instead of N unrolled copies keeps compile time flat in depth, and the
stacked leading axis is what a pipeline later splits over its stages. Each iteration gets its own
slice of the params and its own PRNG key; summaries come back stacked. In training, the body can be
rematerialised with a ``jax.checkpoint`` policy (activation memory of one layer, not N).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from titanax.config import REQUIRED, Required
from titanax.decoding.paged_attention import Paging
from titanax.modules.base_layer import BaseLayer, ParameterSpec, remat_policy
from titanax.modules.initializers import FanAxes
from titanax.modules.module import scan_in_context


# With Config.unroll=None, stacks up to this deep are unrolled (see Config.unroll).
UNROLL_UP_TO = 12


class Repeat(BaseLayer):
    """Applies ``layer`` ``num_layers`` times: ``x = layer_i(x)``."""

    class Config(BaseLayer.Config):
        # The repeated layer; built once, its params stacked num_layers times (child "layer").
        layer: Required[BaseLayer.Config] = REQUIRED
        # Number of repetitions.
        num_layers: Required[int] = REQUIRED
        # jax.checkpoint policy for each iteration in training (see base_layer.REMAT_POLICIES);
        # None: keep every layer's activations.
        layer_remat_policy: Optional[str] = None
        # False: one lax.scan over the layers (compile time flat in depth; every step zero-fills
        # the scan's stacked outputs and nothing fuses across layers). True: the layers are
        # traced one after another (no loop; compile time grows with depth). None: unroll up to
        # UNROLL_UP_TO layers. Measured by benchmarks/scan_vs_unroll.py (GPT, 4x2 CPU mesh):
        # unrolled step / scanned step 0.80 at 4 layers, 0.90 at 8, 0.93 at 12, 1.35 at 24;
        # compile 3.2 vs 2.9 s at 4 layers, 7.7 vs 3.1 s at 12, 20 vs 3.3 s at 24. Under FSDP
        # with per-layer gathers the stack always runs as a loop (see scan_in_context).
        unroll: Optional[bool] = None

        def _validate_values(self):
            if isinstance(self.num_layers, int) and self.num_layers < 1:
                yield "num_layers", f"must be >= 1, got {self.num_layers}"

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        self._add_child("layer", self.config.layer)

    def create_parameter_specs_recursively(self):
        num_layers = self.config.num_layers
        inner = self.layer.create_parameter_specs_recursively()

        def stack(spec: ParameterSpec) -> ParameterSpec:
            fan = spec.fan_axes or FanAxes(in_axes=range(len(spec.shape) - 1),
                                           out_axes=(len(spec.shape) - 1,), declared=False)
            return dataclasses.replace(
                spec, shape=(num_layers,) + tuple(spec.shape),
                mesh_axes=(None,) + tuple(spec.mesh_axes), stacked_dims=spec.stacked_dims + 1,
                logical_axes=((None,) + tuple(spec.logical_axes)
                              if spec.logical_axes is not None else None),
                fan_axes=fan.shifted(1))

        return {"layer": _map_specs(stack, inner)}

    def check_partition_specs(self, specs, *, prefix="", mesh_shape=None):
        del mesh_shape
        prefix = prefix or self.name
        if "layer" in specs:
            self.layer.check_partition_specs(_map_specs(lambda s: type(s)(*tuple(s)[1:]),
                                                        specs["layer"]), prefix=f"{prefix}/layer")

    @property
    def unrolled(self) -> bool:
        """Whether the stack runs as straight-line code (see Config.unroll)."""
        unroll = self.config.unroll
        return self.config.num_layers <= UNROLL_UP_TO if unroll is None else unroll

    def forward(self, x, *, first_layer=None, **layer_inputs):
        """``first_layer``: this stack's place in a longer one (pipeline stages run slices of a
        model's stack): layer ``i`` then draws ``fold_in(key, first_layer + i)``, the same key
        whichever slice of the stack it runs in, so the pipeline schedules and stage counts
        drop out the same units. (Without it the layers split the key: an unpipelined model
        draws other masks than a pipelined one.) ``layer_inputs`` go to every layer as keyword
        arguments (packed rows' ``segment_ids`` / ``positions``)."""
        policy = remat_policy(self.config.layer_remat_policy) if self.is_training else None

        def body(carry, _):
            return self.layer(carry, **layer_inputs), None

        x, _ = scan_in_context(body, carry=x, xs=None, child_name="layer",
                               num_iterations=self.config.num_layers, remat_policy=policy,
                               unroll=self.unrolled, key_offset=first_layer)
        return x


    def decode(self, x, cache, *, start, offsets=None):
        """Each layer's ``decode(x, cache_i, start=start, offsets=offsets)`` in turn, ``cache``
        stacked over the layers on its leading dimension; returns ``(x, cache)`` (the layer's own
        decode says what a cache is: keys and values for attention)."""
        if isinstance(start, Paging):
            return self._decode_paged(x, cache, paging=start, offsets=offsets)

        def body(carry, layer_cache):
            return self.layer.decode(carry, layer_cache, start=start, offsets=offsets)

        return scan_in_context(body, carry=x, xs=cache, child_name="layer",
                               num_iterations=self.config.num_layers, unroll=self.unrolled)

    def _decode_paged(self, x, pools, *, paging, offsets):
        """``decode`` over paged pools stacked over the layers: carried whole through the
        loop, each layer writing and reading its own slice in place (``Paging.layer``). As the
        loop's inputs and outputs, every step would copy the whole pool -- a cost set by the
        pool's size, not by the rows decoding."""
        def body(carry, layer):
            x, pools = carry
            return self.layer.decode(x, pools, start=paging.at_layer(layer),
                                     offsets=offsets), None

        (x, pools), _ = scan_in_context(body, carry=(x, pools),
                                        xs=jnp.arange(self.config.num_layers),
                                        child_name="layer",
                                        num_iterations=self.config.num_layers,
                                        unroll=self.unrolled)
        return x, pools


def _map_specs(fn, tree):
    if isinstance(tree, dict):
        return {k: _map_specs(fn, v) for k, v in tree.items()}
    return fn(tree)
