"""A fresh model's params, drawn one param at a time, each straight into its shards.

Why not one program that draws them all: it compiles a random-number generator per param (a
threefry loop and the normal's inverse error function), so its compile time grows with the
param count -- for gemma3_tiny in float64 it compiled in 5.3 s next to the training step's
10.9 s, and a model whose layers are not stacked has a copy per layer. A program per param
*kind* (initializer, shape, dtype, fan axes, storage dtype, sharding) is compiled once, reused
by every layer of that kind (measured, the same gemma3_tiny launch: its 16 draws compiled in
1.5 s). (They compile in well under a second, below jax's default threshold for the persistent
compilation cache: a restart compiles them again -- the test suite's cache keeps them.)

The values are the same draws: each param's key is ``name_key(root key, its path)`` exactly as
in ``BaseLayer.initialize_parameters_recursively`` (derived here outside the programs, by the
one compiled ``fold_in``), and each program holds only ``draw_param`` and the storage cast.
Each param is created in its own sharding, as the one program did: no param is ever whole on
one device unless its sharding says so.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Tuple

import jax
import jax.numpy as jnp

from titanax.modules.base_layer import ParameterSpec, draw_kind, draw_param, param_path
from titanax.modules.context import name_key

# A draw runs once per run: on CPU, LLVM's optimisation of the random-number code costs more
# than it saves (measured, moe_tiny_ep: its draws compiled in 4.4 s optimised, 1.7 s without;
# the one program drawing them all, optimised: 3.6 s).
_CPU_DRAW_OPTIONS = {"xla_backend_optimization_level": 0}
# (kind of param) -> its compiled draw, least recently used first. Bounded: a process building
# many engines on many meshes (the test suite) drops the least recently used past this many.
_MAX_PROGRAMS = 1024
_PROGRAMS: "collections.OrderedDict[Tuple[Any, ...], Callable[[jax.Array], jax.Array]]" = (
    collections.OrderedDict())


def initial_params(*, model: Any, specs: Any, key: jax.Array, shardings: Any,
                   dtypes: Any) -> Any:
    """``model``'s params for ``specs`` (a subtree of its param specs, or all of them) from the
    run's init ``key``: each placed in its entry of ``shardings`` and, when floating, stored in
    its entry of ``dtypes`` (both trees shaped like ``specs``). A model that initialises itself
    (``draws_each_param_from_its_path`` False: an adapted Flax module) runs as one program."""
    if not model.draws_each_param_from_its_path():
        return jax.jit(lambda k: jax.tree_util.tree_map(
            _stored, model.initialize_parameters_recursively(k, specs=specs), dtypes),
            out_shardings=shardings)(key)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, ParameterSpec))
    drawn = [_program(spec, sharding, dtype, key)(name_key(key, param_path(model.name, path)))
             for (path, spec), sharding, dtype in zip(
                 leaves, treedef.flatten_up_to(shardings), treedef.flatten_up_to(dtypes))]
    return jax.tree_util.tree_unflatten(treedef, drawn)


def _stored(value: jax.Array, dtype: Any) -> jax.Array:
    """``value`` in its storage ``dtype`` (floats only: an integer param keeps its own)."""
    if jnp.issubdtype(value.dtype, jnp.floating) and value.dtype != dtype:
        return value.astype(dtype)
    return value


def _program(spec: ParameterSpec, sharding: Any, dtype: Any, key: jax.Array
             ) -> Callable[[jax.Array], jax.Array]:
    """The compiled draw of ``spec``'s kind of param into ``sharding``, stored as ``dtype``,
    from a key like ``key``."""
    kind = (draw_kind(spec), str(dtype), sharding, key.shape, str(key.dtype),
            # (A compiled program does not follow jax's config: the draw's settings join the key.)
            jax.config.jax_threefry_partitionable, str(jax.config.jax_default_prng_impl))
    program = _PROGRAMS.get(kind)
    if program is not None:
        _PROGRAMS.move_to_end(kind)
    else:
        if len(_PROGRAMS) >= _MAX_PROGRAMS:
            _PROGRAMS.popitem(last=False)
        program = jax.jit(lambda key: _stored(draw_param(spec, key), dtype),
                          out_shardings=sharding)
        if sharding.device_set and next(iter(sharding.device_set)).platform == "cpu":
            program = program.lower(jax.ShapeDtypeStruct(key.shape, key.dtype)).compile(
                compiler_options=_CPU_DRAW_OPTIONS)
        _PROGRAMS[kind] = program
    return program
