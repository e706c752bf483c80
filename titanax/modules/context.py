"""InvocationContext: the implicit inputs and outputs of a module call.

Passing params, a PRNG key and ``is_training`` into every layer call -- and threading summaries
and state updates back out -- buries the model in plumbing. As in AXLearn (after Lingvo and Flax),
a thread-local stack of contexts carries them instead: a module reads ``self.parameters``,
``self.prng_key`` and ``self.is_training`` from the context on top of the stack, and writes
summaries and state updates into it. The stack is plain Python that lives only while a function is
traced, so everything stays pure from jax's point of view.

Keys are derived from the parent's key and the child's *name* (plus a call index when the same
child is called again), never from call order: adding a layer does not change the dropout masks of
the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import zlib
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.parallel import axis_binding as axis_binding_lib
from titanax.utils.dtypes import at_least_float32


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class OutputCollection:
    """What module calls produce besides their return values, nested by module name.

    ``summaries``: values to log (``add_summary``). ``state_updates``: new values for non-trained
    state (``add_state_update``), e.g. moving averages. ``module_outputs``: intermediate values a
    caller asked for (``add_module_output``).
    """

    summaries: Dict[str, Any] = dataclasses.field(default_factory=dict)
    state_updates: Dict[str, Any] = dataclasses.field(default_factory=dict)
    module_outputs: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def add_child(self, name: str) -> "OutputCollection":
        """A collection for child ``name`` whose dicts are nested inside this one's."""
        child = OutputCollection()
        self.summaries[name] = child.summaries
        self.state_updates[name] = child.state_updates
        self.module_outputs[name] = child.module_outputs
        return child

    def tree_flatten(self):
        return (self.summaries, self.state_updates, self.module_outputs), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


@dataclasses.dataclass
class InvocationContext:
    """One module call: which module, its params/state, its key, mode, and where outputs go."""

    # The module's name (with a "_<k>" suffix for the k-th repeated call of the same child).
    name: str
    # The module object being called.
    module: Any
    # The module's params and other state (a dict of arrays and child dicts), in local view.
    state: Any
    # Training mode (dropout on, remat on, ...).
    is_training: bool
    # This call's PRNG key (None when the caller gave none; randomness then fails loudly).
    prng_key: Optional[jax.Array]
    # Where summaries / state updates / module outputs of this call go.
    output_collection: OutputCollection
    # The calling context (None at the root).
    parent: Optional["InvocationContext"] = None
    # Calls made so far to each child name, so a repeated call gets its own key and outputs.
    child_calls: Dict[str, int] = dataclasses.field(default_factory=dict)
    # ``state`` with FSDP-sharded params gathered, made on the first ``parameters`` read.
    gathered_state: Optional[Any] = None
    # Which mesh axis holds each logical dimension (parallel/axis_binding.py): a child's is its
    # parent's; a root call's the innermost ``axis_binding.bound`` block's (None: none bound).
    axis_binding: Optional[Any] = None

    def __post_init__(self):
        if self.axis_binding is None:
            self.axis_binding = axis_binding_lib.scope_binding()

    @property
    def path(self) -> str:
        return self.name if self.parent is None else f"{self.parent.path}/{self.name}"

    def clone(self, **changes: Any) -> "InvocationContext":
        """A copy with fields replaced (e.g. ``is_training=False`` for a teacher model)."""
        changes.setdefault("child_calls", {})
        changes.setdefault("gathered_state", None)
        return dataclasses.replace(self, **changes)


class _Stack(threading.local):
    def __init__(self):
        super().__init__()
        self.contexts: List[InvocationContext] = []


_STACK = _Stack()


def current_context() -> Optional[InvocationContext]:
    """The innermost context on this thread (None outside any module call)."""
    return _STACK.contexts[-1] if _STACK.contexts else None


def _call_binding() -> Optional[axis_binding_lib.AxisBinding]:
    context = current_context()
    return context.axis_binding if context is not None else None


# Layers ask parallel/axis_binding.py for their binding; a module call's is kept here.
axis_binding_lib.look_up_call_bindings_with(_call_binding)


@contextlib.contextmanager
def set_current_context(context: InvocationContext) -> Iterator[InvocationContext]:
    """Makes ``context`` current for the ``with`` block."""
    _STACK.contexts.append(context)
    try:
        yield context
    finally:
        popped = _STACK.contexts.pop()
        if popped is not context:
            raise errors.ModuleError("InvocationContext stack corrupted: contexts were not "
                                     "closed in order", path=context.path)


def name_key(key: jax.Array, name: str) -> jax.Array:
    """A key derived from ``key`` and a name, stable across processes and Python versions."""
    return jax.random.fold_in(key, zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF)


