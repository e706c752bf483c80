"""A decode engine: many requests completed over one paged cache, continuously batched.

Why: the static sampler (``Decoder.sample``) decodes one batch with a contiguous cache of
``prompt + max_new_tokens`` per row, every row until the batch's last ends, and prefills a prompt
once per sample. Here a request's ``samples`` share its prompt's blocks, prefilled once; each
sequence holds a slot of the decode batch only while it decodes, and a finished sequence's slot
and blocks go to the next waiting request between chunks of ``chunk_steps`` compiled steps.

What runs where: the host keeps the book (``BlockPool``: blocks, tables) and the queue; the
device runs three compiled programs -- a prefill per length bucket, a copy of each prompt's
prefill to its other samples (its tail block; a recurrent layer's state, kept per slot:
``slot_states.py``), and a chunk of decode steps over every slot (a slot with no sequence, or
one that ended inside the chunk, writes and draws nothing). A request's blocks for its whole
budget are reserved when it is admitted, so no chunk ever runs out of room.

Each sample's draws use its own key (the call's key -- given, or the engine's seed folded with
the call's number -- then the request's index, the sample's, the token's place), so what a
request gets does not depend on which slot, chunk or batch shard it ran in.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from titanax import errors
from titanax.decoding import row_sampling
from titanax.decoding.block_pool import BlockPool
from titanax.decoding import slot_states
from titanax.decoding import placement as placement_lib
from titanax.decoding.paged_attention import Paging
from titanax.decoding.placement import PARAMS, POOLS, ROWS, SAME
from titanax.modules.module import functional
from titanax.utils.length_buckets import padded_length


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt and how to complete it ``samples`` times."""

    prompt_ids: Tuple[int, ...]
    # Tokens drawn at most per sample (a stop id drawn earlier ends it, itself included).
    max_new_tokens: int
    samples: int = 1
    # 0: greedy.
    temperature: float = 0.0
    top_p: float = 1.0
    # 0: no limit.
    top_k: int = 0
    stop_ids: Tuple[int, ...] = ()


@dataclasses.dataclass
class Completion:
    """One sample's tokens, each one's log-probability and its distribution's entropy
    (``row_sampling.logp_and_entropy``)."""

    tokens: List[int] = dataclasses.field(default_factory=list)
    logps: List[float] = dataclasses.field(default_factory=list)
    entropy: List[float] = dataclasses.field(default_factory=list)


