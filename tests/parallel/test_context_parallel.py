"""Context parallelism (the sequence split over a mesh axis) against one device.

SGD with momentum on every param and the per-step losses, on batches whose rows train on
different numbers of tokens (so each rank's share of a row holds another count: the loss must
be token-weighted across the context axis too); packed rows (segment ids, per-document
positions); RoPE (the decoder) and learned positions (GPT); every composition with the other plan
parts.
"""

import functools

import jax
import numpy as np
import pytest

from tests.numerics import assert_close
from tests.train import helpers
from tests.train.test_decoder_training import MODEL, _packed
from titanax import errors
from titanax.modules.layers.latent_attention import MultiHeadLatentAttention
from titanax.modules.models.decoder import Decoder
from titanax.modules.models.decoder import gpt_config
from titanax.parallel.context_parallel import CP, causal_work, dual_chunk_order
from titanax.parallel.plan import DP, PP, TP, Plan, ZeRO
from titanax.train.engine import Engine

pytestmark = pytest.mark.usefixtures("float64_numerics")

BATCHES = helpers.text_batches(batch_size=8, count=2, uneven=True)
GPT_MODEL = dict(name="gpt", vocab_size=256, max_seq_len=16, num_layers=2, model_dim=32,
                 num_heads=4)
# DeepSeek-V3's multi-head latent attention in place of the decoder's (model "latent").
LATENT = MultiHeadLatentAttention.default_config().set(
    num_heads=4, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
    v_head_dim=5)


def _learner():
    learner = helpers.sgd(0.5)
    learner.optimizer.momentum = 0.9
    return learner


def _engine(model: str, sizes=None, *, strategy="all_gather", load_balance="dual_chunk",
            tp=False, pipe=None, fsdp=False, **model_changes):
    sizes = sizes or {"data": 1}
    axes, shape = tuple(sizes), tuple(sizes.values())
    plan = Plan.default_config().set(
        data_parallel=DP.default_config(),
        context_parallel=(CP.default_config().set(strategy=strategy, load_balance=load_balance)
                          if "context" in sizes else None),
        tensor_parallel=TP.default_config() if tp else None,
        pipeline_parallel=(PP.default_config().set(microbatch_size=2, schedule=pipe)
                           if pipe else None),
        zero=(ZeRO.default_config().set(stage=3, min_shard_size=64,
                                        grad_sync="per_microbatch") if fsdp else None))
    network = {"decoder": lambda: Decoder.default_config().set(**MODEL),
               "latent": lambda: Decoder.default_config().set(**{
                   **MODEL, "qkv_bias": False, "attention_output_bias": False,
                   "latent_attention": LATENT}),
               "gpt": lambda: gpt_config().set(**GPT_MODEL)}[model]().set(**model_changes)
    cfg = Engine.default_config().set(
        mesh=helpers.mesh(shape, axes, devices=list(range(int(np.prod(shape))))), plan=plan,
        model=network, learner=_learner(), loggers=[], log_every=1000,
        precision=helpers.test_precision())
    return cfg.instantiate()


@functools.lru_cache(maxsize=None)
def _one_device(model: str, packed: bool):
    return helpers.train(_engine(model), _batches(packed))


@functools.lru_cache(maxsize=None)
def _batches(packed: bool):
    return tuple(_packed(BATCHES) if packed else BATCHES)


def _assert_trains_like_one_device(engine, model, packed):
    want_losses, want_params = _one_device(model, packed)
    losses, params = helpers.train(engine, _batches(packed))
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params after 2 SGD-momentum steps")


STRATEGIES = ["all_gather", "ring", "ulysses"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model,packed,sizes,load_balance", [
    ("decoder", True, {"data": 2, "context": 4}, "dual_chunk"),
    ("gpt", False, {"data": 1, "context": 2}, "none"),
    ("decoder", False, {"data": 1, "context": 8}, "dual_chunk"),
], ids=["decoder-packed-dp2-cp4", "gpt-rows-cp2-unbalanced", "decoder-rows-cp8"])
def test_context_parallel_trains_like_one_device(strategy, model, packed, sizes, load_balance):
    """(Ulysses at CP=8 repeats the decoder's 2 kv heads to its 8 query heads first.)"""
    engine = _engine(model, sizes, strategy=strategy, load_balance=load_balance)
    _assert_trains_like_one_device(engine, model, packed)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_latent_attention_under_context_parallelism_trains_like_one_device(strategy):
    """DeepSeek-V3's attention on packed rows, data 2 x context 4: the all-gather strategy
    gathers each token's latent and RoPE key and expands the row's keys and values on every
    rank; the ring and Ulysses carry the expanded ones."""
    engine = _engine("latent", {"data": 2, "context": 4}, strategy=strategy)
    _assert_trains_like_one_device(engine, "latent", True)


