"""Gated DeltaNet: the linear-attention mixer of Qwen 3.5 (and Qwen3-Next), three of every four
of its layers.

For each token: q, k and v projected by heads and run through a short causal depthwise
convolution (``conv_kernel_size`` taps, then SiLU), q and k L2-normalised per head; a decay
``g = -exp(a_log) * softplus(x W_a + dt_bias)`` and a write strength ``beta = sigmoid(x W_b)``
per value head; the gated delta rule (``gated_delta_rule.py``) turns them into one output per
value head; that output is RMS-normalised per head and gated by ``silu(x W_z)`` (Qwen's
``RMSNormGated``), and the heads projected back to the residual width.

Nothing here grows with the sequence but the activations: the rule runs in chunks
(``chunk_size``) in O(S) memory, and the convolution reads ``conv_kernel_size - 1`` earlier
tokens. Packed documents stay apart: the convolution does not reach across a document boundary
and the rule's state restarts at each document (``segment_ids``).

Params are stored by head so tensor parallelism splits heads, as it does attention's: value heads
on ``heads`` (their z / a / b projections, conv taps, decay parameters with them), query/key heads
on ``kv_heads`` -- each key head serves a consecutive group of value heads, so splitting both by
the TP size keeps every group on one device -- and the output projection row-parallel.
Hugging Face's ``in_proj_qkv`` / ``conv1d`` hold q, k and v one after the other
(``hf/param_map``). Under context parallelism the state passes from chunk to chunk of the row
as an affine map, and the convolution reads the chunk before's last tokens
(``context_delta_rule.py``): the sequence is never gathered.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.config import REQUIRED, Required
from titanax.decoding import slot_states
from titanax.decoding.paged_attention import Paging
from titanax.modules import projection
from titanax.modules.base_layer import BaseLayer, ParameterSpec, constant
from titanax.modules.layers.context_delta_rule import (by_piece, context_parallel_gated_delta_rule,
                                                       piece_halos)
from titanax.modules.initializers import FanAxes, Initializer
from titanax.modules.layers.gated_delta_rule import (DEFAULT_CHUNK_SIZE, chunked_gated_delta_rule,
                                                     recurrent_gated_delta_rule)
from titanax.modules.layers.linear import Linear
from titanax.modules.module import nowrap
from titanax.parallel import collectives
from titanax.parallel.axis_binding import HEADS, KV_HEADS, RESIDUAL_SEQUENCE, SEQUENCE
from titanax.utils.dtypes import at_least_float32, wide_float

# L2 normalisation's epsilon on q and k (added to the squared norm, as the flash-linear-attention
# kernels and transformers do).
L2_NORM_EPS = 1e-6


class GatedDeltaNet(BaseLayer):
    """``[batch, seq, model_dim]`` in and out; see the module docstring."""

    # LoRA may adapt the projections of the input (Hugging Face's in_proj_qkv holds q, k and v;
    # in_proj_z, in_proj_a, in_proj_b); the output projection is a Linear of its own.
    ADAPTABLE_WEIGHTS = ("q_weight", "k_weight", "v_weight", "z_weight", "a_weight", "b_weight")

    class Config(BaseLayer.Config):
        # Width of the input and output (the residual stream; inside a Decoder: the model's,
        # which sets it).
        model_dim: Optional[int] = None
        # Query/key heads (HF linear_num_key_heads); must divide num_value_heads.
        num_key_heads: Required[int] = REQUIRED
        # Value heads (HF linear_num_value_heads): one recurrent state each.
        num_value_heads: Required[int] = REQUIRED
        # Width of each query/key head (HF linear_key_head_dim).
        key_head_dim: Required[int] = REQUIRED
        # Width of each value head (HF linear_value_head_dim).
        value_head_dim: Required[int] = REQUIRED
        # Taps of the causal depthwise convolution over q, k and v (HF linear_conv_kernel_dim).
        conv_kernel_size: int = 4
        # Epsilon of the gated output norm (HF rms_norm_eps).
        norm_eps: float = 1e-6
        # Tokens per chunk of the delta rule in training and prefill (memory O(S * chunk)).
        chunk_size: int = DEFAULT_CHUNK_SIZE
        # Initializer of the output projection's weight; None: the layer's param_init.
        output_param_init: Optional[Initializer.Config] = None

        def _validate_values(self):
            for name in ("model_dim", "num_key_heads", "num_value_heads", "key_head_dim",
                         "value_head_dim", "conv_kernel_size", "chunk_size"):
                value = getattr(self, name)
                if isinstance(value, int) and value < 1:
                    yield name, f"must be >= 1, got {value}"
            keys, values = self.num_key_heads, self.num_value_heads
            if isinstance(keys, int) and isinstance(values, int) and keys > 0 and values % keys:
                yield "num_key_heads", (f"must divide num_value_heads={values} (each key head "
                                        "serves a whole group of value heads)")
            if self.norm_eps <= 0:
                yield "norm_eps", f"must be > 0, got {self.norm_eps}"

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        if cfg.model_dim is None:
            raise errors.ConfigError("the residual width is not set", path="model_dim",
                                     suggestion="set model_dim (a Decoder sets the model's)")
        self._add_child("o", Linear.default_config().set(
            input_dim=cfg.num_value_heads * cfg.value_head_dim, output_dim=cfg.model_dim,
            bias=False, input_dim_name=HEADS, param_init=cfg.output_param_init))

    def _create_layer_parameter_specs(self):
        cfg = self.config
        keys, values = cfg.num_key_heads, cfg.num_value_heads
        d_k, d_v, taps = cfg.key_head_dim, cfg.value_head_dim, cfg.conv_kernel_size
        fan = FanAxes(in_axes=(0,), out_axes=(1, 2))
        specs = {}
        for name, heads, width, axis in (("q", keys, d_k, KV_HEADS), ("k", keys, d_k, KV_HEADS),
                                         ("v", values, d_v, HEADS), ("z", values, d_v, HEADS)):
            specs[f"{name}_weight"] = ParameterSpec(
                shape=(cfg.model_dim, heads, width), logical_axes=(None, axis, None),
                fan_axes=fan)
            if name != "z":  # Depthwise taps, oldest first (HF conv1d.weight[c, 0, :]).
                specs[f"{name}_conv"] = ParameterSpec(
                    shape=(taps, heads, width), logical_axes=(None, axis, None),
                    fan_axes=FanAxes(in_axes=(0,), out_axes=()))
        for name in ("a_weight", "b_weight"):
            specs[name] = ParameterSpec(shape=(cfg.model_dim, values),
                                        logical_axes=(None, HEADS),
                                        fan_axes=FanAxes(in_axes=(0,), out_axes=(1,)))
        specs["dt_bias"] = ParameterSpec(shape=(values,), logical_axes=(HEADS,),
                                         initializer=constant(1.0), weight_decay_scale=0.0)
        # log A (the decay rate's scale): A = 1 at the start of a run from scratch (HF draws A
        # from U(0.01, 16); an imported model brings its own).
        specs["a_log"] = ParameterSpec(shape=(values,), logical_axes=(HEADS,),
                                       initializer=constant(0.0), weight_decay_scale=0.0)
        specs["norm_scale"] = ParameterSpec(shape=(d_v,), initializer=constant(1.0),
                                            weight_decay_scale=0.0)
        return specs

    def _own_implemented_dims(self):
        return (SEQUENCE,)

    @nowrap
    def check_axis_binding(self, binding, *, path):
        if (binding.axis(HEADS) is None) != (binding.axis(KV_HEADS) is None):
            raise errors.PlanError(
                "value heads and query/key heads must be split alike: each key head serves a "
                "consecutive group of value heads on the same device",
                path="plan.logical_axis_rules['kv_heads']",
                suggestion="map heads and kv_heads to the same mesh axis (or both to None)")
        super().check_axis_binding(binding, path=path)

    def forward(self, x, positions=None, segment_ids=None):
        """``x`` ``[batch, seq, model_dim]`` (seq-split under sequence parallelism);
        ``positions`` unused (the recurrence is its own notion of order: accepted so the layer
        stands where attention does); ``segment_ids`` ``[batch, seq]``: packed documents."""
        del positions
        binding = self.axis_binding
        if binding.active(RESIDUAL_SEQUENCE) is not None:
            x = collectives.all_gather(x, binding.active(RESIDUAL_SEQUENCE), axis_index=1)
        context = binding.active(SEQUENCE)  # (Context parallelism: this rank's chunks.)
        q, k, v = (self._convolved(x, name, segment_ids, context=context)
                   for name in ("q", "k", "v"))
        q, k = _l2_normalised(q), _l2_normalised(k)
        beta, g = self._gates(x)
        if context is None:
            out, _ = chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=self.config.chunk_size,
                                              segment_ids=segment_ids)
        else:
            out = context_parallel_gated_delta_rule(
                q, k, v, g, beta, axis=context, pieces=binding.context_pieces,
                chunk_size=self.config.chunk_size, segment_ids=segment_ids)
        out = self._gated_norm(out, self._project(x, "z"))
        return self.o(out.reshape(out.shape[:2] + (-1,)))

    @nowrap
    def empty_cache(self, stacked_params, *, layers: int, batch: int, dtype):
        """Zeros of ``layers`` stacked caches (``stacked_params``: this device's shards): per
        layer the last ``conv_kernel_size - 1`` projected q, k and v (the convolution's window,
        ``[batch, K - 1, local heads, width]`` each) and the rule's state ``[batch, local value
        heads, d_k, d_v]`` in float32 or wider -- the same size at every position: no cache
        grows with the sequence."""
        window = self.config.conv_kernel_size - 1
        conv = tuple(jnp.zeros((layers, batch, window) + tuple(
            stacked_params[f"{name}_weight"].shape[-2:]), dtype) for name in ("q", "k", "v"))
        heads, d_v = stacked_params["v_weight"].shape[-2:]
        d_k = stacked_params["k_weight"].shape[-1]
        state = jnp.zeros((layers, batch, heads, d_k, d_v), wide_float(dtype))
        return (*conv, state)

    @nowrap
    def empty_slot_states(self, stacked_params, *, layers: int, slots: int, dtype):
        """``empty_cache``'s windows and state for ``slots`` decode slots, as the decode engine
        keeps them (``slot_states.py``)."""
        *conv, state = self.empty_cache(stacked_params, layers=layers, batch=slots, dtype=dtype)
        return slot_states.empty(windows=[w.shape for w in conv], state=state.shape,
                                 dtype=dtype, state_dtype=state.dtype)

    def decode(self, x, cache, *, start, offsets=None):
        """The layer over tokens at positions ``start ..`` (``x`` ``[batch, t, model_dim]``)
        continuing from ``cache`` (``empty_cache``'s per-layer form): a prompt's prefill runs the
        chunked rule from the cached state, each later token one recurrent step. ``offsets``
        ``[batch]``: left-padded prompts -- a row's first ``offsets[i]`` positions are padding,
        which enters neither the convolution's window nor the state (no decay, no write).
        Returns ``(output, cache)``. Under the decode engine, ``start`` is a ``Paging`` and
        ``cache`` the slots' states (``_decode_paged``)."""
        if isinstance(start, Paging):
            return self._decode_paged(x, cache, start)
        length = x.shape[1]
        padding = None
        if offsets is not None:
            padding = (start + jnp.arange(length))[None, :] < offsets[:, None]
        history, state = cache[:3], cache[3]
        convolved, windows = zip(*(self._convolved_after(x, name, window, padding)
                                   for name, window in zip(("q", "k", "v"), history)))
        q, k, v = convolved
        q, k = _l2_normalised(q), _l2_normalised(k)
        beta, g = self._gates(x)
        if padding is not None:
            beta, g = (jnp.where(padding[..., None], 0.0, a) for a in (beta, g))
        rule = (recurrent_gated_delta_rule if length == 1 else functools.partial(
            chunked_gated_delta_rule, chunk_size=self.config.chunk_size))
        out, state = rule(q, k, v, g, beta, initial_state=state)
        out = self._gated_norm(out, self._project(x, "z"))
        return self.o(out.reshape(out.shape[:2] + (-1,))), (*windows, state.astype(cache[3].dtype))

    def _decode_paged(self, x, states, paging):
        """``decode`` of rows that each continue their own slot's state (``paging.slots``):
        a row's tokens are its first ``n`` (positions >= 0; the rest, a shorter prompt's padding
        or an idle slot's nothing, neither decay nor write, and leave the window as it was); a
        row whose first token is at position 0 starts from zeros."""
        if paging.slots is None:
            raise errors.DecodingError(
                "a Gated DeltaNet layer keeps its state in each row's decode slot, and this "
                "call names no slots", path="paging.slots",
                suggestion="give Paging each row's slot on its shard (-1: none)")
        valid = paging.positions >= 0
        history, state = slot_states.read(states, paging.slots, fresh=paging.positions[:, 0] == 0,
                                           layer=paging.layer)
        tokens = jnp.sum(valid, axis=1)
        convolved, windows = zip(*(self._convolved_after(x, name, window, ~valid, tokens)
                                   for name, window in zip(("q", "k", "v"), history)))
        q, k, v = convolved
        q, k = _l2_normalised(q), _l2_normalised(k)
        beta, g = (jnp.where(valid[..., None], a, 0.0) for a in self._gates(x))
        rule = (recurrent_gated_delta_rule if x.shape[1] == 1 else functools.partial(
            chunked_gated_delta_rule, chunk_size=self.config.chunk_size))
        out, state = rule(q, k, v, g, beta, initial_state=state)
        out = self._gated_norm(out, self._project(x, "z"))
        states = slot_states.written(states, windows, state, paging.slots, layer=paging.layer)
        return self.o(out.reshape(out.shape[:2] + (-1,))), states

    def _convolved_after(self, x, name, window, padding, tokens=None):
        """``_convolved`` of tokens that follow ``window`` (the last ``K - 1`` projections
        before them); returns ``(outputs, the new window)``. ``padding`` ``[b, t]``: inputs
        taken as zeros; ``tokens`` ``[b]``: each row's real tokens are its first ``tokens[i]``
        (right padding), and its new window ends at its last (None: at ``x``'s end)."""
        y = self._project(x, name)
        if padding is not None:
            y = jnp.where(padding[..., None, None], 0, y)
        taps = self.parameters[f"{name}_conv"].astype(y.dtype)
        extended = jnp.concatenate([window.astype(y.dtype), y], axis=1)
        if tokens is None:
            kept = extended[:, extended.shape[1] - window.shape[1]:]  # (Empty for one tap.)
        else:  # The K - 1 inputs up to each row's last token.
            places = tokens[:, None] + jnp.arange(window.shape[1])[None, :]
            kept = jnp.take_along_axis(extended, places[:, :, None, None], axis=1)
        return causal_conv(y, taps, halo=window.astype(y.dtype)), kept.astype(window.dtype)

    def _project(self, x, name):
        return projection.project(self, "bsd,dhk->bshk", x, f"{name}_weight")

    def _convolved(self, x, name, segment_ids, *, context=None):
        """``causal_conv`` of ``name``'s projection: nothing before the row's start or, packed,
        before the token's own document. Under context parallelism (``context``: the axis) each
        local chunk reads the last tokens of the chunk before it in the row."""
        y = self._project(x, name)
        taps = self.parameters[f"{name}_conv"].astype(y.dtype)
        width = taps.shape[0] - 1
        if context is None or not width:
            return causal_conv(y, taps, segments=segment_ids)
        pieces = self.axis_binding.context_pieces
        segments = (jnp.zeros(y.shape[:2], jnp.int32) if segment_ids is None
                    else jnp.asarray(segment_ids, jnp.int32))
        halo, halo_segments = piece_halos(y, segments, axis=context, pieces=pieces, width=width)
        out = causal_conv(by_piece(y, pieces), taps, segments=by_piece(segments, pieces),
                          halo=halo, halo_segments=halo_segments)
        return out.reshape(y.shape)

    def _gates(self, x):
        """``beta = sigmoid(x W_b)`` and ``g = -exp(a_log) softplus(x W_a + dt_bias)``, per value
        head, in float32 or wider."""
        params = self.parameters
        x32 = at_least_float32(x)
        beta = jax.nn.sigmoid(projection.project(self, "bsd,dh->bsh", x32, "b_weight"))
        a = (projection.project(self, "bsd,dh->bsh", x32, "a_weight")
             + params["dt_bias"].astype(x32.dtype))
        return beta, -jnp.exp(params["a_log"].astype(x32.dtype)) * jax.nn.softplus(a)

    def _gated_norm(self, out, gate):
        """Each head's output RMS-normalised (statistics in float32 or wider), scaled, and
        multiplied by ``silu(gate)`` (Qwen's RMSNormGated: norm before gate)."""
        dtype = gate.dtype
        out32 = at_least_float32(out)
        normed = out32 * jax.lax.rsqrt(jnp.mean(jnp.square(out32), axis=-1, keepdims=True)
                                       + self.config.norm_eps)
        normed = self.parameters["norm_scale"].astype(dtype) * normed.astype(dtype)
        return (normed * jax.nn.silu(at_least_float32(gate))).astype(dtype)


def causal_conv(y, taps, *, segments=None, halo=None, halo_segments=None):
    """``silu`` of the causal depthwise convolution of ``y`` ``[b, t, heads, width]`` by ``taps``
    ``[K, heads, width]`` (oldest first): tap ``j`` reads the token ``K - 1 - j`` places back --
    into ``halo`` ``[b, K - 1, ...]`` (the tokens before ``y``; zeros if None) before the first.
    With ``segments`` ``[b, t]`` a token reads only its own document's tokens (``halo_segments``
    ``[b, K - 1]``: the halo's; -1, none, if None)."""
    size, length = taps.shape[0], y.shape[1]
    b = y.shape[0]
    if halo is None:
        halo = jnp.zeros((b, size - 1) + y.shape[2:], y.dtype)
    extended = jnp.concatenate([halo.astype(y.dtype), y], axis=1)
    if segments is not None:
        if halo_segments is None:
            halo_segments = jnp.full((b, size - 1), -1, jnp.int32)
        extended_segments = jnp.concatenate([jnp.asarray(halo_segments, jnp.int32),
                                             jnp.asarray(segments, jnp.int32)], axis=1)
    total = jnp.zeros_like(y)
    for j in range(size):
        term = extended[:, j:j + length]
        if segments is not None and j < size - 1:
            same = extended_segments[:, j:j + length] == jnp.asarray(segments, jnp.int32)
            term = jnp.where(same[..., None, None], term, 0)
        total = total + term * taps[j]
    return jax.nn.silu(total)


def _l2_normalised(x):
    x32 = at_least_float32(x)
    return x32 * jax.lax.rsqrt(jnp.sum(jnp.square(x32), axis=-1, keepdims=True) + L2_NORM_EPS)
