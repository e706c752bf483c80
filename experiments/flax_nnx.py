"""A GPT written in Flax NNX, trained by Titanax through the ``FlaxNNX`` adapter.

The decoder below is plain Flax NNX -- nothing of Titanax in it -- the way a user brings their
own model: pre-LayerNorm blocks (causal self-attention, a GELU MLP), learned token and position
embeddings, the LM head tied to the token table. Its layers are stacked at construction
(``nnx.vmap``) and run by ``nnx.scan``, so FSDP gathers them one layer at a time; with
``scan_layers=False`` they are an ``nnx.List`` run one after another (what a pipeline of explicit
stages splits, with ``tie_embeddings=False`` so that each stage owns its table). Params name
their dimensions (``embed``, ``mlp``, ``heads``, ``vocab``, ``layers``) with
``nnx.with_partitioning``; the plan's ``logical_axis_rules`` map them to mesh axes.

* ``flax_nnx_gpt_dp``: the 4-layer, 128-wide NNX GPT on byte-level Shakespeare, data parallel
  over every device. ``--config.plan.zero.stage=1|2|3`` shards its optimizer state, gradients
  and params as for Titanax's own models (the rules put the ZeRO split on ``embed``).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from titanax.config import checked_by, config_for_function, register_experiment
from titanax.config import value_checks as check
from titanax.modules.adapters.flax_nnx import FlaxNNX
from titanax.modules.adapters.objectives import CausalLMLoss

from .language_runs import language_model_run

_INIT = nnx.initializers.normal(0.02)


def _named(*names):
    """The normal(0.02) initializer, with the param's dimensions named."""
    return nnx.with_partitioning(_INIT, names)


class CausalSelfAttention(nnx.Module):
    def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.qkv = nnx.Linear(dim, 3 * dim, kernel_init=_named("embed", "heads"), rngs=rngs)
        self.out = nnx.Linear(dim, dim, kernel_init=_named("heads", "embed"), rngs=rngs)

    def __call__(self, x):
        batch, length, dim = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(batch, length, 3 * self.num_heads, -1), 3,
                            axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(x.dtype)
        causal = jnp.tril(jnp.ones((length, length), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(scores.dtype).min), axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, length, dim))


class Block(nnx.Module):
    def __init__(self, dim: int, num_heads: int, dropout_rate: float, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = CausalSelfAttention(dim, num_heads, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
        self.fc_in = nnx.Linear(dim, 4 * dim, kernel_init=_named("embed", "mlp"), rngs=rngs)
        self.fc_out = nnx.Linear(4 * dim, dim, kernel_init=_named("mlp", "embed"), rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(self, x):
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.fc_out(jax.nn.gelu(self.fc_in(self.ln2(x)))))


class GPT(nnx.Module):
    """``GPT(...)(input_ids)`` is the next-token logits ``[batch, seq, vocab_size]``."""

    def __init__(self, *, vocab_size: int, max_seq_len: int, num_layers: int, model_dim: int,
                 num_heads: int, dropout_rate: float, scan_layers: bool, tie_embeddings: bool,
                 rngs: nnx.Rngs):
        self.scan_layers = scan_layers
        self.tok_emb = nnx.Embed(vocab_size, model_dim, embedding_init=_named("vocab", "embed"),
                                 rngs=rngs)
        self.pos_emb = nnx.Embed(max_seq_len, model_dim, embedding_init=_named(None, "embed"),
                                 rngs=rngs)

        def block(rngs):
            return Block(model_dim, num_heads, dropout_rate, rngs=rngs)

        if scan_layers:
            stacked = nnx.vmap(block, in_axes=(0,), out_axes=0,
                               transform_metadata={nnx.PARTITION_NAME: "layers"})
            self.blocks = nnx.split_rngs(splits=num_layers)(stacked)(rngs)
        else:
            self.blocks = nnx.List([block(rngs) for _ in range(num_layers)])
        self.ln_f = nnx.LayerNorm(model_dim, rngs=rngs)
        # Untied, the head is a param of its own (pipeline stages each own theirs).
        self.lm_head = None if tie_embeddings else nnx.Linear(
            model_dim, vocab_size, use_bias=False, kernel_init=_named("embed", "vocab"),
            rngs=rngs)

    def embed(self, input_ids):
        return self.tok_emb(input_ids) + self.pos_emb(jnp.arange(input_ids.shape[1]))

    def head(self, x):
        x = self.ln_f(x)
        return self.tok_emb.attend(x) if self.lm_head is None else self.lm_head(x)

    def __call__(self, input_ids):
        x = self.embed(input_ids)
        if self.scan_layers:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def run(x, block):
                return block(x)

            x = run(x, self.blocks)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(x)


def _gpt_sizes(*, vocab_size=256, max_seq_len=64, num_layers=4, model_dim=128, num_heads=4,
               dropout_rate=0.0, **_):
    """The factory's arguments, checked where the config is validated (named by path)."""
    for name, value in (("vocab_size", vocab_size), ("max_seq_len", max_seq_len),
                        ("num_layers", num_layers), ("model_dim", model_dim),
                        ("num_heads", num_heads)):
        yield from check.at_least(name, value, 1)
    yield from check.fraction("dropout_rate", dropout_rate)
    if isinstance(model_dim, int) and isinstance(num_heads, int) and num_heads >= 1 and \
            model_dim % num_heads:
        yield "num_heads", f"must divide model_dim={model_dim}, got {num_heads}"


@checked_by(_gpt_sizes)
def make_gpt(*, vocab_size: int = 256, max_seq_len: int = 64, num_layers: int = 4,
             model_dim: int = 128, num_heads: int = 4, dropout_rate: float = 0.0,
             scan_layers: bool = True, tie_embeddings: bool = True, rngs: nnx.Rngs) -> GPT:
    """The factory the adapter calls (it passes ``rngs``, seeded with the run's init key)."""
    return GPT(vocab_size=vocab_size, max_seq_len=max_seq_len, num_layers=num_layers,
               model_dim=model_dim, num_heads=num_heads, dropout_rate=dropout_rate,
               scan_layers=scan_layers, tie_embeddings=tie_embeddings, rngs=rngs)


def nnx_gpt(*, seq_len: int = 64, **sizes) -> FlaxNNX.Config:
    """The adapted NNX GPT: logits trained on the next byte."""
    factory = config_for_function(make_gpt).set(max_seq_len=seq_len, **sizes)
    return FlaxNNX.default_config().set(
        name="nnx_gpt", module=factory, inputs=("input_ids",),
        example_inputs={"input_ids": f"int32[2,{seq_len}]"},
        loss=CausalLMLoss.default_config().set(vocab_size=factory.vocab_size,
                                               max_seq_len=seq_len))


@register_experiment
def flax_nnx_gpt_dp():
    """A 4-layer NNX GPT (written in Flax, adapted by FlaxNNX) on Shakespeare, data parallel."""
    cfg = language_model_run(model=nnx_gpt(), tp_axis=None, seq_len=64, batch_size=16,
                             steps=1000, peak_lr=2e-3, eval_batches=50)
    cfg.plan.logical_axis_rules = {"embed": "data", "mlp": None, "heads": None, "vocab": None,
                                   "layers": None}
    cfg.checkpoint.save_every_n_steps = 250
    return cfg
