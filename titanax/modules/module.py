"""Module: a Configurable tree of layers whose calls read implicit inputs from the context.

A parent builds its children in ``__init__`` with ``self._add_child(name, cfg)`` and calls them
like functions (``self.attn(x)``). Every public method of a Module subclass is wrapped so that a
call from the parent automatically runs in the child's InvocationContext (its slice of the params,
its own PRNG key, its own output collection) under a ``jax.named_scope`` of the child's name --
compiled programs and profiles carry module paths for free. Calling the same child twice works:
the second call gets a ``_1`` suffix for its key and outputs, and shares the params.

At the root, ``functional()`` turns a method call into a pure function of
``(prng_key, state, inputs)``, which is what ``jit``, ``grad``, ``scan``, ``checkpoint`` and
``shard_map`` need.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.config import Configurable
from titanax.modules import gather_on_use
from titanax.modules.context import (InvocationContext, OutputCollection, StateIncrement,
                                     child_context,
                                     current_context, set_current_context)

_NOWRAP_ATTR = "_titanax_nowrap"


def nowrap(method: Callable) -> Callable:
    """Marks a public Module method that must not open a child context (e.g. introspection)."""
    setattr(method, _NOWRAP_ATTR, True)
    return method


def _wrap_method(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self: "Module", *args, **kwargs):
        context = current_context()
        if context is not None and context.module is self:
            return method(self, *args, **kwargs)
        if context is None:
            raise errors.ModuleError(
                f"{type(self).__qualname__}.{method.__name__} needs an InvocationContext",
                path=self.path, suggestion="call the root module through functional(...), or in "
                                           "tests through titanax.modules.testing.bind(...)")
        if self._parent is not None and context.module is self._parent:
            with set_current_context(child_context(self.name)) as child:
                with jax.named_scope(child.name):
                    return self._call_in_own_context(method, args, kwargs)
        raise errors.ModuleError(
            f"{type(self).__qualname__}.{method.__name__} was called from the context of "
            f"{context.path!r}, which is not its parent", path=self.path,
            suggestion="a module may only call its own children; pass values through the parent")
    wrapper.__wrapped_by_titanax__ = True
    return wrapper


class Module(Configurable):
    """A node of a model tree. Subclasses add children in ``__init__`` and compute in methods."""

    class Config(Configurable.Config):
        # The module's name among its parent's children (set by _add_child). None: the class name
        # (for a root module; child configs held in fields stay unnamed until added).
        name: Optional[str] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for attr_name, value in list(vars(cls).items()):
            if attr_name.startswith("_") or not inspect.isfunction(value):
                continue
            if getattr(value, _NOWRAP_ATTR, False) or getattr(value, "__wrapped_by_titanax__",
                                                              False):
                continue
            if any(getattr(getattr(base, attr_name, None), _NOWRAP_ATTR, False)
                   for base in cls.__mro__[1:]):
                setattr(value, _NOWRAP_ATTR, True)  # Overrides of structural methods stay so.
                continue
            setattr(cls, attr_name, _wrap_method(value))

    def __init__(self, cfg: Optional["Module.Config"] = None, *, parent: Optional["Module"] = None,
                 **fields: Any):
        super().__init__(cfg, **fields)
        self._parent = parent
        self._children: Dict[str, Module] = {}
        self.name = self.config.name or type(self).__name__

    def _add_child(self, name: str, child_config: "Module.Config", **kwargs: Any) -> "Module":
        """Builds child ``name`` from ``child_config`` (a copy, with its name set)."""
        if name in self._children:
            raise errors.ModuleError(f"child {name!r} already exists", path=f"{self.path}/{name}",
                                     suggestion="give each child a unique name")
        if not isinstance(child_config, Module.Config):
            raise errors.ModuleError(
                f"child {name!r} needs a Module config, got {type(child_config).__qualname__}",
                path=f"{self.path}/{name}")
        child_config = self._prepare_child_config(child_config.clone(name=name))
        child = child_config.instantiate(parent=self, **kwargs)
        self._children[name] = child
        return child

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``module(x)`` is ``module.forward(x)``."""
        return self.forward(*args, **kwargs)

    def _call_in_own_context(self, method: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
        """Runs ``method`` once this module's context is current (hook: e.g. remat)."""
        return method(self, *args, **kwargs)

    def _prepare_child_config(self, child_config: "Module.Config") -> "Module.Config":
        """Hook for subclasses to cascade settings (dtype, initializers) into a child config."""
        return child_config

    def __getattr__(self, name: str) -> Any:
        children = self.__dict__.get("_children", {})
        if name in children:
            return children[name]
        raise AttributeError(f"{type(self).__qualname__} {self.__dict__.get('name')!r} has no "
                             f"attribute or child {name!r}")

    @property
    def children(self) -> Dict[str, "Module"]:
        return dict(self._children)

    @property
    def parent(self) -> Optional["Module"]:
        return self._parent

    @property
    def path(self) -> str:
        """``root/child/grandchild``."""
        if self._parent is None:
            return self.name
        return f"{self._parent.path}/{self.name}"

    # --- Implicit inputs and outputs (valid only inside this module's own context) -------------

    def _own_context(self) -> InvocationContext:
        context = current_context()
        if context is None or context.module is not self:
            where = context.path if context is not None else "no context"
            raise errors.ModuleError(
                f"implicit inputs of {self.path!r} were read outside its own call ({where})",
                path=self.path, suggestion="read self.parameters / self.prng_key only inside "
                                           "this module's methods")
        return context

    @property
    def parameters(self) -> Dict[str, Any]:
        """This call's params and state (local view inside shard_map). Params stored sharded by
        FSDP come back whole, gathered on this first read of the call (gather_on_use.py)."""
        context = self._own_context()
        if context.gathered_state is None:
            context.gathered_state = gather_on_use.gathered(context.state)
        return context.gathered_state

    @property
    def state(self) -> Dict[str, Any]:
        return self._own_context().state

    @property
    def prng_key(self) -> jax.Array:
        key = self._own_context().prng_key
        if key is None:
            raise errors.ModuleError("this call has no PRNG key", path=self.path,
                                     suggestion="pass prng_key to functional()")
        return key

    @property
    def is_training(self) -> bool:
        return self._own_context().is_training

    def add_summary(self, name: str, value: Any) -> None:
        """Records a value to log, under this module's path."""
        self._own_context().output_collection.summaries[name] = value

    def add_state_update(self, name: str, value: Any, *, increment: bool = False) -> None:
        """Records a new value for non-trained state ``name`` of this module; with
        ``increment``, an amount to add to the *stored* value instead. (The layer reads its
        params cast to the compute dtype: a bfloat16 copy plus a small step would round the step
        away, while the stored float32 value plus the step keeps it.)"""
        if increment:
            value = StateIncrement(value)
        self._own_context().output_collection.state_updates[name] = value

    def add_module_output(self, name: str, value: Any) -> None:
        """Records an intermediate value the caller may want (e.g. attention probabilities)."""
        self._own_context().output_collection.module_outputs[name] = value

    def collected_outputs(self) -> Dict[str, Any]:
        """The module outputs this call's children have written so far (nested by child name,
        a Repeat's stacked over its layers)."""
        return self._own_context().output_collection.module_outputs


def functional(module: Module, prng_key: Optional[jax.Array], state: Any,
               inputs: Any = (), *, method: Union[str, Callable[..., Any]] = "forward",
               is_training: bool,
               drop_output_collections: Sequence[str] = ()) -> Tuple[Any, OutputCollection]:
    """Calls ``module.<method>`` purely: returns ``(outputs, OutputCollection)``.

    ``inputs`` is a tuple of positional args or a dict of keyword args. Nothing is read from or
    left on the context stack, so the call composes with every jax transformation. ``method``
    may also be a function ``fn(module, *inputs)``: it runs in the module's context as one of its
    methods would (an objective's loss written on the model's primitives: train/objective.py).
    """
    context = InvocationContext(name=module.name, module=module, state=state,
                                is_training=is_training, prng_key=prng_key,
                                output_collection=OutputCollection())
    wrapped = method if callable(method) else getattr(type(module), method)
    raw = getattr(wrapped, "__wrapped__", wrapped)
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), {})
    with set_current_context(context):
        with jax.named_scope(module.name):
            outputs = module._call_in_own_context(raw, args, kwargs)  # pylint: disable=protected-access
    collection = context.output_collection
    for name in drop_output_collections:
        setattr(collection, name, {})
    return outputs, collection


