"""``FlaxLinen``: a Flax Linen module trained by Titanax (flax_module.py has what both adapters
do).

The factory returns the module (a Linen module is a description: no params yet)::

    def make_cnn(*, num_classes: int = 10) -> nn.Module: ...

    model = FlaxLinen.default_config().set(
        module=config_for_function(make_cnn), inputs=("image",),
        example_inputs={"image": "float32[2,28,28,1]"}, loss=ClassificationLoss.default_config())

Its params are what ``module.init({"params": key}, *example_inputs)`` makes with the run's init
key -- the module initialised in evaluation mode, as a plain Flax user would -- held at their
variables' paths, collection first (``params/Conv_0/kernel``, ``batch_stats/BatchNorm_0/mean``).
Every collection but ``params`` is mutable state: while training, ``apply`` runs with those
collections mutable and their new values become state updates (``intermediates``, where
``sow`` writes, is not kept). The call's RNG streams (``rng_streams``, e.g. dropout) get this
call's Titanax key folded with each stream's name. A call that asks for a param the init did
not make, or one of another shape, is refused: Titanax holds the variables of the init.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta

from titanax import errors
from titanax.config.configurable import FunctionConfigBase
from titanax.modules.adapters.flax_module import (FlaxModule, FlaxVariable, describe_factory,
                                                  set_at)
from titanax.parallel.sharding import path_string

# Collections a Linen module writes as outputs of a call, not state (``sow``).
OUTPUT_COLLECTIONS = ("intermediates",)
# Flax's errors for a call whose variables differ from the ones it was given.
_STRUCTURE_ERRORS = (flax.errors.ScopeParamNotFoundError, flax.errors.ScopeParamShapeError,
                     flax.errors.ScopeCollectionNotFound, flax.errors.ScopeVariableNotFoundError)


class FlaxLinen(FlaxModule):
    """A Flax Linen module as a Titanax model (see the module docstring)."""

    stack_name_depth = 2  # The collection, then the submodule.

    class Config(FlaxModule.Config):
        # The RNG streams the module draws from while training: each gets this call's key
        # (Titanax's dropout stream, folded with the step and the data shard) folded with
        # its name.
        rng_streams: Sequence[str] = ("dropout",)

        def _validate_values(self):
            yield from super()._validate_values()
            factory = self.module
            if isinstance(factory, FunctionConfigBase) and "rngs" in factory.keys():
                yield "module", (f"the factory {describe_factory(factory)} takes 'rngs', as an "
                                 "NNX module's does: a Linen module gets its RNGs at init and "
                                 "apply (an NNX module goes in titanax.modules.FlaxNNX)")

    def _refuse_tensor_parallel(self, axes):
        raise errors.PlanError(
            f"{self.title}: Linen checks every param a module reads against the shape its init "
            f"made, so a param split over the tensor-parallel axis {axes[0]!r} cannot reach the "
            "module", path="plan.tensor_parallel",
            suggestion="train it with data parallelism, ZeRO-1/2 or FSDP "
                       "(--config.plan.tensor_parallel=None); a module that splits itself over "
                       "a TP axis runs through FlaxNNX")

    # --- The module --------------------------------------------------------------------------

    @functools.cached_property
    def linen_module(self) -> nn.Module:
        return self._from_factory(nn.Module, type_name="flax.linen.Module",
                                  other_adapter="an NNX module goes in FlaxNNX")

    def _init(self, key: jax.Array) -> Dict[str, Any]:
        inputs = [jnp.zeros(s.shape, s.dtype) for s in
                  (self.example_inputs()[name] for name in self.config.inputs)]
        try:
            variables = self.linen_module.init({"params": key}, *inputs,
                                               **self._mode_kwargs(False))
        except errors.TitanaxError:
            raise
        except Exception as e:
            raise errors.ModuleError(
                f"{self.title}.init failed on the example inputs "
                f"{dict(self.config.example_inputs)}: {type(e).__name__}: {e}", path="model",
                suggestion="make model.example_inputs a batch the module accepts (and "
                           "model.inputs the entries its call takes, in order)") from None
        return {name: value for name, value in variables.items()
                if name not in OUTPUT_COLLECTIONS}

    @functools.cached_property
    def _boxed(self) -> List[Tuple[Tuple[Any, ...], Any]]:
        """``(Flax key, value or metadata box)`` of every variable, shapes only."""
        abstract = jax.eval_shape(lambda: self._init(jax.random.PRNGKey(0)))
        flat = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=meta.is_axis_metadata)[0]
        return [(tuple(path_string(path).split("/")), leaf) for path, leaf in flat]

    def _abstract_variables(self) -> List[FlaxVariable]:
        out = []
        for key, leaf in self._boxed:
            value = leaf.unbox() if meta.is_axis_metadata(leaf) else leaf
            names = getattr(leaf, "names", None)
            out.append(FlaxVariable(
                path="/".join(key), key=key, kind="param" if key[0] == "params" else "state",
                shape=tuple(value.shape), dtype=value.dtype,
                logical_axes=tuple(names) if names else None))
        return out

    def _init_values(self, key):
        flat = jax.tree_util.tree_flatten_with_path(meta.unbox(self._init(key)))[0]
        return {tuple(path_string(path).split("/")): value for path, value in flat}

    def _call_signature(self):
        return type(self.linen_module).__call__

    # --- Calls -------------------------------------------------------------------------------

    def _run(self, values: Dict[str, Any], call: Callable[..., Any], inputs: Sequence[Any], *,
             is_training: bool, key: Optional[jax.Array]):
        variables: Dict[str, Any] = {}
        for variable in self.stored_variables():
            set_at(variables, variable.path, values[variable.path])
        state = sorted({v.key[0] for v in self.stored_variables() if v.kind == "state"})
        mutable = state if is_training and state else False
        rngs = ({stream: self.stream_key(key, stream) for stream in self.config.rng_streams}
                if key is not None else {})
        try:
            result = self.linen_module.apply(variables, *inputs, rngs=rngs, mutable=mutable,
                                             method=call)
        except _STRUCTURE_ERRORS as e:
            raise errors.ModuleError(
                f"{self.title} asked for variables its init did not make, or of other shapes: "
                f"{e}", path="model.module",
                suggestion="make every param in init with its final shape (params whose "
                           "shapes depend on the input must see inputs of the example's shapes "
                           "in model.example_inputs)") from None
        except flax.errors.InvalidRngError as e:
            raise errors.ModuleError(
                f"{self.title} draws from an RNG stream it was not given: {e}",
                path="model.rng_streams",
                suggestion="add the stream's name to model.rng_streams") from None
        if not mutable:
            return result, {}
        outputs, updated = result
        new_state = {path_string(path): value for path, value in
                     jax.tree_util.tree_flatten_with_path(updated)[0]}
        self._check_state(new_state, values)
        return outputs, new_state

    def _check_state(self, new_state: Dict[str, Any], values: Dict[str, Any]) -> None:
        """The mutable collections come back as they were given (local shapes)."""
        expected = {v.path: values[v.path].shape for v in self.stored_variables()
                    if v.kind == "state"}
        wrong = sorted(set(new_state) ^ set(expected)) + sorted(
            path for path, value in new_state.items()
            if path in expected and tuple(value.shape) != tuple(expected[path]))
        if wrong:
            raise errors.ModuleError(
                f"{self.title} changed the structure of its mutable collections when called "
                f"({', '.join(wrong[:4])}); Titanax holds the variables of the init",
                path="model.module",
                suggestion="create every variable in init with its final shape")
