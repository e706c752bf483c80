"""Stacks whose layers differ (``Decoder.Config.layer_pattern``): a pattern of alike layers is the
plain stack; windows on other layers than transformers' Qwen 3 slides give other logits;
a Gemma-3-like stack's tail trains on a pipeline's last stage like one device; LoRA on Qwen
3.5-like and DeepSeek-V3-like stacks trains alike under data x tensor and data x context
parallelism (every layout of the families' tiny experiments is checked through the launcher:
tests/test_todays_experiments.py); greedy generation over a pattern (Gated DeltaNet's state and
window cached) is the forward pass's argmax, token by token; and what a pattern cannot do yet
is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from titanax import errors
from titanax.hf import importer
from titanax.modules.layers.gated_deltanet import GatedDeltaNet
from titanax.modules.lora import DEFAULT_TARGETS, LoRA
from titanax.modules.models.decoder import Decoder
from titanax.modules.module import functional
from titanax.modules.layers.latent_attention import MultiHeadLatentAttention
from titanax.modules.layers.moe import MoE
from titanax.modules.layers.rotary import YarnRopeScaling
from titanax.parallel.plan import CP, DP, PP, TP, Plan
from tests.hf import reference_models as ref
from tests.numerics import assert_close
from tests.train import helpers

SMALL = dict(name="d", vocab_size=64, max_seq_len=32, model_dim=32, num_heads=4, num_kv_heads=2,
             hidden_dim=48)


def grouped(plain_stack, size):
    """Plain stacked params ``[L, ...]`` as a pattern of ``size``: member ``i`` holds layers
    ``i, size + i, ...`` (layer ``g * size + i`` is member ``i`` of repetition ``g``)."""
    return {str(i): jax.tree_util.tree_map(lambda a, i=i: np.asarray(a)[i::size], plain_stack)
            for i in range(size)}


def _loss(cfg, params, ids):
    return functional(cfg.instantiate(), None, params, ({"input_ids": ids, "target_ids": ids},),
                      is_training=False)[0][0]


@pytest.mark.parametrize("kind,window", [("full", None), ("sliding", 3)])
def test_a_pattern_of_alike_layers_is_the_plain_stack(kind, window, float64_numerics):
    """Four layers as a pattern of two alike kinds, params regrouped: the plain stack's loss
    (sliding with a window of 3 over 12 tokens: every layer windowed as Mistral's)."""
    del float64_numerics
    plain = Decoder.default_config().set(num_layers=4, sliding_window=window, **SMALL)
    model = plain.instantiate()
    params = jax.tree_util.tree_map(np.asarray, model.initialize_parameters_recursively(
        jax.random.PRNGKey(0)))
    pattern = plain.clone(layer_pattern=(kind, kind))
    regrouped = {**params, "decoder": {"layer": grouped(params["decoder"]["layer"], 2)}}
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)))
    assert_close(_loss(pattern, regrouped, ids), _loss(plain, params, ids), what="loss")


def test_a_depth_the_pattern_does_not_divide_ends_in_its_first_kinds(float64_numerics):
    """Five layers of the pattern (sliding, full): two repetitions, then a sliding layer after
    the stack (``decoder_tail``) -- the loss of the same five layers as one repetition of the
    whole pattern written out, params moved across."""
    del float64_numerics
    whole = Decoder.default_config().set(
        num_layers=5, layer_pattern=("sliding", "full") * 2 + ("sliding",), sliding_window=3,
        **SMALL)
    params = jax.tree_util.tree_map(np.asarray, whole.instantiate().initialize_parameters_recursively(
        jax.random.PRNGKey(0)))
    layers = params["decoder"]["layer"]
    tailed = whole.clone(layer_pattern=("sliding", "full"))
    first_two = {str(i): jax.tree_util.tree_map(
        lambda a, b: np.stack([a[0], b[0]]), layers[str(i)], layers[str(i + 2)])
        for i in range(2)}
    moved = {**params, "decoder": {"layer": first_two},
             "decoder_tail": {"0": jax.tree_util.tree_map(lambda a: a[0], layers["4"])}}
    model = tailed.instantiate()
    assert jax.tree_util.tree_structure(moved) == jax.tree_util.tree_structure(
        model.initialize_parameters_recursively(jax.random.PRNGKey(0)))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)))
    assert_close(_loss(tailed, moved, ids), _loss(whole, params, ids), what="loss")


