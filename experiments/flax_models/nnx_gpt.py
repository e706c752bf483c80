"""The NNX GPT of the ``flax_nnx_gpt_dp`` experiment (``experiments/flax_nnx.py``): plain Flax NNX,
nothing of Titanax in it."""

import jax
import jax.numpy as jnp
from flax import nnx

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
