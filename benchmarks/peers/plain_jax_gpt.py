"""GPT-2 as plain JAX functions under ``jax.shard_map``: every collective written by hand.

A peer for timing Titanax's Engine step against code that shares nothing with it (no Flax, no
Titanax). It is the step an expert writes for data x tensor parallelism on a ('data', 'model')
mesh, in local view:

* Megatron TP: QKV and MLP up-projection split over 'model' by heads / hidden features
  (no collective), attention out- and MLP down-projection split on their input rows, completed by
  one ``psum`` each. The token table is split over 'model' by vocabulary rows: a lookup is a
  masked gather plus ``psum``, and the tied LM head gives vocabulary-split logits that a
  vocab-parallel cross-entropy (``pmax`` + two ``psum`` of one number per token) consumes without
  gathering them.
* Params are cast to *varying* over every axis before ``jax.grad``; otherwise grad would
  all-reduce each replicated param's gradient on every call, i.e. once per microbatch.
* ``lax.scan`` over K microbatches sums gradients locally; after the loop each gradient is reduced
  once: mean over 'data', plus a sum over 'model' for params replicated on it (each model rank
  holds only its own contribution). The loss leaves the vocab-parallel cross-entropy through a
  ``psum``, so it is typed invariant over 'model' and grad counts it once. Were it typed varying
  (one copy per rank), grad would count it once per rank -- TP x the true gradient -- so the
  objective is then divided by the TP size. SGD parity with Titanax (tests/benchmarks) checks it.
* AdamW (or SGD) on local shards: every optax transformation used is elementwise.
Compute dtype f32 or bf16 (params cast per forward pass), params and optimizer state in f32.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.peers import common, convert

DATA, MODEL = common.DATA, common.MODEL
AXES = (DATA, MODEL)

SPECS = {
    "wte": P(MODEL, None),
    "wpe": P(),
    "layers": {
        "ln1_g": P(), "ln1_b": P(), "ln2_g": P(), "ln2_b": P(),
        "w_qkv": P(None, None, None, MODEL, None), "b_qkv": P(None, None, MODEL, None),
        "w_attn_out": P(None, MODEL, None), "b_attn_out": P(),
        "w_fc": P(None, None, MODEL), "b_fc": P(None, MODEL),
        "w_proj": P(None, MODEL, None), "b_proj": P(),
    },
    "lnf_g": P(), "lnf_b": P(),
}


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _split_over_model(spec: P) -> bool:
    return any(MODEL == a or (isinstance(a, tuple) and MODEL in a) for a in spec)


def decay_mask() -> Any:
    """Decay matrices and tables (names ``w*``), not biases and norm gains."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key.startswith("w"), SPECS,
                                            is_leaf=_is_spec)


def _layer_norm(x, gain, bias, eps):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * gain + bias).astype(x.dtype)


def _block(x, w, *, eps):
    """One pre-LN block on this device's heads / hidden features; two psums over 'model'."""
    h = _layer_norm(x, w["ln1_g"], w["ln1_b"], eps)
    qkv = jnp.einsum("bsd,dthk->bsthk", h, w["w_qkv"]) + w["b_qkv"]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    length = x.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((length, length), bool)), scores,
                       jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(x.shape[:2] + (-1,))
    x = x + (jax.lax.psum(ctx @ w["w_attn_out"], MODEL) + w["b_attn_out"])
    h = _layer_norm(x, w["ln2_g"], w["ln2_b"], eps)
    hidden = jax.nn.gelu(h @ w["w_fc"] + w["b_fc"], approximate=True)
    return x + (jax.lax.psum(hidden @ w["w_proj"], MODEL) + w["b_proj"])


def local_loss(p, input_ids, target_ids, *, sizes: common.GPTSizes):
    """Mean token cross-entropy of this device's rows (local view, vocab split over 'model')."""
    rows = p["wte"].shape[0]
    offset = jax.lax.axis_index(MODEL) * rows
    local_ids = input_ids - offset
    held = (local_ids >= 0) & (local_ids < rows)
    x = jnp.where(held[..., None], p["wte"][jnp.where(held, local_ids, 0)], 0)
    x = jax.lax.psum(x, MODEL) + p["wpe"][:input_ids.shape[1]]
    if sizes.num_layers <= common.UNROLL_UP_TO:  # Straight-line layers: faster when shallow.
        for i in range(sizes.num_layers):
            x = _block(x, jax.tree_util.tree_map(lambda w, i=i: w[i], p["layers"]),
                       eps=sizes.norm_eps)
    else:
        x, _ = jax.lax.scan(lambda h, w: (_block(h, w, eps=sizes.norm_eps), None), x,
                            p["layers"])
    x = _layer_norm(x, p["lnf_g"], p["lnf_b"], sizes.norm_eps)
    logits = jnp.einsum("bsd,vd->bsv", x, p["wte"]).astype(jnp.float32)
    logits = jnp.where(offset + jnp.arange(rows) < sizes.vocab_size, logits, -jnp.inf)
    top = jax.lax.pmax(jax.lax.stop_gradient(logits.max(-1)), MODEL)
    sum_exp = jnp.exp(logits - top[..., None]).sum(-1)
    local_targets = target_ids - offset
    mine = (local_targets >= 0) & (local_targets < rows)
    picked = jnp.take_along_axis(logits, jnp.where(mine, local_targets, 0)[..., None], -1)[..., 0]
    sum_exp, target = jax.lax.psum((sum_exp, jnp.where(mine, picked, 0.0)), MODEL)
    return jnp.mean(jnp.log(sum_exp) + top - target)


