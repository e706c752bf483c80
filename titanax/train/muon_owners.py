"""Which device runs Newton-Schulz on which matrix (Muon, ``muon.py``).

Once a matrix param's split fan dimensions are gathered, every device along the param's
``owners`` axes holds the same whole matrices: a *team*. Each matrix is iterated by one member
of its team, and the members' loads are balanced by cost -- the longest first, each to the
least-loaded member so far (LPT scheduling, within 4/3 of the best) -- over all the team's
matrices whatever their shape: 12 MLP matrices and 16 attention ones over 8 devices load
each device with its share and a little, where spreading each shape evenly on its own would
pad the 12 to 16. The plan is static (shapes only), the same on every device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Sequence, Tuple

from titanax.train.param_layouts import ParamLayout

# A matrix: (param index in the list handed over, index in its local batch of matrices).
Matrix = Tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Team:
    """The devices along ``axes`` (``count`` of them) that hold the same whole matrices, and
    which of them iterates each."""

    axes: Tuple[str, ...]
    count: int
    # Per member (its position along ``axes``): its matrices, in the order it iterates them.
    work: Tuple[Tuple[Matrix, ...], ...]
    # Per matrix: its wide-orientation shape (m <= n).
    shapes: Dict[Matrix, Tuple[int, int]]

    def owner(self, matrix: Matrix) -> int:
        return next(d for d, mine in enumerate(self.work) if matrix in mine)

    def load(self, member: int, *, steps: int) -> int:
        return sum(newton_schulz_flops(*self.shapes[m], steps=steps) for m in self.work[member])


def newton_schulz_flops(rows: int, columns: int, *, steps: int) -> int:
    """Multiply-add FLOPs of ``steps`` iterations on one ``rows x columns`` matrix (its wide
    orientation ``m <= n``: the Gram matrix ``2 m^2 n``, its square ``2 m^3``, the product
    with ``x`` ``2 m^2 n``)."""
    m, n = min(rows, columns), max(rows, columns)
    return steps * (4 * m * m * n + 2 * m ** 3)


def fans(layout: ParamLayout) -> Tuple[int, int]:
    return (math.prod(layout.shape[d] for d in layout.fan_in),
            math.prod(layout.shape[d] for d in layout.fan_out))


def owners(layout: ParamLayout) -> Tuple[str, ...]:
    """The mesh axes over which every device holds the same whole matrices of the param once
    its fan dimensions are gathered (all but those that split its batch dimensions)."""
    batch_split = {a for d in range(len(layout.shape))
                   if d not in layout.fan_in + layout.fan_out for a in layout.split[d]}
    return tuple(name for name, _ in layout.mesh if name not in batch_split)


def local_matrices(layout: ParamLayout) -> int:
    """How many matrices of the param a device holds (its part of the batch dimensions)."""
    return math.prod(layout.shape[d] // layout.parts[d] for d in range(len(layout.shape))
                     if d not in layout.fan_in + layout.fan_out)


def teams(layouts: Sequence[ParamLayout], *, keys: Sequence[Any] = ()) -> List[Team]:
    """The teams of the matrix params ``layouts`` (``keys``: a further per-param key that
    keeps params apart, as their dtype), each with its members' balanced work."""
    sizes = [dict(layout.mesh) for layout in layouts]
    grouped: Dict[Any, List[int]] = {}
    for i, layout in enumerate(layouts):
        axes = owners(layout)
        count = math.prod(sizes[i][a] for a in axes)
        grouped.setdefault((axes, count, keys[i] if keys else None), []).append(i)
    result = []
    for (axes, count, _), members in grouped.items():
        shapes = {}
        for i in members:
            fan_in, fan_out = fans(layouts[i])
            for j in range(local_matrices(layouts[i])):
                shapes[(i, j)] = (min(fan_in, fan_out), max(fan_in, fan_out))
        cost = {m: newton_schulz_flops(*shape, steps=1) for m, shape in shapes.items()}
        loads, work = [0] * count, [[] for _ in range(count)]
        for matrix in sorted(shapes, key=lambda m: (-cost[m], m)):
            member = min(range(count), key=lambda d: (loads[d], d))
            loads[member] += cost[matrix]
            work[member].append(matrix)
        result.append(Team(axes=axes, count=count, work=tuple(tuple(w) for w in work),
                           shapes=shapes))
    return result
