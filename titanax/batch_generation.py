"""Many prompts, several samples each, through the decode engine on the run's mesh
(``titanax.generate --prompts_file``; titanax/decoding): every prompt prefilled once and shared
by its ``num_samples`` samples, the samples decoding in continuously refilled slots over a paged
key/value cache, each ending at its first end id or its own ``max_new_tokens``.

The engine compiles its programs as it first meets each size (a prefill per length bucket and
row count, a decode chunk per power of two of running rows); ``seconds`` is the generation's
wall time less what jax spent making programs inside it (``utils/compile_clock.py``), which is
``compile_seconds``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence

from titanax.decoding.engine import DecodeEngine, Request
from titanax.prompts_file import PromptRequest
from titanax.utils.compile_clock import CompileClock

# Sequences decoded at once over the whole mesh (each batch shard its share, at least
# ``num_samples``: a prompt's samples decode on one shard).
BATCH_ROWS = 64
# Tokens per block of the paged cache.
BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True)
class Generated:
    """Per request, its samples' token ids (in sample order); the seconds spent generating
    and compiling."""

    completions: List[List[List[int]]]
    seconds: float
    compile_seconds: float


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How every row samples: ``temperature`` None is greedy; ``end_ids`` end a row (kept as
    its last token)."""

    temperature: Optional[float]
    top_p: float
    seed: int
    end_ids: Sequence[int]


def generate_all(engine: Any, requests: Sequence[PromptRequest], *, num_samples: int,
                 sampling: Sampling) -> Generated:
    """``num_samples`` completions of each of ``requests`` on ``engine``'s mesh."""
    placement = engine.steps.decode_placement()
    slots = max(num_samples, -(-BATCH_ROWS // placement.shards))
    longest = max(len(r.ids) + r.max_new_tokens for r in requests)
    # Room for every slot's longest sequence: no request ever waits for blocks, only slots.
    blocks = -(-longest // BLOCK_SIZE)
    decoder = DecodeEngine(model=engine.model, params=engine.state.params,
                           pool_tokens=slots * blocks * BLOCK_SIZE, block_size=BLOCK_SIZE,
                           slots=slots, seed=sampling.seed, placement=placement)
    with CompileClock() as clock:
        done = decoder.generate([Request(
            prompt_ids=tuple(r.ids), max_new_tokens=r.max_new_tokens, samples=num_samples,
            temperature=sampling.temperature or 0.0, top_p=sampling.top_p,
            stop_ids=tuple(sampling.end_ids)) for r in requests])
    return Generated(completions=[[c.tokens for c in group] for group in done],
                     seconds=clock.run_seconds, compile_seconds=clock.compile_seconds)


def through_first_end(tokens: List[int], end_ids: Sequence[int]) -> List[int]:
    """``tokens`` up to and including the first end id (what a sampled row means: the sampler
    fills the places after it)."""
    for index, token in enumerate(tokens):
        if token in end_ids:
            return tokens[:index + 1]
    return tokens
