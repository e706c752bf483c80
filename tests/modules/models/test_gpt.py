"""GPT-2 parity with Hugging Face, tensor-parallel parity, and the spec tree."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from titanax import errors
from titanax.modules import describe_parameter_specs, functional
from titanax.parallel import axis_binding
from titanax.modules.layers.cross_entropy import vocab_parallel_cross_entropy
from titanax.modules.models.decoder import gpt2_config, gpt_config
from titanax.hf.importer import params_from_state_dict
from titanax.parallel import collectives
from titanax.runtime.mesh import MeshSpec
from tests.modules.models import tensor_parallel_parity
from tests.numerics import assert_close, parity_floats

pytestmark = pytest.mark.usefixtures("float64_numerics")

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "gpt2_tiny_hf.npz")
TINY = dict(name="gpt", vocab_size=64, max_seq_len=16, num_layers=2, model_dim=32, num_heads=4)


@pytest.mark.usefixtures("float32_numerics")  # The stored logits are transformers' float32.
def test_logits_match_hugging_face_gpt2():
    golden = np.load(GOLDEN)
    config = {k.split("/", 1)[1]: int(golden[k]) for k in golden.files if k.startswith("config/")}
    cfg = gpt_config().set(
        name="gpt", vocab_size=config["vocab_size"], max_seq_len=config["n_positions"],
        num_layers=config["n_layer"], model_dim=config["n_embd"], num_heads=config["n_head"],
        vocab_pad_multiple=8)
    state = {k.split("/", 1)[1]: golden[k] for k in golden.files if k.startswith("state/")}
    params = jax.tree_util.tree_map(jnp.asarray, params_from_state_dict(state, cfg))
    model = cfg.instantiate()
    logits, _ = jax.jit(lambda p, ids: functional(model, None, p, (ids,), method="logits",
                                                  is_training=False))(params, golden["input_ids"])
    assert logits.shape == golden["logits"].shape
    # Hugging Face's logits were computed by torch (another order of every sum).
    assert_close(logits, golden["logits"], what="logits")


def test_converter_errors_name_the_tensor():
    """The golden's state dict has 2 layers of width 64: a third layer is missing, a width of
    32 does not fit."""
    golden = np.load(GOLDEN)
    state = {k.split("/", 1)[1]: golden[k] for k in golden.files if k.startswith("state/")}
    cfg = gpt_config().set(name="gpt", vocab_size=101, max_seq_len=32, num_layers=3,
                                   model_dim=64, num_heads=4)
    with pytest.raises(errors.HFError) as info:
        params_from_state_dict(state, cfg)
    assert "'transformer.h.2." in info.value.message and "is missing" in info.value.message
    with pytest.raises(errors.HFError) as info:
        params_from_state_dict(state, cfg.clone(num_layers=2, model_dim=32))
    assert "transformer.h.0.attn.c_proj.bias (64,) cannot make Titanax param " \
        "decoder/layer/attn/o/bias of shape (32,)" in info.value.message


@functools.lru_cache(maxsize=None)
def _reference():
    return tensor_parallel_parity.one_device(gpt_config().set(**TINY).instantiate(),
                                             vocab_size=TINY["vocab_size"])


def _tp_loss_and_grads(tp_size: int, sequence_parallel: bool):
    params, batch, _, _ = _reference()
    model = gpt_config().set(**TINY).instantiate()
    return tensor_parallel_parity.tensor_parallel(model, params, batch, tp_size=tp_size,
                                                  sequence_parallel=sequence_parallel)


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_loss_and_every_gradient_match_one_device(tp_size, sequence_parallel):
    _, _, loss, grads = _reference()
    (tp_loss, tp_grads), specs = _tp_loss_and_grads(tp_size, sequence_parallel)
    assert_close(tp_loss, loss, what="loss")
    assert_close(tp_grads, grads, what="gradients")
    # The layout really is split: every big matrix is sharded over the model axis.
    assert specs["decoder"]["layer"]["attn"]["qkv_weight"] == P(None, None, None, "model", None)
    assert specs["decoder"]["layer"]["mlp"]["down"]["weight"] == P(None, "model", None)
    assert specs["token_emb"]["weight"] == P("model", None)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_vocab_parallel_cross_entropy_matches_one_device(tp_size):
    rng = np.random.default_rng(0)
    vocab, real_vocab = 16, 13
    logits = jnp.asarray(parity_floats(rng.normal(size=(4, 5, vocab)).astype(np.float32)) * 3)
    targets = jnp.asarray(rng.integers(0, real_vocab, size=(4, 5)))

    def reference(x):
        masked = jnp.where(jnp.arange(vocab) < real_vocab, x, -jnp.inf)
        return jnp.sum(-jax.nn.log_softmax(masked)[
            jnp.arange(4)[:, None], jnp.arange(5)[None], targets])

    want, want_grad = jax.value_and_grad(reference)(logits)
    mesh = MeshSpec(axes=("data", "model"), shape=(None, tp_size)).build()

    def local(x, t):
        def loss(y):
            offset = collectives.axis_index("model") * y.shape[-1]
            return jnp.sum(vocab_parallel_cross_entropy(y, t, vocab_axis="model",
                                                        vocab_offset=offset,
                                                        vocab_size=real_vocab))
        value, grad = jax.value_and_grad(loss)(collectives.cast_varying(x, "data"))
        return collectives.pmean(value, "data"), collectives.pmean(grad, "data")

    got, got_grad = jax.jit(jax.shard_map(local, mesh=mesh,
                                          in_specs=(P(None, None, "model"), P()),
                                          out_specs=(P(), P(None, None, "model"))))(logits,
                                                                                     targets)
    assert_close(got, want, what="loss")
    assert_close(got_grad, want_grad, what="gradient")


def test_tensor_parallel_code_runs_unchanged_without_the_axis():
    params, batch, loss, _ = _reference()
    model = gpt_config().set(**TINY).instantiate()

    def run(p, b):  # The TP axis bound, and no shard_map: the layers run unsplit.
        with axis_binding.bound(tensor_parallel_parity.tp_binding(sequence_parallel=True)):
            return functional(model, None, p, (b,), is_training=False)[0][0]

    value = jax.jit(run)(params, batch)
    assert_close(value, loss, what="loss")


def test_parameter_spec_tree_prints_every_param():
    model = gpt2_config("small", vocab_pad_multiple=128).instantiate()
    with axis_binding.bound(tensor_parallel_parity.tp_binding()):
        text = describe_parameter_specs(model.create_parameter_specs_recursively())
    lines = text.splitlines()
    assert len(lines) == 16
    line = next(l for l in lines if l.startswith("decoder/layer/attn/qkv_weight"))
    assert "shape=(12, 768, 3, 12, 64)" in line and "dtype=float32" in line
    assert "mesh_axes=(None, None, None, 'model', None)" in line and "init=Normal(stddev=0.02" in line
    line = next(l for l in lines if l.startswith("token_emb/weight"))
    assert "shape=(50304, 768)" in line and "mesh_axes=('model', None)" in line
    line = next(l for l in lines if l.startswith("decoder/layer/mlp/down/bias"))
    assert "init=Constant(value=0.0)" in line and "wd_scale=0.0" in line
    total = sum(int(np.prod(s.shape)) for s in jax.tree_util.tree_leaves(
        model.create_parameter_specs_recursively(), is_leaf=lambda x: hasattr(x, "mesh_axes")))
    assert total == 124_475_904  # GPT-2 small's 124.4M params with the vocab padded to 50304.


def test_layer_rejects_a_layout_it_cannot_implement():
    model = gpt_config().set(**TINY).instantiate()
    with axis_binding.bound(tensor_parallel_parity.tp_binding()):
        specs = model.param_partition_specs()
        model.check_partition_specs(specs)
        specs["decoder"]["layer"]["mlp"]["up"]["weight"] = P(None, "model", None)  # Not column.
        with pytest.raises(errors.ShardingError) as info:
            model.check_partition_specs(specs)
    assert info.value.path == "gpt/decoder/layer/mlp/up/weight"
    assert "P(None, 'model')" in info.value.suggestion
