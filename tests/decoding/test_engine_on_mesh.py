"""The decode engine on the training mesh (``StepBuilder.decode_placement``): each batch shard
its own slots and pool, key/value heads over TP, FSDP's params gathered per program.

Greedy: for prompts of mixed lengths with several samples each -- more requests than one shard's
slots, so every shard decodes and refills its slots -- each completion equals the static
sampler's on the same mesh (``StepBuilder.sampler``, the prompts left-padded into one batch):
tokens equal, log-probs within 1e-5 (float32, absolute), under DP8, DP4 x TP2 and FSDP8; and
with DeepSeek-V3's experts over an expert axis, and with LoRA adapters under DP4 x TP2. Today's
caches that are not keys and values (Gated DeltaNet states, latents) decode on the mesh as on
one device.

Sampled: the engine's draws are keyed by (request, sample, token), not by where a row runs, so
the same seed gives the same tokens on every mesh and on one device. The static sampler keys a
row by its batch shard and its place in the shard's batch, so its draws and the engine's cannot
be compared token by token; they are compared in distribution instead: a first token's
frequencies over many samples against the model's own probabilities.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.modules.models.test_layer_pattern import FAMILIES
from tests.rl import helpers
from titanax.decoding.engine import DecodeEngine, Request
from titanax.modules.lora import LoRA
from titanax.modules.module import functional
from titanax.parallel.expert_parallel import EP

_RNG = np.random.default_rng(4)
# 16 prompts of 1 to 9 tokens, 40 sequences.
PROMPTS = tuple(tuple(int(t) for t in _RNG.integers(1, 16, n)) for n in
                (4, 1, 7, 2, 9, 3, 5, 2, 8, 6, 1, 4, 9, 3, 7, 5))
SAMPLES = (2, 3, 1, 4) * 4
NEW_TOKENS = 8


def _run(tmp_path, layout):
    run = helpers.engine(helpers.sums_file(tmp_path / f"sums_{layout}.jsonl"), layout=layout)
    run.init_or_restore()
    return run


def _static_greedy(run):
    """The static sampler's greedy completions: every request's prompt once per sample,
    left-padded into one batch of 40 rows."""
    rows = [p for p, g in zip(PROMPTS, SAMPLES) for _ in range(g)]
    width = max(len(p) for p in rows)
    ids = np.zeros((len(rows), width), np.int32)
    for i, prompt in enumerate(rows):
        ids[i, width - len(prompt):] = prompt
    lengths = np.asarray([len(p) for p in rows], np.int32)
    placed = run.inputs.placed({"prompt_ids": ids, "prompt_lengths": lengths})
    sample = run.steps.sampler(max_new_tokens=NEW_TOKENS)
    out = sample(run.state.params, placed["prompt_ids"], placed["prompt_lengths"],
                 jax.random.PRNGKey(0))
    return np.asarray(out["tokens"]), np.asarray(out["logps"])


@pytest.mark.parametrize("layout", sorted(helpers.LAYOUTS))
def test_greedy_completions_on_the_mesh_are_the_static_samplers(tmp_path, layout):
    run = _run(tmp_path, layout)
    tokens, logps = _static_greedy(run)
    placement = run.steps.decode_placement()
    assert placement.shards == (4 if layout == "dp_tp" else 8)
    # Four slots per shard: some of the 40 sequences wait for slots and refill them.
    engine = DecodeEngine(model=run.model, params=run.state.params, pool_tokens=64,
                          block_size=4, slots=4, chunk_steps=3, placement=placement)
    got = engine.generate([Request(prompt_ids=p, max_new_tokens=NEW_TOKENS, samples=g)
                           for p, g in zip(PROMPTS, SAMPLES)])
    row = 0
    for completions in got:
        for completion in completions:
            assert completion.tokens == tokens[row].tolist(), (row, completion.tokens)
            difference = np.abs(np.asarray(completion.logps) - logps[row]).max()
            assert difference <= 1e-5, (row, difference)
            row += 1
    assert np.abs(logps[:row]).mean() > 0.3, "log-probs this near 0 prove little"
    assert all(book.free_blocks == engine.num_blocks for book in engine.books)
    # The pools as global arrays: every shard's blocks, every key/value head.
    for pool in jax.tree_util.tree_leaves(engine.pools):
        assert pool.shape[-4:] == (engine.num_blocks * placement.shards, 4, 2, 8), pool.shape


def test_sampled_tokens_are_the_same_on_every_mesh_and_follow_the_models_distribution(
        tmp_path):
    requests = [Request(prompt_ids=p, max_new_tokens=5, samples=g, temperature=1.0,
                        top_p=0.95) for p, g in zip(PROMPTS, SAMPLES)]
    drawn = {}
    for layout in ("dp_tp", "fsdp"):
        run = _run(tmp_path, layout)
        engine = DecodeEngine(model=run.model, params=run.state.params, pool_tokens=64,
                              block_size=4, slots=4, chunk_steps=2, seed=5,
                              placement=run.steps.decode_placement())
        drawn[layout] = [[c.tokens for c in group] for group in engine.generate(requests)]
    one_device = DecodeEngine(model=run.model, params=jax.device_get(run.state.params),
                              pool_tokens=256, block_size=4, slots=16, chunk_steps=4, seed=5)
    drawn["one device"] = [[c.tokens for c in g] for g in one_device.generate(requests)]
    assert drawn["dp_tp"] == drawn["fsdp"] == drawn["one device"]
    assert any(len({tuple(t) for t in group}) > 1 for group in drawn["fsdp"])

    # In distribution: 2048 first tokens of one prompt against the model's probabilities,
    # its logits made 10x larger (a random model's are near uniform over its 16 ids).
    params = dict(run.state.params)
    params["final_norm"] = jax.tree_util.tree_map(lambda a: a * 10, params["final_norm"])
    prompt, samples = PROMPTS[2], 16
    engine = DecodeEngine(model=run.model, params=params, pool_tokens=256, block_size=4,
                          slots=samples, chunk_steps=1, seed=9,
                          placement=run.steps.decode_placement())
    counts = np.zeros(run.model.config.vocab_size)
    for _ in range(16):
        for group in engine.generate([Request(prompt_ids=prompt, max_new_tokens=1,
                                              samples=samples, temperature=1.0)] * 8):
            for completion in group:
                counts[completion.tokens[0]] += 1
    logits = functional(run.model, None, jax.device_get(params), (jnp.asarray([prompt]),),
                        method="logits", is_training=False)[0][0, -1]
    probs = np.asarray(jax.nn.softmax(logits.astype(jnp.float32)))
    total_variation = 0.5 * np.abs(counts / counts.sum() - probs).sum()
    # 2048 draws: the distance from sampling alone is ~0.026 (at most 0.045 in 200 simulated
    # runs); the same logits at temperature 0.8 are 0.13 away.
    assert total_variation < 0.07, (total_variation, counts, probs)
    assert 0.3 < probs.max() < 0.7, "a near-uniform or near-certain token proves little"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_todays_recurrent_and_latent_caches_decode_on_the_mesh_as_on_one_device(tmp_path,
                                                                                family):
    """Qwen 3.5's Gated DeltaNet states (per slot on each batch shard; value heads over TP)
    and DeepSeek-V3's latent pools under DP4 x TP2 and FSDP8: the greedy completions of one
    device's engine (itself the contiguous sampler's: tests/decoding/test_engine.py) -- tokens
    equal, log-probs within 1e-5 (float32)."""
    model = FAMILIES[family](vocab_size=16, max_seq_len=24).set(mtp_depths=0)
    requests = [Request(prompt_ids=p, max_new_tokens=NEW_TOKENS, samples=g)
                for p, g in zip(PROMPTS, SAMPLES)]
    got = {}
    for layout in ("dp_tp", "fsdp"):
        run = helpers.engine(helpers.sums_file(tmp_path / f"sums_{layout}.jsonl"), layout=layout,
                             model=model)
        run.init_or_restore()
        engine = DecodeEngine(model=run.model, params=run.state.params, pool_tokens=64,
                              block_size=4, slots=4, chunk_steps=3,
                              placement=run.steps.decode_placement())
        got[layout] = engine.generate(requests)
    one_device = DecodeEngine(model=run.model, params=jax.device_get(run.state.params),
                              pool_tokens=512, block_size=4, slots=8, chunk_steps=4)
    want = one_device.generate(requests)
    for layout, completions in got.items():
        for group, want_group in zip(completions, want):
            for completion, expected in zip(group, want_group):
                assert completion.tokens == expected.tokens, (layout, completion.tokens)
                difference = np.abs(np.asarray(completion.logps) -
                                    np.asarray(expected.logps)).max()
                assert difference <= 1e-5, (layout, difference)
    logps = np.concatenate([c.logps for g in want for c in g])
    assert np.abs(logps).mean() > 0.3, "log-probs this near 0 prove little"


def _with_trained_adapters(params):
    """``params`` with every LoRA ``B`` drawn at random (they start at zero: the adapted model
    would be the base's)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.PRNGKey(3), len(leaves))
    return jax.tree_util.tree_unflatten(tree, [
        leaf + 0.3 * jax.random.normal(key, leaf.shape, leaf.dtype)
        if jax.tree_util.keystr(path).endswith("_lora_b']") else leaf
        for (path, leaf), key in zip(leaves, keys)])


ADAPTED_AND_EXPERT_LAYOUTS = {
    # DeepSeek-V3's experts over an expert axis, its latents in blocks.
    "deepseek_v3 dp2 x ep4": dict(layout=((2, 4), ("data", "expert"), {
        "expert_parallel": EP.default_config()}), model=FAMILIES["deepseek_v3"](
            vocab_size=16, max_seq_len=24).set(mtp_depths=0)),
    # LoRA on every attention and MLP weight, the adapters of head-split weights split with
    # them over TP.
    "lora dp4 x tp2": dict(layout=helpers.LAYOUTS["dp_tp"], lora=LoRA.default_config().set(
        rank=4, alpha=8.0))}


@pytest.mark.parametrize("case", sorted(ADAPTED_AND_EXPERT_LAYOUTS))
def test_experts_over_an_expert_axis_and_lora_adapters_decode_as_the_static_sampler(
        tmp_path, case, monkeypatch):
    """Greedy, as ``test_greedy_completions_on_the_mesh_are_the_static_samplers``, for the
    layouts whose params are not a plain model's: experts split over an ``expert`` axis, and
    a LoRA run (its adapters drawn non-zero)."""
    spec = dict(ADAPTED_AND_EXPERT_LAYOUTS[case])
    monkeypatch.setitem(helpers.LAYOUTS, case, spec.pop("layout"))
    run = helpers.engine(helpers.sums_file(tmp_path / "sums.jsonl"), layout=case, **spec)
    run.init_or_restore()
    if "lora" in spec:
        base_tokens, _ = _static_greedy(run)
        run.state = run.state.replace(params=_with_trained_adapters(run.state.params))
    tokens, logps = _static_greedy(run)
    if "lora" in spec:  # The adapters change what is decoded.
        assert (tokens != base_tokens).any()
    else:  # The experts are split over the expert axis.
        specs = {str(leaf.sharding.spec) for leaf in jax.tree_util.tree_leaves(
            run.state.params["decoder"])}
        assert any("expert" in spec for spec in specs), specs
    engine = DecodeEngine(model=run.model, params=run.state.params, pool_tokens=64,
                          block_size=4, slots=4, chunk_steps=3,
                          placement=run.steps.decode_placement())
    got = engine.generate([Request(prompt_ids=p, max_new_tokens=NEW_TOKENS, samples=g)
                           for p, g in zip(PROMPTS, SAMPLES)])
    completions = [c for group in got for c in group]
    for row, completion in enumerate(completions):
        assert completion.tokens == tokens[row].tolist(), (row, completion.tokens)
        difference = np.abs(np.asarray(completion.logps) - logps[row]).max()
        assert difference <= 1e-5, (row, difference)
    assert np.abs(logps[:len(completions)]).mean() > 0.3
