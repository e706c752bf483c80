"""The operand types of the matmuls in a lowered (StableHLO) program: what a run hands XLA
before any backend rewrites it -- ``--compile_only``'s proof that FP8 projections reach the
compiler as float8 dots (XLA:CPU then upcasts them; a GPU keeps them)."""

from __future__ import annotations

import collections
import re
from typing import Counter, Tuple

# "stablehlo.dot_general %a, %b, ... : (tensor<10x8xf8E4M3FN>, tensor<8x12xf8E4M3FN>) -> ..."
_DOT = re.compile(r"stablehlo\.dot_general\b.*:\s*\(tensor<([^>]*)>,\s*tensor<([^>]*)>\)")
FLOAT8_TYPES = ("f8E4M3FN", "f8E5M2")


def _element(tensor_type: str) -> str:
    return tensor_type.split("x")[-1]


def dot_operand_types(stablehlo_text: str) -> Counter[Tuple[str, str]]:
    """How many ``dot_general``s take each pair of operand element types."""
    return collections.Counter((_element(m.group(1)), _element(m.group(2)))
                               for m in _DOT.finditer(stablehlo_text))


def float8_dots(stablehlo_text: str) -> Tuple[int, int]:
    """``(dots with float8 operands, all dots)`` of the program."""
    types = dot_operand_types(stablehlo_text)
    return (sum(n for pair, n in types.items() if set(pair) <= set(FLOAT8_TYPES)),
            sum(types.values()))