def test_windows_on_other_layers_than_transformers_slides_give_other_logits(tmp_path):
    """The imported pattern equals transformers' logits (tests/hf/test_import.py); the same
    weights with the kinds swapped -- or no window at all -- do not: the check sees where the
    windows are."""
    directory = ref.saved_model("qwen3_sliding", tmp_path)
    imported = importer.model_config(directory)
    assert imported.layer_pattern == ("sliding", "full") and imported.sliding_window == 5
    params = importer.params_as_numpy(directory, imported)
    ids = ref.token_ids()
    expected = ref.hf_logits(directory, ids)
    for cfg in (imported, imported.clone(layer_pattern=("full", "sliding")),
                imported.clone(layer_pattern=("full", "full"), sliding_window=None)):
        logits, _ = functional(cfg.instantiate(), None, params, (ids,), method="logits",
                               is_training=False)
        matches = np.allclose(np.asarray(logits), expected, atol=1e-3 * np.abs(expected).max())
        assert matches == (cfg is imported), cfg.layer_pattern


def _qwen35_like(**changes):
    """Three Gated DeltaNet layers then a full attention, twice."""
    linear = GatedDeltaNet.default_config().set(num_key_heads=2, num_value_heads=4,
                                                key_head_dim=8, value_head_dim=8, chunk_size=8)
    return Decoder.default_config().set(
        num_layers=8, layer_pattern=("linear", "linear", "linear", "full"),
        linear_attention=linear, **{**SMALL, "max_seq_len": 16, **changes})


def _deepseek_v3_like(**changes):
    """DeepSeek-V3's switches: multi-head latent attention (low-rank queries, a latent with a
    shared RoPE key; YaRN with mscale), a dense first layer (before the stack), then experts
    chosen by sigmoid scores with a choosing bias among the best groups, scaled gates, a shared
    expert; one multi-token-prediction depth (an MoE block of its own)."""
    moe = MoE.default_config().set(hidden_dim=16, num_experts=8, top_k=2, dispatch="dropless",
                                   shared_hidden_dim=16)
    moe.router.set(scoring="sigmoid", routed_scaling=2.5, balance_rate=0.01, num_groups=4,
                   top_groups=2)
    latent = MultiHeadLatentAttention.default_config().set(
        num_heads=4, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
        v_head_dim=5)
    return Decoder.default_config().set(
        num_layers=3, first_dense_layers=1, latent_attention=latent, moe=moe, mtp_depths=1,
        rope_scaling=YarnRopeScaling.default_config().set(
            factor=4.0, original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=1.0),
        **{**SMALL, "max_seq_len": 16, **changes})


FAMILIES = {"qwen3_5": _qwen35_like, "deepseek_v3": _deepseek_v3_like}


def _engine(family, mesh_shape, axes, plan, *, lora=None, **model_changes):
    cfg = helpers.gpt_engine(data=1, learner=helpers.sgd(0.5)).config.clone()
    cfg.model = FAMILIES[family](vocab_size=256).set(**model_changes)  # (text_batches: bytes.)
    cfg.mesh = helpers.mesh(mesh_shape, axes, devices=list(range(int(np.prod(mesh_shape)))))
    cfg.plan = plan
    cfg.lora = lora
    return cfg.instantiate()


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_lora_on_todays_attention_trains_alike_under_tp_and_cp(family, float64_numerics):
    """LoRA on every weight Gated DeltaNet and latent attention adapt (and the stacks' other
    projections): three steps under data x TP (the adapters of head-split weights split with
    them) and data x context (the latent attention's adapters on the gathered row) equal one
    device's."""
    del float64_numerics
    adapters = LoRA.default_config().set(rank=4, alpha=8.0, targets=(
        *DEFAULT_TARGETS, *[r"(^|/)attn/(z|a|b)_weight$"] * (family == "qwen3_5")))
    layouts = {
        "dp4 x tp2": ((4, 2), ("data", "model"), Plan.default_config().set(
            data_parallel=DP.default_config(), tensor_parallel=TP.default_config())),
        "dp2 x cp4": ((2, 4), ("data", "context"), Plan.default_config().set(
            data_parallel=DP.default_config(), context_parallel=CP.default_config().set(
                axis="context")))}
    batches = helpers.text_batches(batch_size=8, seq_len=16, count=3)
    changes = dict(mtp_depths=0)  # (Context parallelism takes no MTP depth.)
    runs = {"one device": _engine(family, (1,), ("data",), Plan.default_config().set(
        data_parallel=DP.default_config()), lora=adapters, **changes)}
    runs.update({name: _engine(family, *layout, lora=adapters, **changes)
                 for name, layout in layouts.items()})
    results = {name: helpers.train(engine, batches) for name, engine in runs.items()}
    want_losses, want_params = results.pop("one device")
    moved = {k for k, v in helpers.flat(want_params).items()
             if k.endswith("_lora_b") and np.abs(v).max() > 0}
    assert any("attn" in k for k in moved), moved  # The adapters trained.
    for name, (losses, params) in results.items():
        assert_close(losses, want_losses, what=f"{family} LoRA {name} losses")
        assert_close(params, want_params, what=f"{family} LoRA {name} params")


