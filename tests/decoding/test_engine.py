"""The decode engine (titanax/decoding/engine.py) against the contiguous-cache sampler, one
request at a time: requests of mixed prompt lengths, samples, budgets and stop ids through fewer
slots than samples and a pool too small for all at once (requests wait, finished sequences' slots
and blocks go to the next), in chunks that sequences end inside -- each completion is the
sampler's greedy one, to the stop id it drew -- for attention, today's recurrent layers (a
state per slot) and latent attention alike. Sampled completions do not depend on the slots or
the chunk length they ran in. Float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from titanax import errors
from titanax.decoding.engine import DecodeEngine, Request
from titanax.modules.layers.moe import MoE
from tests.decoding.test_paged_decoder import _call, _model, models
from tests.numerics import FLOAT64, assert_close

pytestmark = pytest.mark.usefixtures("float64_numerics")

REQUESTS = (Request(prompt_ids=(5, 9, 2, 33, 7), max_new_tokens=7, samples=2),
            Request(prompt_ids=tuple(range(1, 13)), max_new_tokens=4, samples=3),
            Request(prompt_ids=(60, 61, 62), max_new_tokens=9, samples=1),
            Request(prompt_ids=(8,), max_new_tokens=6, samples=2),
            Request(prompt_ids=(3, 1, 4, 1, 5, 9, 2), max_new_tokens=8, samples=1))


def _samplers(model, params, requests):
    """``Decoder.sample``'s greedy completion of each request's prompt (to its first stop): the
    prompts left-padded into one batch, which samples each row as it would alone
    (``prompt_lengths``), for the longest budget, each row then cut to its own -- greedy tokens
    do not depend on how many follow (one program instead of one per request)."""
    width = max(len(r.prompt_ids) for r in requests)
    ids = jnp.asarray([[0] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in requests])
    lengths = jnp.asarray([len(r.prompt_ids) for r in requests])
    longest = max(r.max_new_tokens for r in requests)
    out = _call(model, params, lambda m, ids, lengths: m.sample(
        ids, None, max_new_tokens=longest, prompt_lengths=lengths), ids, lengths)
    tokens, logps = np.asarray(out["tokens"]), np.asarray(out["logps"])
    return [_to_first_stop(tokens[row, :r.max_new_tokens], logps[row, :r.max_new_tokens],
                           r.stop_ids) for row, r in enumerate(requests)]


def _to_first_stop(tokens, logps, stop_ids):
    """``(tokens, logps)`` to the first of ``stop_ids`` among ``tokens``, itself included."""
    ends = [i for i, t in enumerate(tokens) if t in stop_ids]
    stop = ends[0] + 1 if ends else len(tokens)
    return list(tokens[:stop]), logps[:stop]


@pytest.mark.parametrize("kind", ["gqa", "qwen3_5", "deepseek_v3"])
def test_greedy_completions_are_the_samplers_through_refilled_slots_and_a_small_pool(kind):
    """Grouped-query attention; Qwen 3.5's Gated DeltaNet states in slots that later requests
    take over (each starting from zeros, not the state its slot held); DeepSeek-V3's latents
    in blocks."""
    model, params = models(kind)
    plain = _samplers(model, params, REQUESTS)
    # Two requests get a stop id their greedy completion reaches at its fifth token (or before,
    # where it drew that token earlier): they end there and free their slots early; the others
    # run their whole budgets, over several chunks.
    requests = [Request(**{**r.__dict__, "stop_ids": (tokens[4],)}) if index in (0, 3) else r
                for index, (r, (tokens, _)) in enumerate(zip(REQUESTS, plain))]
    # Greedy tokens do not depend on the stop ids before the first stop: each wanted completion
    # is the plain one to its first stop id (the sampler run again with them would compile
    # another program per request).
    want = [_to_first_stop(tokens, logps, r.stop_ids)
            for r, (tokens, logps) in zip(requests, plain)]
    assert any(len(t) < r.max_new_tokens for r, (t, _) in zip(requests, want))
    # 12 blocks: requests 0 and 1 hold 5 + 6 in 5 of the 6 slots, so request 2 (3 blocks) waits
    # for blocks with a slot free; later ones wait for slots.
    engine = DecodeEngine(model=model, params=params, pool_tokens=48, block_size=4, slots=6,
                          chunk_steps=3)
    needed = [engine._blocks_needed(r) for r in requests[:3]]  # pylint: disable=protected-access
    assert needed == [5, 6, 3]
    assert max(len(t) for t, _ in want) > 1 + 2 * engine.chunk_steps  # Across chunks.
    got = engine.generate(requests)
    for request, completions, (tokens, logps) in zip(requests, got, want):
        assert len(completions) == request.samples
        for completion in completions:
            assert completion.tokens == tokens, (request, completion.tokens, tokens)
            assert_close(np.asarray(completion.logps), logps, bound=FLOAT64, what="log-probs")
    assert engine.book.free_blocks == engine.num_blocks  # Every block back.


@pytest.mark.parametrize("kind", ["gqa", "qwen3_5"])
def test_sampled_completions_do_not_depend_on_slots_or_chunks(kind):
    model, params = models(kind)
    requests = [Request(**{**r.__dict__, "temperature": 0.8, "top_p": 0.9, "top_k": 20})
                for r in REQUESTS]
    engines = [DecodeEngine(model=model, params=params, pool_tokens=256, block_size=4,
                            slots=slots, chunk_steps=chunk, seed=7)
               for slots, chunk in ((3, 1), (8, 5))]
    runs = [engine.generate(requests) for engine in engines]
    tokens = [[[c.tokens for c in completions] for completions in run] for run in runs]
    assert tokens[0] == tokens[1]
    # The samples of a request differ (their own keys), and the seed matters.
    assert any(len({tuple(t) for t in group}) > 1 for group in tokens[0])
    other = DecodeEngine(model=model, params=params, pool_tokens=256, block_size=4, slots=8,
                         chunk_steps=5, seed=8).generate(requests)
    assert [[c.tokens for c in completions] for completions in other] != tokens[0]
    # A second call on the same engine draws anew (its keys: the seed, then the call's number).
    again = engines[1]
    second = again.generate(requests)
    assert [[c.tokens for c in g] for g in second] != tokens[0]
    # A call's own key, raw or typed (jax.random.key), decides its draws alike.
    raw, typed = (again.generate(requests, key=k)
                  for k in (jax.random.PRNGKey(11), jax.random.key(11)))
    assert [[c.tokens for c in g] for g in raw] == [[c.tokens for c in g] for g in typed]


@pytest.mark.parametrize("request_,match", [
    (Request(prompt_ids=(1, 2), max_new_tokens=3, samples=0), r"requests\[0\].samples"),
    (Request(prompt_ids=(1, 2), max_new_tokens=3, samples=1.5), r"requests\[0\].samples"),
    (Request(prompt_ids=tuple(range(30)), max_new_tokens=20, samples=2),
     "make the pool larger"),
    (Request(prompt_ids=(), max_new_tokens=3), "prompt_ids"),
    (Request(prompt_ids=(1, 64), max_new_tokens=3), r"prompt_ids.*vocabulary"),
    (Request(prompt_ids=(-1,), max_new_tokens=3), "prompt_ids"),
    (Request(prompt_ids=tuple(range(60)), max_new_tokens=8), "max_seq_len 64"),
    (Request(prompt_ids=(1,), max_new_tokens=2.5), "max_new_tokens"),
    (Request(prompt_ids=(1,), max_new_tokens=2, top_k=1.5), "top_k 1.5"),
    (Request(prompt_ids=(1,), max_new_tokens=0), "max_new_tokens"),
    (Request(prompt_ids=(1,), max_new_tokens=2, temperature=-1.0), "temperature -1.0"),
    (Request(prompt_ids=(1,), max_new_tokens=2, top_p=1.5), "top_p 1.5"),
    (Request(prompt_ids=(1,), max_new_tokens=2, top_k=-2), "top_k -2")],
    ids=["no samples", "half a sample", "longer than the pool", "no prompt",
         "an id past the vocabulary", "a negative id", "past max_seq_len",
         "a fraction of a token", "a fractional top_k", "no new tokens",
         "negative temperature", "top_p above 1", "negative top_k"])
def test_requests_that_cannot_be_served_are_refused_by_name(request_, match):
    model, params = _model()
    engine = DecodeEngine(model=model, params=params, pool_tokens=64, block_size=4, slots=4)
    with pytest.raises(errors.DecodingError, match=match):
        engine.generate([request_])


@pytest.mark.parametrize("value", [0, -3, 2.5])
@pytest.mark.parametrize("field", ["block_size", "slots", "chunk_steps", "pool_tokens"])
def test_an_engine_of_zero_negative_or_fractional_parts_is_refused_by_name(field, value):
    model, params = _model()
    with pytest.raises(errors.DecodingError, match=f"decoding.{field}"):
        DecodeEngine(model=model, params=params, **{"pool_tokens": 64, field: value})


def test_an_empty_list_of_requests_is_an_empty_answer_and_capacity_experts_are_refused():
    model, params = _model()
    engine = DecodeEngine(model=model, params=params, pool_tokens=64, block_size=4)
    assert engine.generate([]) == []
    moe = MoE.default_config().set(hidden_dim=16, num_experts=4, top_k=2)  # dispatch="capacity"
    model, params = _model(moe=moe)
    with pytest.raises(errors.DecodingError, match="model.moe.dispatch"):
        DecodeEngine(model=model, params=params, pool_tokens=64, block_size=4)
