"""Flash attention as one fused GPU kernel, with packed documents: jax's Pallas (Triton) kernel.

cuDNN's kernel (``jax.nn.dot_product_attention(implementation="cudnn")``) is the fastest on a
GPU, but takes only half-precision inputs and masks documents by a dense ``[t, s]`` mask. The
Pallas flash-attention kernel that ships with jax (``jax.experimental.pallas.ops.gpu.attention``)
runs any float dtype, skips the key blocks after each query block (causal), and masks packed
documents by their segment ids inside the kernel -- nothing of size ``t x s`` exists, forward or
backward. This module fits Titanax's attention to it:

- grouped-query attention: the kernel pairs each query head with its own kv head, so the kv heads
  are repeated for their group (``[b, s, n, d]``: O(S) memory, unlike the scores);
- the head width is padded with zeros to a power of two of at least 16 (Triton's dot shapes;
  zero columns add nothing to a score, and the output's are cut off);
- the sequence is padded to whole blocks; a padded key sits after every real query, so causality
  hides it, and padded queries are cut off.

It covers causal attention over the whole row, with or without segment ids (training and
prefill). A sliding window and decoding against a cache it does not cover: ``attend`` refuses
the first by config and runs decoding blockwise.

Off a GPU the kernel runs in Pallas' interpret mode (jax ops emulating each program instance):
slow, and only for the parity tests, which check its numerics on CPU.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

# The kernel's forward query / key block length at most (jax's own default), and the backward's.
FORWARD_BLOCK = 128
BACKWARD_BLOCK = 32
# The bytes of one forward block of one of q / k / v that fit: 128 positions x 128 features of
# bfloat16.
_FORWARD_TILE_BYTES = FORWARD_BLOCK * 128 * 2
# Triton's dot needs each dimension to be at least this and a power of two.
_MIN_WIDTH = 16


def pallas_attention(q, k, v, *, scale: float, segment_ids: Optional[jax.Array] = None,
                     block_size: int = FORWARD_BLOCK) -> jax.Array:
    """Causal attention of ``q`` ``[b, s, n, d]`` over ``k``/``v`` ``[b, s, g, d]`` (``g``
    dividing ``n``; queries and keys the same positions), ``[b, s, n, d]`` out; ``segment_ids``
    ``[b, s]``: no query sees another document's keys. ``block_size`` caps the kernel's blocks
    (the tests make it small to cross several blocks)."""
    from jax.experimental.pallas.ops.gpu import attention as kernel  # pylint: disable=import-outside-toplevel
    b, s, n, d = q.shape
    groups = n // k.shape[2]
    if groups > 1:  # One kv head per query head, as the kernel reads them.
        k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    width = _power_of_two(d)
    # A block's query, key and value tiles live in shared memory: 128-long blocks of 128-wide
    # half-precision heads fit (jax's default), float32 or 256-wide heads take 64 (measured on
    # an H200: 128 x 128 in float32 asks 256 KiB of its 227).
    fits = _FORWARD_TILE_BYTES // (width * jnp.dtype(q.dtype).itemsize)
    block = min(block_size, FORWARD_BLOCK, _power_of_two(s), fits)
    block = 1 << (max(block, 1).bit_length() - 1)  # Triton's blocks are powers of two.
    backward = min(block, BACKWARD_BLOCK)
    length = -(-s // block) * block
    q, k, v = (_padded(x, length=length, width=width) for x in (q, k, v))
    if segment_ids is not None:
        # Padded keys: a segment of their own (causality already hides them from real queries).
        segment_ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, length - s)),
                              constant_values=-1)
    sizes = kernel.BlockSizes(block_q=block, block_k=block, block_q_dkv=backward,
                              block_kv_dkv=backward, block_q_dq=backward, block_kv_dq=backward)
    out = kernel.mha(q, k, v, segment_ids, sm_scale=scale, causal=True, block_sizes=sizes,
                     interpret=jax.default_backend() != "gpu")
    return out[:, :s, :, :d]


def _power_of_two(size: int) -> int:
    """The smallest power of two >= ``size`` and >= 16."""
    return max(_MIN_WIDTH, 1 << (max(size, 1) - 1).bit_length())


def _padded(x, *, length: int, width: int):
    """``x`` ``[b, s, h, d]`` padded with zeros to ``length`` positions and ``width`` features."""
    _, s, _, d = x.shape
    if (s, d) == (length, width):
        return x
    return jnp.pad(x, ((0, 0), (0, length - s), (0, 0), (0, width - d)))
