"""A layer's projection of its input by one of its weights, as every converter sees it.

``project`` is ``einsum(equation, x, W)`` with ``W`` in ``x``'s dtype -- in float8 inside an
FP8 scope (``float8.py``) -- plus the weight's low-rank update where LoRA adapts it
(``lora.py``). Layers call it for each weight product, so a converter that changes how
projections run reaches every layer through this one function.
"""

from __future__ import annotations

import jax

from titanax.modules import float8, lora


def project(layer, equation: str, x: jax.Array, name: str, *,
            whole_sequence: bool = False) -> jax.Array:
    """``einsum(equation, x, W)`` for ``layer``'s weight ``name`` (``whole_sequence``: see
    ``lora.low_rank_update``)."""
    y = float8.einsum(equation, x, layer.parameters[name].astype(x.dtype))
    update = lora.low_rank_update(layer, equation, x, name, whole_sequence=whole_sequence)
    return y if update is None else y + update
