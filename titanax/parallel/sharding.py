"""Turning PartitionSpec trees into placed arrays, and default specs for input batches.

``apply_named_sharding`` places each array leaf of a tree with ``NamedSharding(mesh, spec)``;
``shard_batch_specs`` gives a batch the data-parallel default: the leading (batch) dimension split
over the data axis, everything else replicated. Both are one-time placement helpers, not part of
the step's hot path, so they favour diagnostics: a structure mismatch or a failed placement names
the leaf's path and says what to do.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from titanax import errors
from titanax.parallel import rules as rules_lib
from titanax.parallel.tree_paths import path_string  # noqa: F401  (sharding.path_string)


def sharding_error(path: str, message: str, *, suggestion: Optional[str] = None
                   ) -> errors.ShardingError:
    return errors.ShardingError(message, path=path, suggestion=suggestion)


def tree_paths(tree: Any, *, is_leaf=None) -> Any:
    """A tree of the same structure whose leaves are the leaves' ``a/b/c`` paths."""
    return jax.tree_util.tree_map_with_path(lambda p, _: path_string(p), tree, is_leaf=is_leaf)


def _is_array_like(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def spec_for(param_path: str, param_shape: Sequence[int], rules: rules_lib.RulesLike,
             mesh: Optional[Mesh] = None) -> PartitionSpec:
    """The spec the first matching rule gives ``param_path``, checked against the shape/mesh.

    Raises ShardingError when no rule matches.
    """
    normalized = rules_lib.normalize_rules(rules)
    rule = rules_lib.first_match(normalized, param_path)
    if rule is None:
        raise sharding_error(param_path, "no sharding rule matches this param; rules tried: "
                             + (", ".join(repr(r.pattern) for r in normalized) or "(none)"),
                             suggestion="add a rule for it, or declare it replicated")
    mesh_shape = dict(mesh.shape) if mesh is not None else {a: 1 for a in
                                                               _axes_named(rule.spec)}
    return rules_lib.check_spec_fits(param_path, rule.spec, param_shape, mesh_shape,
                                     source=f"rule {rule.pattern!r}")


def _axes_named(spec) -> Sequence[str]:
    return rules_lib.spec_axes(PartitionSpec(*spec))


def apply_named_sharding(tree: Any, mesh: Mesh, spec_tree: Any) -> Any:
    """Places every array leaf of ``tree`` with ``NamedSharding(mesh, spec)`` from ``spec_tree``.

    ``spec_tree`` must mirror ``tree`` (same structure, a PartitionSpec per leaf). Array-likes
    (jax/numpy arrays, anything with ``shape`` and ``dtype``) become ``jax.Array``s with that
    sharding; ``jax.ShapeDtypeStruct`` leaves come back as ShapeDtypeStructs carrying the sharding
    (useful as restore targets); Python scalars and other leaves pass through unchanged.
    """
    value_structure = jax.tree_util.tree_structure(tree)
    spec_structure = jax.tree_util.tree_structure(spec_tree, is_leaf=_is_spec)
    if value_structure != spec_structure:
        raise sharding_error(
            "<root>", "structure mismatch between value tree and spec tree "
            f"(values: {value_structure}; specs: {spec_structure})",
            suggestion="Build specs via build_param_specs(...) or ensure spec_tree mirrors the "
                       "value structure")
    specs = jax.tree_util.tree_leaves(spec_tree, is_leaf=_is_spec)
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    placed = []
    for (key_path, leaf), spec in zip(leaves_with_paths, specs):
        path = path_string(key_path) or "<root>"
        if not _is_spec(spec):
            raise sharding_error(path, f"the spec tree holds {spec!r} here, not a PartitionSpec",
                                 suggestion="use jax.sharding.PartitionSpec leaves")
        if not _is_array_like(leaf):
            placed.append(leaf)
            continue
        rules_lib.check_spec_fits(path, tuple(spec), tuple(leaf.shape), dict(mesh.shape))
        sharding = NamedSharding(mesh, spec)
        if isinstance(leaf, jax.ShapeDtypeStruct):
            placed.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding))
            continue
        try:
            placed.append(jax.device_put(leaf, sharding))
        except Exception as e:  # pylint: disable=broad-except
            raise sharding_error(path, f"placement failed: {e}",
                                 suggestion="Check that spec dimensions refer to mesh axes and "
                                            "match array rank") from e
    return jax.tree_util.tree_unflatten(treedef, placed)


# One entry of a PartitionSpec / the axis argument of a collective: no axis, one, or several.
AxisEntry = Optional[Union[str, Tuple[str, ...]]]


def axis_entry(axes: Sequence[str]) -> AxisEntry:
    """``axes`` as one spec entry: None when empty, the name when one, else the tuple."""
    axes = tuple(axes)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def axes_size(mesh_shape: Mapping[str, int], axes: AxisEntry) -> int:
    """The number of devices along ``axes`` (a name, a tuple of names or None: 1)."""
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(int(mesh_shape[a]) for a in axes)


def shard_batch_specs(batch_example: Any, dp_axis: AxisEntry, *,
                      seq_axis: Optional[str] = None) -> Any:
    """Data-parallel default specs for a batch: ``P(dp_axis, None, ...)`` per array leaf.

    ``dp_axis`` may be a tuple of axes (HSDP splits the batch over data x fsdp). Scalars
    (rank 0) and non-array leaves get ``P()`` (replicated). ``dp_axis=None`` replicates
    everything. Shape-only leaves (``jax.ShapeDtypeStruct``) work too: only ``ndim`` is read.
    ``seq_axis`` (context parallelism): every leaf of two or more dimensions -- ``[rows, seq,
    ...]`` -- is also split along its second over that axis.
    """
    def spec(leaf):
        ndim = getattr(leaf, "ndim", None)
        if ndim is None and hasattr(leaf, "shape"):
            ndim = len(leaf.shape)
        if not ndim or (dp_axis is None and seq_axis is None):
            return PartitionSpec()
        if ndim >= 2 and seq_axis is not None:
            return PartitionSpec(dp_axis, seq_axis, *([None] * (ndim - 2)))
        return PartitionSpec(dp_axis, *([None] * (ndim - 1)))

    return jax.tree_util.tree_map(spec, batch_example)


def named_shardings(mesh: Mesh, spec_tree: Any) -> Any:
    """``NamedSharding(mesh, spec)`` for every spec of a tree."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), spec_tree, is_leaf=_is_spec)


def flat_paths(tree: Any, *, is_leaf=None) -> Mapping[str, Any]:
    """``{path: leaf}`` in flattening order."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {path_string(p): leaf for p, leaf in leaves}
