"""What crosses devices in a compiled program: every collective, its mesh axes, bytes, and whether
it sits inside a loop.

Titanax's promise is that the only communication is what the user or a layer wrote; this report
is how that is checked. It reads the compiled HLO text: each ``all-reduce`` / ``all-gather`` /
``reduce-scatter`` / ``collective-permute`` / ``all-to-all`` instruction (async ``-start`` forms
counted once), maps its replica groups back to mesh axes, sizes its result, and marks it
``in_loop`` when its computation is reachable from the body of a ``while`` (a ``lax.scan``).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import numpy as np
from jax.sharding import Mesh

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>" + "|".join(_OPS) + r")(?P<start>-start)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)="
                    r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_BODY = re.compile(r"body=%?([\w.\-]+)")
_ARRAY = re.compile(r"\b(pred|s8|s16|s32|s64|u8|u16|u32|u64|f16|bf16|f32|f64|c64|c128|"
                    r"f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
          "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1,
          "f8e5m2": 1}


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of a compiled program."""

    # HLO op: all-reduce, all-gather, reduce-scatter, collective-permute or all-to-all.
    op: str
    # Mesh axes it communicates over (empty when the groups match no set of axes).
    axes: Tuple[str, ...]
    # Size of its result in bytes (per device).
    bytes: int
    # Inside the body of a while loop (e.g. a lax.scan over microbatches or layers).
    in_loop: bool
    # Instruction and computation names, and the jax op that produced it (from metadata).
    name: str
    computation: str
    source: str

    @property
    def layer(self) -> str:
        """The module path (or step part: ``gradient_reduction``, ``optimizer_update``) whose
        code emitted it, from the named scopes in ``source``; "" when none."""
        return source_scopes(self.source)[0]

    @property
    def pass_name(self) -> str:
        """``forward``, ``backward`` (the transpose of a forward collective) or ``step`` (outside
        the model's differentiated code: reduction, update)."""
        return source_scopes(self.source)[1]


# Names jax gives the levels of a program (not module scopes).
_JAX_LEVELS = {"main", "shard_map", "while", "body", "cond", "scan", "checkpoint", "remat",
               "rematted_computation", "closed_call", "core_call", "custom_jvp_call",
               "custom_vjp_call", "pjit", "vmap"}
_WRAPPED = re.compile(r"^(?P<outer>[\w.]+)\((?P<inner>.*)\)$")


def source_scopes(source: str) -> Tuple[str, str]:
    """``(layer, pass)`` of a collective from its ``op_name`` metadata, e.g.
    ``jit(step)/jit(main)/shard_map/transpose(jvp(decoder))/layer/mlp/down/psum`` ->
    ``("decoder/layer/mlp/down", "backward")``: the named scopes (a module's path), with jax's own
    levels (``jit(...)``, ``shard_map``, ``while/body``, ...) and the primitive left out."""
    if not source:
        return "", ""
    # XLA names an op merged from two as ".../(name_a:name_b)": the first one's.
    source = source.split(":")[0]
    pass_name = ("backward" if "transpose(" in source
                 else "forward" if "jvp(" in source or "vjp(" in source else "step")
    scopes = []
    for part in source.split("/")[:-1]:  # The last part is the primitive.
        if part.startswith(("jit(", "pjit(")):
            continue
        part = part.lstrip("(")
        while (match := _WRAPPED.match(part)) is not None:
            part = match.group("inner")
        if part and part not in _JAX_LEVELS and not part.startswith(("branch_", "checkpoint")):
            scopes.append(part)
    return "/".join(scopes), pass_name


def _shape_bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        count = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += count * _BYTES[dtype]
    return total


def _parse_groups(line: str, num_devices: int) -> Optional[List[List[int]]]:
    explicit = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?)*)\}", line)
    if explicit:
        return [[int(v) for v in group.split(",") if v.strip()]
                for group in re.findall(r"\{([\d,\s]*)\}", explicit.group(1))]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        groups, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
        return ids.reshape(groups, size).tolist()
    pairs = re.search(r"source_target_pairs=\{([^}]*(?:\}[^}]*)*?)\}(?:,|\s|$)", line)
    if pairs:
        edges = [tuple(int(v) for v in pair.split(","))
                 for pair in re.findall(r"\{(\d+,\d+)\}", pairs.group(0))]
        return _components(edges, num_devices)
    if "replica_groups={}" in line:
        return [list(range(num_devices))]
    return None


def _components(edges: Sequence[Tuple[int, int]], num_devices: int) -> List[List[int]]:
    parent = list(range(num_devices))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in edges:
        parent[find(a)] = find(b)
    groups: Dict[int, List[int]] = {}
    for device in sorted({d for edge in edges for d in edge}):
        groups.setdefault(find(device), []).append(device)
    return list(groups.values())


