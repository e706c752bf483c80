"""Causal self-attention of the decoder family: GPT-2's, and Llama's / Qwen's / Mistral's.

Weights are stored ``[in, out]`` with the heads as their own dimension:

* ``fused_qkv`` (GPT-2): one ``qkv_weight [model_dim, 3, num_heads, head_dim]`` (q, k and v
  stacked, each head's columns contiguous) and ``qkv_bias [3, num_heads, head_dim]``: one matmul;
  query and key/value heads are the same heads.
* otherwise (Hugging Face's per-projection split): ``q_weight [model_dim, num_heads, head_dim]``,
  ``k_weight`` / ``v_weight [model_dim, num_kv_heads, head_dim]`` (grouped-query attention: query
  head ``h`` reads key/value head ``h // (num_heads / num_kv_heads)``, HF's ``repeat_kv``;
  ``num_kv_heads = 1`` is multi-query), biases optional (Qwen 2).

The output projection ``o`` is a ``Linear`` from ``num_heads * head_dim`` features.

The layer names its logical dimensions (``heads``, ``kv_heads``; the ``sequence`` under context
parallelism) and the axis binding says where each lives. Under tensor parallelism the query heads
are split over the TP axis: every device holds whole heads, and the output projection -- whose
input features are exactly this device's heads -- ends with the layer's only collective. The
key/value heads are split too when ``num_kv_heads`` is divisible by the TP size (each rank then
holds exactly the kv heads its query heads read); otherwise the layout keeps them whole on every
rank (``ParameterSpec.replicated_if_indivisible``) and each rank picks, per local query head, the
kv head it reads. The layer sees which of the two it runs from its own shard of ``k_weight``.
Where the binding splits the ``sequence`` (context parallelism), keys cross devices as
modules/layers/context_attention.py says.

Options: rotary positions (``rotary``; GPT-2 adds learned positions at the embedding instead),
RMSNorm of each q and k head before the rotation (Qwen 3's QK-norm), a sliding window (Mistral),
dropout on the attention probabilities (GPT-2). Scores and softmax in float32; on a GPU through
``jax.nn.dot_product_attention`` (cuDNN flash attention) except where the probabilities must be
written out (attention dropout, a query block at an offset into a cache, float64); written out
(``softmax_attention.py``) on other backends, where jax's call is the same XLA math.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.config import REQUIRED, Required
from titanax.parallel.axis_binding import HEADS, KV_HEADS, RESIDUAL_SEQUENCE, SEQUENCE
from titanax.modules import projection
from titanax.modules.base_layer import BaseLayer, ParameterSpec, constant
from titanax.modules.initializers import FanAxes, Initializer
from titanax.modules.layers import rotary
from titanax.modules.layers.dropout import Dropout
from titanax.modules.layers.linear import Linear
from titanax.modules.layers.norm import RMSNorm
from titanax.modules.module import nowrap
from titanax.parallel import collectives
from titanax.modules.layers.context_attention import (SINKS_ON_A_RING,
                                                      SINKS_ON_A_RING_SUGGESTION,
                                                      context_attention)
from titanax.modules.layers.blockwise_attention import BLOCKWISE_FROM, blockwise_attention
from titanax.modules.layers.pallas_attention import pallas_attention
from titanax.modules.layers.softmax_attention import masked_attention
from titanax.decoding import paged_attention
from titanax.utils.dtypes import fused_attention_fits


class Attention(BaseLayer):
    """Each position attends to itself and earlier positions (within the window, if any)."""

    ADAPTABLE_WEIGHTS = ("q_weight", "k_weight", "v_weight", "qkv_weight")

    class Config(BaseLayer.Config):
        # Width of the input and output (the residual stream).
        model_dim: Required[int] = REQUIRED
        # Query heads (divisible by the TP size).
        num_heads: Required[int] = REQUIRED
        # Key/value heads; must divide num_heads (None: num_heads, plain multi-head; 1:
        # multi-query).
        num_kv_heads: Optional[int] = None
        # Width of each head (Qwen 3 sets it apart from model_dim / num_heads); None:
        # model_dim / num_heads.
        head_dim: Optional[int] = None
        # One [model_dim, 3, heads, head_dim] projection for q, k and v (GPT-2's c_attn);
        # needs num_kv_heads == num_heads.
        fused_qkv: bool = False
        # Biases on the q, k and v projections (GPT-2, Qwen 2).
        qkv_bias: bool = False
        # Bias on the output projection (GPT-2; Llama's attention_bias sets both).
        output_bias: bool = False
        # Rotate q and k by their positions (RoPE); False: positions reach the model otherwise
        # (GPT-2's learned table, added at the embedding).
        rotary: bool = True
        # Rotary base (Llama 3: 500000; Qwen: 1000000; Mistral: 10000 or 1000000).
        rope_theta: float = 10000.0
        # Frequency rescaling: Llama 3.1's, linear (Gemma 3's global layers) or YaRN (gpt-oss,
        # DeepSeek-V3); None: plain RoPE.
        rope_scaling: Optional[Union[rotary.Llama3RopeScaling.Config,
                                     rotary.LinearRopeScaling.Config,
                                     rotary.YarnRopeScaling.Config]] = None
        # RMSNorm each query and key head (over head_dim) before the rotation (Qwen 3).
        qk_norm: bool = False
        # Epsilon of the QK-norm.
        norm_eps: float = 1e-6
        # The QK-norm's scale is 1 + its param (RMSNorm.Config.zero_centered: Qwen 3.5, Gemma).
        norm_zero_centered: bool = False
        # The part of each head RoPE rotates, from its first feature (Qwen 3.5: 0.25, HF
        # partial_rotary_factor); the rest carries no position.
        rotary_fraction: float = 1.0
        # A second query-sized projection whose sigmoid gates each head's output before the
        # output projection (Qwen 3.5's gated attention: HF q_proj of 2 x heads x head_dim).
        output_gate: bool = False
        # Attend only to the last this many positions (the position itself included); None:
        # every earlier position (Mistral's sliding_window).
        sliding_window: Optional[int] = None
        # Dropout on the attention probabilities (training only; GPT-2's attn_pdrop).
        attention_dropout_rate: float = 0.0
        # A learned logit per head that joins every query's softmax as a key without a value,
        # so a head may attend to nothing (gpt-oss's attention sinks; param "sinks").
        sinks: bool = False
        # What the scores q.k are multiplied by; None: 1 / sqrt(head_dim) (Gemma 3:
        # query_pre_attn_scalar ** -0.5, which its published sizes set to head_dim or not).
        scale: Optional[float] = None
        # Initializer of the output projection's weight; None: the layer's param_init.
        output_param_init: Optional[Initializer.Config] = None
        # How scores become outputs (IMPLEMENTATIONS): "dense" writes the [t, s] scores out
        # (softmax_attention.py), "blockwise" folds key blocks into query blocks in O(S) memory
        # (blockwise_attention.py), "fused" is jax.nn.dot_product_attention (cuDNN's kernel
        # where jax picks it, else XLA's dense math), "pallas" jax's Pallas flash-attention
        # kernel (pallas_attention.py: any float dtype, packed documents; no sliding window;
        # off a GPU in interpret mode, for tests); "auto": cuDNN's kernel on a GPU where it
        # takes the inputs, else blockwise from BLOCKWISE_FROM keys on, dense below.
        implementation: str = "auto"
        # Query and key block length of the blockwise implementation.
        block_size: int = 512

        def _validate_values(self):
            for name in ("model_dim", "num_heads", "num_kv_heads", "head_dim"):
                value = getattr(self, name)
                if isinstance(value, int) and value < 1:
                    yield name, f"must be >= 1, got {value}"
            heads, kv = self.num_heads, self.num_kv_heads
            if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
                yield "num_kv_heads", (f"must divide num_heads={heads} (each kv head serves a "
                                       "whole group of query heads)")
            if self.fused_qkv and kv is not None and kv != heads:
                yield "fused_qkv", "one q/k/v projection has as many kv heads as query heads"
            if self.head_dim is None and isinstance(heads, int) and heads > 0 and \
                    isinstance(self.model_dim, int) and self.model_dim % heads:
                yield "num_heads", f"must divide model_dim={self.model_dim}, or set head_dim"
            width = self.head_dim or (self.model_dim // heads
                                      if isinstance(heads, int) and heads > 0
                                      and isinstance(self.model_dim, int) else 2)
            if self.rotary and width % 2:
                yield "head_dim", f"must be even (RoPE rotates pairs), got {width}"
            if self.sliding_window is not None and self.sliding_window < 1:
                yield "sliding_window", f"must be >= 1 (or None), got {self.sliding_window}"
            if self.rope_theta <= 0:
                yield "rope_theta", f"must be > 0, got {self.rope_theta}"
            if self.scale is not None and not self.scale > 0:
                yield "scale", f"must be > 0 (or None: 1 / sqrt(head_dim)), got {self.scale}"
            if self.rotary and not (0.0 < self.rotary_fraction <= 1.0
                                    and int(width * self.rotary_fraction) % 2 == 0
                                    and int(width * self.rotary_fraction) >= 2):
                yield "rotary_fraction", (f"must rotate an even number of a head's {width} "
                                          f"features, at least 2: got {self.rotary_fraction}")
            if self.sinks and self.fused_qkv:
                yield "sinks", "are gpt-oss's, on separate q/k/v projections: not with fused_qkv"
            if self.sinks and self.implementation in ("fused", "pallas"):
                yield "implementation", (f"{self.implementation!r} has no attention sinks: "
                                         "use 'auto', 'dense' or 'blockwise' with sinks")
            if self.output_gate and (self.qkv_bias or self.fused_qkv):
                yield "output_gate", ("gates the heads of separate q/k/v projections without "
                                      "biases (Qwen 3.5's): not with qkv_bias or fused_qkv")
            if not 0.0 <= self.attention_dropout_rate < 1.0:
                yield "attention_dropout_rate", (f"must be in [0, 1), got "
                                                 f"{self.attention_dropout_rate}")
            yield from check_implementation(self.implementation, self.attention_dropout_rate,
                                            sliding_window=self.sliding_window)
            if self.block_size < 1:
                yield "block_size", f"must be >= 1, got {self.block_size}"

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        # Row-parallel under TP: its input features are this device's heads.
        self._add_child("o", Linear.default_config().set(
            input_dim=cfg.num_heads * self.head_dim, output_dim=cfg.model_dim,
            bias=cfg.output_bias, input_dim_name=HEADS, param_init=cfg.output_param_init))
        self._add_child("dropout", Dropout.default_config().set(
            rate=cfg.attention_dropout_rate, split_dims=(HEADS,)))
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                self._add_child(name, RMSNorm.default_config().set(
                    input_dim=self.head_dim, eps=cfg.norm_eps,
                    zero_centered=cfg.norm_zero_centered))
        self._inv_freq, self._rope_magnitude = None, 1.0
        if cfg.rotary:
            scaling = cfg.rope_scaling.instantiate() if cfg.rope_scaling is not None else None
            self._inv_freq = rotary.inverse_frequencies(
                int(self.head_dim * cfg.rotary_fraction), cfg.rope_theta, scaling)
            self._rope_magnitude = rotary.attention_scaling(scaling)

    @property
    def head_dim(self) -> int:
        return self.config.head_dim or self.config.model_dim // self.config.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_kv_heads or self.config.num_heads

    @property
    def scale(self) -> float:
        """What the scores are multiplied by before the softmax."""
        return self.config.scale or 1.0 / math.sqrt(self.head_dim)

    def _create_layer_parameter_specs(self):
        cfg = self.config
        heads, kv, width = cfg.num_heads, self.num_kv_heads, self.head_dim
        bias = dict(initializer=constant(0.0), weight_decay_scale=0.0)
        if cfg.fused_qkv:
            specs = {"qkv_weight": ParameterSpec(
                shape=(cfg.model_dim, 3, heads, width), logical_axes=(None, None, HEADS, None),
                fan_axes=FanAxes(in_axes=(0,), out_axes=(1, 2, 3), groups=(1,)))}
            if cfg.qkv_bias:
                specs["qkv_bias"] = ParameterSpec(shape=(3, heads, width),
                                                  logical_axes=(None, HEADS, None), **bias)
            return specs
        fan = FanAxes(in_axes=(0,), out_axes=(1, 2))
        specs = {"q_weight": ParameterSpec(shape=(cfg.model_dim, heads, width),
                                           logical_axes=(None, HEADS, None), fan_axes=fan)}
        if cfg.output_gate:
            specs["gate_weight"] = ParameterSpec(shape=(cfg.model_dim, heads, width),
                                                 logical_axes=(None, HEADS, None), fan_axes=fan)
        if cfg.sinks:
            specs["sinks"] = ParameterSpec(shape=(heads,), logical_axes=(HEADS,), **bias)
        for name in ("k_weight", "v_weight"):
            specs[name] = ParameterSpec(shape=(cfg.model_dim, kv, width),
                                        logical_axes=(None, KV_HEADS, None), fan_axes=fan,
                                        replicated_if_indivisible=True)
        if cfg.qkv_bias:
            specs["q_bias"] = ParameterSpec(shape=(heads, width), logical_axes=(HEADS, None),
                                            **bias)
            for name in ("k_bias", "v_bias"):
                specs[name] = ParameterSpec(shape=(kv, width), logical_axes=(KV_HEADS, None),
                                            replicated_if_indivisible=True, **bias)
        return specs

    def _own_implemented_dims(self):
        return (SEQUENCE,)

    @nowrap
    def check_axis_binding(self, binding, *, path):
        refuse_split_attention_dropout(self.config.attention_dropout_rate, binding, path=path)
        refuse_ignored_implementation(self.config.implementation, binding,
                                      path=f"{path}.implementation")
        if (self.config.sinks and binding.axis(SEQUENCE) is not None
                and binding.context_strategy == "ring"):
            raise errors.PlanError(f"{path}.sinks: {SINKS_ON_A_RING}",
                                   path="plan.context_parallel.strategy",
                                   suggestion=SINKS_ON_A_RING_SUGGESTION)
        if binding.axis(HEADS) is None and (binding.axis(KV_HEADS) is not None
                                            or binding.axis(RESIDUAL_SEQUENCE) is not None):
            split = ("the key/value heads are split" if binding.axis(KV_HEADS) is not None
                     else "the residual stream is split over the sequence")
            raise errors.PlanError(
                f"the query heads are whole on every device while {split}: attention would "
                "group queries with other ranks' keys, or hand back the whole sequence",
                path="plan.logical_axis_rules['heads']",
                suggestion="leave heads on the TP axis, or map kv_heads to None too (and "
                           "no sequence parallelism)")
        super().check_axis_binding(binding, path=path)

    @nowrap
    def cache_shape(self, stacked_params, *, layers: int, batch: int, length: int):
        """The key/value cache of ``layers`` stacked attentions (``stacked_params``: their
        params, this device's shards): ``[layers, batch, length, local kv heads, head_dim]``."""
        weight = stacked_params["qkv_weight" if self.config.fused_qkv else "k_weight"]
        return (layers, batch, length) + tuple(weight.shape[-2:])

    # --- The forward pass ------------------------------------------------------------------------

    def _qkv(self, x, positions):
        """q ``[batch, seq, local heads, head_dim]``, k and v ``[.., local kv heads, ..]``:
        projected, QK-normed and rotated."""
        cfg = self.config
        params = self.parameters
        if cfg.fused_qkv:
            qkv = projection.project(self, "bsd,dthk->bsthk", x, "qkv_weight")
            if cfg.qkv_bias:
                qkv = qkv + params["qkv_bias"].astype(x.dtype)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            q, k, v = (self._project(x, name) for name in ("q", "k", "v"))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.rotary:
            q = rotary.rotate(q, positions, self._inv_freq, self._rope_magnitude)
            k = rotary.rotate(k, positions, self._inv_freq, self._rope_magnitude)
        return q, k, v

    def _project(self, x, name: str):
        y = projection.project(self, "bsd,dhk->bshk", x, f"{name}_weight")
        if self.config.qkv_bias:
            y = y + self.parameters[f"{name}_bias"].astype(x.dtype)
        return y

    def _kv_for_local_queries(self, kv, local_heads: int):
        """Under TP with kv heads kept whole: per local query head, the kv head it reads."""
        cfg = self.config
        if kv.shape[2] != self.num_kv_heads or local_heads == cfg.num_heads \
                or self.num_kv_heads == cfg.num_heads:
            return kv
        group = cfg.num_heads // self.num_kv_heads
        first = self.axis_binding.rank(HEADS) * local_heads
        return jnp.take(kv, (first + jnp.arange(local_heads)) // group, axis=2)

    def forward(self, x, positions: Optional[jax.Array] = None,
                segment_ids: Optional[jax.Array] = None):
        """``x`` ``[batch, seq, model_dim]`` (seq-split under sequence parallelism);
        ``positions`` ``[seq]`` or ``[batch, seq]`` (default ``0 .. seq-1``; read by RoPE, and
        by the causal mask under context parallelism); ``segment_ids`` ``[batch, seq]``: a
        token attends only to earlier tokens of its own segment."""
        cfg = self.config
        binding = self.axis_binding
        if binding.active(RESIDUAL_SEQUENCE) is not None:
            x = collectives.all_gather(x, binding.active(RESIDUAL_SEQUENCE), axis_index=1)
        if positions is None:
            positions = jnp.arange(x.shape[1])
        q, k, v = self._qkv(x, positions)
        k = self._kv_for_local_queries(k, q.shape[2])
        v = self._kv_for_local_queries(v, q.shape[2])
        if binding.axis(SEQUENCE) is not None:  # (check_axis_binding refuses dropout here.)
            context = context_attention(
                q, k, v, positions=positions, segment_ids=segment_ids, axis=binding.axis(SEQUENCE),
                strategy=binding.context_strategy, scale=self.scale,
                sliding_window=cfg.sliding_window, sinks=self._sinks())
        else:
            dropout = self.dropout if self.is_training and cfg.attention_dropout_rate else None
            context = attend(q, k, v, sliding_window=cfg.sliding_window, scale=self.scale,
                             segment_ids=segment_ids, dropout=dropout, sinks=self._sinks(),
                             implementation=cfg.implementation, block_size=cfg.block_size)
        return self._output(context, x)

    def _sinks(self) -> Optional[jax.Array]:
        """This device's heads' sink logits (None without sinks)."""
        return self.parameters["sinks"] if self.config.sinks else None

    def _output(self, context, x):
        """The heads' outputs ``[batch, seq, local heads, head_dim]`` through the output
        projection (gated by ``sigmoid(x W_gate)`` per head with ``output_gate``)."""
        if self.config.output_gate:
            context = context * jax.nn.sigmoid(self._project(x, "gate")).astype(context.dtype)
        return self.o(context.reshape(context.shape[:2] + (-1,)))

    def decode(self, x, cache, *, start, offsets: Optional[jax.Array] = None):
        """Attention of ``x`` ``[batch, t, model_dim]`` -- the tokens at positions ``start ..
        start + t - 1`` -- over a key/value cache ``(k, v)``, each ``[batch, max_len, local kv
        heads, head_dim]`` holding positions ``0 .. start - 1``: returns the output and the cache
        with these tokens' keys and values written in (a prompt's prefill is ``start=0``, then
        one token at a time). ``offsets`` ``[batch]``: left-padded prompts -- row ``i``'s first
        ``offsets[i]`` cache positions are padding no query sees, and its tokens' own positions
        (RoPE's) start after them. No sequence parallelism here: decoding has no sequence to
        split."""
        cfg = self.config
        if isinstance(start, paged_attention.Paging):
            return self._decode_paged(x, cache, start)
        places, key_valid = decoding_places(x.shape[1], start=start, offsets=offsets,
                                            cache_length=cache[0].shape[1])
        q, k, v = self._qkv(x, places)
        k_cache, v_cache = cache
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, 1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, 1)
        keys = self._kv_for_local_queries(k_cache, q.shape[2])
        values = self._kv_for_local_queries(v_cache, q.shape[2])
        context = attend(q, keys.astype(q.dtype), values.astype(q.dtype),
                         sliding_window=cfg.sliding_window, kv_length=start + x.shape[1],
                         scale=self.scale, sinks=self._sinks(),
                         key_valid=key_valid, implementation=cfg.implementation,
                         block_size=cfg.block_size)
        return self._output(context, x), (k_cache, v_cache)

    def _decode_paged(self, x, pools, paging):
        """``decode`` over a paged cache (titanax/decoding/paged_attention.py): ``pools`` ``(k,
        v)``, each ``[num_blocks, block_size, local kv heads, head_dim]`` (or stacked over a
        stack's layers, ``paging.layer`` this one's); ``paging`` says where each row's tokens
        go (their own positions: rows at different places decode together)."""
        q, k, v = self._qkv(x, jnp.maximum(paging.positions, 0))
        pools = tuple(paged_attention.write(pool, new, tables=paging.tables,
                                            positions=paging.positions, layer=paging.layer)
                      for pool, new in zip(pools, (k, v)))
        keys, values = (self._kv_for_local_queries(
            paged_attention.gathered(pool, paging.tables, layer=paging.layer), q.shape[2])
            for pool in pools)
        context = paged_attention.attend(q, keys, values, positions=paging.positions,
                                         scale=self.scale,
                                         sliding_window=self.config.sliding_window,
                                         sinks=self._sinks())
        return self._output(context, x), pools


def decoding_places(length: int, *, start, offsets: Optional[jax.Array], cache_length: int):
    """``(positions, key_valid)`` of ``length`` tokens decoded at cache slots ``start ..``:
    their RoPE positions (``[length]``, or per row ``[b, length]`` after left padding of
    ``offsets[i]`` slots, which shifts no position) and which cache slots hold real keys
    (``[b, cache_length]``; None without padding)."""
    places = start + jnp.arange(length)
    if offsets is None:
        return places, None
    return (jnp.maximum(places[None, :] - offsets[:, None], 0),
            jnp.arange(cache_length)[None, :] >= offsets[:, None])


def refuse_split_attention_dropout(rate: float, binding, *, path: str) -> None:
    """Attention dropout under context parallelism, refused before anything compiles (``path``:
    the config holding ``attention_dropout_rate``)."""
    if binding.axis(SEQUENCE) is not None and rate:
        raise errors.PlanError(
            "attention dropout needs each query's whole row of probabilities, which context "
            "parallelism never holds in one place", path=f"{path}.attention_dropout_rate",
            suggestion="set it to 0 under context parallelism (residual dropout is fine)")


def refuse_ignored_implementation(implementation: str, binding, *, path: str) -> None:
    """An attention implementation chosen under context parallelism, refused: the split
    attention runs its own way (``context_attention.py``, by the plan's strategy) and would
    drop it silently (``path``: the field holding it)."""
    if binding.axis(SEQUENCE) is not None and implementation != "auto":
        raise errors.PlanError(
            f"context parallelism computes attention by its own strategy "
            f"(plan.context_parallel.strategy), so {implementation!r} would be ignored",
            path=path, suggestion="leave it 'auto' under context parallelism, and choose how the "
                                  "split attention runs with plan.context_parallel.strategy")


# The implementations that exist only as a GPU kernel, and what each is. ("fused" is
# jax.nn.dot_product_attention: cuDNN's kernel on a GPU, XLA's attention elsewhere.)
GPU_KERNELS = {"pallas": "the Pallas (Triton) flash-attention kernel"}


def refuse_kernel_off_its_device(implementation: str, *, path: str) -> None:
    """A GPU-only kernel chosen for a run on another backend, refused by name: off a GPU the
    Pallas kernel only runs emulated (interpret mode: the layer's parity tests, not a sharded
    train step, where it fails inside jax)."""
    backend = jax.default_backend()
    if implementation in GPU_KERNELS and backend != "gpu":
        raise errors.PlanError(
            f"{implementation!r} is {GPU_KERNELS[implementation]}, and this run's devices are "
            f"{backend}", path=path,
            suggestion="use 'auto' (or 'blockwise': the same O(S) memory) off a GPU")


def same_segment(segment_ids: Optional[jax.Array]) -> Optional[jax.Array]:
    """``[batch, 1, seq, seq]``: which key each query may see by document (None: all)."""
    if segment_ids is None:
        return None
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


IMPLEMENTATIONS = ("auto", "dense", "blockwise", "fused", "pallas")


def check_implementation(implementation: str, dropout_rate: float, *,
                         sliding_window: Optional[int] = None):
    """``(field, message)`` for an attention implementation a config cannot use."""
    if implementation not in IMPLEMENTATIONS:
        yield "implementation", (f"must be one of {', '.join(map(repr, IMPLEMENTATIONS))}, got "
                                 f"{implementation!r}")
    elif implementation in ("blockwise", "fused", "pallas") and dropout_rate:
        yield "implementation", (f"{implementation!r} never writes the probabilities out, so it "
                                 "cannot drop them: use 'dense' (or 'auto') with attention "
                                 "dropout, or set attention_dropout_rate to 0")
    elif implementation == "pallas" and sliding_window is not None:
        yield "implementation", ("the Pallas flash kernel masks causally and by document only, "
                                 "not by a sliding window: use 'fused' (cuDNN), 'blockwise' or "
                                 "'auto' with sliding_window")


def choose_implementation(implementation: str, *, queries: int, keys: int, dtype,
                          dropout: bool, decoding: bool) -> str:
    """The implementation ``"auto"`` stands for at these sizes (others stand for themselves)."""
    if implementation != "auto":
        return implementation
    if not (dropout or decoding) and queries == keys and fused_attention_fits(dtype):
        return "fused"
    return _unfused(keys=keys, dropout=dropout)


def _unfused(*, keys: int, dropout: bool) -> str:
    """Off a fused kernel: blockwise from BLOCKWISE_FROM keys on (dropout needs the probabilities
    written out), dense below."""
    return "blockwise" if keys >= BLOCKWISE_FROM and not dropout else "dense"


def attend(q, k, v, *, sliding_window: Optional[int] = None, kv_length=None,
           segment_ids: Optional[jax.Array] = None, key_valid: Optional[jax.Array] = None,
           dropout: Optional[Callable[[jax.Array], jax.Array]] = None,
           implementation: str = "auto", block_size: int = 512,
           scale: Optional[float] = None, sinks: Optional[jax.Array] = None):
    """Causal attention of ``q`` ``[b, t, n, d]`` over ``k``/``v`` ``[b, s, g, d]`` (``g``
    dividing ``n``): queries are the last ``t`` of the ``s`` positions (``t = s`` in training;
    decoding with a cache has ``t < s``). ``kv_length`` (decoding): how many of the ``s``
    cached positions are filled; the queries then sit at ``kv_length - t .. kv_length - 1``.
    ``segment_ids`` ``[b, s]`` (training): no query sees a key of another document.
    ``key_valid`` ``[b, s]`` (decoding left-padded prompts): no query sees a key where it is
    False.
    ``dropout``: applied to the probabilities (which it then writes out). ``implementation``:
    one of IMPLEMENTATIONS (``Attention.Config.implementation``). ``scale``: what the scores
    are multiplied by (None: ``1 / sqrt(d)``). ``sinks`` ``[n]``: attention sinks
    (``Attention.Config.sinks``; written out or blockwise only)."""
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    t, s = q.shape[1], k.shape[1]
    chosen = choose_implementation(implementation, queries=t, keys=s, dtype=q.dtype,
                                   dropout=dropout is not None, decoding=kv_length is not None)
    if sinks is not None and chosen in ("fused", "pallas"):  # (Neither kernel takes sinks.)
        chosen = _unfused(keys=s, dropout=dropout is not None)
    filled = s if kv_length is None else kv_length
    q_segments = k_segments = segment_ids
    if key_valid is not None:  # (Decoding: no segment ids; a padding key is "another document".)
        q_segments, k_segments = jnp.ones((q.shape[0], t), jnp.int32), key_valid
    if chosen == "blockwise":
        return blockwise_attention(
            q, k, v, scale=scale, q_positions=filled - t + jnp.arange(t),
            k_positions=jnp.arange(s), q_segments=q_segments, k_segments=k_segments,
            sliding_window=sliding_window, kv_length=kv_length, block_q=block_size,
            block_k=block_size, sinks=sinks)
    if chosen == "pallas" and kv_length is None and t == s:
        return pallas_attention(q, k, v, scale=scale, segment_ids=segment_ids,
                                block_size=block_size)
    if chosen == "pallas":  # Decoding against a cache: the kernel's rows are whole.
        return attend(q, k, v, sliding_window=sliding_window, kv_length=kv_length,
                      segment_ids=segment_ids, key_valid=key_valid, implementation="blockwise",
                      block_size=block_size, scale=scale)
    documents = same_segment(segment_ids)
    if chosen == "fused" and kv_length is None and t == s:
        window = (sliding_window - 1, 0) if sliding_window is not None else None
        fused = functools.partial(jax.nn.dot_product_attention, q, k, v, mask=documents,
                                  is_causal=True, scale=scale, local_window_size=window)
        if implementation == "auto":  # cuDNN's kernel where it takes these inputs, else ours.
            try:
                return fused(implementation="cudnn")
            except (RuntimeError, ValueError, NotImplementedError):  # jax's cuDNN checks refuse
                return attend(q, k, v, sliding_window=sliding_window, segment_ids=segment_ids,
                              implementation=_unfused(keys=s, dropout=False),
                              block_size=block_size, scale=scale)
        return fused(implementation=None)
    allowed = _allowed(t, s, filled=filled, sliding_window=sliding_window, documents=documents,
                       key_valid=key_valid)
    return masked_attention(q, k, v, allowed, scale=scale, dropout=dropout, sinks=sinks)


def _allowed(t: int, s: int, *, filled, sliding_window, documents, key_valid):
    """``attend``'s written-out mask: causal over the filled keys, within the window, within
    the document, valid keys only (broadcastable to ``[b, 1, t, s]``)."""
    query_pos = filled - t + jnp.arange(t)
    key_pos = jnp.arange(s)
    allowed = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] < filled)
    if sliding_window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - sliding_window
    if documents is not None:  # [t, s] & [b, 1, t, s].
        allowed = allowed & documents
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :]
    return allowed
