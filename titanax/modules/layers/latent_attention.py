"""Multi-head latent attention (MLA): DeepSeek-V2/V3's (and Kimi K2's) attention.

Keys and values come from one small latent per token instead of per-head projections::

    latent, k_rope = x W_kv_a               (kv_lora_rank + qk_rope_head_dim features)
    latent = RMSNorm(latent)
    k_nope, v = latent W_kv_b               (per head: qk_nope_head_dim + v_head_dim)
    q_nope, q_rope = x W_q                  (or x W_q_a -> RMSNorm -> W_q_b: q_lora_rank)
    score = (q_nope . k_nope + rot(q_rope) . rot(k_rope)) * scale

``k_rope`` is one head's worth, shared by every head (the decoupled RoPE key); the rest of each
head carries no position. Decoding caches the normalised latent and the rotated ``k_rope`` --
``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer, not ``2 x heads x head_dim`` --
and expands them through ``W_kv_b`` for each step (the plain form; absorbing ``W_kv_b`` into the
query is a speed-up for later). The scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``,
times ``mscale(factor, mscale_all_dim) ** 2`` under DeepSeek's YaRN (``rope_scaling``).

Params by heads, as ``Attention``'s: under tensor parallelism the heads of ``q_b`` / ``kv_b`` and
the output projection's input are split (the latent projections are small and stay whole), so
the output projection's all-reduce is the layer's only collective. Under context parallelism
each rank gathers the row's latents and RoPE keys, not keys and values (``all_gather``
strategy: ~70x fewer bytes at DeepSeek-V3's sizes), and expands them itself; the ring and
Ulysses strategies carry the expanded keys and values as for any attention. Hugging Face's DeepSeek-V3
rotates interleaved pairs; its import permutes the RoPE rows of ``q_b_proj`` / ``kv_a_proj`` once
to Titanax's rotate-half pairing (``hf/param_map``), which leaves every score unchanged.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.config import REQUIRED, Required
from titanax.decoding import paged_attention
from titanax.modules import projection
from titanax.modules.base_layer import BaseLayer, ParameterSpec, constant
from titanax.modules.initializers import FanAxes, Initializer
from titanax.modules.layers import rotary
from titanax.modules.layers.attention import attend, decoding_places
from titanax.modules.layers.context_attention import attend_gathered_row, context_attention
from titanax.modules.layers.linear import Linear
from titanax.modules.layers.norm import RMSNorm
from titanax.modules.module import nowrap
from titanax.parallel import collectives
from titanax.parallel.axis_binding import HEADS, RESIDUAL_SEQUENCE, SEQUENCE


class MultiHeadLatentAttention(BaseLayer):
    """Causal MLA; ``forward(x, positions=None, segment_ids=None)`` as ``Attention``'s."""

    # LoRA may adapt each projection (PEFT's q_proj / q_a_proj / q_b_proj / kv_a_proj_with_mqa /
    # kv_b_proj; the output projection is a Linear of its own).
    ADAPTABLE_WEIGHTS = ("q_weight", "q_a_weight", "q_b_weight", "kv_a_weight", "kv_b_weight")

    class Config(BaseLayer.Config):
        # Width of the input and output (inside a Decoder: the model's, which sets it).
        model_dim: Optional[int] = None
        # Query heads (DeepSeek-V3: 128).
        num_heads: Required[int] = REQUIRED
        # Rank of the query's low-rank projection (DeepSeek-V3: 1536); None: one projection.
        q_lora_rank: Optional[int] = None
        # Width of the key/value latent (DeepSeek-V3: 512).
        kv_lora_rank: Required[int] = REQUIRED
        # Per-head query/key features without position (DeepSeek-V3: 128) ...
        qk_nope_head_dim: Required[int] = REQUIRED
        # ... and with RoPE, the key's shared by every head (DeepSeek-V3: 64).
        qk_rope_head_dim: Required[int] = REQUIRED
        # Per-head value width (DeepSeek-V3: 128).
        v_head_dim: Required[int] = REQUIRED
        # RoPE base and scaling (DeepSeek-V3: YaRN, factor 40, mscale_all_dim 1).
        rope_theta: float = 10000.0
        rope_scaling: Optional[Union[rotary.YarnRopeScaling.Config,
                                     rotary.LinearRopeScaling.Config]] = None
        # Biases on the latent projections and the output (HF attention_bias).
        bias: bool = False
        # Epsilon of the latent norms.
        norm_eps: float = 1e-6
        # Attend only to the last this many positions; None: every earlier one.
        sliding_window: Optional[int] = None
        # Initializer of the output projection's weight; None: the layer's param_init.
        output_param_init: Optional[Initializer.Config] = None
        # How attention runs (Attention.Config.implementation) and its block size.
        implementation: str = "auto"
        block_size: int = 512

        def _validate_values(self):
            for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                         "v_head_dim", "q_lora_rank", "model_dim"):
                value = getattr(self, name)
                if isinstance(value, int) and value < 1:
                    yield name, f"must be >= 1, got {value}"
            if isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim % 2:
                yield "qk_rope_head_dim", "must be even (RoPE rotates pairs)"

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        if cfg.model_dim is None:
            raise errors.ConfigError("the residual width is not set", path="model_dim",
                                     suggestion="set model_dim (a Decoder sets the model's)")
        self._add_child("o", Linear.default_config().set(
            input_dim=cfg.num_heads * cfg.v_head_dim, output_dim=cfg.model_dim, bias=cfg.bias,
            input_dim_name=HEADS, param_init=cfg.output_param_init))
        self._add_child("kv_norm", RMSNorm.default_config().set(input_dim=cfg.kv_lora_rank,
                                                                eps=cfg.norm_eps))
        if cfg.q_lora_rank is not None:
            self._add_child("q_norm", RMSNorm.default_config().set(input_dim=cfg.q_lora_rank,
                                                                   eps=cfg.norm_eps))
        scaling = cfg.rope_scaling.instantiate() if cfg.rope_scaling is not None else None
        self._inv_freq = rotary.inverse_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta,
                                                    scaling)
        self._rope_magnitude = rotary.attention_scaling(scaling)

    @property
    def scale(self) -> float:
        """``(nope + rope) ** -0.5``, times DeepSeek's YaRN ``mscale(factor, mscale_all_dim)``
        squared."""
        cfg = self.config
        scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        scaling = cfg.rope_scaling
        if isinstance(scaling, rotary.YarnRopeScaling.Config) and scaling.mscale_all_dim \
                and scaling.factor > 1:
            mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
            scale *= mscale * mscale
        return scale

    def _create_layer_parameter_specs(self):
        cfg = self.config
        heads, d = cfg.num_heads, cfg.model_dim
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        bias = dict(initializer=constant(0.0), weight_decay_scale=0.0)
        specs = {}
        if cfg.q_lora_rank is None:
            specs["q_weight"] = ParameterSpec(shape=(d, heads, qk), logical_axes=(None, HEADS, None),
                                              fan_axes=FanAxes(in_axes=(0,), out_axes=(1, 2)))
        else:
            specs["q_a_weight"] = ParameterSpec(shape=(d, cfg.q_lora_rank),
                                                logical_axes=(None, None), fan_axes=FanAxes(
                                                    in_axes=(0,), out_axes=(1,)))
            specs["q_b_weight"] = ParameterSpec(
                shape=(cfg.q_lora_rank, heads, qk), logical_axes=(None, HEADS, None),
                fan_axes=FanAxes(in_axes=(0,), out_axes=(1, 2)))
            if cfg.bias:
                specs["q_a_bias"] = ParameterSpec(shape=(cfg.q_lora_rank,),
                                                  logical_axes=(None,), **bias)
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        specs["kv_a_weight"] = ParameterSpec(shape=(d, latent), logical_axes=(None, None),
                                             fan_axes=FanAxes(in_axes=(0,), out_axes=(1,)))
        if cfg.bias:
            specs["kv_a_bias"] = ParameterSpec(shape=(latent,), logical_axes=(None,), **bias)
        specs["kv_b_weight"] = ParameterSpec(
            shape=(cfg.kv_lora_rank, heads, cfg.qk_nope_head_dim + cfg.v_head_dim),
            logical_axes=(None, HEADS, None), fan_axes=FanAxes(in_axes=(0,), out_axes=(1, 2)))
        return specs

    def _own_implemented_dims(self):
        return (SEQUENCE,)

    @nowrap
    def cache_shape(self, stacked_params, *, layers: int, batch: int, length: int):
        """The latent cache of ``layers`` stacked layers: ``([layers, batch, length,
        kv_lora_rank], [layers, batch, length, qk_rope_head_dim])`` -- the normalised latent and
        the rotated shared key."""
        cfg = self.config
        return ((layers, batch, length, cfg.kv_lora_rank),
                (layers, batch, length, cfg.qk_rope_head_dim))

    @nowrap
    def paged_cache_shape(self, stacked_params, *, layers: int, num_blocks: int,
                          block_size: int):
        """``cache_shape``'s latent and RoPE key as the decode engine's pools: blocks of
        tokens, each token's latent one head wide (``paged_attention``'s layout)."""
        return tuple(shape[:-1] + (1, shape[-1]) for shape in self.cache_shape(
            stacked_params, layers=layers, batch=num_blocks, length=block_size))

    # --- The forward pass ------------------------------------------------------------------------

    def _queries(self, x, positions):
        """``[b, s, local heads, nope + rope]``, the RoPE part rotated."""
        cfg = self.config
        params = self.parameters
        if cfg.q_lora_rank is None:
            q = projection.project(self, "bsd,dhk->bshk", x, "q_weight")
        else:
            low = projection.project(self, "bsd,dr->bsr", x, "q_a_weight")
            if cfg.bias:
                low = low + params["q_a_bias"].astype(x.dtype)
            q = projection.project(self, "bsr,rhk->bshk", self.q_norm(low), "q_b_weight")
        nope = cfg.qk_nope_head_dim
        return jnp.concatenate([q[..., :nope], self._rotated(q[..., nope:], positions)], -1)

    def _rotated(self, x, positions):
        return rotary.rotate(x, positions, self._inv_freq, self._rope_magnitude)

    def _latent(self, x, positions):
        """The normalised latent ``[b, s, kv_lora_rank]`` and the rotated shared key ``[b, s,
        rope]``: what the cache holds."""
        cfg = self.config
        both = projection.project(self, "bsd,dl->bsl", x, "kv_a_weight")
        if cfg.bias:
            both = both + self.parameters["kv_a_bias"].astype(x.dtype)
        latent = self.kv_norm(both[..., :cfg.kv_lora_rank])
        k_rope = self._rotated(both[..., None, cfg.kv_lora_rank:], positions)[..., 0, :]
        return latent, k_rope

    def _keys_values(self, latent, k_rope, *, gathered: bool = False):
        """Per local head, keys ``[b, s, h, nope + rope]`` and values ``[b, s, h, qk width]``
        (zero-padded to the keys' width when narrower, so every attention implementation takes
        them; ``_output`` drops the padding). ``gathered``: the latents are the whole row's,
        gathered under context parallelism."""
        cfg = self.config
        kv = projection.project(self, "bsr,rhk->bshk", latent, "kv_b_weight",
                                 whole_sequence=gathered)
        nope = cfg.qk_nope_head_dim
        heads = kv.shape[2]
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(
            k_rope[:, :, None, :], k_rope.shape[:2] + (heads, k_rope.shape[-1]))], -1)
        v = kv[..., nope:]
        width = k.shape[-1]
        if v.shape[-1] < width:
            v = jnp.pad(v, [(0, 0)] * 3 + [(0, width - v.shape[-1])])
        return k, v

    def _output(self, context):
        cfg = self.config
        context = context[..., :cfg.v_head_dim]
        return self.o(context.reshape(context.shape[:2] + (-1,)))

    def forward(self, x, positions: Optional[jax.Array] = None,
                segment_ids: Optional[jax.Array] = None):
        """As ``Attention.forward``."""
        cfg = self.config
        binding = self.axis_binding
        if binding.active(RESIDUAL_SEQUENCE) is not None:
            x = collectives.all_gather(x, binding.active(RESIDUAL_SEQUENCE), axis_index=1)
        if positions is None:
            positions = jnp.arange(x.shape[1])
        q = self._queries(x, positions)
        latent, k_rope = self._latent(x, positions)
        axis = binding.axis(SEQUENCE)
        if axis is not None:
            return self._output(self._split_row_attention(q, latent, k_rope, axis=axis,
                                                          positions=positions,
                                                          segment_ids=segment_ids))
        k, v = self._keys_values(latent, k_rope)
        context = attend(q, k, v, sliding_window=cfg.sliding_window, scale=self.scale,
                         segment_ids=segment_ids, implementation=cfg.implementation,
                         block_size=cfg.block_size)
        return self._output(context)

    def _split_row_attention(self, q, latent, k_rope, *, axis, positions, segment_ids):
        """Context parallelism: with the ``all_gather`` strategy the rank gathers the row's
        latents and shared RoPE keys (``kv_lora_rank + qk_rope_head_dim`` numbers a token --
        not every head's keys and values) and expands them itself; the ring and Ulysses pass
        the expanded keys and values as they would any attention's."""
        cfg, strategy = self.config, self.axis_binding.context_strategy
        if strategy == "all_gather":
            row = collectives.all_gather(jnp.concatenate([latent, k_rope], -1), axis,
                                         axis_index=1)
            k, v = self._keys_values(row[..., :cfg.kv_lora_rank], row[..., cfg.kv_lora_rank:],
                                     gathered=True)
            return attend_gathered_row(q, k, v, positions=positions, segment_ids=segment_ids,
                                       axis=axis, scale=self.scale,
                                       sliding_window=cfg.sliding_window)
        k, v = self._keys_values(latent, k_rope)
        return context_attention(q, k, v, positions=positions, segment_ids=segment_ids,
                                 axis=axis, strategy=strategy, scale=self.scale,
                                 sliding_window=cfg.sliding_window)

    def decode(self, x, cache, *, start, offsets: Optional[jax.Array] = None):
        """As ``Attention.decode``, over the latent cache ``(latent, k_rope)``: this step's
        latents are written in, then every cached one expanded to keys and values."""
        cfg = self.config
        if isinstance(start, paged_attention.Paging):
            return self._decode_paged(x, cache, start)
        places, key_valid = decoding_places(x.shape[1], start=start, offsets=offsets,
                                            cache_length=cache[0].shape[1])
        q = self._queries(x, places)
        latent, k_rope = self._latent(x, places)
        cache = tuple(jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), start, 1)
                      for c, new in zip(cache, (latent, k_rope)))
        k, v = self._keys_values(*(c.astype(q.dtype) for c in cache))
        context = attend(q, k, v, sliding_window=cfg.sliding_window,
                         kv_length=start + x.shape[1], key_valid=key_valid, scale=self.scale,
                         implementation=cfg.implementation, block_size=cfg.block_size)
        return self._output(context), cache

    def _decode_paged(self, x, pools, paging):
        """``decode`` over the engine's paged pools of latents and RoPE keys (``(latent,
        k_rope)``, each ``[.., num_blocks, block_size, 1, width]``): this step's written in
        through the rows' tables, every row's gathered ones expanded to keys and values."""
        positions = jnp.maximum(paging.positions, 0)
        q = self._queries(x, positions)
        pools = tuple(paged_attention.write(pool, new[:, :, None], tables=paging.tables,
                                            positions=paging.positions, layer=paging.layer)
                      for pool, new in zip(pools, self._latent(x, positions)))
        latent, k_rope = (paged_attention.gathered(pool, paging.tables, layer=paging.layer)
                          [:, :, 0].astype(q.dtype) for pool in pools)
        k, v = self._keys_values(latent, k_rope)
        context = paged_attention.attend(q, k, v, positions=paging.positions, scale=self.scale,
                                         sliding_window=self.config.sliding_window)
        return self._output(context), pools
