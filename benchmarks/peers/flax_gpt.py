"""GPT-2 in Flax NNX under plain ``jax.jit`` with NamedSharding: the way a MaxText-style user
writes data x tensor parallelism, letting GSPMD choose every collective.

Written from scratch (no Titanax code) so the Titanax Engine step can be timed against a peer that
shares nothing with it. Same maths as Titanax's GPT: learned token + position embeddings, pre-LN
blocks (LayerNorm eps 1e-5, GELU tanh, fused QKV), final LayerNorm, LM head tied to the token
table, padding ids masked out of the softmax, loss = mean token cross-entropy.

Layout (Megatron, by annotation only; GSPMD inserts the collectives):

* QKV kernel ``[D, 3, H, Dh]`` and MLP up-projection ``[D, F]`` split over 'model' on heads / F
  (column-parallel); attention out-projection ``[H, Dh, D]`` and MLP down-projection ``[F, D]``
  split on their input side (row-parallel).
* Token table ``[V, D]`` split over 'model' on the vocabulary, as in Titanax, so the tied LM head
  yields vocabulary-split logits; position table and norms replicated.
* Batch rows split over 'data'; the residual stream is constrained to that layout between blocks.
* Layers are stacked ``[L, ...]`` (``nnx.vmap`` at construction) and run by ``nnx.scan``.

Gradient accumulation: the batch is cut into K microbatches (strided rows, so every microbatch
keeps its 'data' split without moving data) and ``lax.scan`` sums their gradients; reductions
are left to GSPMD. On jax 0.10.2 GSPMD puts the data-axis gradient all-reduce *inside* that loop
(K per step, where an explicit shard_map step has one): that is the real cost of this style, and
part of what a benchmark against it measures. Compute dtype f32 or bf16, params and optimizer f32.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.peers import common, convert

_INIT = nnx.initializers.normal(0.02)
_ZEROS = nnx.initializers.zeros_init()


def _split(init, *axes):
    return nnx.with_partitioning(init, axes)


class Attention(nnx.Module):
    def __init__(self, sizes: common.GPTSizes, *, dtype, rngs: nnx.Rngs):
        heads, head_dim, dim = sizes.num_heads, sizes.head_dim, sizes.model_dim
        self.qkv = nnx.LinearGeneral(
            dim, (3, heads, head_dim), dtype=dtype, rngs=rngs,
            kernel_init=_split(_INIT, None, None, common.MODEL, None),
            bias_init=_split(_ZEROS, None, common.MODEL, None))
        self.out = nnx.LinearGeneral(
            (heads, head_dim), dim, axis=(-2, -1), dtype=dtype, rngs=rngs,
            kernel_init=_split(_INIT, common.MODEL, None, None), bias_init=_split(_ZEROS, None))
        self.scale = head_dim ** -0.5

    def __call__(self, x):
        qkv = self.qkv(x)  # [batch, seq, 3, heads, head_dim]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * self.scale
        length = x.shape[1]
        causal = jnp.tril(jnp.ones((length, length), bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v))


class Block(nnx.Module):
    def __init__(self, sizes: common.GPTSizes, *, dtype, rngs: nnx.Rngs):
        norm = dict(epsilon=sizes.norm_eps, use_fast_variance=False, dtype=dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(sizes.model_dim, **norm)
        self.attn = Attention(sizes, dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(sizes.model_dim, **norm)
        self.fc_in = nnx.Linear(sizes.model_dim, sizes.hidden_dim, dtype=dtype, rngs=rngs,
                                kernel_init=_split(_INIT, None, common.MODEL),
                                bias_init=_split(_ZEROS, common.MODEL))
        self.fc_out = nnx.Linear(sizes.hidden_dim, sizes.model_dim, dtype=dtype, rngs=rngs,
                                 kernel_init=_split(_INIT, common.MODEL, None),
                                 bias_init=_split(_ZEROS, None))

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc_out(jax.nn.gelu(self.fc_in(self.ln2(x)), approximate=True))


class GPT(nnx.Module):
    """``GPT(...)(input_ids, target_ids)`` is the mean token cross-entropy."""

    def __init__(self, sizes: common.GPTSizes, *, dtype=jnp.float32,
                 residual_sharding: Optional[NamedSharding] = None, rngs: nnx.Rngs):
        self.vocab_size = sizes.vocab_size
        self.num_layers = sizes.num_layers
        self.residual_sharding = residual_sharding
        self.wte = nnx.Embed(sizes.padded_vocab, sizes.model_dim, dtype=dtype, rngs=rngs,
                             embedding_init=_split(_INIT, common.MODEL, None))
        self.wpe = nnx.Embed(sizes.max_seq_len, sizes.model_dim, dtype=dtype, rngs=rngs,
                             embedding_init=_split(_INIT, None, None))

        @nnx.split_rngs(splits=sizes.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def stacked(rngs):
            return Block(sizes, dtype=dtype, rngs=rngs)

        self.blocks = stacked(rngs)
        self.ln_f = nnx.LayerNorm(sizes.model_dim, epsilon=sizes.norm_eps,
                                  use_fast_variance=False, dtype=dtype, rngs=rngs)

    def _constrain(self, x):
        if self.residual_sharding is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.residual_sharding)

    def __call__(self, input_ids, target_ids):
        x = self.wte(input_ids) + self.wpe(jnp.arange(input_ids.shape[1]))
        x = self._constrain(x)

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry,
                  transform_metadata={nnx.PARTITION_NAME: None})
        def run(block, h):
            return self._constrain(block(h))

        if self.num_layers <= common.UNROLL_UP_TO:  # Straight-line layers when shallow.
            graphdef, stacked = nnx.split(self.blocks)
            for i in range(self.num_layers):
                layer = nnx.merge(graphdef, jax.tree_util.tree_map(lambda w, i=i: w[i], stacked))
                x = self._constrain(layer(x))
        else:
            x = run(self.blocks, x)
        logits = self.wte.attend(self.ln_f(x)).astype(jnp.float32)
        ids = jnp.arange(logits.shape[-1])
        logits = jnp.where(ids < self.vocab_size, logits, -jnp.inf)
        target = jnp.take_along_axis(logits, target_ids[..., None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)


def decay_mask(params: nnx.State) -> Any:
    """True for matrices and embedding tables (decayed), False for biases and norms."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(k, "key", None) in ("bias", "scale") for k in path),
        params)


