"""Each iteration of a Flax module's own scans rematerialised (FSDP: one layer's weights at a
time in the backward pass).

Under FSDP the adapter hands a module its params' shards as values it reads whole
(flax_gather.py), so a stacked param is gathered one layer at a time inside the module's
``nnx.scan`` / ``nn.scan``. The backward pass needs each layer's whole weights again. Saved by
the forward scan, they would be stacked -- every layer's gathered weights held at once, the
memory FSDP exists to save (measured on the NNX GPT of ``benchmarks/fsdp_memory.py``: 79 MiB of
temp memory against 18). Titanax's own ``Repeat`` avoids it by rematerialising its loop body with
a policy that never saves a gathered value (``module.scan_in_context``); a Flax module's scan
is written by its author, so the adapter does the same from outside, on the program:

``with_scans_rematerialised(fn, policy)`` traces ``fn`` (``jax.make_jaxpr``) and evaluates the
program it recorded into the current trace, equation by equation, except that every outermost
``scan`` -- however the module made it: ``nnx.scan``, ``nn.scan``, ``jax.lax.scan`` by any name,
``jax.lax.map``, inside a ``jit`` -- runs again through ``jax.lax.scan`` with its body under
``jax.checkpoint(policy)``. Each backward iteration then gathers its own layer again. Nothing
global is changed (any thread may trace at once), and the program's named scopes are kept (the
collectives of ``--explain`` still name their layers).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax._src import source_info_util
from jax.extend import core as jex_core

# Primitives whose sub-program is a plain call of their operands: evaluated inline, so that a
# scan inside them is reached.
_CALLS = ("jit", "pjit", "closed_call", "core_call")


def with_scans_rematerialised(fn: Callable[..., Any], policy: Callable) -> Callable[..., Any]:
    """``fn`` (pure, of pytrees) with the body of every outermost scan it runs under
    ``jax.checkpoint(policy=policy)`` (see the module docstring)."""
    def rematerialised(*args):
        closed, out_shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _evaluate(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves(args), policy)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shapes), outs)
    return rematerialised


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], policy: Callable):
    env = {}

    def read(atom):
        return atom.val if isinstance(atom, jex_core.Literal) else env[atom]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(atom) for atom in eqn.invars]
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), \
                eqn.ctx.manager:
            if eqn.primitive.name == "scan":
                outs = _rematerialised_scan(eqn.params, invals, policy)
            elif eqn.primitive.name in _CALLS:
                sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                outs = _evaluate(getattr(sub, "jaxpr", sub), getattr(sub, "consts", ()),
                                 invals, policy)
            else:
                outs = eqn.primitive.bind(*invals,
                                          **eqn.primitive.get_bind_params(eqn.params))
                if not eqn.primitive.multiple_results:
                    outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(atom) for atom in jaxpr.outvars]


def _rematerialised_scan(params: dict, invals: Sequence[Any], policy: Callable):
    """The scan equation ``params`` on ``invals``, its body under ``jax.checkpoint``."""
    consts_count, carry_count = params["num_consts"], params["num_carry"]
    consts = invals[:consts_count]
    init = list(invals[consts_count:consts_count + carry_count])
    xs = list(invals[consts_count + carry_count:])
    body = params["jaxpr"]

    def step(carry, x):
        outs = jax.core.eval_jaxpr(body.jaxpr, body.consts, *consts, *carry, *x)
        return outs[:carry_count], outs[carry_count:]

    carry, ys = jax.lax.scan(jax.checkpoint(step, policy=policy, prevent_cse=False), init, xs,
                             length=params["length"], reverse=params["reverse"],
                             unroll=params["unroll"])
    return [*carry, *ys]
