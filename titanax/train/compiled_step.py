"""Ahead-of-time compiled steps, cached by input signature, with a recompile guard.

A training loop should compile its step once. A batch of another shape (a short last batch, a
changed sequence length) or dtype silently costs a full recompile with plain ``jit``; here the
step is compiled for a signature, and a call with another signature is an error (or a warning, by
policy) that says which input changed and how.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax

from titanax import errors

_log = logging.getLogger("titanax")

Signature = Tuple[Any, Tuple[Tuple[str, Tuple[int, ...], str], ...]]


def signature_of(args: Tuple[Any, ...]) -> Signature:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(args)
    return treedef, tuple((jax.tree_util.keystr(path), tuple(getattr(x, "shape", ())),
                           str(getattr(x, "dtype", type(x).__name__))) for path, x in leaves)


def describe_change(old: Signature, new: Signature) -> str:
    if old[0] != new[0]:
        return "the structure of the inputs changed"
    changes = [f"{path}: {o_shape} {o_dtype} -> {n_shape} {n_dtype}"
               for (path, o_shape, o_dtype), (_, n_shape, n_dtype) in zip(old[1], new[1])
               if (o_shape, o_dtype) != (n_shape, n_dtype)]
    return "; ".join(changes[:5]) + (f" (and {len(changes) - 5} more)" if len(changes) > 5 else "")


class CompiledStep:
    """``jitted`` compiled per signature; ``compile_count`` says how often it compiled."""

    def __init__(self, jitted: Callable, *, name: str, policy: str = "error"):
        self._jitted = jitted
        self.name = name
        self.policy = policy
        self._cache: Dict[Signature, Any] = {}
        self._first: Optional[Signature] = None
        self.compile_count = 0
        self.compile_seconds: List[float] = []

    def compiled_for(self, *args) -> Any:
        """The compiled executable for these arguments (compiling if needed)."""
        signature = signature_of(args)
        compiled = self._cache.get(signature)
        if compiled is None:
            if self._first is not None and self.policy != "allow":
                change = describe_change(self._first, signature)
                message = f"{self.name} would recompile: {change}"
                if self.policy == "error":
                    raise errors.RecompileError(
                        message, path=self.name,
                        suggestion="keep batch shapes and dtypes fixed (drop or pad the last "
                                   "batch), or set recompile_policy='warn'")
                _log.warning(message)
            started = time.perf_counter()
            compiled = self._jitted.lower(*args).compile()
            self.compile_seconds.append(time.perf_counter() - started)
            self.compile_count += 1
            self._cache[signature] = compiled
            self._first = self._first or signature
        return compiled

    def __call__(self, *args):
        return self.compiled_for(*args)(*args)

    @property
    def latest(self) -> Any:
        """The most recently compiled executable."""
        return list(self._cache.values())[-1] if self._cache else None
