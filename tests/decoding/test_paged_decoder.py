"""A decoder over a paged cache (``Decoder.paged_logits``, ``Attention`` decoding through
``Paging``) against its contiguous-cache sampler (``Decoder.sample``): prompts of mixed lengths,
each prefilled once into blocks its samples share, then every row one token per step at its own
position -- the same greedy tokens, log-probs within float64's rounding. Grouped-query heads,
with and without a sliding window and sinks; today's families whose caches are not keys and
values (Qwen 3.5's Gated DeltaNet states per slot, also in an unstacked tail; DeepSeek-V3's
latents)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from titanax.decoding.block_pool import BlockPool
from titanax.decoding import slot_states
from titanax.decoding.paged_attention import Paging
from titanax.modules import sampling
from titanax.modules.models.decoder import Decoder
from titanax.modules.module import functional
from tests.modules.models.test_layer_pattern import FAMILIES
from tests.numerics import FLOAT64, assert_close

pytestmark = pytest.mark.usefixtures("float64_numerics")

SMALL = dict(name="d", vocab_size=64, max_seq_len=64, model_dim=32, num_heads=4, num_kv_heads=2,
             hidden_dim=48, num_layers=2)
PROMPTS = ([5, 9, 2, 33, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [60, 61, 62])
SAMPLES, NEW, BLOCK = 2, 6, 4


def _model(**changes):
    model = Decoder.default_config().set(**{**SMALL, **changes}).instantiate(parent=None)
    params = jax.jit(model.initialize_parameters_recursively)(jax.random.PRNGKey(0))
    return model, jax.tree_util.tree_map(lambda p: p.astype(jnp.float64), params)


def _family_model(family, **changes):
    """Today's family ``family`` (``FAMILIES``) at this file's vocabulary, params in float64."""
    model = FAMILIES[family](vocab_size=64).set(**changes).instantiate(parent=None)
    params = jax.jit(model.initialize_parameters_recursively)(jax.random.PRNGKey(0))
    return model, jax.tree_util.tree_map(lambda p: p.astype(jnp.float64), params)


def models(kind):
    """``(model, float64 params)``: ``"gqa"``, this file's grouped-query decoder, or one of
    today's families."""
    return _model() if kind == "gqa" else _family_model(kind)


# (id(model), method) -> (model, its compiled call): the model held, so its id is not reused.
_COMPILED_CALLS = {}


def _call(model, params, method, *args):
    """``model.<method>(*args)`` in inference, one compiled program per model and method (run op
    by op, each step of a decoding loop would dispatch its hundreds of operations anew). A method
    named by string is called again step after step and is kept; a one-off callable is not."""
    def program():
        return jax.jit(lambda params, *args: functional(
            model, None, params, args, method=method, is_training=False)[0])
    if not isinstance(method, str):
        return program()(params, *args)
    key = (id(model), method)
    if key not in _COMPILED_CALLS:
        _COMPILED_CALLS[key] = model, program()
    return _COMPILED_CALLS[key][1](params, *args)


def _contiguous(model, params):
    """Greedy tokens and log-probs of ``Decoder.sample`` over the left-padded prompts."""
    width = max(len(p) for p in PROMPTS)
    ids = jnp.asarray([[0] * (width - len(p)) + p for p in PROMPTS])
    out = _call(model, params, lambda m, ids, lengths: m.sample(
        ids, None, max_new_tokens=NEW, prompt_lengths=lengths), ids,
        jnp.asarray([len(p) for p in PROMPTS]))
    return np.asarray(out["tokens"]), np.asarray(out["logps"])


