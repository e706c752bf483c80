"""Typed collectives: the one place Titanax calls ``jax.lax`` communication primitives.

Every byte that crosses devices in a Titanax step goes through a function here, called by the user
or by a layer. Each checks, at trace time, that it runs inside ``shard_map`` (outside it arrays are
global and no collective is needed), that the mesh axis exists there, and that the values are
arrays; the error names the axis and lists the axes that do exist. Because nothing else
communicates, the compiled step's collectives are exactly the calls made here, which is what
``titanax.observe`` reports and tests assert on.

All functions take pytrees unless noted, and ``axis`` may be one axis name or a tuple of names.

A mesh axis of size 1 moves nothing, so no collective is emitted over it: values are never cast
to varying over it, reductions skip it (unless a value already varies over it, which only a
``shard_map`` of the user's own can make happen), and a gather, scatter, permutation or
all-to-all over it alone returns its input. A plan with ``model=1`` therefore compiles to the
step without that axis.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from titanax import errors

AxisNames = Union[str, Tuple[str, ...]]


def manual_axes() -> Tuple[str, ...]:
    """Mesh axes that are manual here (inside ``shard_map``); empty outside."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(getattr(mesh, "manual_axes", ()) or ())


def _axes_tuple(axis: AxisNames) -> Tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def check_axis(op: str, axis: AxisNames) -> Tuple[str, ...]:
    """Raises CollectiveError unless every axis in ``axis`` is a manual axis here."""
    axes = _axes_tuple(axis)
    available = manual_axes()
    if not axes or not all(isinstance(a, str) for a in axes):
        raise errors.CollectiveError(f"{op} needs a mesh axis name (or a tuple of them), got "
                                     f"{axis!r}", path=f"collectives.{op}",
                                     suggestion=f"axes here: {', '.join(available) or 'none'}")
    if not available:
        raise errors.CollectiveError(
            f"{op} over {axis!r} was called outside shard_map", path=f"mesh axis {axis!r}",
            suggestion="collectives only make sense in local view: call it inside the step "
                       "function (Titanax runs it in shard_map over every mesh axis); outside, "
                       "arrays are global and need no collective")
    missing = [a for a in axes if a not in available]
    if missing:
        raise errors.CollectiveError(
            f"{op}: mesh axis {missing[0]!r} does not exist here", path=f"mesh axis {missing[0]!r}",
            suggestion=f"axes available: {', '.join(available)}; check the plan's axis names")
    return axes


def _check_leaves(op: str, tree: Any) -> None:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in leaves:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex)) \
                or isinstance(leaf, bool):
            where = jax.tree_util.keystr(path) or "<root>"
            raise errors.CollectiveError(
                f"{op} needs arrays, but the leaf at {where} is a {type(leaf).__qualname__}",
                path=where, suggestion="pass only arrays (strip strings/None from the tree)")


def _size(axes: Tuple[str, ...]) -> int:
    return int(np.prod([jax.lax.axis_size(a) for a in axes]))


def _axis_arg(axes: Tuple[str, ...]) -> AxisNames:
    return axes[0] if len(axes) == 1 else axes


def axis_size(axis: AxisNames) -> int:
    """Number of devices along ``axis`` (a Python int, known at trace time)."""
    return _size(check_axis("axis_size", axis))


def axis_index(axis: AxisNames) -> jax.Array:
    """This device's position along ``axis`` (row-major over a tuple of axes); over axes of size
    1 alone, the constant 0 (the same on every device)."""
    axes = _moving(check_axis("axis_index", axis))
    return jax.lax.axis_index(_axis_arg(axes)) if axes else jnp.int32(0)


def _moving(axes: Tuple[str, ...], tree: Any = None) -> Tuple[str, ...]:
    """``axes`` without those of size 1 -- except where a leaf of ``tree`` already varies over
    one (its type must change, so the collective must run)."""
    varying = set()
    if tree is not None:
        for leaf in jax.tree_util.tree_leaves(tree):
            varying |= varying_axes(leaf)
    return tuple(a for a in axes if jax.lax.axis_size(a) > 1 or a in varying)


def _reduce(name: str, reduction, tree: Any, axis: AxisNames) -> Any:
    axes = check_axis(name, axis)
    _check_leaves(name, tree)
    axes = _moving(axes, tree)
    if not axes:  # Over size-1 axes a reduction is the identity.
        return jax.tree_util.tree_map(jnp.asarray, tree)
    return reduction(_varying(tree, axes), _axis_arg(axes))