def _varies_over(x) -> frozenset:
    """Mesh axes along which ``x``'s type says it differs between devices (jax 0.10 spelling)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def _to_varying(x):
    missing = tuple(a for a in AXES if a not in _varies_over(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def build(titanax_params: Mapping[str, Any], *, mesh: jax.sharding.Mesh,
          accumulate_steps: int = 1, dtype: Any = jnp.float32, learning_rate: float = 1e-3,
          weight_decay: float = 0.0, optimizer: str = "adamw",
          vocab_size: Optional[int] = None) -> Tuple[dict, Callable]:
    """``(state, step_fn)`` with ``step_fn(state, batch) -> (state, loss)`` (see package doc)."""
    common.check_setup(mesh=mesh, accumulate_steps=accumulate_steps)
    sizes = common.GPTSizes.of_titanax(titanax_params, vocab_size=vocab_size)
    tp = mesh.shape[MODEL]
    count = accumulate_steps
    tx = common.make_optimizer(kind=optimizer, learning_rate=learning_rate,
                               weight_decay=weight_decay, decay_mask=decay_mask())
    params = jax.tree_util.tree_map(
        lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
        convert.titanax_to_plain(titanax_params), SPECS)
    opt_specs = optax.tree_map_params(
        tx, lambda _, spec: spec, jax.eval_shape(tx.init, params), SPECS,
        transform_non_params=lambda _: P(), is_leaf=_is_spec)
    opt_state = jax.jit(tx.init, out_shardings=jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), opt_specs, is_leaf=_is_spec))(params)
    state_specs = {"params": SPECS, "opt_state": opt_specs}

    def objective(varying_params, input_ids, target_ids):
        compute = jax.tree_util.tree_map(lambda x: x.astype(dtype), varying_params)
        loss = local_loss(compute, input_ids, target_ids, sizes=sizes)
        copies = tp if MODEL in _varies_over(loss) else 1
        return loss / copies, loss

    grad_fn = jax.grad(objective, has_aux=True)

    def reduce(grads):
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        specs = treedef.flatten_up_to(SPECS)
        replicated = [i for i, s in enumerate(specs) if not _split_over_model(s)]
        summed = jax.lax.psum([leaves[i] for i in replicated], MODEL)
        for i, g in zip(replicated, summed):
            leaves[i] = g
        return jax.lax.pmean(jax.tree_util.tree_unflatten(treedef, leaves), DATA)

    def local_step(state, batch):
        params = state["params"]
        varying = jax.tree_util.tree_map(_to_varying, params)
        if count == 1:
            grads, loss = grad_fn(varying, batch["input_ids"], batch["target_ids"])
        else:
            def split(x):  # Contiguous rows per microbatch, within this device's rows.
                return x.reshape((count, x.shape[0] // count) + x.shape[1:])

            def body(grad_sum, mb):
                grads_i, loss_i = grad_fn(varying, *mb)
                return jax.tree_util.tree_map(jnp.add, grad_sum, grads_i), loss_i

            grads, losses = jax.lax.scan(
                body, jax.tree_util.tree_map(jnp.zeros_like, varying),
                (split(batch["input_ids"]), split(batch["target_ids"])))
            grads = jax.tree_util.tree_map(lambda g: g / count, grads)
            loss = losses.mean()
        grads = reduce(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        varying_over = tuple(a for a in AXES if a in _varies_over(loss))
        loss = jax.lax.pmean(loss, varying_over) if varying_over else loss
        return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}, loss

    batch_specs = {k: P(DATA) for k in common.BATCH_KEYS}
    jitted = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(state_specs, batch_specs),
                                   out_specs=(state_specs, P())), donate_argnums=0)

    def step_fn(state, batch):
        common.check_batch(batch, mesh=mesh, accumulate_steps=count)
        return jitted(state, {k: batch[k] for k in common.BATCH_KEYS})

    step_fn.jitted = jitted  # For benchmarks: lower / compile / memory_analysis of the step.

    return {"params": params, "opt_state": opt_state}, step_fn
