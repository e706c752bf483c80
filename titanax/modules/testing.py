"""Helpers for tests of layers: call a layer without writing functional(), compare trees."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import jax
import numpy as np

from titanax.modules.context import InvocationContext, OutputCollection, set_current_context
from titanax.modules.module import Module


@contextlib.contextmanager
def bind(module: Module, state: Any, *, prng_key: Optional[jax.Array] = None,
         is_training: bool = False) -> Iterator[InvocationContext]:
    """Within the block, ``module.forward(x)`` (or any method) runs as the root with ``state``.

    The yielded context's ``output_collection`` holds what the calls produced.
    """
    context = InvocationContext(name=module.name, module=module, state=state,
                                is_training=is_training, prng_key=prng_key,
                                output_collection=OutputCollection())
    with set_current_context(context):
        yield context


def assert_nested_allclose(actual: Any, expected: Any, *, rtol: float = 1e-6,
                           atol: float = 0.0) -> None:
    """allclose on every leaf of two trees with the same structure; names the leaf that differs."""
    actual_leaves, actual_def = jax.tree_util.tree_flatten_with_path(actual)
    expected_leaves, expected_def = jax.tree_util.tree_flatten_with_path(expected)
    if actual_def != expected_def:
        raise AssertionError(f"tree structures differ:\n{actual_def}\n{expected_def}")
    for (path, a), (_, e) in zip(actual_leaves, expected_leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                                   err_msg=f"at {jax.tree_util.keystr(path)}")


def max_relative_difference(actual: Any, expected: Any) -> float:
    """max over leaves of ``max|a - e| / max(max|e|, tiny)``: one number per tree comparison."""
    worst = 0.0
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        worst = max(worst, float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30)))
    return worst