def child_context(name: str, **overrides: Any) -> InvocationContext:
    """The context for calling child ``name`` of the current context's module.

    The child's state is ``state[name]``; its key is derived from the parent's key and ``name``
    (and the call index when the child is called again in the same invocation); ``is_training``
    is inherited. ``overrides`` replace any field (``is_training=False``, ``state=...``).
    """
    parent = current_context()
    if parent is None:
        raise errors.ModuleError(f"cannot call child {name!r}: no module is being invoked",
                                 path=name, suggestion="call the root module through functional()"
                                                       " (or titanax.modules.testing.bind)")
    calls = parent.child_calls.get(name, 0)
    parent.child_calls[name] = calls + 1
    call_name = name if calls == 0 else f"{name}_{calls}"
    if "state" in overrides:
        state = overrides.pop("state")
    else:
        state = parent.state.get(name, {}) if isinstance(parent.state, dict) else {}
    key = parent.prng_key
    if key is not None:
        key = name_key(key, name)
        if calls:
            key = jax.random.fold_in(key, calls)
    child_module = getattr(parent.module, "_children", {}).get(name) if parent.module else None
    values = dict(name=call_name, module=child_module, state=state,
                  is_training=parent.is_training, prng_key=key,
                  output_collection=parent.output_collection.add_child(call_name), parent=parent,
                  axis_binding=parent.axis_binding)
    values.update(overrides)
    return InvocationContext(**values)


class _Tagged:
    """A value marked for how the collection's reader treats it: a pytree node with the value
    as its one child (so a Repeat stacks it and jax transformations see through it)."""

    def __init__(self, value: Any):
        self.value = value

    def tree_flatten(self):
        return (self.value,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(children[0])


@jax.tree_util.register_pytree_node_class
class StateIncrement(_Tagged):
    """A state update that is an amount to add to the stored value (``add_state_update(...,
    increment=True)``), resolved against the stored param when collected
    (train/state_updates.py)."""


@jax.tree_util.register_pytree_node_class
class VectorSummary(_Tagged):
    """A summary with one value per item (a mixture of experts' load per expert): averaged over
    shards and microbatches element by element like a scalar summary, and reported -- once
    averaged -- by its largest and smallest element (``expand_vector_metrics``), per layer when
    a ``Repeat`` stacked it."""


def expand_vector_metrics(metrics: Mapping[str, jax.Array]) -> Dict[str, jax.Array]:
    """``metrics`` with every vector summary (``[items]``, or ``[layers, items]``) replaced by
    scalars: ``<name>/max`` and ``<name>/min`` (over the items; for a stack the mean over its
    layers of each layer's), and each layer's as ``<name>/layer_<i>/max`` and ``.../min``."""
    out: Dict[str, jax.Array] = {}
    for name, value in metrics.items():
        value = jnp.asarray(value)
        if value.ndim == 0:
            out[name] = value
            continue
        largest, smallest = jnp.max(value, axis=-1), jnp.min(value, axis=-1)
        out[f"{name}/max"], out[f"{name}/min"] = jnp.mean(largest), jnp.mean(smallest)
        if value.ndim == 2 and value.shape[0] > 1:
            for layer in range(value.shape[0]):
                out[f"{name}/layer_{layer}/max"] = largest[layer]
                out[f"{name}/layer_{layer}/min"] = smallest[layer]
    return out


def flat_summaries(tree: Mapping[str, Any], prefix: str = "summaries", *,
                   per_layer: bool = True) -> Dict[str, jax.Array]:
    """``{"summaries/<module path>/<name>": float32 scalar}`` from a nested summaries dict.

    A summary of a stacked ``Repeat`` comes back with a leading layer axis: it is averaged, and
    with ``per_layer`` each layer's value is kept too, as ``<path>/layer_<i>`` (a pipeline
    stage, which holds a slice of the stack, asks for the average only, and gets no vector
    summary).
    """
    out: Dict[str, jax.Array] = {}
    for name, value in tree.items():
        path = f"{prefix}/{name}"
        if isinstance(value, Mapping):
            out.update(flat_summaries(value, path, per_layer=per_layer))
        elif isinstance(value, VectorSummary):  # Kept a vector until reduced (see above).
            # A pipeline stage (per_layer=False) holds a slice of the stack: the whole batch's
            # per-layer vectors are not in one place, and a max over a mean of layers would
            # understate the spread, so none is reported there.
            if per_layer:
                out[path] = at_least_float32(value.value)
        elif value is not None:
            value = at_least_float32(value)
            out[path] = jnp.mean(value) if value.ndim else value
            if per_layer and value.ndim == 1 and value.shape[0] > 1:
                out.update({f"{path}/layer_{i}": value[i] for i in range(value.shape[0])})
    return out


def flat_state_updates(tree: Mapping[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """``(<module path>/<name>, value)`` for every state update in a nested ``state_updates``."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from flat_state_updates(value, f"{prefix}{key}/")
        elif value is not None:
            yield f"{prefix}{key}", value


def refuse_state_updates(collection: "OutputCollection", *, where: str) -> None:
    """Raises if a pipelined training forward wrote ``add_state_update``s: a pipeline does not
    carry them to the train state (the plain and microbatched steps do, train/state_updates.py),
    and dropping them would train silently wrong (running statistics that never move)."""
    written = sorted(path for path, _ in flat_state_updates(collection.state_updates))
    if written:
        raise errors.ModuleError(
            f"the model wrote state updates ({', '.join(written[:6])}) while training under a "
            "pipeline; pipelined steps do not carry state updates to the train state, so they "
            "would be dropped", path=where,
            suggestion="train this model without pipeline_parallel (DP, TP, ZeRO and "
                       "accumulation carry them), or compute the statistic as a summary")
