"""``FlaxNNX``: a Flax NNX module trained by Titanax (flax_module.py has what both adapters do).

The factory builds the module from its arguments and an ``nnx.Rngs`` -- the adapter's: seeded
with the run's init key, so the params are exactly what ``factory(..., rngs=nnx.Rngs(key))``
makes in plain Flax::

    def make_gpt(*, vocab_size: int, num_layers: int, rngs: nnx.Rngs) -> nnx.Module: ...

    model = FlaxNNX.default_config().set(
        module=config_for_function(make_gpt).set(vocab_size=256, num_layers=4),
        example_inputs={"input_ids": "int32[2,16]"})

The factory's ``rngs`` argument is left to the adapter (its config shows a placeholder). On
every call the module is rebuilt from its graph and this call's values (``nnx.merge``; pure, so
``jit``, ``grad``, ``scan`` and ``shard_map`` compose with it), put in training or evaluation
mode (``module.train()`` / ``module.eval()``: Dropout's ``deterministic``, BatchNorm's
``use_running_average``, plus the call's own keyword, flax_module.py), its RNG streams' keys made
from this call's Titanax key, and its new ``BatchStat`` (and any other non-param, non-RNG
``Variable``) values read back as state updates. A variable that appears, disappears or changes
shape during the call is refused: Titanax holds the state the module had at init. Values the
module ``sow``s (``nnx.Intermediate``) are dropped.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from titanax import errors
from titanax.config import config_for_function
from titanax.config.configurable import FunctionConfigBase
from titanax.modules.adapters.flax_module import FlaxModule, FlaxVariable, describe_factory
from titanax.modules.context import name_key


def rngs_given_by_the_adapter() -> None:
    """Placeholder of a factory's ``rngs``: FlaxNNX passes the module its ``nnx.Rngs`` there
    (seeded with the run's init key) and calls the factory itself."""
    return None


def _missing_rngs(factory: Any) -> Optional[str]:
    """Why ``factory`` cannot be FlaxNNX's (None: it can): it must take ``rngs``."""
    if isinstance(factory, FunctionConfigBase) and "rngs" not in factory.keys():
        return (f"the factory {describe_factory(factory)} takes no 'rngs' argument: FlaxNNX "
                "seeds the module's params with the run's init key through it (give it an "
                "'rngs: nnx.Rngs' keyword argument and build the module with it)")
    return None


def _kind(variable: nnx.Variable) -> str:
    if isinstance(variable, nnx.Param):
        return "param"
    if isinstance(variable, nnx.RngState):
        return "rng"
    return "state"


def _path(key: Tuple[Any, ...]) -> str:
    return "/".join(str(part) for part in key)


class FlaxNNX(FlaxModule):
    """A Flax NNX module as a Titanax model (see the module docstring)."""

    class Config(FlaxModule.Config):

        def _validate_values(self):
            yield from super()._validate_values()
            problem = _missing_rngs(self.module)
            if problem:
                yield "module", problem

        def _checked_value(self, name, value):
            value = super()._checked_value(name, value)
            if name == "module" and isinstance(value, FunctionConfigBase) \
                    and "rngs" in value.keys() and not isinstance(value.rngs, FunctionConfigBase):
                value.rngs = config_for_function(rngs_given_by_the_adapter)
            return value

    # --- The module --------------------------------------------------------------------------

    def _build(self, rngs: nnx.Rngs) -> nnx.Module:
        problem = _missing_rngs(self.config.module)
        if problem:
            raise errors.ModuleError(problem, path="model.module",
                                     suggestion="a Linen module goes in FlaxLinen")
        with nnx.use_eager_sharding(False):  # Titanax places the arrays, not Flax.
            return self._from_factory(nnx.Module, type_name="flax.nnx.Module",
                                      other_adapter="a flax.linen module goes in FlaxLinen",
                                      rngs=rngs)

    @functools.cached_property
    def _abstract_module(self) -> nnx.Module:
        """The module with shapes for values (built once: nothing is computed)."""
        return nnx.eval_shape(lambda: self._build(nnx.Rngs(0)))

    @functools.cached_property
    def _graph(self) -> Tuple[Any, List[Tuple[Tuple[Any, ...], nnx.Variable]]]:
        """The module's graph and its abstract variables, by Flax path."""
        graphdef, state = nnx.split(self._abstract_module)
        return graphdef, list(nnx.to_flat_state(state))

    def _abstract_variables(self) -> List[FlaxVariable]:
        out = []
        for key, variable in self._graph[1]:
            value = variable.get_value()
            names = variable.get_metadata().get("out_sharding")
            out.append(FlaxVariable(
                path=_path(key), key=tuple(key), kind=_kind(variable),
                shape=tuple(value.shape), dtype=value.dtype,
                logical_axes=tuple(names) if names else None))
        return out

    def _init_values(self, key):
        module = self._build(nnx.Rngs(key))
        return {tuple(k): v.get_value() for k, v in nnx.to_flat_state(nnx.state(module))
                if _kind(v) != "rng"}

    def _call_signature(self):
        return type(self._abstract_module).__call__

    def _mode_text(self) -> str:
        return "module.train() / module.eval() (Dropout.deterministic, BatchNorm." \
               "use_running_average)"

    # --- Calls -------------------------------------------------------------------------------

    def _run(self, values: Dict[str, Any], call: Callable[..., Any], inputs: Sequence[Any], *,
             is_training: bool, key: Optional[jax.Array]):
        graphdef, abstract = self._graph
        flat = []
        for path_key, variable in abstract:
            path = _path(path_key)
            if _kind(variable) == "rng":
                value = self._rng_value(path, variable, key)
            else:
                value = values[path]
            flat.append((path_key, variable.replace(value)))
        module = nnx.merge(graphdef, nnx.from_flat_state(flat))
        if is_training:
            module.train()
        else:
            module.eval()
        outputs = call(module, *inputs)
        after = {tuple(k): v for k, v in nnx.to_flat_state(nnx.state(module))
                 if not isinstance(v, nnx.Intermediate)}
        self._check_unchanged(abstract, after, values)
        new_state = {}
        if is_training:
            new_state = {_path(k): v.get_value() for k, v in after.items()
                         if _kind(v) == "state"}
        return outputs, new_state

    def _rng_value(self, path: str, variable: nnx.Variable, key: Optional[jax.Array]):
        """A fresh key (or a zero count) for one RNG variable: from this call's key, the
        stream's name and the variable's path, so every layer of a stack draws its own."""
        shape = tuple(variable.get_value().shape)
        if isinstance(variable, nnx.RngCount):
            return jnp.zeros(shape, jnp.uint32)
        stream = self.stream_key(key, variable.get_metadata().get("tag") or "default")
        typed = jax.random.wrap_key_data(name_key(stream, path))
        if not shape:
            return typed
        return jax.random.split(typed, math.prod(shape)).reshape(shape)

    def _check_unchanged(self, abstract, after, values: Dict[str, Any]) -> None:
        """The module holds the variables it was given, of the shapes it was given (local
        shapes: a module that splits over the TP axis holds its shards)."""
        before = {tuple(k): v for k, v in abstract}
        appeared = [_path(k) for k in after if k not in before]
        gone = [_path(k) for k in before if k not in after]
        reshaped = [f"{_path(k)} {tuple(values[_path(k)].shape)} -> {tuple(v.get_value().shape)}"
                    for k, v in after.items() if k in before and _kind(v) != "rng"
                    and tuple(v.get_value().shape) != tuple(values[_path(k)].shape)]
        if appeared or gone or reshaped:
            what = "; ".join(part for part in (
                f"new: {', '.join(appeared[:4])}" if appeared else "",
                f"gone: {', '.join(gone[:4])}" if gone else "",
                f"reshaped: {', '.join(reshaped[:4])}" if reshaped else "") if part)
            raise errors.ModuleError(
                f"{self.title} changed the structure of its variables when called ({what}); "
                "Titanax trains and checkpoints the variables the module has after init",
                path="model.module",
                suggestion="create every Param / BatchStat in the module's __init__ with its "
                           "final shape (no variables made on the first call)")