@pytest.mark.parametrize("strategy,blockwise,tp", [
    ("all_gather", False, False), ("ulysses", False, False), ("all_gather", True, False),
    ("ulysses", True, False), ("ulysses", False, True)],
    ids=["all_gather", "ulysses", "all_gather-blockwise", "ulysses-blockwise", "ulysses-tp2"])
def test_attention_sinks_under_context_parallelism_train_like_one_device(strategy, blockwise, tp,
                                                                         monkeypatch):
    """gpt-oss's per-head sinks join each query's softmax over the whole row once: under
    Ulysses each rank's heads take their own sinks (under TP too: of the model rank's heads);
    written out and blockwise (from 1 key on, in 2-token tiles). Packed rows, dp2 x cp4 (tp2 x
    cp4), each head's sink its own from the start."""
    from titanax.modules.layers import context_attention  # pylint: disable=import-outside-toplevel
    one = _engine("decoder", attention_sinks=True)
    start = jax.tree_util.tree_map_with_path(  # (They start at 0: every head's the same.)
        lambda path, x: np.linspace(-2.0, 3.0, x.size).reshape(x.shape)
        if jax.tree_util.keystr(path).endswith("['sinks']") else x,
        jax.device_get(one.init_state().params))
    assert any(k.endswith("sinks") for k in helpers.flat(start))
    one.init_state(params=start)
    if blockwise:
        monkeypatch.setattr(context_attention, "BLOCKWISE_FROM", 1)
        monkeypatch.setattr(context_attention, "RING_TILE", 2)
    sizes = {"data": 1, "context": 4, "model": 2} if tp else {"data": 2, "context": 4}
    engine = _engine("decoder", sizes, strategy=strategy, tp=tp, attention_sinks=True)
    engine.init_state(params=start)
    want_losses, want_params = helpers.train(one, _batches(True))
    losses, params = helpers.train(engine, _batches(True))
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params after 2 SGD-momentum steps")
    ring = _engine("decoder", {"data": 2, "context": 4}, strategy="ring",
                   attention_sinks=True)
    with pytest.raises(errors.PlanError, match="sinks under the ring") as raised:
        ring.build()
    assert raised.value.path == "plan.context_parallel.strategy"


@pytest.mark.parametrize("case,strategy", [
    (case, strategy) for case in ("tp", "fsdp", "1f1b", "gpipe") for strategy in STRATEGIES
    if (case, strategy) != ("1f1b", "ring")])  # Refused: see the refusals below.
def test_context_parallel_composes_with_the_other_plan_parts(case, strategy):
    """TP x CP (heads over model, sequence over context; Ulysses splits the 4 local heads over
    context), FSDP x CP (params gathered per layer over data), PP x CP (each stage's attention
    talks over context inside the schedule)."""
    sizes = {"tp": {"data": 1, "context": 4, "model": 2}, "fsdp": {"data": 2, "context": 4},
             "1f1b": {"data": 1, "pipe": 2, "context": 4},
             "gpipe": {"data": 1, "pipe": 2, "context": 4}}[case]
    engine = _engine("decoder", sizes, strategy=strategy, tp=case == "tp", fsdp=case == "fsdp",
                     pipe=case if case in ("1f1b", "gpipe") else None)
    _assert_trains_like_one_device(engine, "decoder", packed=True)


def test_dual_chunk_gives_every_rank_the_same_causal_work():
    """From the schedule: with contiguous chunks the last of 8 ranks computes 15x the first's
    (query, key) pairs; with dual chunks every rank the same, within 5% (here exactly)."""
    assert sorted(dual_chunk_order(16, 4).tolist()) == list(range(16))
    assert dual_chunk_order(16, 4)[:4].tolist() == [0, 1, 14, 15]  # Rank 0: chunks 0 and 7.
    for length, size in ((1024, 2), (4096, 4), (32768, 8)):
        plain = causal_work(length, size, load_balance="none")
        balanced = causal_work(length, size, load_balance="dual_chunk")
        assert plain.sum() == balanced.sum() == length * (length + 1) // 2
        assert balanced.max() / balanced.min() <= 1.05
        assert plain.max() / plain.min() > 2 * size - 1.5


