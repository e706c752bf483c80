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
from titanax.observe import goodput, memory, throughput

_log = logging.getLogger("titanax")

Signature = Tuple[Any, Tuple[Tuple[Tuple[int, ...], Any], ...]]


def signature_of(args: Tuple[Any, ...]) -> Signature:
    """Structure plus (shape, dtype) per leaf: cheap enough to compute on every step."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple((tuple(getattr(x, "shape", ())), getattr(x, "dtype", type(x)))
                          for x in leaves)


def describe_change(old: Signature, new: Signature, args: Tuple[Any, ...]) -> str:
    """Which inputs differ, by path (paths are only worked out here, off the hot path)."""
    if old[0] != new[0]:
        return "the structure of the inputs changed"
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    changes = [f"{path}: {o_shape} {o_dtype} -> {n_shape} {n_dtype}"
               for path, (o_shape, o_dtype), (n_shape, n_dtype) in zip(paths, old[1], new[1])
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
        # FLOPs per call of the most recent executable (XLA cost analysis, read once per compile).
        self.latest_flops: Optional[float] = None
        # Per-device bytes the most recent executable needs (XLA memory analysis, read once).
        self.latest_step_bytes: Optional[int] = None

    def lower(self, *args) -> Any:
        """The step lowered for ``args`` (arrays, or ShapeDtypeStructs with shardings: what
        ``--compile_only`` compiles without allocating anything)."""
        return self._jitted.lower(*args)

    def compiled_for(self, *args) -> Any:
        """The compiled executable for these arguments (compiling if needed)."""
        signature = signature_of(args)
        compiled = self._cache.get(signature)
        if compiled is None:
            if self._first is not None and self.policy != "allow":
                change = describe_change(self._first, signature, args)
                message = f"{self.name} would recompile: {change}"
                if self.policy == "error":
                    raise errors.RecompileError(
                        message, path=self.name,
                        suggestion="keep batch shapes and dtypes fixed (drop or pad the last "
                                   "batch), or set recompile_policy='warn'")
                _log.warning(message)
            started = time.perf_counter()
            with goodput.spent_on("compile"):
                compiled = self._jitted.lower(*args).compile()
            self.compile_seconds.append(time.perf_counter() - started)
            self.compile_count += 1
            self.latest_flops = throughput.compiled_flops(compiled)
            self.latest_step_bytes = memory.compiled_step_bytes(compiled)
            self._cache[signature] = compiled
            self._first = self._first or signature
        return compiled

    def __call__(self, *args):
        return self.compiled_for(*args)(*args)

    @property
    def latest(self) -> Any:
        """The most recently compiled executable."""
        return list(self._cache.values())[-1] if self._cache else None
