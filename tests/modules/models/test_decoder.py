"""The Llama / Qwen / Mistral decoder: tensor-parallel parity of the loss and every gradient
(kv heads split or kept whole, sequence parallelism), and its FLOP count."""

import functools

import pytest
from jax.sharding import PartitionSpec as P

from tests.modules.models import tensor_parallel_parity
from tests.numerics import assert_close
from titanax.modules.models.decoder import Decoder, llama_config, qwen3_config

pytestmark = pytest.mark.usefixtures("float64_numerics")

# Two shapes of the family: Llama-like (8 heads over 2 kv heads, biases, untied head, sliding
# window) and Qwen 3-like (QK-norm, head_dim apart from model_dim / heads, tied head).
SHAPES = {
    "llama": dict(num_heads=8, num_kv_heads=2, qkv_bias=True, attention_output_bias=True,
                  mlp_bias=True, sliding_window=6, tie_embeddings=False),
    "qwen3": dict(num_heads=4, num_kv_heads=2, head_dim=12, qk_norm=True, tie_embeddings=True),
}
BASE = dict(name="decoder", vocab_size=64, max_seq_len=16, num_layers=2, model_dim=32,
            hidden_dim=48, rope_theta=10000.0)


@functools.lru_cache(maxsize=None)
def _reference(shape: str):
    model = Decoder.default_config().set(**BASE, **SHAPES[shape]).instantiate()
    return tensor_parallel_parity.one_device(model, vocab_size=BASE["vocab_size"], perturb=True)


def _tp_loss_and_grads(shape: str, tp_size: int, sequence_parallel: bool):
    params, batch, _, _ = _reference(shape)
    model = Decoder.default_config().set(**BASE, **SHAPES[shape]).instantiate()
    return tensor_parallel_parity.tensor_parallel(model, params, batch, tp_size=tp_size,
                                                  sequence_parallel=sequence_parallel)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tp_size,sequence_parallel", [(2, False), (4, False), (4, True)])
def test_tensor_parallel_loss_and_every_gradient_match_one_device(shape, tp_size,
                                                                 sequence_parallel):
    _, _, loss, grads = _reference(shape)
    (tp_loss, tp_grads), specs = _tp_loss_and_grads(shape, tp_size, sequence_parallel)
    assert_close(tp_loss, loss, what="loss")
    assert_close(tp_grads, grads, what="gradients")
    attn = specs["decoder"]["layer"]["attn"]
    assert attn["q_weight"] == P(None, None, "model", None)
    kv_split = SHAPES[shape]["num_kv_heads"] % tp_size == 0
    assert tuple(attn["k_weight"]) == ((None, None, "model", None) if kv_split
                                       else (None,) * 4), attn["k_weight"]
    assert specs["decoder"]["layer"]["mlp"]["gate_up_weight"] == P(None, None, None, "model")


def test_flops_per_token_counts_what_each_token_multiplies_by():
    """Llama 3.2 1B (tied head, GQA 32/8, SwiGLU) and 8B (untied), against the published
    shapes written out by hand."""
    def expected(v, d, layers, heads, kv, f, tied, seq):
        hd = d // heads
        per_layer = 2 * d + d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * f
        multiplied = v * d + layers * per_layer + d  # head (or tied table) + layers + final norm
        return 6 * multiplied + 12 * layers * heads * hd * seq
    one_b = llama_config("3.2-1b").instantiate().flops_per_token(2048)
    eight_b = llama_config("3.1-8b").instantiate().flops_per_token(4096)
    assert one_b == expected(128256, 2048, 16, 32, 8, 8192, True, 2048)
    assert eight_b == expected(128256, 4096, 32, 32, 8, 14336, False, 4096)
    # Qwen 3's attention width is heads x 128, not model_dim.
    qwen = qwen3_config("0.6b").instantiate()
    assert qwen.attention_width() == 16 * 128 != qwen.config.model_dim


def test_a_rule_that_keeps_the_mlp_whole_under_sequence_parallelism_matches_one_device():
    """``{'mlp': None}`` under TP with sequence parallelism: the MLP runs whole on each rank's
    part of the sequence (no gather, no scatter), attention stays split by heads."""
    shape = sorted(SHAPES)[0]
    _, _, loss, grads = _reference(shape)
    params, batch, _, _ = _reference(shape)
    model = Decoder.default_config().set(**BASE, **SHAPES[shape]).instantiate()
    (tp_loss, tp_grads), specs = tensor_parallel_parity.tensor_parallel(
        model, params, batch, tp_size=2, sequence_parallel=True, logical_axis_rules={"mlp": None})
    assert_close(tp_loss, loss, what="loss")
    assert_close(tp_grads, grads, what="gradients")
    assert tuple(specs["decoder"]["layer"]["mlp"]["gate_up_weight"]) in ((), (None,) * 4)
    assert specs["decoder"]["layer"]["attn"]["q_weight"] == P(None, None, "model", None)
