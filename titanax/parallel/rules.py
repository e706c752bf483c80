"""Sharding rules: param-path patterns -> PartitionSpecs, checked against shapes and the mesh.

A param path is its keys joined by ``/`` (``decoder/layers/attn/qkv/weight``). Patterns are globs
where ``*`` matches within one segment and ``**`` across any number of segments
(``**/attn/qkv/weight``), or regular expressions written ``re:<regex>``; a pattern must match the
whole path. Rules are tried in order and the first match wins. A rule whose spec is all ``None``
(or ``()``) declares the param replicated explicitly.

Every resolved spec is checked before anything is placed: rank, axis names, an axis used twice, and
divisibility of each sharded dimension. The errors name both the param path and the rule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from jax.sharding import PartitionSpec

from titanax import errors

SpecEntry = Union[None, str, Tuple[str, ...]]
SpecTuple = Tuple[SpecEntry, ...]
RulesLike = Union[Mapping[str, Sequence[SpecEntry]], Sequence[Tuple[str, Sequence[SpecEntry]]]]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule: a path pattern and the spec it gives."""

    pattern: str
    spec: SpecTuple

    def matches(self, path: str) -> bool:
        return compile_pattern(self.pattern).fullmatch(path) is not None


@functools.lru_cache(maxsize=None)
def compile_pattern(pattern: str) -> "re.Pattern[str]":
    """Compiles a glob (``*`` within a segment, ``**`` across segments) or ``re:`` pattern."""
    if pattern.startswith("re:"):
        try:
            return re.compile(pattern[3:])
        except re.error as e:
            raise errors.ShardingError(f"bad regular expression: {e}", path=f"rule {pattern!r}",
                                       suggestion="fix the regex after 're:'") from e
    out = ""
    index = 0
    while index < len(pattern):
        if pattern.startswith("**/", index):
            out += "(?:.*/)?"
            index += 3
        elif pattern.startswith("/**", index) and index + 3 == len(pattern):
            out += "(?:/.*)?"
            index += 3
        elif pattern.startswith("**", index):
            out += ".*"
            index += 2
        elif pattern[index] == "*":
            out += "[^/]*"
            index += 1
        elif pattern[index] == "?":
            out += "[^/]"
            index += 1
        else:
            out += re.escape(pattern[index])
            index += 1
    return re.compile(out)


def normalize_rules(rules: Optional[RulesLike]) -> List[Rule]:
    """Rules from a dict ``{pattern: spec}`` or a sequence of ``(pattern, spec)`` pairs."""
    if rules is None:
        return []
    pairs = rules.items() if isinstance(rules, Mapping) else rules
    out = []
    for pattern, spec in pairs:
        if isinstance(spec, PartitionSpec):
            spec = tuple(spec)
        if isinstance(spec, str) or not isinstance(spec, (tuple, list)):
            raise errors.ShardingError(
                f"a rule's spec must be a tuple of axis names / None, got {spec!r}",
                path=f"rule {pattern!r}", suggestion="e.g. (None, 'model')")
        out.append(Rule(pattern=pattern, spec=tuple(tuple(e) if isinstance(e, list) else e
                                                    for e in spec)))
    return out


def first_match(rules: Sequence[Rule], path: str) -> Optional[Rule]:
    for rule in rules:
        if rule.matches(path):
            return rule
    return None