def build(titanax_params: Mapping[str, Any], *, mesh: jax.sharding.Mesh,
          accumulate_steps: int = 1, dtype: Any = jnp.float32, learning_rate: float = 1e-3,
          weight_decay: float = 0.0, optimizer: str = "adamw",
          vocab_size: Optional[int] = None) -> Tuple[dict, Callable]:
    """``(state, step_fn)`` with ``step_fn(state, batch) -> (state, loss)`` (see package doc)."""
    common.check_setup(mesh=mesh, accumulate_steps=accumulate_steps)
    sizes = common.GPTSizes.of_titanax(titanax_params, vocab_size=vocab_size)
    residual = NamedSharding(mesh, P(common.DATA))
    with jax.set_mesh(mesh):  # Flax resolves the annotations against the ambient mesh.
        abstract = nnx.eval_shape(lambda: GPT(sizes, dtype=dtype, residual_sharding=residual,
                                              rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    shardings = nnx.get_named_sharding(params, mesh)
    nnx.replace_by_pure_dict(params, convert.titanax_to_flax(titanax_params))
    params = jax.device_put(params, shardings)
    tx = common.make_optimizer(kind=optimizer, learning_rate=learning_rate,
                               weight_decay=weight_decay, decay_mask=decay_mask(params))
    replicated = NamedSharding(mesh, P())
    opt_shardings = optax.tree_map_params(
        tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, params), shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding))
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    state = {"params": params, "opt_state": opt_state}
    state_shardings = jax.tree_util.tree_map(lambda x: x.sharding, state)
    batch_sharding = NamedSharding(mesh, P(common.DATA))
    microbatch_sharding = NamedSharding(mesh, P(None, common.DATA))
    count = accumulate_steps

    def loss_fn(p, input_ids, target_ids):
        return nnx.merge(graphdef, p)(input_ids, target_ids)

    grad_fn = jax.value_and_grad(loss_fn)

    def microbatches(x):
        # Rows i*K + k form microbatch k: each device keeps its own rows.
        x = x.reshape((x.shape[0] // count, count) + x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, microbatch_sharding)

    def train_step(state, batch):
        p = state["params"]
        if count == 1:
            loss, grads = grad_fn(p, batch["input_ids"], batch["target_ids"])
        else:
            def body(carry, mb):
                loss_i, grads_i = grad_fn(p, *mb)
                return jax.tree_util.tree_map(jnp.add, carry, (loss_i, grads_i)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree_util.tree_map(jnp.zeros_like, p))
            (loss, grads), _ = jax.lax.scan(
                body, zeros, (microbatches(batch["input_ids"]),
                              microbatches(batch["target_ids"])))
            loss, grads = jax.tree_util.tree_map(lambda x: x / count, (loss, grads))
        updates, opt_state = tx.update(grads, state["opt_state"], p)
        return {"params": optax.apply_updates(p, updates), "opt_state": opt_state}, loss

    jitted = jax.jit(train_step, donate_argnums=0,
                     in_shardings=(state_shardings, {k: batch_sharding for k in common.BATCH_KEYS}),
                     out_shardings=(state_shardings, replicated))

    def step_fn(state, batch):
        common.check_batch(batch, mesh=mesh, accumulate_steps=count)
        return jitted(state, {k: batch[k] for k in common.BATCH_KEYS})

    step_fn.jitted = jitted  # For benchmarks: lower / compile / memory_analysis of the step.

    return state, step_fn
