"""Causal grouped-query attention with rotary positions (Llama / Qwen / Mistral), split by heads.

Weights keep Hugging Face's per-projection split, stored ``[in, out]`` with the heads as their
own dimension: ``q_weight [model_dim, num_heads, head_dim]``, ``k_weight`` / ``v_weight``
``[model_dim, num_kv_heads, head_dim]``, and the output projection a row-parallel ``Linear``
from ``num_heads * head_dim`` features. Query head ``h`` reads key/value head
``h // (num_heads / num_kv_heads)`` (HF's ``repeat_kv``; ``num_kv_heads = 1`` is multi-query).

The layer names its logical dimensions (``heads``, ``kv_heads``; the ``sequence`` under context
parallelism) and the axis binding says where each lives. Under tensor parallelism the query
heads are split over the TP axis. The key/value heads are split too when ``num_kv_heads`` is
divisible by the TP size (each rank then holds exactly the kv
heads its query heads read); otherwise the layout keeps them whole on every rank
(``ParameterSpec.replicated_if_indivisible``) and each rank picks, per local query head, the kv
head it reads -- the same attention, a little more kv compute, never a wrong grouping. The layer
sees which of the two it runs from its own shard of ``k_weight``.

Options for the family: biases on q/k/v (Qwen 2) and on the output (Llama's
``attention_bias``), RMSNorm of each q and k head before the rotation (Qwen 3's QK-norm), a
sliding window (Mistral). Scores and softmax in float32, through ``jax.nn.dot_product_attention``
(cuDNN flash attention on GPUs).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from titanax.config import REQUIRED, Required
from titanax.modules.base_layer import BaseLayer, ParameterSpec, constant
from titanax.modules.initializers import FanAxes, Initializer
from titanax.modules.layers import rotary
from titanax.modules.layers.linear import Linear
from titanax.modules.layers.norm import RMSNorm
from titanax.modules.axis_binding import HEADS, KV_HEADS, RESIDUAL_SEQUENCE, SEQUENCE
from titanax.parallel import collectives
from titanax.parallel.context_attention import context_attention
from titanax.utils.dtypes import fused_attention_fits, lowest, wide_float


class GroupedQueryAttention(BaseLayer):
    """Each position attends to itself and earlier positions (within the window, if any)."""

    class Config(BaseLayer.Config):
        # Width of the input and output (the residual stream).
        model_dim: Required[int] = REQUIRED
        # Query heads (divisible by the TP size).
        num_heads: Required[int] = REQUIRED
        # Key/value heads; must divide num_heads (num_heads: plain multi-head; 1: multi-query).
        num_kv_heads: Required[int] = REQUIRED
        # Width of each head (Qwen 3 sets it apart from model_dim / num_heads).
        head_dim: Required[int] = REQUIRED
        # Rotary base (Llama 3: 500000; Qwen: 1000000; Mistral: 10000 or 1000000).
        rope_theta: float = 10000.0
        # Llama 3.1 frequency rescaling; None: plain RoPE.
        rope_scaling: Optional[rotary.Llama3RopeScaling.Config] = None
        # Biases on the q, k and v projections (Qwen 2).
        qkv_bias: bool = False
        # Bias on the output projection (Llama's attention_bias sets both).
        output_bias: bool = False
        # RMSNorm each query and key head (over head_dim) before the rotation (Qwen 3).
        qk_norm: bool = False
        # Epsilon of the QK-norm.
        norm_eps: float = 1e-6
        # Attend only to the last this many positions (the position itself included); None:
        # every earlier position (Mistral's sliding_window).
        sliding_window: Optional[int] = None
        # Initializer of the output projection's weight; None: the layer's param_init.
        output_param_init: Optional[Initializer.Config] = None

        def _validate_values(self):
            for name in ("model_dim", "num_heads", "num_kv_heads", "head_dim"):
                value = getattr(self, name)
                if isinstance(value, int) and value < 1:
                    yield name, f"must be >= 1, got {value}"
            if isinstance(self.num_heads, int) and isinstance(self.num_kv_heads, int) \
                    and self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
                yield "num_kv_heads", (f"must divide num_heads={self.num_heads} (each kv head "
                                       "serves a whole group of query heads)")
            if isinstance(self.head_dim, int) and self.head_dim % 2:
                yield "head_dim", f"must be even (RoPE rotates pairs), got {self.head_dim}"
            if self.sliding_window is not None and self.sliding_window < 1:
                yield "sliding_window", f"must be >= 1 (or None), got {self.sliding_window}"
            if self.rope_theta <= 0:
                yield "rope_theta", f"must be > 0, got {self.rope_theta}"

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        self._add_child("o", Linear.default_config().set(
            input_dim=cfg.num_heads * cfg.head_dim, output_dim=cfg.model_dim,
            bias=cfg.output_bias, input_dim_name=HEADS, param_init=cfg.output_param_init))
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                self._add_child(name, RMSNorm.default_config().set(input_dim=cfg.head_dim,
                                                                   eps=cfg.norm_eps))
        scaling = cfg.rope_scaling.instantiate() if cfg.rope_scaling is not None else None
        self._inv_freq = rotary.inverse_frequencies(cfg.head_dim, cfg.rope_theta, scaling)

    def _create_layer_parameter_specs(self):
        cfg = self.config
        fan = FanAxes(in_axes=(0,), out_axes=(1, 2))
        specs = {"q_weight": ParameterSpec(shape=(cfg.model_dim, cfg.num_heads, cfg.head_dim),
                                           logical_axes=(None, HEADS, None), fan_axes=fan)}
        for name in ("k_weight", "v_weight"):
            specs[name] = ParameterSpec(shape=(cfg.model_dim, cfg.num_kv_heads, cfg.head_dim),
                                        logical_axes=(None, KV_HEADS, None), fan_axes=fan,
                                        replicated_if_indivisible=True)
        if cfg.qkv_bias:
            specs["q_bias"] = ParameterSpec(shape=(cfg.num_heads, cfg.head_dim),
                                            logical_axes=(HEADS, None),
                                            initializer=constant(0.0), weight_decay_scale=0.0)
            for name in ("k_bias", "v_bias"):
                specs[name] = ParameterSpec(shape=(cfg.num_kv_heads, cfg.head_dim),
                                            logical_axes=(KV_HEADS, None),
                                            initializer=constant(0.0), weight_decay_scale=0.0,
                                            replicated_if_indivisible=True)
        return specs

    def _own_implemented_dims(self):
        return (SEQUENCE,)

    def _project(self, x, name: str):
        params = self.parameters
        y = jnp.einsum("bsd,dhk->bshk", x, params[f"{name}_weight"].astype(x.dtype))
        if self.config.qkv_bias:
            y = y + params[f"{name}_bias"].astype(x.dtype)
        return y

    def _kv_for_local_queries(self, kv, local_heads: int):
        """Under TP with kv heads kept whole: per local query head, the kv head it reads."""
        cfg = self.config
        group = cfg.num_heads // cfg.num_kv_heads
        first = self.axis_binding.rank(HEADS) * local_heads
        return jnp.take(kv, (first + jnp.arange(local_heads)) // group, axis=2)

    def forward(self, x, positions: Optional[jax.Array] = None,
                segment_ids: Optional[jax.Array] = None):
        """``x`` ``[batch, seq, model_dim]`` (seq-split under sequence parallelism);
        ``positions`` ``[seq]`` or ``[batch, seq]`` (default ``0 .. seq-1``); ``segment_ids``
        ``[batch, seq]``: a token attends only to earlier tokens of its own segment."""
        cfg = self.config
        binding = self.axis_binding
        if binding.active(RESIDUAL_SEQUENCE) is not None:
            x = collectives.all_gather(x, binding.active(RESIDUAL_SEQUENCE), axis_index=1)
        q, k, v = (self._project(x, name) for name in ("q", "k", "v"))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if positions is None:
            positions = jnp.arange(x.shape[1])
        q = rotary.rotate(q, positions, self._inv_freq)
        k = rotary.rotate(k, positions, self._inv_freq)
        local_heads = q.shape[2]
        if k.shape[2] == cfg.num_kv_heads and local_heads < cfg.num_heads:
            k = self._kv_for_local_queries(k, local_heads)
            v = self._kv_for_local_queries(v, local_heads)
        if binding.axis(SEQUENCE) is not None:
            context = context_attention(q, k, v, positions=positions, segment_ids=segment_ids,
                                        axis=binding.axis(SEQUENCE),
                                        strategy=binding.context_strategy,
                                        scale=1.0 / math.sqrt(cfg.head_dim),
                                        sliding_window=cfg.sliding_window)
        else:
            context = attend(q, k, v, sliding_window=cfg.sliding_window,
                             segment_ids=segment_ids)
        return self.o(context.reshape(context.shape[:2] + (-1,)))

    def decode(self, x, cache, *, start):
        """Attention of ``x`` ``[batch, t, model_dim]`` -- the tokens at positions ``start ..
        start + t - 1`` -- over a key/value cache ``(k, v)``, each ``[batch, max_len, local kv
        heads, head_dim]`` holding positions ``0 .. start - 1``: returns the output and the cache
        with these tokens' keys and values written in (a prompt's prefill is ``start=0``, then
        one token at a time). No sequence parallelism here: decoding has no sequence to split."""
        cfg = self.config
        q, k, v = (self._project(x, name) for name in ("q", "k", "v"))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        positions = start + jnp.arange(x.shape[1])
        q = rotary.rotate(q, positions, self._inv_freq)
        k = rotary.rotate(k, positions, self._inv_freq)
        k_cache, v_cache = cache
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, 1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, 1)
        keys, values = k_cache, v_cache
        local_heads = q.shape[2]
        if keys.shape[2] == cfg.num_kv_heads and local_heads < cfg.num_heads:
            keys = self._kv_for_local_queries(keys, local_heads)
            values = self._kv_for_local_queries(values, local_heads)
        context = attend(q, keys.astype(q.dtype), values.astype(q.dtype),
                         sliding_window=cfg.sliding_window, kv_length=start + x.shape[1])
        return self.o(context.reshape(context.shape[:2] + (-1,))), (k_cache, v_cache)


def same_segment(segment_ids: Optional[jax.Array]) -> Optional[jax.Array]:
    """``[batch, 1, seq, seq]``: which key each query may see by document (None: all)."""
    if segment_ids is None:
        return None
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def attend(q, k, v, *, sliding_window: Optional[int] = None, kv_length=None,
           segment_ids: Optional[jax.Array] = None):
    """Causal attention of ``q`` ``[b, t, n, d]`` over ``k``/``v`` ``[b, s, g, d]`` (``g``
    dividing ``n``): queries are the last ``t`` of the ``s`` positions (``t = s`` in training;
    decoding with a cache has ``t < s``). ``kv_length`` (decoding): how many of the ``s``
    cached positions are filled; the queries then sit at ``kv_length - t .. kv_length - 1``.
    ``segment_ids`` ``[b, s]`` (training): no query sees a key of another document."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    t, s = q.shape[1], k.shape[1]
    documents = same_segment(segment_ids)
    if kv_length is None and t == s and fused_attention_fits(q.dtype):
        window = (sliding_window - 1, 0) if sliding_window is not None else None
        return jax.nn.dot_product_attention(q, k, v, mask=documents, is_causal=True,
                                            scale=scale, local_window_size=window,
                                            implementation=None)
    # Written out: a query block at an offset into a cache (and the dtypes jax's fused
    # attention does not fit: float16 on XLA:CPU, float64).
    filled = s if kv_length is None else kv_length
    query_pos = filled - t + jnp.arange(t)
    key_pos = jnp.arange(s)
    allowed = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] < filled)
    if sliding_window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - sliding_window
    if documents is not None:  # [b, 1, t, s] -> [b, 1, 1, t, s] against [b, g, q, t, s].
        allowed = allowed & documents[:, :, None]
    group = q.shape[2] // k.shape[2]
    qg = q.reshape(q.shape[:2] + (k.shape[2], group, q.shape[3]))
    scores = jnp.einsum("btgqd,bsgd->bgqts", qg, k, preferred_element_type=wide_float(q.dtype)
                        ) * scale
    scores = jnp.where(allowed, scores, lowest(scores.dtype))
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bgqts,bsgd->btgqd", probs, v)
    return out.reshape(q.shape[:3] + (v.shape[-1],))