def scan_in_context(fn: Callable[[Any, Any], Tuple[Any, Any]], *, carry: Any, xs: Any,
                    child_name: str, num_iterations: int,
                    remat_policy: Optional[Callable] = None,
                    unroll: Union[bool, int] = 1,
                    key_offset: Optional[Any] = None) -> Tuple[Any, Any]:
    """``lax.scan`` over stacked params of child ``child_name`` of the current module.

    Iteration ``i`` runs ``fn(carry, x_i)`` in a copy of the current context whose child
    ``child_name`` sees slice ``i`` of its stacked state and a key derived from ``i``; the child's
    summaries / state updates come back stacked along a leading axis, under ``child_name``.
    With ``remat_policy`` the body is wrapped in ``jax.checkpoint`` with that policy; ``unroll``
    is ``lax.scan``'s (True: straight-line code, no loop; state holding FSDP's ``GatherOnUse``
    shards always runs as a loop, its gathers never saved for backward). With ``key_offset`` (an int or traced
    int) iteration ``i``'s key is ``fold_in(key, key_offset + i)`` instead of the ``i``-th split,
    so every slice of a stack run with its offset draws the keys of its layers' places.
    """
    context = current_context()
    if context is None:
        raise errors.ModuleError("scan_in_context needs a module context", path=child_name)
    stacked_state = context.state[child_name]
    base_key = context.prng_key
    if base_key is None:
        keys = [None] * num_iterations
    elif key_offset is not None:
        keys = jax.vmap(lambda i: jax.random.fold_in(base_key, i))(
            key_offset + jnp.arange(num_iterations))
    else:
        keys = jax.random.split(base_key, num_iterations)

    def body(carry_in, per_iteration):
        state_i, key_i, x_i = per_iteration
        iteration_context = context.clone(state={**context.state, child_name: state_i},
                                          prng_key=key_i, output_collection=OutputCollection())
        with set_current_context(iteration_context):
            carry_out, y = fn(carry_in, x_i)
        collection = iteration_context.output_collection
        return carry_out, (y, _child_outputs(collection, child_name))

    fsdp_axes = gather_on_use.gathered_axes(stacked_state)
    if fsdp_axes:
        # FSDP gathers each iteration's params inside the loop. Unrolled, XLA is free to
        # schedule every gather up front and hold all layers' weights at once (measured: 10.9
        # layers' worth of temp memory, 2.9 as a loop; benchmarks/fsdp_memory.py), so it stays
        # a loop; and the gathered params are recomputed for backward, never saved.
        unroll = 1
        if context.is_training:
            remat_policy = gather_on_use.never_saving_gathered(remat_policy, fsdp_axes)
    if remat_policy is not None:
        body = jax.checkpoint(body, policy=remat_policy, prevent_cse=False)
    keys_xs = keys if base_key is not None else None
    carry, (ys, stacked_outputs) = jax.lax.scan(body, carry, (stacked_state, keys_xs, xs),
                                                length=num_iterations, unroll=unroll)
    parent_collection = context.output_collection
    child_collection = parent_collection.add_child(child_name)
    for field in ("summaries", "state_updates", "module_outputs"):
        getattr(child_collection, field).update(getattr(stacked_outputs, field))
    return carry, ys


def _child_outputs(collection: OutputCollection, child_name: str) -> OutputCollection:
    return OutputCollection(summaries=collection.summaries.get(child_name, {}),
                            state_updates=collection.state_updates.get(child_name, {}),
                            module_outputs=collection.module_outputs.get(child_name, {}))
