"""Where the decode engine's programs run: one device, or the mesh a run trains on.

Why: the engine samples with the training params where they live -- no weights move, and the
log-probs it reports are the ones the train step recomputes. On a mesh each batch shard (the
devices that hold one slice of a batch's rows) runs a decode engine of its own: its own slots,
its own pool of blocks, the host keeping one book per shard; tensor parallelism splits every
block's key/value heads as it splits the attention's weights, FSDP gathers the params once per
program, as the static sampler (``StepBuilder.sampler``) does.

The engine names the role of each input and output and the placement lays it out:
- ``PARAMS``: the params in the run's layout (gathered and cast for compute inside);
- ``POOLS``: the model's paged cache -- attention pools ``[.., blocks, block_size, kv heads,
  head_dim]`` and recurrent layers' slot states (``slot_states.py``) -- dimension -4 (blocks,
  or slots) over the batch axes, -2 (heads) over the TP axis: each device's own pools stacked
  into one array (a shard's block ids and slots are its own; a latent attention's one-head
  pools hold each TP rank's copy);
- ``ROWS``: arrays of slots or prompt rows, split by rows over the batch axes, shard by shard;
- ``SAME``: the same on every device (a key).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

PARAMS, POOLS, ROWS, SAME = "params", "pools", "rows", "same"


class OneDevice:
    """Every program a plain ``jit`` on the default device: one shard."""

    shards = 1

    def program(self, fn: Callable, *, inputs: Sequence[str], outputs: Any,
                donate: Tuple[int, ...] = ()) -> Callable:
        """``jit(fn)``; ``inputs``' and ``outputs``' roles matter on a mesh only."""
        del inputs, outputs
        return jax.jit(fn, donate_argnums=donate)

    def local_params(self, params: Any) -> Any:
        """The params the model computes with inside a program: as given."""
        return params

    @staticmethod
    def host(value: Any) -> Any:
        """A program's outputs (a tree of arrays) on this host."""
        return jax.tree_util.tree_map(np.asarray, value)

    def abstract(self, role: str, value: Any) -> jax.ShapeDtypeStruct:
        """``value``'s shape and dtype (a program compiled from shapes alone)."""
        del role
        return jax.ShapeDtypeStruct(value.shape, value.dtype)


class OnMesh:
    """Every program ``jit(shard_map(fn))`` over ``mesh``, run with the layers' axis binding."""

    def __init__(self, *, mesh: Any, param_specs: Any, row_spec: PartitionSpec,
                 kv_heads_axis: Optional[str], bound: Callable[[Callable], Callable],
                 local_params: Callable[[Any], Any]):
        """``row_spec``: how rows split over the batch axes (one entry); ``kv_heads_axis``: the
        mesh axis splitting key/value heads (None: whole); ``bound``: a function run with the
        run's axis binding and converters' scopes; ``local_params``: a shard's params gathered
        and cast for compute."""
        self.mesh, self.param_specs, self.row_spec = mesh, param_specs, row_spec
        self.kv_heads_axis, self._bound, self._local_params = kv_heads_axis, bound, local_params
        rows = row_spec[0] if len(row_spec) else None
        self.row_axes = () if rows is None else (rows,) if isinstance(rows, str) else rows
        self.shards = math.prod(int(mesh.shape[a]) for a in self.row_axes)

    def local_params(self, params: Any) -> Any:
        return self._local_params(params)

    @staticmethod
    def host(value: Any) -> Any:
        """``value`` (a tree of global arrays: a program's outputs, a placed batch) whole on
        this host -- every process's rows gathered, in one call, when the mesh spans several
        processes, so that each process's host loop sees what every other's does."""
        if jax.process_count() > 1:
            value = multihost_utils.process_allgather(value, tiled=True)
        return jax.tree_util.tree_map(np.asarray, value)

    def abstract(self, role: str, value: Any) -> jax.ShapeDtypeStruct:
        """``value``'s shape and dtype, laid out as a ``role`` (``POOLS`` or ``ROWS``) array."""
        spec = self.pool_spec(value) if role == POOLS else self.row_spec
        return jax.ShapeDtypeStruct(value.shape, value.dtype,
                                    sharding=NamedSharding(self.mesh, spec))

    def pool_spec(self, leaf: Any) -> PartitionSpec:
        """A pool ``[.., blocks, block_size, kv heads, head_dim]`` (or a slot state, laid out
        alike): blocks over the batch axes, heads over the TP axis."""
        rows = self.row_spec[0] if len(self.row_spec) else None
        return PartitionSpec(*([None] * (leaf.ndim - 4)), rows, None, self.kv_heads_axis, None)

    def program(self, fn: Callable, *, inputs: Sequence[str], outputs: Any,
                donate: Tuple[int, ...] = ()) -> Callable:
        """``jit(shard_map(fn))`` with each input and output laid out by its role
        (``outputs``: a role, or a tuple of roles matching ``fn``'s tuple of outputs); a
        ``POOLS`` output's spec follows its arrays' ranks, found by tracing ``fn`` once."""
        bound = self._bound(fn)

        def run(*args):
            in_specs = tuple(self._specs(role, arg) for role, arg in zip(inputs, args))
            local = jax.eval_shape(lambda *xs: jax.shard_map(
                bound, mesh=self.mesh, in_specs=in_specs, out_specs=PartitionSpec(),
                check_vma=False)(*xs), *args) if _has_pools(outputs) else None
            out_specs = self._out_specs(outputs, local)
            return jax.shard_map(bound, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False)(*args)

        compiled = jax.jit(run, donate_argnums=donate)
        if jax.process_count() == 1:
            return compiled

        def across_processes(*args):
            # (Every process's host loop holds the same whole arrays: each gives its devices'
            # parts of them, as global arrays.)
            return compiled(*(self._global(role, arg) for role, arg in zip(inputs, args)))
        across_processes.lower, across_processes.eval_shape = compiled.lower, compiled.eval_shape
        return across_processes

    def _global(self, role: str, tree: Any) -> Any:
        """``tree``'s host arrays (the same on every process: each process's host loop is the
        same) as global arrays -- a ``ROWS`` input's split by rows, any other replicated;
        global arrays (params, pools) as they are."""
        def one(value):
            if isinstance(value, jax.Array) and not value.is_fully_addressable:
                return value
            value = np.asarray(value)
            spec = self.row_spec if role == ROWS else PartitionSpec()
            return jax.make_array_from_callback(value.shape, NamedSharding(self.mesh, spec),
                                                lambda index: value[index])
        return jax.tree_util.tree_map(one, tree)

    def _specs(self, role: str, tree: Any) -> Any:
        if role == PARAMS:
            return self.param_specs
        if role == POOLS:
            return jax.tree_util.tree_map(self.pool_spec, tree)
        if role == ROWS:
            return jax.tree_util.tree_map(lambda _: self.row_spec, tree)
        return jax.tree_util.tree_map(lambda _: PartitionSpec(), tree)

    def _out_specs(self, outputs: Any, local: Any) -> Any:
        if isinstance(outputs, tuple):
            parts = (None,) * len(outputs) if local is None else local
            return tuple(self._out_specs(role, part) for role, part in zip(outputs, parts))
        if outputs == POOLS:
            return jax.tree_util.tree_map(self.pool_spec, local)
        return PartitionSpec() if outputs == SAME else self.row_spec


def _has_pools(outputs: Any) -> bool:
    return any(_has_pools(o) for o in outputs) if isinstance(outputs, tuple) else \
        outputs == POOLS
