"""Named PRNG streams from one global seed.

``init`` initialises params, ``dropout`` drives dropout (folded with the step inside the train step
and with the data-shard index, so shards differ and TP ranks of a shard agree), ``data`` shuffles
input (folded with the process index where each process draws its own). Streams are derived by
name, so adding a stream never changes the others.
"""

from __future__ import annotations

from typing import Dict, Sequence

import jax

from titanax.modules.context import name_key

STREAMS = ("init", "dropout", "data")


def root_key(seed: int) -> jax.Array:
    return jax.random.PRNGKey(seed)


def stream_key(seed: int, name: str) -> jax.Array:
    """The key of stream ``name`` for this seed (the same on every process)."""
    return name_key(root_key(seed), name)


def streams(seed: int, names: Sequence[str] = STREAMS) -> Dict[str, jax.Array]:
    return {name: stream_key(seed, name) for name in names}


def per_process(key: jax.Array) -> jax.Array:
    """A key that differs between processes (for what each process draws on its own)."""
    return jax.random.fold_in(key, jax.process_index())