def test_what_context_parallelism_cannot_split_is_refused():
    engine = _engine("decoder", {"data": 1, "context": 4})
    short = {k: v[:, :12] for k, v in BATCHES[0].items()}  # 12 tokens: not 8 chunks.
    with pytest.raises(errors.PlanError, match="do not split into 8 equal chunks") as info:
        helpers.train(engine, [short])
    assert info.value.path == "plan.context_parallel.axis"
    cfg = _engine("gpt").config.clone()
    cfg.mesh = helpers.mesh((1, 2), ("data", "context"), devices=[0, 1])
    cfg.plan.context_parallel = CP.default_config()
    cfg.model.attention_dropout_rate = 0.1
    with pytest.raises(errors.PlanError, match="attention dropout") as info:
        cfg.instantiate().build()
    assert info.value.path == "model.attention_dropout_rate"
    cfg.model.attention_dropout_rate = 0.0
    cfg.model.attention_implementation = "blockwise"  # (The split attention has its own.)
    with pytest.raises(errors.PlanError, match="would be ignored") as info:
        cfg.instantiate().build()
    assert info.value.path == "model.attention_implementation"
    gpt = _engine("gpt", {"data": 1, "context": 8}, strategy="ulysses")  # 4 heads, 8 ranks.
    with pytest.raises(errors.PlanError, match="4 attention heads of each rank over the 8"):
        helpers.train(gpt, BATCHES[:1])


@functools.lru_cache(maxsize=None)
def _collectives(strategy: str):
    """The compiled step's collectives: decoder (its 2 layers in a scan), DP 2 x CP 4, packed."""
    cfg = _engine("decoder", {"data": 2, "context": 4}, strategy=strategy).config.clone()
    cfg.model.unroll_layers = False
    engine = cfg.instantiate()
    engine.init_state()
    engine.compile(example_batch=_batches(True)[0])
    return engine.collectives()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_attention_alone_talks_over_context_and_the_gradients_cross_data_x_context_once(
        strategy):
    """Inside the layer loop only context-axis collectives of the attention, as many as the
    strategy needs per layer: one all-gather of K and V forward and one reduce-scatter of their
    gradients backward; a ring of C-1 shifts of K and V forward and C of K, V and their
    gradients backward (the last: the gradients only); four all-to-alls each way (q, k, v, out).
    (Positions and segment ids are the same for every layer: XLA moves their collectives out of
    the loop.) After it, one all-reduce over data x context for every gradient."""
    ops = _collectives(strategy)
    in_loop = [op for op in ops if op.in_loop]
    assert in_loop and all(op.axes == ("context",) and op.layer.endswith("attn")
                           for op in in_loop), [(op.op, op.axes, op.layer) for op in in_loop]
    kinds = sorted((op.op, op.pass_name) for op in in_loop)
    size = 4
    want = {"all_gather": [("all-gather", "forward"), ("reduce-scatter", "backward")],
            "ring": sorted([("collective-permute", "forward")] * 2 * (size - 1)
                           + [("collective-permute", "backward")] * (4 * (size - 1) + 2)),
            "ulysses": sorted([("all-to-all", "forward")] * 4
                              + [("all-to-all", "backward")] * 4)}[strategy]
    assert kinds == want
    reductions = [op for op in ops if op.layer == "gradient_reduction"]
    assert [(op.op, op.axes) for op in reductions] == [("all-reduce", ("data", "context"))]
    assert not any("data" in op.axes for op in in_loop)


def test_the_model_runs_whole_rows_outside_the_train_step():
    """model_method (logits for import checks and fine-tuning) feeds whole rows, the same on
    every context rank: the model runs them without context parallelism, as on one device."""
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    ids = jnp.asarray(BATCHES[0]["input_ids"][:2])
    one = _engine("decoder")
    one.init_state()
    want = one.steps.model_method("logits")(one.state.params, ids)
    split = _engine("decoder", {"data": 2, "context": 4}, strategy="ring")
    split.init_state()
    got = split.steps.model_method("logits")(split.state.params, ids)
    assert_close(np.asarray(got), np.asarray(want), what="logits")