def check_spec_fits(path: str, spec: Sequence[SpecEntry], shape: Sequence[int],
                    mesh_shape: Mapping[str, int], *, source: str = "") -> PartitionSpec:
    """Checks ``spec`` against ``shape`` and the mesh; returns it as a PartitionSpec."""
    spec = tuple(spec)
    where = f" (from {source})" if source else ""
    if len(spec) > len(shape):
        raise errors.ShardingError(
            f"spec {spec}{where} has {len(spec)} entries but the param has rank {len(shape)} "
            f"(shape {tuple(shape)})", path=path,
            suggestion="give one entry (axis name or None) per dimension")
    used: List[str] = []
    for dimension, entry in enumerate(spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for axis in axes:
            if axis not in mesh_shape:
                raise errors.ShardingError(
                    f"spec {spec}{where} names mesh axis {axis!r}, which the mesh does not have",
                    path=path, suggestion=f"mesh axes: {', '.join(mesh_shape)}")
            if axis in used:
                raise errors.ShardingError(f"spec {spec}{where} uses mesh axis {axis!r} twice",
                                           path=path, suggestion="shard each axis over one "
                                                                 "dimension only")
            used.append(axis)
        parts = math.prod(mesh_shape[a] for a in axes)
        if shape[dimension] % parts:
            raise errors.ShardingError(
                f"dimension {dimension} (size {shape[dimension]}) of shape {tuple(shape)} is not "
                f"divisible by {parts}, the size of mesh axis {'x'.join(axes)}, as spec "
                f"{spec}{where} asks", path=path,
                suggestion="change the model size, the mesh shape, or the rule"
                + ("; a vocabulary table is padded to a multiple of "
                   "model.vocab_pad_multiple (e.g. --config.model.vocab_pad_multiple=128)"
                   if dimension == 0 and path.split("/")[0] in ("token_emb", "lm_head") else ""))
    return PartitionSpec(*spec)


def resolve_specs(shapes: Mapping[str, Sequence[int]], rules: Sequence[Rule],
                  defaults: Mapping[str, Optional[SpecTuple]], mesh_shape: Mapping[str, int], *,
                  undeclared_replicated: bool) -> Dict[str, PartitionSpec]:
    """The spec of every param: first matching rule, else the layer's default, else an error.

    Args:
        shapes: ``{param path: global shape}``.
        rules: Plan rules, tried in order.
        defaults: ``{param path: spec}`` declared by layers (None where a layer declared none).
        mesh_shape: ``{axis: size}``.
        undeclared_replicated: Treat params with neither a rule nor a layer default as replicated
            (right for data-parallel-only plans) instead of failing.
    """
    resolved: Dict[str, PartitionSpec] = {}
    unmatched: List[str] = []
    for path, shape in shapes.items():
        rule = first_match(rules, path)
        if rule is not None:
            resolved[path] = check_spec_fits(path, rule.spec, shape, mesh_shape,
                                             source=f"rule {rule.pattern!r}")
        elif defaults.get(path) is not None:
            resolved[path] = check_spec_fits(path, defaults[path], shape, mesh_shape,
                                             source="the layer's default")
        elif undeclared_replicated:
            resolved[path] = PartitionSpec()
        else:
            unmatched.append(path)
    if unmatched:
        tried = ", ".join(repr(r.pattern) for r in rules) or "(no rules)"
        raise errors.ShardingError(
            f"{len(unmatched)} param(s) match no sharding rule and declare no layout: "
            f"{', '.join(unmatched)}; rules tried: {tried}", path=unmatched[0],
            suggestion="add a rule for them, e.g. {'" + unmatched[0] + "': (None,) * rank} to "
                       "replicate explicitly, or a '**' catch-all rule last")
    return resolved


def divisible_part(spec: SpecTuple, shape: Sequence[int],
                   mesh_shape: Mapping[str, int]) -> SpecTuple:
    """``spec`` with every entry whose mesh axes do not divide its dimension made whole."""
    out = []
    for dimension, entry in enumerate(spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        parts = math.prod(mesh_shape.get(a, 1) for a in axes)
        out.append(entry if shape[dimension] % parts == 0 else None)
    return tuple(out)


def spec_axes(spec: PartitionSpec) -> Tuple[str, ...]:
    """Mesh axes a spec shards over."""
    out: List[str] = []
    for entry in spec:
        if entry is None:
            continue
        out.extend((entry,) if isinstance(entry, str) else entry)
    return tuple(out)


def local_shape(shape: Sequence[int], spec: PartitionSpec,
                mesh_shape: Mapping[str, int]) -> Tuple[int, ...]:
    """The per-device shape of a global array with this spec."""
    out = list(shape)
    for dimension, entry in enumerate(spec):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else entry
        out[dimension] //= math.prod(mesh_shape[a] for a in axes)
    return tuple(out)


def is_param_leaf(x) -> bool:
    """Leaves of a param tree: arrays, ShapeDtypeStructs and ParameterSpecs (anything shaped)."""
    return hasattr(x, "shape") and not isinstance(x, (dict, list, tuple))


def itemsize(leaf) -> int:
    import numpy as np  # pylint: disable=import-outside-toplevel
    return np.dtype(leaf.dtype).itemsize


def build_param_specs(params, plan, mesh):
    """A PartitionSpec for every leaf of ``params``, combining plan rules and layer defaults.

    ``params`` may hold arrays, ``jax.ShapeDtypeStruct``s or ``ParameterSpec``s (whose
    ``mesh_axes`` is the layer's declared layout). The first matching plan rule wins; otherwise the
    layer's layout is used; params with neither are replicated when the plan has no tensor
    parallelism, and an error (listing them all) when it has.
    """
    return LayerLayouts(rules=tuple(plan.sharding_rules()),
                        undeclared_replicated=plan.tp_axis is None).specs(params, dict(mesh.shape))


@dataclasses.dataclass(frozen=True)
class LayerLayouts:
    """The first transform of the layout pipeline (parallel/layout.py): every param's spec from
    the layout its layer declares, overridden by the first matching TP rule."""

    # The plan's TP rules, in order (empty without tensor parallelism).
    rules: Tuple[Rule, ...] = ()
    # Params with neither a rule nor a declared layout are replicated (no TP) or an error (TP).
    undeclared_replicated: bool = True
    name: str = "layer layouts + TP rules"

    def specs(self, params, mesh_shape: Mapping[str, int]):
        import jax  # pylint: disable=import-outside-toplevel
        from titanax.parallel.tree_paths import path_string  # pylint: disable=import-outside-toplevel

        leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_param_leaf)
        shapes = {}
        defaults = {}
        for key_path, leaf in leaves:
            path = path_string(key_path)
            shapes[path] = tuple(leaf.shape)
            mesh_axes = getattr(leaf, "mesh_axes", None)
            defaults[path] = tuple(mesh_axes) if mesh_axes is not None else None
            if defaults[path] is not None and getattr(leaf, "replicated_if_indivisible", False):
                defaults[path] = divisible_part(defaults[path], leaf.shape, mesh_shape)
        resolved = resolve_specs(shapes, self.rules, defaults, mesh_shape,
                                 undeclared_replicated=self.undeclared_replicated)
        return jax.tree_util.tree_unflatten(treedef, [resolved[p] for p in shapes])

    def apply(self, layout):
        specs = self.specs(layout.parameter_specs, layout.mesh_shape)
        return layout.evolve(self.name, param_specs=specs, layer_specs=specs)