class DecodeEngine:
    """Completes requests with ``model`` (a ``Decoder``) and ``params`` over a cache of
    ``pool_tokens`` tokens in blocks of ``block_size``, ``slots`` sequences decoding at once,
    ``chunk_steps`` steps per compiled chunk -- the pool and the slots per batch shard of
    ``placement`` (``placement.py``: one device by default)."""

    def __init__(self, *, model: Any, params: Any, pool_tokens: int, block_size: int = 16,
                 slots: int = 16, chunk_steps: int = 8, seed: int = 0,
                 placement: Any = None):
        for name, value in (("block_size", block_size), ("slots", slots),
                            ("chunk_steps", chunk_steps), ("pool_tokens", pool_tokens)):
            if not _is_count(value) or value < 1:
                raise errors.DecodingError(f"must be a whole number >= 1, got {value!r}",
                                           path=f"decoding.{name}")
        if pool_tokens < block_size:
            raise errors.DecodingError(f"holds less than one block of {block_size} tokens",
                                       path="decoding.pool_tokens")
        self.model, self.params, self.slots, self.chunk_steps = model, params, slots, chunk_steps
        self.placement = placement_lib.OneDevice() if placement is None else placement
        self.block_size, self.num_blocks = block_size, pool_tokens // block_size
        self.books = self._fresh_books()
        program = self.placement.program
        self._make_pools = pools_program(model=model, placement=self.placement,
                                         num_blocks=self.num_blocks, block_size=block_size,
                                         slots=slots)
        # What the model cannot decode over a paged cache is refused now (by tracing the
        # pools' making); the pools are made at the first call: an engine made to be compiled
        # only holds none.
        self.pools = None
        self._holds_states = slot_states.holds_states(self._make_pools.eval_shape(params))
        # Each generate() call draws with keys of its own (the seed, then the call's number).
        self.seed_key, self.calls = jax.random.PRNGKey(seed), 0
        self.root_key = self.seed_key
        # The pools are donated: each program updates the cache in place, never a second copy.
        self._prefill = program(self._prefill_logits, inputs=(PARAMS, POOLS, ROWS, ROWS),
                                outputs=(ROWS, POOLS), donate=(1,))
        self._chunk = program(self._decode_chunk, inputs=(PARAMS, POOLS, SAME, ROWS),
                              outputs=(POOLS, ROWS, ROWS), donate=(1,))
        self._first_draw = program(_draw_rows, inputs=(ROWS, ROWS, SAME) + (ROWS,) * 6,
                                   outputs=(ROWS, ROWS, ROWS))
        self._copy = program(slot_states.copy_prompts, inputs=(POOLS, ROWS, ROWS, ROWS, ROWS),
                             outputs=POOLS, donate=(0,))

    @property
    def book(self) -> BlockPool:
        """The first shard's book (counting blocks: the same size on every shard)."""
        return self.books[0]

    def _fresh_books(self) -> List[BlockPool]:
        return [BlockPool(num_blocks=self.num_blocks, block_size=self.block_size)
                for _ in range(self.placement.shards)]

    def _shard_of(self, slot: int) -> int:
        return slot // self.slots

    # --- The host's loop ----------------------------------------------------------------------

    def generate(self, requests: Sequence[Request], *,
                 key: Optional[jax.Array] = None) -> List[List[Completion]]:
        """Every request's ``samples`` completions, in the requests' order; ``key``: the call's
        root key (a rollout's, so a resumed run draws what the uninterrupted one drew), else
        the seed's, folded with the call's number. On a mesh spanning several processes every
        process calls it with the same requests and key: each runs the same host loop (its
        programs span them all), which stays in step because what each host reads back -- the
        drawn tokens -- is the same everywhere."""
        if not requests:
            return []
        self._check(requests)
        if self.pools is None:
            self.pools = self._make_pools(self.params)
        # A fresh book (one a failed call left entries in would refuse the next), fresh keys.
        self.books = self._fresh_books()
        self.root_key = self._host_key(
            jax.random.fold_in(self.seed_key, self.calls) if key is None else key)
        self.calls += 1
        width = max(self.book.blocks_for(len(r.prompt_ids) + r.max_new_tokens) for r in requests)
        waiting = collections.deque(enumerate(requests))
        out = [[Completion() for _ in range(r.samples)] for r in requests]
        running: Dict[int, Tuple[int, int]] = {}  # slot -> (request, sample)
        state = _SlotState(self.slots * self.placement.shards, width,
                           stops=max(1, *(len(r.stop_ids) for r in requests)),
                           per_shard=self.slots)
        while waiting or running:
            admitted = self._admit(waiting, running)
            if admitted:
                state = self._start(admitted, requests, running, state, out, width)
            if running:
                state = self._run_chunk(requests, running, state, out)
        return out

    def _check(self, requests: Sequence[Request]) -> None:
        for index, request in enumerate(requests):
            self._check_request(request, path=f"requests[{index}]")

    def _check_request(self, request: Request, *, path: str) -> None:
        """What the engine cannot serve as asked, refused by name before anything runs."""
        cfg = self.model.config
        if not _is_count(request.samples) or not 1 <= request.samples <= self.slots:
            raise errors.DecodingError(
                f"asks for {request.samples!r} samples; the engine decodes 1 to {self.slots} "
                f"at once", path=f"{path}.samples")
        if not _is_count(request.max_new_tokens) or request.max_new_tokens < 1:
            raise errors.DecodingError(f"must be a whole number >= 1, got "
                                       f"{request.max_new_tokens!r}", path=f"{path}.max_new_tokens")
        if not request.prompt_ids or not all(
                _is_count(t) and 0 <= t < cfg.vocab_size for t in request.prompt_ids):
            raise errors.DecodingError(
                f"needs a prompt of token ids in [0, {cfg.vocab_size}) (the model's vocabulary)",
                path=f"{path}.prompt_ids")
        if len(request.prompt_ids) + request.max_new_tokens > cfg.max_seq_len:
            raise errors.DecodingError(
                f"{len(request.prompt_ids)} prompt + {request.max_new_tokens} new tokens exceed "
                f"the model's max_seq_len {cfg.max_seq_len}", path=f"{path}.max_new_tokens")
        if not (request.temperature >= 0 and 0 < request.top_p <= 1 and _is_count(request.top_k)
                and request.top_k >= 0):
            raise errors.DecodingError(
                f"temperature {request.temperature} (>= 0), top_p {request.top_p} (in (0, "
                f"1]) or top_k {request.top_k!r} (a whole number >= 0, 0: no limit) is out of "
                f"range", path=path)
        need = self._blocks_needed(request)
        if need > self.num_blocks:
            raise errors.DecodingError(
                f"needs {need} blocks of {self.block_size} tokens for its prompt and "
                f"samples, the pool has {self.num_blocks}", path=path,
                suggestion="make the pool larger (pool_tokens) or the request shorter")

    def _admit(self, waiting, running) -> List[Tuple[int, List[int]]]:
        """Requests moved from the queue into free slots while their blocks fit, in order, each
        to the batch shard with the most free slots that can hold it (its samples share its
        prompt's blocks, so all run on one shard): ``[(request, its samples' slots)]``."""
        admitted = []
        free = [[s for s in range(shard * self.slots, (shard + 1) * self.slots)
                 if s not in running] for shard in range(self.placement.shards)]
        while waiting:
            index, request = waiting[0]
            fits = [shard for shard, slots in enumerate(free) if len(slots) >= request.samples
                    and self._blocks_needed(request) <= self.books[shard].free_blocks]
            if not fits:
                break
            shard = max(fits, key=lambda s: (len(free[s]), -s))
            waiting.popleft()
            slots, free[shard] = free[shard][:request.samples], free[shard][request.samples:]
            self._reserve(request, slots, self.books[shard])
            running.update({slot: (index, sample) for sample, slot in enumerate(slots)})
            admitted.append((index, slots))
        return admitted

    def _blocks_needed(self, request: Request) -> int:
        """Blocks a request holds while it runs: its prompt's (the full ones once), and each
        sample's room for its whole budget."""
        length = len(request.prompt_ids)
        extra = self.book.blocks_for(length + request.max_new_tokens) - \
            self.book.blocks_for(length)
        return self.book.group_cost(prompt_length=length, samples=request.samples) + \
            request.samples * extra

    @staticmethod
    def _reserve(request: Request, slots: List[int], book: BlockPool) -> None:
        """The request's blocks (``_blocks_needed``, which fit) under its samples' ``slots``."""
        book.add_group(sequences=slots, prompt_length=len(request.prompt_ids))
        for slot in slots:
            book.grow(slot, to_length=len(request.prompt_ids) + request.max_new_tokens)

    def _start(self, admitted, requests, running, state: "_SlotState", out, width: int):
        """Prefill the admitted requests' prompts (``_prefill_prompts``), copy each prompt's
        tail block to its other samples, draw every sample's first token; the slots' state set
        to decode on."""
        logits, rows = self._prefill_prompts(admitted, requests, width)
        self._copy_tails(admitted, requests)
        started = []
        for row, (index, slots) in zip(rows, admitted):
            book = self.books[self._shard_of(slots[0])]
            state.admit(slots, index, requests[index], tables=[book.table(s) for s in slots])
            state.logits_row[slots] = row
            started += slots
        for slot, token, logp, entropy in self._first(logits, state, started):
            index, sample = running[slot]
            completion = out[index][sample]
            completion.tokens.append(token)
            completion.logps.append(logp)
            completion.entropy.append(entropy)
            state.drew_first(slot, token)
            if not state.active[slot]:
                self._finish(slot, running, state)
        return state

    def _prefill_prompts(self, admitted, requests, width: int):
        """One row per admitted prompt, written through its first sample's table, on its
        shard (each shard's rows padded to one power of two: a program per size): the logits
        after each row's last token, and each admitted request's row among them."""
        shards = [self._shard_of(slots[0]) for _, slots in admitted]
        per_shard = max(shards.count(s) for s in set(shards))
        rows_each = 1 << (per_shard - 1).bit_length()
        prompts = [requests[index].prompt_ids for index, _ in admitted]
        length = padded_length(max(len(p) for p in prompts), limit=width * self.block_size)
        total = rows_each * self.placement.shards
        ids = np.zeros((total, length), np.int32)
        positions = np.full((total, length), -1, np.int32)
        tables = np.zeros((total, width), np.int32)
        local_slots = np.full(total, -1, np.int32)  # (A padding row's: none.)
        rows, used = [], [0] * self.placement.shards
        for shard, (_, slots), prompt in zip(shards, admitted, prompts):
            row = shard * rows_each + used[shard]
            used[shard] += 1
            table = self.books[shard].table(slots[0])
            ids[row, :len(prompt)], positions[row, :len(prompt)] = prompt, range(len(prompt))
            tables[row, :len(table)] = table
            local_slots[row] = slots[0] % self.slots
            rows.append(row)
        logits, self.pools = self._prefill(
            self.params, self.pools, ids,
            Paging(tables=tables, positions=positions, slots=local_slots))
        return logits, rows

    def _copy_tails(self, admitted, requests) -> None:
        """Each prompt's prefill shared with its other samples, shard by shard: its partly
        filled last block, written under its first sample's table, copied to their own tail
        blocks, and its recurrent layers' states (a model with any) from the first sample's
        slot to theirs. Each shard's copies padded to ``slots`` by repeating one (the same
        value written twice; a shard with none copies its block 0 and slot 0 onto themselves)."""
        shards = self.placement.shards
        blocks, slots = [[] for _ in range(shards)], [[] for _ in range(shards)]
        for index, group in admitted:
            shard, length = self._shard_of(group[0]), len(requests[index].prompt_ids)
            if self._holds_states:
                slots[shard] += [(group[0] % self.slots, s % self.slots) for s in group[1:]]
            if length % self.block_size:
                book = self.books[shard]
                tail = book.blocks_for(length) - 1
                blocks[shard] += [(book.table(group[0])[tail], book.table(s)[tail])
                                  for s in group[1:]]
        if not any(blocks) and not any(slots):
            return
        self.pools = self._copy(self.pools, *self._copy_pairs(blocks), *self._copy_pairs(slots))

    def _copy_pairs(self, pairs_by_shard):
        """``(sources, targets)``: each shard's ``(source, target)`` pairs padded to
        ``slots`` pairs (``_copy_tails``), shard after shard."""
        padded = [pairs + (pairs or [(0, 0)])[:1] * (self.slots - len(pairs))
                  for pairs in pairs_by_shard]
        return tuple(np.asarray([[pair[i] for pair in pairs] for pairs in padded],
                                np.int32).reshape(-1) for i in (0, 1))

    def _host_key(self, key: jax.Array) -> np.ndarray:
        """``key``'s data on the host (every process's loop hands each program the same)."""
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        return np.asarray(key) if key.is_fully_addressable else self.placement.host(key)

    def _first(self, logits, state: "_SlotState", slots: List[int]):
        """The first token of each sample in ``slots``, from its prompt's prefill row: drawn
        on each batch shard from its own rows (no logits leave the devices)."""
        per_shard = logits.shape[0] // self.placement.shards
        shard = np.arange(len(state.logits_row)) // self.slots
        # Every slot draws (one program for every call); a slot not started here may name a
        # row of an earlier prefill, clipped into this one's: its draw is not read.
        local = np.clip(state.logits_row - shard * per_shard, 0, per_shard - 1).astype(np.int32)
        tokens, logps, entropy = self.placement.host(self._first_draw(
            logits, local, self.root_key, state.request, state.sample, state.counts,
            state.temperature, state.top_p, state.top_k))
        return [(slot, int(tokens[slot]), float(logps[slot]), float(entropy[slot]))
                for slot in slots]

    def _run_chunk(self, requests, running, state: "_SlotState", out):
        """``chunk_steps`` decode steps over every slot; what each running sample drew
        recorded, the ended ones' slots and blocks freed."""
        rows = self._decode_rows(running)
        self.pools, carry, drawn = self._chunk(
            self.params, self.pools, self.root_key, state.device_inputs(rows))
        carry, drawn = self.placement.host((carry, drawn))  # (One gather, one read.)
        state.update(carry, rows)
        tokens, logps, entropy, produced = drawn
        for row, slot in enumerate(rows):
            if slot not in running:
                continue
            index, sample = running[slot]
            completion = out[index][sample]
            for step in np.flatnonzero(produced[row]):
                completion.tokens.append(int(tokens[row, step]))
                completion.logps.append(float(logps[row, step]))
                completion.entropy.append(float(entropy[row, step]))
            if not state.active[slot]:
                self._finish(slot, running, state)
        return state

    def _decode_rows(self, running) -> List[int]:
        """The slots a chunk decodes: on each shard its running ones, padded with its idle
        slots to a power of two, the same on every shard (a program per size): as sequences
        end, the chunks shrink with them instead of computing every slot to the last
        sequence's end."""
        shards = range(self.placement.shards)
        live = [[s for s in sorted(running) if self._shard_of(s) == shard] for shard in shards]
        size = min(self.slots, 1 << (max(len(x) for x in live) - 1).bit_length())
        rows = []
        for shard, slots in zip(shards, live):
            idle = [s for s in range(shard * self.slots, (shard + 1) * self.slots)
                    if s not in running]
            rows += slots + idle[:size - len(slots)]
        return rows

    def _finish(self, slot: int, running, state: "_SlotState") -> None:
        self.books[self._shard_of(slot)].release(slot)
        del running[slot]
        state.active[slot] = False

    def release(self) -> None:
        """Lets the pools go (their memory is free once nothing else holds them); the next
        call makes them anew. Between rollouts, or between evaluations, the train step has the
        memory."""
        self.pools = None

    def pool_bytes_per_device(self) -> int:
        """The pools' bytes on each device (its shard's blocks, its share of the key/value
        heads), from their shapes: nothing allocated."""
        total = 0
        for leaf in jax.tree_util.tree_leaves(self._make_pools.eval_shape(self.params)):
            laid = self.placement.abstract(POOLS, leaf)
            shape = laid.shape if laid.sharding is None else laid.sharding.shard_shape(laid.shape)
            total += int(np.prod(shape)) * laid.dtype.itemsize
        return total

    def chunk_memory(self, *, width: int, stops: int) -> Any:
        """The decode chunk compiled for every slot of every shard, from shapes alone (the
        params may be abstract; nothing is allocated): its ``memory_analysis()``. ``width``:
        the blocks of a sequence's table; ``stops``: stop ids per request."""
        rows = self.slots * self.placement.shards
        state = _SlotState(rows, width, stops=stops, per_shard=self.slots)
        inputs = {name: self.placement.abstract(ROWS, value)
                  for name, value in state.device_inputs(list(range(rows))).items()}
        pools = jax.tree_util.tree_map(lambda leaf: self.placement.abstract(POOLS, leaf),
                                       self._make_pools.eval_shape(self.params))
        key = jax.ShapeDtypeStruct((2,), np.uint32)
        return self._chunk.lower(self.params, pools, key, inputs).compile().memory_analysis()

    # --- The device's programs ----------------------------------------------------------------

    def _prefill_logits(self, params, pools, ids, paging):
        return functional(self.model, None, self.placement.local_params(params),
                          (ids, pools, paging), method="paged_logits", is_training=False)[0]

    def _decode_chunk(self, params, pools, root_key, inputs):
        """``chunk_steps`` steps: each active slot feeds its last token at its own position and
        draws the next; one that draws a stop id or spends its budget stops there."""
        fixed = {k: inputs[k] for k in ("tables", "temperature", "top_p", "top_k", "stops",
                                        "request", "sample", "local_slot")}
        params = self.placement.local_params(params)  # (Gathered once for every step.)

        def step(carry, _):
            pools, tokens, lengths, active, budgets, counts = carry
            paging = Paging(tables=fixed["tables"],
                            positions=jnp.where(active, lengths, -1)[:, None],
                            slots=fixed["local_slot"])
            logits, pools = functional(self.model, None, params, (tokens[:, None], pools, paging),
                                       method="paged_logits", is_training=False)[0]
            new, logp, entropy = _draw(logits, root_key, fixed["request"], fixed["sample"],
                                       counts, fixed["temperature"], fixed["top_p"],
                                       fixed["top_k"])
            stopped = jnp.any(new[:, None] == fixed["stops"], axis=-1)
            step_of = active.astype(jnp.int32)
            budgets = budgets - step_of
            carry = (pools, jnp.where(active, new, tokens), lengths + step_of,
                     active & ~stopped & (budgets > 0), budgets, counts + step_of)
            return carry, (new, logp, entropy, active)

        init = (pools, inputs["tokens"], inputs["lengths"], inputs["active"], inputs["budgets"],
                inputs["counts"])
        (pools, *carry), drawn = jax.lax.scan(step, init, None, length=self.chunk_steps)
        return pools, carry, tuple(jnp.moveaxis(x, 0, 1) for x in drawn)


