"""Which device runs Newton-Schulz on which matrix (Muon, ``muon.py``), and how the parts get
there.

A matrix param's momentum is held in parts: the mesh axes that split its fan dimensions (TP's,
ZeRO's or FSDP's: the *split* axes) give each device one block of every matrix, and the other
axes that do not split its batch dimensions (the *replica* axes: data-parallel replicas) hold
those blocks again. All these devices together are the param's *team*. Each of the team's
matrices is iterated by one member, the members' loads balanced by cost -- the longest first,
each to the least-loaded member so far (LPT scheduling) -- over all the
team's matrices whatever their shape (LPT's bound: within 4/3 - 1/(3 x members) of the best
balance). A member ``(replica r, split position s)`` receives the
blocks of its matrices from the devices of its own replica (an all-to-all over the split axes),
and sends each of them back its block of the result (the reverse all-to-all), then the replicas
exchange what they computed (an all-gather over the replica axes). No device ever assembles
more matrices whole than its own. The plan is static (shapes only), the
same on every device.
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
    """The devices along ``replica_axes`` x ``split_axes`` that hold the same matrices (in
    blocks over the split axes), and which of them iterates each."""

    replica_axes: Tuple[str, ...]
    split_axes: Tuple[str, ...]
    # How many devices along each: the team has replicas x splits members; member
    # r * splits + s is the device at position r along the replica axes and s along the split
    # axes.
    replicas: int
    splits: int
    # Per member: its matrices, in the order it iterates them.
    work: Tuple[Tuple[Matrix, ...], ...]
    # Per matrix: its wide-orientation shape (m <= n).
    shapes: Dict[Matrix, Tuple[int, int]]

    @property
    def count(self) -> int:
        return self.replicas * self.splits

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


def _axes_splitting(layout: ParamLayout, dims: Sequence[int]) -> set:
    return {a for d in dims for a in layout.split[d]}


def fan_dims(layout: ParamLayout) -> Tuple[int, ...]:
    """The param's fan dimensions, in its own order."""
    return tuple(d for d in range(len(layout.shape)) if d in layout.fan_in + layout.fan_out)


def batch_dims(layout: ParamLayout) -> Tuple[int, ...]:
    return tuple(d for d in range(len(layout.shape)) if d not in layout.fan_in + layout.fan_out)


def team_axes(layout: ParamLayout) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """``(replica axes, split axes)`` of the param's team, each in mesh order: the axes that
    split its fan dimensions, and the others that do not split its batch dimensions."""
    split = _axes_splitting(layout, fan_dims(layout))
    batch = _axes_splitting(layout, batch_dims(layout))
    names = [name for name, _ in layout.mesh]
    return (tuple(n for n in names if n not in split and n not in batch),
            tuple(n for n in names if n in split))


def local_matrices(layout: ParamLayout) -> int:
    """How many matrices of the param a device holds (its part of the batch dimensions)."""
    return math.prod(layout.shape[d] // layout.parts[d] for d in batch_dims(layout))


def teams(layouts: Sequence[ParamLayout]) -> List[Team]:
    """The teams of the matrix params ``layouts``, each with its members' balanced work."""
    grouped: Dict[Any, List[int]] = {}
    for i, layout in enumerate(layouts):
        grouped.setdefault(team_axes(layout), []).append(i)
    result = []
    for (replica_axes, split_axes), members in grouped.items():
        sizes = dict(layouts[members[0]].mesh)
        replicas = math.prod(sizes[a] for a in replica_axes)
        splits = math.prod(sizes[a] for a in split_axes)
        shapes = {}
        for i in members:
            fan_in, fan_out = fans(layouts[i])
            for j in range(local_matrices(layouts[i])):
                shapes[(i, j)] = (min(fan_in, fan_out), max(fan_in, fan_out))
        cost = {m: newton_schulz_flops(*shape, steps=1) for m, shape in shapes.items()}
        count = replicas * splits
        loads, work = [0] * count, [[] for _ in range(count)]
        for matrix in sorted(shapes, key=lambda m: (-cost[m], m)):
            member = min(range(count), key=lambda d: (loads[d], d))
            loads[member] += cost[matrix]
            work[member].append(matrix)
        result.append(Team(replica_axes=replica_axes, split_axes=split_axes, replicas=replicas,
                           splits=splits, work=tuple(tuple(w) for w in work), shapes=shapes))
    return result
