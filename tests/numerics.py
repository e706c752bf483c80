"""Comparing numbers that two computations reach by adding in different orders.

Why the bounds are what they are (written once here; every parity test uses them):

Two computations of the same quantity -- one device against eight, a stack of layers against a
pipeline, one x86 build of XLA against another with other vector widths or FMA -- add the same
terms in different orders. A reordered sum of ``n`` terms is off by up to about ``n * u * m``
(``u`` the unit roundoff, ``m`` the terms' magnitude): the error follows the size of the *terms*,
not of the result. A gradient element that nearly cancels (a norm's scale, whose terms are as
large as their neighbours' but whose sum is small) carries the same absolute error as its large
neighbours, so a bound at each element's or each leaf's own scale fails on some CPU for no defect
-- it did, twice: 1.29e-6 against 1e-6 on an AMD EPYC (issue 26), and ``final_norm/scale`` at
1.67e-5 of its own scale against 1e-5 on an Intel Xeon (issue 33).

So the parity tests run in **float64** (``float64_numerics``: jax's 64-bit mode, and the test
engines store and compute in float64 -- ``Precision.Config.float64``). There ``u`` is 1.1e-16: a
correct layout agrees with one device to ~1e-14 of each leaf's scale (measured: 1.6e-14 on the
GPT's ``final_norm/scale`` under DP x TP), and the defects the tests guard against -- a missing
1/N, a sum instead of a mean, a dropped or doubled microbatch, a shard read twice -- move a
loss, a gradient or an SGD update by 1e-3 of its scale or more. ``FLOAT64`` (1e-9) sits five
orders of magnitude from each, at each leaf's own scale, on any CPU.

What must stay float32 (bfloat16 / float16 runs, the Flax adapters' own float32 modules,
transformers under torch, subprocess launches) is bounded by the reduction instead:
``float32_bound(n)`` = ``n * u32`` measured at the scale of the *whole tree* (every leaf's error
against the largest magnitude of any leaf: the terms' magnitude, not the leaf's), with ``n`` the
length of the longest sum behind the numbers (tokens x features of a batch). ``FLOAT32`` is the
default: ``n`` = 256.

Adam divides by the root of the squared gradients, which turns the rounding of tiny gradients
into whole steps of ``learning_rate`` size: after float32 Adam steps ``ADAM`` (1e-4) bounds the
params, still far below a wrong scale (which Adam hides anyway: its parity tests also compare
SGD updates).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, List, Optional, Tuple

import jax
import numpy as np

# float64 computations of the same thing in another order, at each leaf's scale (see above).
FLOAT64 = 1e-9
# The unit roundoff of float32.
FLOAT32_ROUNDOFF = 2.0 ** -24


def float32_bound(length: int) -> float:
    """The bound of a float32 comparison whose numbers come from sums of at most ``length``
    terms, at the scale of the whole tree (see the module docstring)."""
    return length * FLOAT32_ROUNDOFF


# float32 computations in another order, at the tree's scale: sums of up to 256 terms.
FLOAT32 = float32_bound(256)
# Params after a few Adam steps computed in another order (float32).
ADAM = 1e-4
# Two implementations in two frameworks (Titanax under XLA against transformers under torch):
# every matmul, softmax and norm is its own float32 kernel on each side, and the tiny reference
# models' logits spread over several nats -- measured 1e-6 .. 3.4e-6 of the logits' scale here.
# A wrong rotation pairing, kv grouping or missing bias moves them by 1e-2 .. 1 of it.
CROSS_FRAMEWORK = 1e-4

# Set to a file path to have every comparison append "test | what | error | bound" to it.
ERRORS_LOG = "TITANAX_TEST_ERRORS"


def scaled_error(actual: Any, expected: Any) -> float:
    """``max |actual - expected| / max |expected|`` in float64 (0 when both are all zeros; the
    plain difference when ``expected`` is all zeros)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shapes differ: {a.shape} vs {e.shape}")
    if a.size == 0:
        return 0.0
    finite = np.isfinite(e)
    if not (np.all(finite) and np.all(np.isfinite(a))):
        # Non-finite values must be the same ones at the same places (NaN equals NaN here).
        if not np.array_equal(a[~finite], e[~finite], equal_nan=True) or \
                not np.all(np.isfinite(a[finite])):
            return float("inf")
        a, e = a[finite], e[finite]
        if a.size == 0:
            return 0.0
    scale = float(np.max(np.abs(e)))
    difference = float(np.max(np.abs(a - e)))
    return difference / scale if scale > 0 else difference


def tree_errors(actual: Any, expected: Any, *, scale: str = "leaf") -> List[Tuple[str, float]]:
    """``[(leaf path, scaled error)]`` for two trees of the same structure (lists of losses and
    scalars are trees too); ``scale="tree"`` measures every leaf against the whole tree's
    largest magnitude."""
    actual, expected = _as_tensor(actual), _as_tensor(expected)
    actual_leaves, actual_def = jax.tree_util.tree_flatten_with_path(actual)
    expected_leaves, expected_def = jax.tree_util.tree_flatten_with_path(expected)
    if actual_def != expected_def:
        raise AssertionError(f"tree structures differ:\n{actual_def}\n{expected_def}")
    if scale == "tree":
        largest = max((float(np.max(np.abs(np.asarray(e, np.float64)), initial=0.0))
                       for _, e in expected_leaves), default=0.0)
        return [(jax.tree_util.keystr(path),
                 float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(e, np.float64)),
                              initial=0.0)) / (largest or 1.0))
                for (path, a), (_, e) in zip(actual_leaves, expected_leaves)]
    return [(jax.tree_util.keystr(path), scaled_error(a, e))
            for (path, a), (_, e) in zip(actual_leaves, expected_leaves)]


