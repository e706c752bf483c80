"""Padded lengths for batches of rows of different lengths: a compiled program per bucket, not
per length (scoring and generating over many prompts: ``harness/lm.py``, ``batch_generation.py``)."""

import math


def padded_length(length: int, *, limit: int) -> int:
    """The padded length of a batch whose longest row has ``length`` tokens: the next multiple
    of 16 up to 256, then of 1/16 of the next power of two (a few percent of padding at most;
    a program per bucket), at most ``limit``."""
    length = max(length, 1)
    step = 16 if length <= 256 else (1 << math.ceil(math.log2(length))) // 16
    return min(limit, -(-length // step) * step)
