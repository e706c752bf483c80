"""Independent peer implementations of Titanax's GPT, for timing the Engine step against code
that shares nothing with it (no ``titanax`` import anywhere in this package).

* ``flax_gpt``: Flax NNX model under ``jax.jit`` with NamedSharding annotations; GSPMD picks the
  collectives (what a MaxText-style user writes).
* ``plain_jax_gpt``: plain JAX functions under ``jax.shard_map`` with hand-written collectives,
  one gradient reduction per step.
* ``convert``: a Titanax param tree -> each peer's params (renames only), so all three compute
  the same thing from the same numbers.
* ``common``: sizes read off the param shapes, the optimizer, batch placement.

Both peers expose the same entry point::

    state, step_fn = peer.build(titanax_params, *, mesh, accumulate_steps=1,
                                dtype=jnp.float32, learning_rate=1e-3, weight_decay=0.0,
                                optimizer="adamw", vocab_size=None)
    state, loss = step_fn(state, batch)

``titanax_params``: the nested dict ``engine.state.params`` (or
``model.initialize_parameters_recursively(...)``) of a Titanax ``GPT``; sizes are read from the
shapes, ``vocab_size`` is the real vocabulary when the table is padded. ``mesh``: a
``jax.sharding.Mesh`` with axes exactly ``('data', 'model')`` (Auto axis types); 'model' may have
size 1. ``batch``: Titanax GPT's batch, ``{"input_ids", "target_ids"}`` int arrays ``[B, S]``
(``weights`` is refused: the peers compute the unweighted token mean); B must split into
data x ``accumulate_steps``. Place it once with ``common.place_batch(batch, mesh=mesh)`` so the
step does not copy from the host. ``dtype``: compute dtype (f32 or bf16); params and optimizer
state stay f32. ``optimizer``: "adamw" is Titanax's ``optimizers.adamw`` (Adam, decoupled weight
decay on matrices and embedding tables only, then -lr); "sgd" exposes gradient-scale errors that
Adam normalises away. ``step_fn`` donates ``state``; ``loss`` is the mean token cross-entropy of
the batch before the update (a replicated f32 scalar).
"""
