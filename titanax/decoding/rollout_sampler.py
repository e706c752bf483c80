"""The decode engine as a sampling objective's sampler (GRPO, on-policy distillation):
``objective.decoding`` set, each rollout's groups are completed by the engine on the training
mesh instead of the static sampler.

What changes for a rollout: each prompt is prefilled once for its ``num_generations`` samples
(their prompt blocks shared), a completion that ends frees its slot for the next group, and no
row decodes past its own end. What does not: the rollout's rows, their order, the log-probs the
train step recomputes (the same params, the same mesh), and the rollout's key -- the engine
draws each sample with a key of (rollout key, group, sample, token), so a resumed run samples
what the uninterrupted one did, and a job of several processes what one process does: each
process runs the same host loop over every process's prompts (the engine's programs span
them all) and keeps its own rows of the result.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from titanax import errors
from titanax.config import Configurable
from titanax.decoding.engine import DecodeEngine, Request


class PagedDecoding(Configurable):
    """The decode engine's sizes for a run's rollouts (titanax/decoding/engine.py)."""

    class Config(Configurable.Config):
        # Tokens of key/value cache per batch shard; None: room for every rollout row of a
        # shard at its longest (prompt + max_new_tokens), prompts' shared blocks not counted.
        pool_tokens: Optional[int] = None
        # Tokens per block of the cache.
        block_size: int = 16
        # Sequences decoding at once per batch shard (at least num_generations: a group
        # decodes on one shard); None: every rollout row of a shard.
        slots: Optional[int] = None
        # Decode steps per compiled chunk (slots are refilled between chunks).
        chunk_steps: int = 8

        def _validate_values(self):
            yield from super()._validate_values()
            for name in ("pool_tokens", "block_size", "slots", "chunk_steps"):
                value = getattr(self, name)
                if value is not None and value < 1:
                    yield name, f"must be >= 1, got {value}"

    def sizes(self, run: Any, *, rows_per_shard: int, max_new_tokens: int,
              group: int) -> "EngineSizes":
        """The engine's sizes for ``run``'s rollouts of ``rows_per_shard`` rows per batch
        shard in groups of ``group`` (the configured ones, else ``Config``'s defaults); refused
        by name when a group does not fit a shard's slots."""
        cfg = self.config
        slots = cfg.slots if cfg.slots is not None else rows_per_shard
        if slots < group:
            raise errors.ConfigError(
                f"{slots} slots per batch shard cannot decode a group of {group} samples "
                f"(a group decodes on one shard)", path="objective.decoding.slots",
                suggestion=f"give at least num_generations={group} slots")
        longest = run.config.train_input.source.max_prompt_tokens + max_new_tokens
        pool = cfg.pool_tokens if cfg.pool_tokens is not None else \
            rows_per_shard * -(-longest // cfg.block_size) * cfg.block_size
        return EngineSizes(pool_tokens=pool, block_size=cfg.block_size, slots=slots,
                           chunk_steps=cfg.chunk_steps)

    def sampler(self, run: Any, *, rows_per_shard: int, group: int, max_new_tokens: int,
                temperature: float, top_p: float, end_ids: Sequence[int]) -> "RolloutSampler":
        """The rollout sampler for ``run``: ``rows_per_shard`` rollout rows per batch shard in
        groups of ``group``."""
        sizes = self.sizes(run, rows_per_shard=rows_per_shard, max_new_tokens=max_new_tokens,
                           group=group)
        return RolloutSampler(sizes.engine(run, run.state.params), group=group,
                              max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, end_ids=end_ids)


@dataclasses.dataclass(frozen=True)
class EngineSizes:
    """A run's decode engine sizes (per batch shard)."""

    pool_tokens: int
    block_size: int
    slots: int
    chunk_steps: int

    def engine(self, run: Any, params: Any) -> DecodeEngine:
        """The engine on ``run``'s mesh with ``params`` (abstract ones: to be compiled only;
        its pools are made at its first call)."""
        return DecodeEngine(model=run.model, params=params, pool_tokens=self.pool_tokens,
                            block_size=self.block_size, slots=self.slots,
                            chunk_steps=self.chunk_steps, placement=run.steps.decode_placement())


class RolloutSampler:
    """``(params, prompt_ids, prompt_lengths, key) -> {"tokens", "logps", "entropy"}`` as the
    static sampler's (``StepBuilder.sampler``): rows of left-padded prompts, each group of
    ``group`` consecutive rows one prompt; ``[rows, max_new_tokens]`` out, a completion's places
    after its end id filled with that id (log-prob and entropy 0)."""

    def __init__(self, engine: DecodeEngine, *, group: int, max_new_tokens: int,
                 temperature: float, top_p: float, end_ids: Sequence[int]):
        self.engine, self.group, self.max_new_tokens = engine, group, max_new_tokens
        self.temperature, self.top_p, self.end_ids = temperature, top_p, tuple(end_ids)

    def __call__(self, params: Any, prompt_ids: Any, prompt_lengths: Any,
                 key: jax.Array) -> Dict[str, jax.Array]:
        self.engine.params = params  # (The current params: the same layout, no recompile.)
        # Every process's prompts: with several processes each runs the same host loop (the
        # engine's programs span them all), and keeps its own rows of the result.
        if jax.process_count() > 1 and not isinstance(prompt_ids, jax.Array):
            raise errors.DecodingError(
                "with several processes the rollout's prompts are a global array (each "
                "process's rows of one batch), not each host's own", path="prompt_ids",
                suggestion="place them on the mesh first (the run's inputs.placed)")
        ids, lengths = (self.engine.placement.host(a) for a in (prompt_ids, prompt_lengths))
        width = ids.shape[1]
        requests = [Request(prompt_ids=tuple(int(t) for t in ids[row, width - lengths[row]:]),
                            max_new_tokens=self.max_new_tokens, samples=self.group,
                            temperature=self.temperature, top_p=self.top_p,
                            stop_ids=self.end_ids)
                    for row in range(0, len(ids), self.group)]
        done = self.engine.generate(requests, key=key)
        # The pools and these params let go until the next rollout: the train steps between
        # have their memory (a rollout sampled ahead holds a copy of older params).
        self.engine.release()
        self.engine.params = None
        rows = len(ids)
        out = {"tokens": np.zeros((rows, self.max_new_tokens), np.int32),
               "logps": np.zeros((rows, self.max_new_tokens), np.float32),
               "entropy": np.zeros((rows, self.max_new_tokens), np.float32)}
        for row, completion in enumerate(c for group in done for c in group):
            n = len(completion.tokens)
            out["tokens"][row, :n] = completion.tokens
            out["tokens"][row, n:] = completion.tokens[-1]  # (An end id, when n is short.)
            out["logps"][row, :n] = completion.logps
            out["entropy"][row, :n] = completion.entropy
        if not isinstance(prompt_ids, jax.Array):  # (Host prompts: host-made results.)
            return {name: jax.device_put(value) for name, value in out.items()}
        # Rows laid out as the prompts' (whole along the tokens): with several processes each
        # keeps its own rows.
        sharding = prompt_ids.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:1]))
        return {name: jax.make_array_from_callback(value.shape, sharding,
                                                   lambda index, value=value: value[index])
                for name, value in out.items()}