def pools_program(*, model: Any, placement: Any, num_blocks: int, block_size: int,
                  slots: int):
    """``params -> pools``: every layer's pool of ``num_blocks`` blocks of ``block_size``
    tokens (a recurrent layer's: states for ``slots`` slots) per batch shard of ``placement``,
    zeros (``jax.eval_shape`` of it: their sizes, with nothing allocated)."""
    def empty(params):
        return functional(model, None, placement.local_params(params), (),
                          method=lambda m: m.empty_paged_cache(
                              num_blocks=num_blocks, block_size=block_size, slots=slots),
                          is_training=False)[0]
    return placement.program(empty, inputs=(PARAMS,), outputs=POOLS)


def _draw(logits, root_key, request, sample, counts, temperature, top_p, top_k):
    """Tokens, their log-probs and entropies, per row (``row_sampling``), each row drawn with
    its own key (``sample_keys``)."""
    keys = sample_keys(root_key, request, sample, counts)
    tokens = row_sampling.next_tokens(logits, keys, temperature=temperature, top_p=top_p,
                                      top_k=top_k)
    logps, entropy = row_sampling.logp_and_entropy(logits, tokens, temperature=temperature)
    return tokens, logps, entropy


def _draw_rows(logits, rows, root_key, request, sample, counts, temperature, top_p, top_k):
    """``_draw`` of the logits' ``rows`` (one per slot)."""
    return _draw(logits[rows], root_key, request, sample, counts, temperature, top_p, top_k)