def psum(tree: Any, axis: AxisNames) -> Any:
    """Sum over ``axis``. A value replicated over the axis comes back multiplied by its size."""
    return _reduce("psum", jax.lax.psum, tree, axis)


def pmean(tree: Any, axis: AxisNames) -> Any:
    """Mean over ``axis``."""
    return _reduce("pmean", jax.lax.pmean, tree, axis)


def pmax(tree: Any, axis: AxisNames) -> Any:
    """Maximum over ``axis``."""
    return _reduce("pmax", jax.lax.pmax, tree, axis)


def pmin(tree: Any, axis: AxisNames) -> Any:
    """Minimum over ``axis``."""
    return _reduce("pmin", jax.lax.pmin, tree, axis)


def all_gather(tree: Any, axis: AxisNames, axis_index: Optional[int] = None, *,
               invariant: bool = False) -> Any:
    """Gathers every device's value along ``axis``.

    ``axis_index=None`` stacks the values on a new leading dimension (size = axis size);
    ``axis_index=d`` concatenates them along existing dimension ``d`` (the inverse of sharding
    that dimension over the axis). ``invariant=True`` types the result as identical across the
    axis (it is), so it can leave shard_map as a replicated value.
    """
    axes = check_axis("all_gather", axis)
    _check_leaves("all_gather", tree)
    axes = _moving(axes, tree)
    if not axes:  # One device: its own value (stacked on a new leading dimension if asked).
        return jax.tree_util.tree_map(
            lambda x: jnp.asarray(x)[None] if axis_index is None else jnp.asarray(x), tree)
    tree = _varying(tree, axes)
    to = "invarying" if invariant else "varying"

    def gather(x):
        x = jnp.asarray(x)
        if axis_index is None:
            return jax.lax.all_gather(x, _axis_arg(axes), axis=0, tiled=False, to=to)
        _check_dimension("all_gather", x, axis_index)
        return jax.lax.all_gather(x, _axis_arg(axes), axis=axis_index, tiled=True, to=to)

    return jax.tree_util.tree_map(gather, tree)


def reduce_scatter(tree: Any, axis: AxisNames, op: str = "add", *,
                   scatter_dimension: int = 0) -> Any:
    """Reduces over ``axis`` and leaves each device its slice of dimension ``scatter_dimension``.

    ``op`` is ``"add"`` or ``"mean"``. The dimension must be divisible by the axis size.
    """
    axes = check_axis("reduce_scatter", axis)
    _check_leaves("reduce_scatter", tree)
    if op not in ("add", "mean"):
        raise errors.CollectiveError(f"reduce_scatter op must be 'add' or 'mean', got {op!r}",
                                     path="collectives.reduce_scatter",
                                     suggestion="use op='add' or op='mean'")
    axes = _moving(axes, tree)
    if not axes:  # One device keeps all of it: the sum (and the mean) of one value.
        return jax.tree_util.tree_map(jnp.asarray, tree)
    size = _size(axes)
    tree = _varying(tree, axes)

    def scatter(x):
        x = jnp.asarray(x)
        _check_dimension("reduce_scatter", x, scatter_dimension)
        if x.shape[scatter_dimension] % size:
            raise errors.CollectiveError(
                f"reduce_scatter: dimension {scatter_dimension} of shape {tuple(x.shape)} is not "
                f"divisible by the size {size} of axis {axis!r}", path=f"mesh axis {axis!r}",
                suggestion="pad the dimension to a multiple of the axis size")
        out = jax.lax.psum_scatter(x, _axis_arg(axes), scatter_dimension=scatter_dimension,
                                   tiled=True)
        return out / size if op == "mean" else out

    return jax.tree_util.tree_map(scatter, tree)


def broadcast(tree: Any, axis: AxisNames, src_index: int = 0) -> Any:
    """Every device along ``axis`` gets the value of the device at ``src_index``.

    Written as a masked ``psum`` because ``lax.pbroadcast`` has no CPU lowering.
    """
    axes = check_axis("broadcast", axis)
    _check_leaves("broadcast", tree)
    size = _size(axes)
    if not 0 <= src_index < size:
        raise errors.CollectiveError(f"broadcast src_index={src_index} is outside axis {axis!r} "
                                     f"of size {size}", path=f"mesh axis {axis!r}",
                                     suggestion=f"use 0..{size - 1}")
    if not _moving(axes, tree):
        return jax.tree_util.tree_map(jnp.asarray, tree)
    is_source = jax.lax.axis_index(_axis_arg(axes)) == src_index
    tree = _varying(tree, axes)

    def send(x):
        x = jnp.asarray(x)
        if x.dtype == jnp.bool_:
            return jax.lax.psum(jnp.where(is_source, x, False).astype(jnp.int32),
                                _axis_arg(axes)).astype(jnp.bool_)
        return jax.lax.psum(jnp.where(is_source, x, jnp.zeros_like(x)), _axis_arg(axes))

    return jax.tree_util.tree_map(send, tree)