def _greedy_by_forward(model, params, prompt, tokens):
    """The argmax of the whole forward pass over the prompt and the generated ``tokens`` at the
    positions that chose each of them: by causality, the forward pass over each one's prefix --
    no cache, one program instead of one per length."""
    sequence = jnp.concatenate([prompt, jnp.asarray(tokens[:, :-1])], axis=1)
    logits, _ = jax.jit(lambda params, sequence: functional(
        model, None, params, (sequence,), method="logits", is_training=False))(params, sequence)
    return np.asarray(jnp.argmax(logits[:, prompt.shape[1] - 1:], axis=-1))


@pytest.mark.parametrize("pattern", ["sliding-full", "sliding-full-tail", "linear-x3-full",
                                     "latent"])
def test_greedy_generation_over_a_pattern_is_the_forwards_argmax(pattern):
    """Each greedy token -- from a key/value cache per attention member, a convolution window
    and recurrent state per Gated DeltaNet member -- is the argmax of the whole forward pass
    over the prompt and the tokens before it (an independent computation); and prompts
    left-padded to one length generate what each does unpadded (row 1 alone, row 0 beside
    it)."""
    cfg = (Decoder.default_config().set(num_layers=5 if pattern.endswith("tail") else 4,
                                        layer_pattern=("sliding", "full"), sliding_window=3,
                                        **SMALL)
           if pattern.startswith("sliding") else _deepseek_v3_like(max_seq_len=32)
           if pattern == "latent" else _qwen35_like(max_seq_len=32))
    model = cfg.instantiate()
    params = jax.jit(model.initialize_parameters_recursively)(jax.random.PRNGKey(1))
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 9)))

    @jax.jit  # (One program per prompt shape; op by op, the decoding loop's prefill dispatches
    def generated(prompt_ids, prompt_lengths):  # hundreds of operations.)
        tokens, _ = functional(model, None, params, {"prompt_ids": prompt_ids, "key": None,
                                                     "max_new_tokens": 6,
                                                     "prompt_lengths": prompt_lengths},
                               method="generate", is_training=False)
        return tokens

    def generate(prompt_ids, prompt_lengths=None):
        return np.asarray(generated(prompt_ids, prompt_lengths))

    greedy = generate(prompt)
    np.testing.assert_array_equal(greedy, _greedy_by_forward(model, params, prompt, greedy))
    short = prompt[1:, 4:]  # Row 1's last 5 tokens, alone and left-padded beside row 0.
    padded = jnp.concatenate([prompt[:1], jnp.pad(short, [(0, 0), (4, 0)])], axis=0)
    together = generate(padded, jnp.asarray([9, 5]))
    np.testing.assert_array_equal(together[1], generate(short)[0])
    # Row 0 as it generated beside row 1 unpadded (itself checked against the forward pass).
    np.testing.assert_array_equal(together[0], greedy[0])


def test_what_a_pattern_cannot_do_yet_is_refused_by_name():
    with pytest.raises(errors.ConfigValidationError, match="num_layers"):
        Decoder.default_config().set(num_layers=3, layer_pattern=("sliding", "full", "full", "full"),
                                     sliding_window=3, **SMALL).instantiate()
    with pytest.raises(errors.ConfigValidationError, match="sliding_window"):
        Decoder.default_config().set(num_layers=4, layer_pattern=("sliding", "full"),
                                     **SMALL).instantiate()
    with pytest.raises(errors.ConfigValidationError, match="linear_attention"):
        Decoder.default_config().set(num_layers=4, layer_pattern=("linear", "full"),
                                     **SMALL).instantiate()
    one_repetition = _engine("qwen3_5", (4, 2), ("data", "pipe"), Plan.default_config().set(
        data_parallel=DP.default_config(), pipeline_parallel=PP.default_config()), num_layers=4)
    with pytest.raises(errors.PlanError, match="one per repetition") as info:  # (Nothing to cut.)
        one_repetition.build()
    assert info.value.path == "model.num_layers", info.value.path
    from titanax.hf.model_configs import hf_config_from_model  # pylint: disable=import-outside-toplevel
    with pytest.raises(errors.HFError, match="qwen3_5_text has norm_zero_centered=True"):
        hf_config_from_model(_qwen35_like())