def _paged(model, params):
    """The same through the paged cache: one prefill per prompt (its first sample's table), the
    tail block copied to the other samples, then every sample a token per step."""
    pool = BlockPool(num_blocks=32, block_size=BLOCK)
    rows = [[g * SAMPLES + s for s in range(SAMPLES)] for g in range(len(PROMPTS))]
    for group, prompt in zip(rows, PROMPTS):
        pool.add_group(sequences=group, prompt_length=len(prompt))
        for sequence in group:
            pool.grow(sequence, to_length=len(prompt) + NEW)
    width = max(len(pool.table(s)) for g in rows for s in g)
    tables = jnp.asarray([pool.table(s) + [0] * (width - len(pool.table(s)))
                          for g in rows for s in g])
    pools = _call(model, params, lambda m: m.empty_paged_cache(num_blocks=32, block_size=BLOCK,
                                                               slots=len(PROMPTS) * SAMPLES))
    longest = max(len(p) for p in PROMPTS)
    firsts = tables[::SAMPLES]
    logits, pools = _call(model, params, "paged_logits",
                          jnp.asarray([p + [0] * (longest - len(p)) for p in PROMPTS]), pools,
                          Paging(tables=firsts, positions=jnp.asarray(
                              [list(range(len(p))) + [-1] * (longest - len(p))
                               for p in PROMPTS]), slots=jnp.asarray([g[0] for g in rows])))
    for group, prompt in zip(rows, PROMPTS):  # Each other sample's own copy of the prefill.
        tail = pool.blocks_for(len(prompt)) - 1
        for sequence in group[1:]:
            pools = slot_states.copy_prompts(
                pools, *(jnp.asarray([pool.table(s)[tail]]) for s in (group[0], sequence)),
                jnp.asarray([group[0]]), jnp.asarray([sequence]))
    logits = jnp.repeat(logits, SAMPLES, axis=0)
    lengths = np.repeat([len(p) for p in PROMPTS], SAMPLES)
    tokens, logps = [], []
    for step in range(NEW):
        token = jnp.argmax(logits, axis=-1)
        logp, _ = sampling.token_logp_and_entropy(logits, token, temperature=None)
        tokens.append(np.asarray(token))
        logps.append(np.asarray(logp))
        if step + 1 < NEW:
            logits, pools = _call(model, params, "paged_logits", token[:, None], pools,
                                  Paging(tables=tables, positions=jnp.asarray(lengths[:, None]),
                                         slots=jnp.arange(len(lengths))))
            lengths = lengths + 1
    return np.stack(tokens, 1), np.stack(logps, 1)


@pytest.mark.parametrize("changes", [
    {}, {"sliding_window": 4, "attention_sinks": True},
    # Gemma 3's shape: a pattern of sliding and full layers, and an unstacked tail layer.
    {"layer_pattern": ("sliding", "full"), "sliding_window": 3, "num_layers": 3}],
    ids=["full", "window-and-sinks", "pattern-and-tail"])
def test_paged_greedy_decoding_is_the_contiguous_samplers(changes):
    model, params = _model(**changes)
    want_tokens, want_logps = _contiguous(model, params)
    tokens, logps = _paged(model, params)
    for sample in range(SAMPLES):  # Each sample of a prompt: the prompt's greedy completion.
        np.testing.assert_array_equal(tokens[sample::SAMPLES], want_tokens)
        assert_close(logps[sample::SAMPLES], want_logps, bound=FLOAT64, what="log-probs")
    assert len({tuple(row) for row in want_tokens}) == len(PROMPTS)  # Prompts tell apart.


@pytest.mark.parametrize("family,changes", [
    ("qwen3_5", {}), ("deepseek_v3", {}),
    # One repetition of the pattern and a tail of three Gated DeltaNet layers, unstacked.
    ("qwen3_5", {"num_layers": 7})], ids=["qwen3_5", "deepseek_v3", "qwen3_5 with a tail"])
def test_todays_caches_that_are_not_keys_and_values_decode_paged_as_contiguous(family,
                                                                               changes):
    """Qwen 3.5's Gated DeltaNet layers (a state per slot: prefilled over two of the rule's
    chunks, copied to each other sample, carried token by token) beside full attention, and
    DeepSeek-V3's latent attention (latents and RoPE keys in blocks) with a dense first layer
    and experts: the contiguous sampler's greedy tokens and log-probs."""
    model, params = _family_model(family, **changes)
    if changes:
        assert "decoder_tail" in model.children
    want_tokens, want_logps = _contiguous(model, params)
    tokens, logps = _paged(model, params)
    for sample in range(SAMPLES):
        np.testing.assert_array_equal(tokens[sample::SAMPLES], want_tokens)
        assert_close(logps[sample::SAMPLES], want_logps, bound=FLOAT64, what="log-probs")
    assert len({tuple(row) for row in want_tokens}) == len(PROMPTS)
