"""Every iteration of a Flax module's own scans rematerialised, while the adapter traces it.

Under FSDP the adapter hands a module its params' shards as values it reads whole
(flax_gather.py), so a stacked param is gathered one layer at a time inside the module's
``nnx.scan`` / ``nn.scan``. The backward pass needs each layer's whole weights again. Saved by
the forward scan, they would be stacked -- every layer's gathered weights held at once, the
memory FSDP exists to save (measured on the NNX GPT of the tests: one whole model's worth of
extra temp memory). Titanax's own ``Repeat`` avoids it by rematerialising its loop body with a
policy that never saves a gathered value (``module.scan_in_context``); a Flax module's scan is
written by its author, so the adapter does the same from outside: while it traces the module,
``jax.lax.scan`` (which ``nnx.scan`` and ``nn.scan`` both call) wraps the body of every
outermost scan in ``jax.checkpoint`` with that policy. Each backward iteration then gathers its
own layer again, and the loop holds one layer at a time.

Tracing is Python running on one thread; the original ``jax.lax.scan`` is back in place when the
``with`` block ends, however it ends.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import jax

_STATE = threading.local()


@contextlib.contextmanager
def scan_bodies_rematerialised(policy: Callable) -> Iterator[None]:
    """Within the block, the body of every outermost ``jax.lax.scan`` traced on this thread
    runs under ``jax.checkpoint(policy=policy)``."""
    original = jax.lax.scan

    def scan(f, init, xs=None, *args, **kwargs):
        if getattr(_STATE, "inside", False):  # A nested scan: its parent's body is remat'd.
            return original(f, init, xs, *args, **kwargs)
        _STATE.inside = True
        try:
            return original(jax.checkpoint(f, policy=policy, prevent_cse=False), init, xs,
                            *args, **kwargs)
        finally:
            _STATE.inside = False

    jax.lax.scan = scan
    try:
        yield
    finally:
        jax.lax.scan = original