def _is_count(value: Any) -> bool:
    """A whole number (``numpy`` integers too; not a bool, not 2.5)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def sample_keys(root_key: jax.Array, request: jax.Array, sample: jax.Array,
                count: jax.Array) -> jax.Array:
    """``[b, 2]``: the key of each row's next draw -- its request's, its sample's, its token's
    place -- whatever slot or chunk it runs in."""
    def one(r, s, c):
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(root_key, r), s), c)
    return jax.vmap(one)(request, sample, count)


class _SlotState:
    """What the decode chunk reads and updates per slot, on the host between chunks."""

    def __init__(self, slots: int, width: int, stops: int, per_shard: int):
        # Each slot's place on its batch shard (where its recurrent states live).
        self.local_slot = np.arange(slots, dtype=np.int32) % per_shard
        self.tables = np.zeros((slots, width), np.int32)
        self.tokens = np.zeros(slots, np.int32)
        self.lengths = np.zeros(slots, np.int32)
        self.active = np.zeros(slots, bool)
        self.budgets = np.zeros(slots, np.int32)
        self.counts = np.zeros(slots, np.int32)
        self.temperature = np.zeros(slots, np.float32)
        self.top_p = np.ones(slots, np.float32)
        self.top_k = np.zeros(slots, np.int32)
        self.stops = np.full((slots, stops), -1, np.int32)
        self.request = np.zeros(slots, np.int32)
        self.sample = np.zeros(slots, np.int32)
        self.logits_row = np.zeros(slots, np.int32)

    def admit(self, slots: List[int], index: int, request: Request, *, tables) -> None:
        for sample, (slot, table) in enumerate(zip(slots, tables)):
            self.tables[slot] = 0
            self.tables[slot, :len(table)] = table
            self.lengths[slot] = len(request.prompt_ids)
            self.budgets[slot] = request.max_new_tokens
            self.counts[slot] = 0
            self.temperature[slot] = request.temperature
            self.top_p[slot] = request.top_p
            self.top_k[slot] = request.top_k
            self.stops[slot] = -1
            self.stops[slot, :len(request.stop_ids)] = request.stop_ids
            self.request[slot], self.sample[slot] = index, sample

    def drew_first(self, slot: int, token: int) -> None:
        """The slot's first token is drawn: it decodes on unless that ended it."""
        self.tokens[slot] = token
        self.counts[slot] = 1
        self.budgets[slot] -= 1
        self.active[slot] = self.budgets[slot] > 0 and token not in self.stops[slot]

    def device_inputs(self, rows: List[int]) -> Dict[str, np.ndarray]:
        """The state of the slots ``rows``, in that order (a chunk's batch)."""
        return {name: getattr(self, name)[rows] for name in (
            "tables", "tokens", "lengths", "active", "budgets", "counts", "temperature",
            "top_p", "top_k", "stops", "request", "sample", "local_slot")}

    def update(self, carry, rows: List[int]) -> None:
        """The chunk's final state of the slots ``rows`` written back."""
        for name, value in zip(("tokens", "lengths", "active", "budgets", "counts"), carry):
            getattr(self, name)[rows] = np.asarray(value)
