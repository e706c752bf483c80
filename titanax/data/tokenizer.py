"""Byte-level tokenizer: every UTF-8 byte is a token (vocabulary 256), so any text round-trips."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Text <-> uint8 ids."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")