def test_what_context_parallelism_refuses_before_the_first_step():
    from titanax.data.pipeline import Input  # pylint: disable=import-outside-toplevel
    from titanax.data.sources import TextWindows  # pylint: disable=import-outside-toplevel
    from titanax.train.evaler import Evaler  # pylint: disable=import-outside-toplevel
    with pytest.raises(errors.TitanaxError, match="plan.context_parallel.strategy: the ring's"):
        _engine("decoder", {"data": 1, "pipe": 2, "context": 4}, strategy="ring", pipe="1f1b")
    cfg = _engine("decoder", {"data": 2, "context": 4}).config.clone()
    cfg.plan.data_parallel.sync_metrics = False
    with pytest.raises(errors.TitanaxError,
                       match="plan.data_parallel.sync_metrics: reports one data shard"):
        cfg.instantiate()
    text = lambda length: Input.default_config().set(  # noqa: E731
        source=TextWindows.default_config().set(seq_len=length), global_batch_size=8)
    cfg = _engine("decoder", {"data": 2, "context": 4}).config.clone()
    cfg.set(train_input=text(16), max_steps=1,
            evalers={"short": Evaler.default_config().set(input=text(12), every_n_steps=1)})
    engine = cfg.instantiate()
    with pytest.raises(errors.PlanError, match="rows of 12 tokens do not split into the 8") as info:
        engine.fit()
    assert info.value.path == "evalers['short'].input.source.seq_len"
    assert engine.state is None  # Nothing was spent on training.


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_sliding_window_is_the_window_of_each_tokens_position(strategy):
    """Mistral's window (5 positions) across ranks and dual chunks: the mask follows positions."""
    want_losses, want_params = helpers.train(_engine("decoder", sliding_window=5), BATCHES)
    engine = _engine("decoder", {"data": 1, "context": 4}, strategy=strategy, sliding_window=5)
    losses, params = helpers.train(engine, BATCHES)
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params")


def test_the_host_reorders_each_row_into_dual_chunks():
    """Rank r's quarter of a 16-token row holds tokens 2r, 2r+1, 14-2r, 15-2r; every per-token
    array moves alike, per-row ones not at all."""
    batch = {"input_ids": np.arange(32).reshape(2, 16), "target_ids": np.arange(32).reshape(2, 16),
             "weights": np.ones(2, np.float32)}
    prepared = CP.default_config().instantiate().prepare(batch, size=4)
    order = [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert prepared["positions"][1].tolist() == order
    assert prepared["input_ids"][1].tolist() == [16 + i for i in order]
    assert prepared["weights"].tolist() == [1.0, 1.0] and "positions" not in batch
    plain = CP.default_config().set(load_balance="none").instantiate().prepare(batch, size=4)
    assert plain["positions"][0].tolist() == list(range(16))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_tokens_loss_is_its_loss_on_one_device(strategy):
    """Token by token (a weight of 1 on one token of a packed batch, 0 elsewhere), the
    evaluation loss on DP 2 x CP 4 is that token's loss on one device."""
    batch = dict(_batches(True)[0])
    one = _engine("decoder")
    one.init_state()
    split = _engine("decoder", {"data": 2, "context": 4}, strategy=strategy)
    split.init_state()
    want, got = [], []
    for row, position in [(0, p) for p in range(16)] + [(5, 3), (7, 15)]:
        weights = np.zeros(batch["input_ids"].shape, np.float32)
        weights[row, position] = 1.0
        single = dict(batch, weights=weights)
        want.append(one.eval(data=[single])["loss"])
        got.append(split.eval(data=[single])["loss"])
    assert_close(got, want, what="per-token losses", scale="leaf")
    assert len(set(np.round(want, 4))) > 10  # The tokens' losses differ: the check can fail.


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_the_ring_folds_each_visiting_block_in_tiles_like_one_device(monkeypatch, sliding_window):
    """Ring tiles shorter than a rank's chunk (2-token tiles of 4-token chunks, dual-chunk order,
    packed documents): each visiting block is folded tile by tile, the tiles no local query sees
    skipped, forward and backward -- as one device computes it."""
    from titanax.modules.layers import context_attention  # pylint: disable=import-outside-toplevel
    want_losses, want_params = helpers.train(_engine("decoder", sliding_window=sliding_window),
                                             _batches(True))
    monkeypatch.setattr(context_attention, "RING_TILE", 2)
    engine = _engine("decoder", {"data": 1, "context": 4}, strategy="ring",
                     sliding_window=sliding_window)
    losses, params = helpers.train(engine, _batches(True))
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params")


@pytest.mark.parametrize("strategy", ["all_gather", "ulysses"])
def test_gathered_rows_attend_blockwise_like_one_device(monkeypatch, strategy):
    """All-gather and Ulysses attend over whole rows blockwise from BLOCKWISE_FROM keys on
    (here from 1, in 2-token tiles: the rows' dual-chunk positions and packed documents decide
    which tiles are visited)."""
    from titanax.modules.layers import context_attention  # pylint: disable=import-outside-toplevel
    want_losses, want_params = helpers.train(_engine("decoder", sliding_window=3),
                                             _batches(True))
    monkeypatch.setattr(context_attention, "BLOCKWISE_FROM", 1)
    monkeypatch.setattr(context_attention, "RING_TILE", 2)
    engine = _engine("decoder", {"data": 1, "context": 4}, strategy=strategy, sliding_window=3)
    losses, params = helpers.train(engine, _batches(True))
    assert_close(losses, want_losses, what="losses")
    assert_close(params, want_params, what="params")