def ppermute(tree: Any, axis: str, perm: Sequence[Tuple[int, int]]) -> Any:
    """Sends each device's value to another along ``axis``: ``perm`` lists (source, dest) pairs.

    Devices that receive nothing get zeros.
    """
    axes = check_axis("ppermute", axis)
    _check_leaves("ppermute", tree)
    size = _size(axes)
    perm = [tuple(int(i) for i in pair) for pair in perm]
    sources = [s for s, _ in perm]
    dests = [d for _, d in perm]
    bad = [p for p in perm if len(p) != 2 or not all(0 <= i < size for i in p)]
    if bad or len(set(sources)) != len(sources) or len(set(dests)) != len(dests):
        raise errors.CollectiveError(
            f"ppermute perm {perm} is not a partial permutation of 0..{size - 1}",
            path=f"mesh axis {axis!r}",
            suggestion="give (source, dest) pairs with each source and each dest at most once")
    if not _moving(axes, tree):  # One device: it keeps its value, or receives nothing.
        keep = perm == [(0, 0)]
        return jax.tree_util.tree_map(
            lambda x: jnp.asarray(x) if keep else jnp.zeros_like(jnp.asarray(x)), tree)
    return jax.lax.ppermute(_varying(tree, axes), _axis_arg(axes), perm)


def shift(tree: Any, axis: str, offset: int = 1) -> Any:
    """Ring shift: device ``i`` receives the value of device ``i - offset`` (mod axis size)."""
    size = axis_size(axis)
    return ppermute(tree, axis, [(i, (i + offset) % size) for i in range(size)])


def all_to_all(x: jax.Array, axis: str, *, split_dimension: int,
               concat_dimension: int) -> jax.Array:
    """Splits ``split_dimension`` over ``axis``; received chunks are joined on ``concat_dimension``."""
    axes = check_axis("all_to_all", axis)
    _check_leaves("all_to_all", x)
    if not _moving(axes, x):
        return jnp.asarray(x)
    return jax.lax.all_to_all(_varying(x, axes), _axis_arg(axes), split_dimension,
                              concat_dimension, tiled=True)


def varying_axes(x: Any) -> frozenset:
    """Mesh axes over which ``x`` may differ between devices (its "varying manual axes")."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def cast_varying(tree: Any, axis: AxisNames) -> Any:
    """Marks each leaf as varying over ``axis`` (a no-op on axes where it already varies).

    Differentiating with respect to a value that is *replicated* over an axis makes ``jax.grad``
    all-reduce the gradient over that axis on every call -- once per microbatch inside an
    accumulation loop. Casting params to varying first keeps the gradient local, so the step can
    reduce it once, after the loop.
    """
    return _varying(tree, check_axis("cast_varying", axis))


def _varying(tree: Any, axes: Tuple[str, ...]) -> Any:
    """Casts leaves to varying over ``axes`` where they are not already.

    A value replicated over an axis takes part in a collective as identical copies, one per
    device -- summing them multiplies by the axis size, as psum of a replicated value always has.
    The cast makes that explicit, so a value varying over some of the axes and replicated over
    the others can be reduced over all of them at once.
    """
    def cast(x):
        x = jnp.asarray(x)
        missing = tuple(a for a in axes
                        if a not in varying_axes(x) and jax.lax.axis_size(a) > 1)
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree_util.tree_map(cast, tree)


def _check_dimension(op: str, x: jax.Array, dimension: int) -> None:
    if not -x.ndim <= dimension < x.ndim:
        raise errors.CollectiveError(f"{op}: dimension {dimension} is out of range for shape "
                                     f"{tuple(x.shape)}", path=f"collectives.{op}",
                                     suggestion=f"use a dimension in 0..{x.ndim - 1}")


def in_manual_context() -> bool:
    """True inside ``shard_map``."""
    return bool(manual_axes())


