"""A helper for tests of layers: call a layer without writing functional().

(Comparing numbers is the tests' own: tests/numerics.py, with the reason for its tolerance.)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import jax

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