def _as_tensor(value: Any) -> Any:
    """A sequence of numbers (per-step losses, a literal like ``[0.6, 0.8]``) is one tensor,
    with one scale; anything else stays a tree."""
    if isinstance(value, (list, tuple)) and value and all(np.ndim(x) == 0 for x in value):
        return np.asarray([np.asarray(x, np.float64) for x in value])
    return value


def assert_close(actual: Any, expected: Any, *, bound: Optional[float] = None, what: str = "",
                 scale: Optional[str] = None) -> float:
    """Every leaf of ``actual`` within ``bound`` of ``expected`` at the leaf's scale (or the
    tree's: ``scale="tree"``); returns the worst error. The message names the leaf, its error
    and the bound. Without a bound: ``FLOAT64`` per leaf in jax's 64-bit mode (the parity
    tests' float64 runs), else ``FLOAT32`` at the tree's scale."""
    if bound is None:
        x64 = bool(jax.config.jax_enable_x64)
        bound = FLOAT64 if x64 else FLOAT32
        scale = scale or ("leaf" if x64 else "tree")
    errors = tree_errors(actual, expected, scale=scale or "leaf")
    worst = max((error for _, error in errors), default=0.0)
    _log(what, worst, bound)
    bad = [(path, error) for path, error in errors if not error <= bound]
    if bad:
        shown = ", ".join(f"{path or '<value>'}: {error:.3g}" for path, error in bad[:8])
        raise AssertionError(f"{what or 'values'} differ by more than {bound:g} of their scale "
                             f"(max |a - b| / max |b|) at {shown}"
                             + (f" and {len(bad) - 8} more" if len(bad) > 8 else ""))
    return worst


def assert_identical(actual: Any, expected: Any, *, what: str = "") -> None:
    """Bit for bit (the same computation on the same machine: a resumed run, a layout moved
    and moved back); names the first leaf that differs."""
    actual_leaves, actual_def = jax.tree_util.tree_flatten_with_path(actual)
    expected_leaves, expected_def = jax.tree_util.tree_flatten_with_path(expected)
    if actual_def != expected_def:
        raise AssertionError(f"tree structures differ:\n{actual_def}\n{expected_def}")
    for (path, a), (_, e) in zip(actual_leaves, expected_leaves):
        a, e = np.asarray(a), np.asarray(e)
        if a.shape != e.shape or a.dtype != e.dtype or not np.array_equal(a, e, equal_nan=True):
            raise AssertionError(f"{what or 'values'} differ at {jax.tree_util.keystr(path)}: "
                                 f"max |a - b| {scaled_error(a, e) if a.shape == e.shape else '?'}"
                                 " of the scale")


def float64_mode() -> bool:
    """Whether jax runs in 64-bit mode now (the test engines then compute in float64)."""
    return bool(jax.config.jax_enable_x64)


def parity_floats(tree: Any) -> Any:
    """``tree``'s floating leaves in float64 in jax's 64-bit mode (params a test builds by hand
    for a float64 parity check), else unchanged."""
    if not float64_mode():
        return tree
    return jax.tree_util.tree_map(
        lambda x: x.astype(np.float64) if np.issubdtype(np.asarray(x).dtype, np.floating)
        else x, tree)


@contextlib.contextmanager
def float64_numerics() -> Iterator[None]:
    """Inside: jax's 64-bit mode, and the test engines (``tests/train/helpers.py``) store and
    compute in float64 (``Precision.Config.float64``)."""
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


@contextlib.contextmanager
def float64_reference() -> Iterator[None]:
    """Inside: jax computes in float64 (for a reference that carries no float32 error of its
    own; convert its inputs with ``np.float64``)."""
    with jax.enable_x64(True):
        yield


def _log(what: str, error: float, bound: float) -> None:
    path = os.environ.get(ERRORS_LOG)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{test} | {what or '-'} | {error:.3g} | {bound:g}\n")


def summarize(path: str) -> str:
    """The worst error per test in an ``ERRORS_LOG`` file, with its bound and the margin."""
    worst = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            test, _, error, bound = [part.strip() for part in line.split(" | ")]
            error, bound = float(error), float(bound)
            if test not in worst or error / bound > worst[test][0] / worst[test][1]:
                worst[test] = (error, bound)
    rows = [f"{test}: worst {error:.2g}, bound {bound:g} ({bound / error:.0f}x margin)"
            if error > 0 else f"{test}: exact (0), bound {bound:g}"
            for test, (error, bound) in sorted(worst.items())]
    return "\n".join(rows)


if __name__ == "__main__":
    print(summarize(sys.argv[1] if len(sys.argv) > 1 else os.environ[ERRORS_LOG]))
