"""Where a layer stands on its tensor-parallel axis.

Layers name their TP mesh axis in their config. Inside ``shard_map`` with that axis present they
see their shard and call collectives; with the axis absent (one device, or a mesh without it) or of
size 1, the same code runs with size 1 and rank 0, and skips the collectives.
"""

from __future__ import annotations

from typing import Optional, Union

import jax

from titanax.parallel import collectives


def tp_active(axis: Optional[str]) -> bool:
    """True when ``axis`` names a manual mesh axis here of more than one device (over one device
    a layer has nothing to split, and runs the unsplit code)."""
    return (axis is not None and axis in collectives.manual_axes()
            and collectives.axis_size(axis) > 1)


def tp_rank(axis: Optional[str]) -> Union[int, jax.Array]:
    return collectives.axis_index(axis) if tp_active(axis) else 0
