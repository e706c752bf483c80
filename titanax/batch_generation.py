"""Many prompts, several samples each, through the run's sampler (``titanax.generate
--prompts_file``): every request's ``num_samples`` rows, longest prompts first, in batches of
rows left-padded to a length bucket (``utils/length_buckets.py``: a compiled program per
bucket and per distinct ``max_new_tokens``, not per prompt); each row cut after its first end
id (each batch's rows share one ``max_new_tokens``, the sampler's).

This is the static sampler (``StepBuilder.sampler``: a batch decodes until every row has ended
or the longest may, each row's cache ``prompt + max_new_tokens``); the compiled programs are
built before the clock starts, so ``seconds`` is generation alone.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from titanax.prompts_file import PromptRequest
from titanax.utils.length_buckets import padded_length

# Rows decoded at once (rounded up to a multiple of the mesh's batch shards).
BATCH_ROWS = 64


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
    shards = engine.plan.batch_shards(engine.mesh)
    batch_rows = -(-BATCH_ROWS // shards) * shards
    rows = sorted(((index, sample) for index in range(len(requests))
                   for sample in range(num_samples)),
                  key=lambda row: (requests[row[0]].max_new_tokens,
                                   -len(requests[row[0]].ids)))
    completions: List[List[List[int]]] = [[[] for _ in range(num_samples)] for _ in requests]
    programs: Dict[Tuple[int, int], Any] = {}
    clocks = {"seconds": 0.0, "compile_seconds": 0.0}
    batches = _batches(rows, requests, batch_rows)
    for number, chosen in enumerate(batches):
        new_tokens = requests[chosen[0][0]].max_new_tokens
        prompts, lengths = _padded(chosen, requests, batch_rows,
                                   limit=engine.model.config.max_seq_len - new_tokens)
        key = jax.random.fold_in(jax.random.PRNGKey(sampling.seed), number)
        shape = (new_tokens, prompts.shape[1])
        if shape not in programs:
            start = time.perf_counter()
            programs[shape] = engine.steps.sampler(
                max_new_tokens=new_tokens, temperature=sampling.temperature,
                top_p=sampling.top_p, end_ids=tuple(sampling.end_ids)).lower(
                    engine.state.params, prompts, lengths, key).compile()
            clocks["compile_seconds"] += time.perf_counter() - start
        start = time.perf_counter()
        tokens = np.asarray(jax.device_get(programs[shape](engine.state.params, prompts,
                                                           lengths, key)["tokens"]))
        clocks["seconds"] += time.perf_counter() - start
        for row, (index, sample) in enumerate(chosen):
            completions[index][sample] = through_first_end(tokens[row].tolist(),
                                                           sampling.end_ids)
    return Generated(completions=completions, **clocks)


def _batches(rows, requests, batch_rows) -> List[List[Tuple[int, int]]]:
    """Consecutive rows of one ``max_new_tokens``, at most ``batch_rows`` each."""
    batches: List[List[Tuple[int, int]]] = []
    for row in rows:
        if (not batches or len(batches[-1]) == batch_rows or requests[batches[-1][0][0]]
                .max_new_tokens != requests[row[0]].max_new_tokens):
            batches.append([])
        batches[-1].append(row)
    return batches


def _padded(chosen, requests, batch_rows, *, limit) -> Tuple[np.ndarray, np.ndarray]:
    """``(prompt_ids [batch_rows, L], prompt_lengths [batch_rows])``: the chosen rows' prompts
    left-padded to their bucket; rows past them are one padding token (their output unread)."""
    length = padded_length(max(len(requests[index].ids) for index, _ in chosen), limit=limit)
    prompts = np.zeros((batch_rows, length), np.int32)
    lengths = np.ones((batch_rows,), np.int32)
    for row, (index, _) in enumerate(chosen):
        ids = requests[index].ids
        prompts[row, length - len(ids):], lengths[row] = ids, len(ids)
    return prompts, lengths


def through_first_end(tokens: List[int], end_ids: Sequence[int]) -> List[int]:
    """``tokens`` up to and including the first end id (what a sampled row means: the sampler
    fills the places after it)."""
    for index, token in enumerate(tokens):
        if token in end_ids:
            return tokens[:index + 1]
    return tokens
