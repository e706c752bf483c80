"""Block-quantised FP8 weights, as DeepSeek-V3 and Kimi K2 are published: each quantised weight
``W`` ``[out, in]`` is stored as ``float8_e4m3fn`` beside ``W_scale_inv`` ``[ceil(out / bo),
ceil(in / bi)]`` (float32), one scale per ``bo x bi`` block (``quantization_config``:
``quant_method "fp8"``, ``fmt "e4m3"``, ``weight_block_size [bo, bi]``; DeepSeek's is 128 x
128). An import multiplies each block by its scale (DeepSeek's own ``weight_dequant``), in
float32, and casts to the run's param dtype as any weight: the run trains a bfloat16 or float32
model, and an export writes it unquantised. Tensors not stored in FP8 (norms, embeddings, the
router) are read as they are.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import ml_dtypes
import numpy as np

# The name of a quantised weight's scales: its own name with this appended.
SCALE_SUFFIX = "_scale_inv"
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def readable(quantization: Optional[Mapping[str, Any]]) -> bool:
    """Whether a config's ``quantization_config`` is none, or FP8 blocks this module reads."""
    if not quantization:
        return True
    if not isinstance(quantization, Mapping):
        return False
    size = quantization.get("weight_block_size")
    return (quantization.get("quant_method") == "fp8"
            and quantization.get("fmt", "e4m3") == "e4m3"
            and quantization.get("activation_scheme", "dynamic") == "dynamic"
            and isinstance(size, (list, tuple)) and len(size) == 2
            and all(isinstance(n, int) and n > 0 for n in size))


def block_size(config: Mapping[str, Any]) -> Optional[Tuple[int, int]]:
    """The ``(out, in)`` block of a config's FP8 weights; None for an unquantised model (the
    config readers refuse a ``quantization_config`` that ``readable`` does not accept)."""
    quantization = config.get("quantization_config")
    if not quantization or not readable(quantization):
        return None
    out, inputs = quantization["weight_block_size"]
    return int(out), int(inputs)


def dequantized(weight: np.ndarray, scales: np.ndarray, *, block: Tuple[int, int],
                dtype: np.dtype = np.float32) -> np.ndarray:
    """``weight`` (FP8, ``[out, in]``) times each block's scale -- one float32 multiply per
    element -- rounded to ``dtype``, a block of rows at a time (the float32 product never
    larger than one row of blocks)."""
    rows, cols = weight.shape
    out = np.empty((rows, cols), dtype)
    for start in range(0, rows, block[0]):
        stop = min(start + block[0], rows)
        row_scales = np.repeat(np.asarray(scales[start // block[0]], np.float32),
                               block[1])[:cols]
        out[start:stop] = np.asarray(weight[start:stop], np.float32) * row_scales
    return out


def scales_shape(shape: Tuple[int, ...], *, block: Tuple[int, int]) -> Tuple[int, int]:
    """The shape of the scales of a weight of ``shape``."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