def _axis_partitions(mesh: Mesh) -> Dict[FrozenSet[FrozenSet[int]], Tuple[str, ...]]:
    """For every non-empty set of mesh axes, the partition of device positions it induces."""
    names = list(mesh.axis_names)
    positions = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    out = {}
    for count in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), count):
            rest = [i for i in range(len(names)) if i not in subset]
            moved = positions.transpose(rest + list(subset))
            groups = moved.reshape(-1, int(np.prod([positions.shape[i] for i in subset])))
            key = frozenset(frozenset(int(v) for v in g) for g in groups)
            out.setdefault(key, tuple(names[i] for i in subset))
    return out


def _covering_axes(components: FrozenSet[FrozenSet[int]],
                   partitions: Dict[FrozenSet[FrozenSet[int]], Tuple[str, ...]]
                   ) -> Tuple[str, ...]:
    """The fewest axes whose groups each contain a whole component (partial permutations, e.g. a
    pipeline's non-wrapping send, touch only some devices of each group)."""
    fits = [axes for partition, axes in partitions.items()
            if all(any(c <= group for group in partition) for c in components)]
    return min(fits, key=len) if fits else ()


def _mesh_axes_from_text(line: str) -> Optional[Tuple[str, ...]]:
    match = re.search(r"replica_groups=mesh\[[^\]]*\]\s*\{([^}]*)\}", line)
    if not match:
        return None
    return tuple(a.strip().strip("'\"") for a in match.group(1).split(",") if a.strip())


def collectives_report(hlo_text: str, mesh: Mesh) -> List[CollectiveOp]:
    """Every collective in ``hlo_text`` (a compiled program's ``as_text()``)."""
    lines = hlo_text.splitlines()
    calls: Dict[str, Set[str]] = {}
    loop_bodies: Set[str] = set()
    found = []
    current = ""
    for line in lines:
        header = _COMPUTATION.match(line)
        # Computation headers start in column 0; instructions are indented.
        if header and not line.startswith((" ", "\t")):
            current = header.group("name")
            calls.setdefault(current, set())
            continue
        callees = set(_CALLS.findall(line))
        for branch_list in _BRANCHES.findall(line):
            callees.update(name.strip().lstrip("%") for name in branch_list.split(","))
        calls.setdefault(current, set()).update(callees)
        loop_bodies.update(_BODY.findall(line))
        match = _INSTRUCTION.match(line)
        if match:
            found.append((current, match, line))
    in_loop: Set[str] = set()
    frontier = list(loop_bodies)
    while frontier:
        name = frontier.pop()
        if name in in_loop:
            continue
        in_loop.add(name)
        frontier.extend(calls.get(name, ()))
    partitions = _axis_partitions(mesh)
    report = []
    for computation, match, line in found:
        axes = _mesh_axes_from_text(line)
        if axes is None:
            groups = _parse_groups(line, mesh.devices.size) or []
            key = frozenset(frozenset(g) for g in groups if len(g) > 1)
            axes = partitions.get(key, ()) if key else ()
            if not axes and key and match.group("op") == "collective-permute":
                axes = _covering_axes(key, partitions)
        source = re.search(r'op_name="([^"]*)"', line)
        report.append(CollectiveOp(op=match.group("op"), axes=tuple(axes),
                                   bytes=_shape_bytes(match.group("shape")),
                                   in_loop=computation in in_loop, name=match.group("name"),
                                   computation=computation,
                                   source=source.group(1) if source else ""))
    return report


def format_report(ops: Sequence[CollectiveOp]) -> str:
    """A table of collectives with totals per (op, axes, in loop)."""
    if not ops:
        return "no collectives"
    rows = [("op", "axes", "bytes", "in loop", "pass", "layer", "from")]
    for op in ops:
        rows.append((op.op, ",".join(op.axes) or "?", str(op.bytes), "yes" if op.in_loop else "no",
                     op.pass_name or "?", op.layer or "-",
                     re.sub(r"[()]", "", op.source.split("/")[-1]) if op.source else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    total = sum(op.bytes for op in ops)
    lines.append(f"total: {len(ops)} collectives, {total} bytes per device per call "
                 f"({sum(op.in_loop for op in ops)} inside loops)")
    return "\n".join(lines)


def format_totals_by_axis(ops: Sequence[CollectiveOp]) -> str:
    """Bytes per device by mesh axes and op, each op counted once (an op inside a loop runs once
    per iteration): what each axis carries."""
    totals: Dict[Tuple[Tuple[str, ...], str], List[int]] = {}
    for op in ops:
        entry = totals.setdefault((op.axes, op.op), [0, 0, 0])
        entry[0] += 1
        entry[1] += op.bytes
        entry[2] += op.in_loop
    if not totals:
        return "communication by axis: none"
    lines = ["communication by axis (per device, per call of each op; loop bodies run more):"]
    for (axes, op), (count, size, looped) in sorted(totals.items()):
        lines.append(f"  {','.join(axes) or '?'}: {count} x {op}, {size} bytes"
                     + (f" ({looped} inside loops)" if looped else ""))
    return "\n".join(lines)
