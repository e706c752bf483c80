"""What a data source says its examples hold, before it reads any: how many ids each batch entry
may hold and how many positions a row has.

A model declares what its inputs may hold (``modules/input_limits.py``: ``model.vocab_size``,
``model.max_seq_len``, the classes); a source declares what it produces -- from its config and
its tokenizer alone (the tokenizer's vocabulary, bytes' 256, a pre-tokenized set's largest id,
its ``seq_len``). The two are compared for every input of a run (``train/inputs.py``) before the
first compile: a model smaller than its tokenizer is refused at once, not hundreds of steps later
when the first rare id arrives. The per-batch check stays as the last line of defence.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Declared:
    """A source's declaration."""

    # Batch entry -> its ids lie in [0, n).
    ids: Dict[str, int] = dataclasses.field(default_factory=dict)
    # What says so ("the tokenizer tok/tokenizer.json (4096 tokens)", "bytes (256 ids)").
    ids_from: str = ""
    # Positions per row (dimension 1 of every entry), None: not a sequence.
    length: Optional[int] = None
    # The source's config field that says so ("seq_len").
    length_field: str = "seq_len"
    # The vocabulary its ids come from (its tokenizer's size: bytes 256), None: not known. What
    # a model left without a vocab_size is sized to -- not the largest id the data holds, which
    # a prompt or another input of the same tokenizer may exceed.
    vocabulary: Optional[int] = None

    @classmethod
    def of_tokens(cls, tokenizer: Any, *, fields: Tuple[str, ...],
                  length: Optional[int]) -> "Declared":
        """Entries of ``fields`` hold ids of ``tokenizer``; rows of ``length`` positions."""
        return cls(ids={name: int(tokenizer.vocab_size) for name in fields},
                   ids_from=describe_tokenizer(tokenizer), length=length,
                   vocabulary=int(tokenizer.vocab_size))


def describe_tokenizer(tokenizer: Any) -> str:
    """"the tokenizer <file> (N tokens)", or "bytes (256 ids)"."""
    file = getattr(tokenizer, "file", None)
    if file is None:
        return f"the byte tokenizer ({tokenizer.vocab_size} ids)"
    return f"the tokenizer {file} ({tokenizer.vocab_size} tokens)"
