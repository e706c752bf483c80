"""A Flax module as a Titanax layer: what the NNX and Linen adapters share.

The adapted module is built from the config tree -- a factory and its arguments given with
``config_for_function`` -- so experiments, golden dumps and ``--config.model.module.<arg>=``
overrides work as for Titanax's own models. From there the adapter (``FlaxNNX`` in flax_nnx.py,
``FlaxLinen`` in flax_linen.py) makes the module a Titanax model:

- **Params** become ``ParameterSpec``s at the Flax state paths (``blocks/attn/qkv/kernel``,
  ``params/Conv_0/kernel``), so TP rules, ZeRO overrides, ``--explain``, checkpoints and
  ``restore_mode=params`` address them. Each spec carries the param's partitioning metadata as
  logical axis names (mapped to mesh axes by ``Plan.Config.logical_axis_rules``), and a param
  the module runs through a layer scan is marked stacked (module_trace.py).
- **Init** is the module's own: the factory is called with the run's init key (NNX) or the
  module's ``init`` runs on the example inputs (Linen), under ``jit``, into the params' shards.
- **Calls** read the params, the PRNG key and ``is_training`` from the InvocationContext: the
  key feeds the module's RNG streams (dropout), ``is_training`` its train / deterministic flags.
- **Mutable collections** (Linen ``batch_stats``, NNX ``BatchStat``) are non-trained params:
  read in float32 without gradient, their new values are state updates (steps from the stored
  value under a lower compute precision), averaged over microbatches and data shards like every
  layer's (train/state_updates.py).
- **FSDP** shards reach the module as values it reads whole (flax_gather.py): gathered one layer
  at a time inside its scan, at their use otherwise; the forward and each iteration of the
  module's scans are rematerialised so that no gathered value is kept for the backward pass
  (layer_remat.py).
- **Pipelines**: ``stage(fn)`` makes a ``Stage``'s ``fwd`` from a function of the module.

A module written for one device has no collectives, so splitting its weights over a TP axis
would leave it computing on pieces: the adapters refuse tensor parallelism unless the module
calls ``titanax.parallel.collectives`` over the TP axis itself (seen in its trace; FlaxNNX
only: Linen checks every param against its init's shape, so a split one cannot reach it).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, PartitionSpec

from titanax import errors
from titanax.config import REQUIRED, InstantiableConfig, Required
from titanax.modules import gather_on_use
from titanax.modules.adapters import flax_gather, layer_remat, module_trace
from titanax.modules.adapters.objectives import CausalLMLoss, Objective
from titanax.modules.base_layer import BaseLayer, ParameterSpec
from titanax.modules.context import StateIncrement, name_key
from titanax.modules.module import nowrap
from titanax.parallel.sharding import path_string

# Keyword arguments of a module's call that say "training" (get ``is_training``) or "evaluation"
# (get ``not is_training``), looked for in this order when ``mode_argument="auto"``.
TRAINING_ARGUMENTS = ("train", "training", "is_training")
EVALUATION_ARGUMENTS = ("deterministic", "use_running_average", "inference", "eval")

_EXAMPLE = re.compile(r"^\s*([a-z0-9_]+)\s*\[\s*(\d+(?:\s*,\s*\d+)*)?\s*\]\s*$")


@dataclasses.dataclass(frozen=True)
class FlaxVariable:
    """One array of the module's state, as the adapter sees it."""

    # The Titanax param path ("blocks/attn/kernel"): the Flax state path joined with "/".
    path: str
    # The Flax state path (NNX: a tuple of attribute names and list indices; Linen: the
    # collection, then the module names).
    key: Tuple[Any, ...]
    # "param" (trained), "state" (a mutable collection: a state update each training call),
    # "rng" (an NNX RNG stream's key or count: made afresh for every call, never stored).
    kind: str
    shape: Tuple[int, ...]
    dtype: Any
    # The partitioning metadata's names, one per dimension (None: none given).
    logical_axes: Optional[Tuple[Optional[str], ...]] = None


def parse_example(text: str) -> jax.ShapeDtypeStruct:
    """``"int32[2,16]"`` -> ``ShapeDtypeStruct((2, 16), int32)`` (``"float32[]"``: a scalar)."""
    match = _EXAMPLE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not '<dtype>[<dims>]', e.g. 'int32[2,16]'")
    dtype = jnp.dtype(match.group(1))
    dims = tuple(int(d) for d in match.group(2).split(",")) if match.group(2) else ()
    if 0 in dims:
        raise ValueError(f"{text!r} has a dimension of 0: give one small batch, e.g. 2 rows")
    return jax.ShapeDtypeStruct(dims, dtype)


def describe_factory(factory: Any) -> str:
    """``module.function`` of a factory config (for errors and --explain)."""
    fn = getattr(factory, "fn", None)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def set_at(tree: Dict[str, Any], path: str, value: Any) -> None:
    """``tree[a][b][c] = value`` for ``path = "a/b/c"`` (making the dicts on the way)."""
    *parents, leaf = path.split("/")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _decays(variable: FlaxVariable, per_layer_ndim: int) -> bool:
    """Weight decay for matrices and tables; none for biases and norm scales (the usual optax
    mask: by rank, and by name for a multi-dimensional bias), nor for mutable state."""
    name = variable.path.rsplit("/", 1)[-1]
    return variable.kind == "param" and per_layer_ndim >= 2 and name not in ("bias", "scale")


class FlaxModule(BaseLayer):
    """The base of ``FlaxNNX`` and ``FlaxLinen`` (see the module docstring)."""

    # How many leading parts of a param path name the submodule that holds it (--explain's
    # layer stacks): NNX ``blocks/...``; Linen ``params/ScanBlock_0/...``.
    stack_name_depth = 1

    class Config(BaseLayer.Config):
        # The factory of the module: config_for_function(make_model).set(<its arguments>).
        module: Required[InstantiableConfig] = REQUIRED
        # Batch entries passed to the module's call, positionally, in this order.
        inputs: Sequence[str] = ("input_ids",)
        # One small batch of those entries as '<dtype>[<dims>]' (e.g. {'input_ids':
        # 'int32[2,16]'}): the module is traced once on them, abstractly, to find the layer
        # stacks it scans over (Linen also initialises on them). Only the structure matters.
        example_inputs: Required[Dict[str, str]] = REQUIRED
        # What the module's outputs are trained on (adapters/objectives.py): CausalLMLoss
        # (logits), ClassificationLoss, ReturnedLoss (the module returns its loss).
        loss: Objective.Config = CausalLMLoss.default_config()
        # The keyword of the module's call that switches training and evaluation: 'auto' takes
        # the first of train / training / is_training (given is_training) or deterministic /
        # use_running_average / inference / eval (given its negation) that the call declares;
        # None passes none.
        mode_argument: Optional[str] = "auto"
        # (The TP axis comes from the run's axis binding. Only a module that calls
        # titanax.parallel.collectives over it -- a Megatron-style module, seen in its trace --
        # runs under tensor parallelism.)

        def _validate_values(self):
            yield from super()._validate_values()
            for name in ("dtype", "param_init"):
                if getattr(self, name) is not None:
                    yield name, ("the Flax module makes its own params (their dtypes and "
                                 "initializers are its factory's arguments, under "
                                 "model.module); leave it None: the run's precision casts for "
                                 "compute")
            if not self.inputs:
                yield "inputs", "name at least one batch entry to pass to the module"
            if isinstance(self.example_inputs, dict):
                for name in self.inputs:
                    if name not in self.example_inputs:
                        yield "example_inputs", (f"has no example of input {name!r} (inputs: "
                                                 f"{list(self.inputs)})")
                for name, text in self.example_inputs.items():
                    if name not in self.inputs:
                        yield "example_inputs", (f"{name!r} is not one of the inputs "
                                                 f"{list(self.inputs)}")
                    try:
                        parse_example(text)
                    except (ValueError, TypeError) as e:
                        yield f"example_inputs[{name!r}]", str(e)

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        self.objective: Objective = self.config.loss.instantiate()

    # --- What subclasses supply ------------------------------------------------------------------

    @property
    def title(self) -> str:
        """``FlaxNNX(pkg.make_model)``: the adapter and its factory, for errors."""
        return f"{type(self).__name__}({describe_factory(self.config.module)})"

    def _from_factory(self, module_type: type, *, type_name: str, other_adapter: str,
                      **extra: Any) -> Any:
        """The factory's module (the factory called with ``extra``, and with the TP axis as
        ``tp_axis`` when it takes one), checked to be a ``module_type``; the factory's own
        errors come back naming it."""
        factory = self.config.module
        if "tp_axis" in factory.keys() and factory.tp_axis is None and self._tensor_axes():
            # A Megatron-style factory is told the TP axis it splits itself over (the run's
            # axis binding's; the module is built inside the run's binding).
            extra.setdefault("tp_axis", self._tensor_axes()[0])
        try:
            module = factory.instantiate(**extra)
        except errors.TitanaxError:
            raise
        except Exception as e:  # The user's factory: name it and what it was given.
            raise errors.ModuleError(
                f"the factory {describe_factory(factory)} raised {type(e).__name__}: {e}",
                path="model.module", suggestion="check its arguments under model.module") from e
        if not isinstance(module, module_type):
            raise errors.ModuleError(
                f"the factory {describe_factory(factory)} returned "
                f"{type(module).__module__}.{type(module).__qualname__}, not a {type_name}",
                path="model.module",
                suggestion=f"return the module itself ({other_adapter})")
        return module

    def _abstract_variables(self) -> List[FlaxVariable]:
        """Every array of the module's state (shapes only), in a fixed order."""
        raise NotImplementedError

    def _init_values(self, key: jax.Array) -> Dict[Tuple[Any, ...], jax.Array]:
        """``{Flax key: array}`` of the params and mutable state, initialised from ``key``."""
        raise NotImplementedError

    def _run(self, values: Dict[str, Any], call: Callable[..., Any], inputs: Sequence[Any], *,
             is_training: bool, key: Optional[jax.Array]) -> Tuple[Any, Dict[str, jax.Array]]:
        """``(call(module, *inputs), {path: new value of each mutable state variable})`` with
        the module holding ``values`` (``{path: array}`` of every param and state variable);
        the new values only when training."""
        raise NotImplementedError

    def _call_signature(self) -> Optional[Callable]:
        """The module's ``__call__`` (for the mode argument)."""
        raise NotImplementedError

    # --- The module's state as Titanax params ----------------------------------------------------

    @functools.cached_property
    def variables(self) -> List[FlaxVariable]:
        """Every array of the module's state (params, mutable state, RNG streams)."""
        return self._abstract_variables()

    @functools.cached_property
    def stacked_paths(self) -> Tuple[str, ...]:
        """Params the module runs through a layer scan (their leading dimension is the layer),
        read off one abstract trace of the module on its example inputs (module_trace.py)."""
        values = self._abstract_values()
        # A module that calls the collectives needs its TP axis bound: one device's worth here
        # (the whole params are that device's shard).
        program = self._trace(values, axis_sizes={a: 1 for a in self._tensor_axes()})
        order = sorted(values)  # The flattening order of a dict: its sorted keys.
        positions = module_trace.scanned_positions(program)
        return tuple(order[i] for i in sorted(positions) if i < len(order))

    def _tensor_axes(self) -> Tuple[str, ...]:
        """The mesh axes the run's axis binding splits weights over (TP's)."""
        return self.axis_binding.tensor_axes()

    def _trace(self, values: Dict[str, Any], *, axis_sizes: Dict[str, int],
               param_specs: Optional[Dict[str, PartitionSpec]] = None) -> Any:
        """The module's program on its example inputs (``jax.make_jaxpr``: shapes only), with
        ``values`` the params' whole shapes; under TP axes (``axis_sizes``), in an abstract
        mesh of them, the params split by ``param_specs`` (the module sees its shards)."""
        inputs = [self.example_inputs()[name] for name in self.config.inputs]

        def trace(values, inputs):
            return self._run(values, self._full_call(False), inputs, is_training=False,
                             key=None)[0]

        if axis_sizes:
            specs = {path: (param_specs or {}).get(path, PartitionSpec()) for path in values}
            trace = jax.shard_map(trace, mesh=AbstractMesh(tuple(axis_sizes.values()),
                                                           tuple(axis_sizes)),
                                  in_specs=(specs, PartitionSpec()), out_specs=PartitionSpec(),
                                  check_vma=False)
        split = {a: n for a, n in axis_sizes.items() if n > 1}
        try:
            return jax.make_jaxpr(trace)(values, inputs)
        except errors.TitanaxError:
            raise
        except Exception as e:  # The user's module: say which one failed on what.
            raise errors.ModuleError(
                f"{self.title} failed when called on its example inputs "
                f"{dict(self.config.example_inputs)}"
                + "".join(f" (split over {a!r} of {n} devices)" for a, n in split.items())
                + f": {type(e).__name__}: {e}", path="model",
                suggestion="check the module's arguments (model.module.*), and that "
                           "model.example_inputs is a batch it accepts (model.inputs: the "
                           "entries its call takes, in order)") from None

    def _abstract_values(self) -> Dict[str, jax.ShapeDtypeStruct]:
        """``{path: shape and dtype}`` of the params and mutable state (checked first: float
        arrays with elements)."""
        for variable in self.stored_variables():
            if 0 in variable.shape:
                raise errors.ModuleError(
                    f"{self.title}: {variable.path} has shape {tuple(variable.shape)}, with no "
                    "elements", path="model.module",
                    suggestion="check the module's sizes under model.module (a layer count or "
                               "width of 0)")
            if not jnp.issubdtype(variable.dtype, jnp.floating):
                raise errors.ModuleError(
                    f"{self.title}: {variable.path} holds {np.dtype(variable.dtype).name} values; "
                    "Titanax trains and averages float params and state", path="model",
                    suggestion="keep integer counters out of the module's variables (or store "
                               "them as floats)")
        return {v.path: jax.ShapeDtypeStruct(v.shape, v.dtype) for v in self.stored_variables()}

    @nowrap
    def stored_variables(self) -> List[FlaxVariable]:
        """The params and mutable state (what the train state holds; not the RNG streams)."""
        return [v for v in self.variables if v.kind != "rng"]

    @nowrap
    def example_inputs(self) -> Dict[str, jax.ShapeDtypeStruct]:
        return {name: parse_example(text) for name, text in self.config.example_inputs.items()}

    @nowrap
    def create_parameter_specs_recursively(self) -> Dict[str, Any]:
        """One ParameterSpec per param and mutable state variable, nested by the Flax path."""
        return self._specs

    @functools.cached_property
    def _specs(self) -> Dict[str, Any]:
        stacked = set(self.stacked_paths)
        specs: Dict[str, Any] = {}
        for variable in self.stored_variables():
            layers = 1 if variable.path in stacked else 0
            per_layer = len(variable.shape) - layers
            set_at(specs, variable.path, ParameterSpec(
                shape=tuple(variable.shape), dtype=jnp.dtype(variable.dtype),
                mesh_axes=(None,) * len(variable.shape),
                weight_decay_scale=1.0 if _decays(variable, per_layer) else 0.0,
                stacked_dims=layers, logical_axes=self._logical_axes(variable, layers),
                layer_state=variable.kind == "state"))
        return specs

    def _logical_axes(self, variable: FlaxVariable, layers: int):
        names = variable.logical_axes
        if names is None:
            return None
        names = tuple(names)
        if len(names) == len(variable.shape) - layers:  # A stack made without naming its axis.
            names = (None,) * layers + names
        if len(names) != len(variable.shape):
            raise errors.ModuleError(
                f"{self.title}: the partitioning metadata of {variable.path} names {names} for a "
                f"param of shape {tuple(variable.shape)}", path="model",
                suggestion="give one logical name (or None) per dimension")
        return names

    @nowrap
    def initialize_parameters_recursively(self, prng_key: jax.Array,
                                          specs: Optional[Dict[str, Any]] = None
                                          ) -> Dict[str, Any]:
        """The module's own initialisation from ``prng_key`` (pure: runs under ``jit``)."""
        del specs
        values = self._init_values(prng_key)
        params: Dict[str, Any] = {}
        for variable in self.stored_variables():
            set_at(params, variable.path, values[variable.key])
        return params

    @nowrap
    def check_partition_specs(self, specs: Dict[str, Any], *, prefix: str = "",
                              mesh_shape: Optional[Dict[str, int]] = None) -> None:
        """Any layout of the data, ZeRO and FSDP axes runs (the adapter gathers what is split).
        The TP axis only reaches a module that communicates over it: the module is traced on
        its shards (``specs``: the layer layouts, the TP rules applied) in a mesh of the TP
        axis's size, and one that calls no collective over it is refused."""
        del prefix
        sizes = {a: int((mesh_shape or {}).get(a, 1)) for a in self._tensor_axes()}
        sizes = {a: n for a, n in sizes.items() if n > 1}
        if not sizes:
            return
        self._refuse_tensor_parallel(tuple(sizes))
        only_tp = lambda spec: PartitionSpec(*(e if e in sizes else None for e in spec))  # noqa: E731
        flat = {path_string(path): only_tp(spec) for path, spec in
                jax.tree_util.tree_flatten_with_path(
                    specs, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]}
        program = self._trace(self._abstract_values(), axis_sizes=sizes, param_specs=flat)
        silent = [a for a in sizes if a not in module_trace.communicated_axes(program)]
        if silent:
            tp_axis = silent[0]
            raise errors.PlanError(
                f"{self.title} is a module written for one device: it calls no collective over "
                f"the tensor-parallel axis {tp_axis!r}, so splitting its weights over that axis "
                "would leave each rank computing on a piece of every layer with nothing to join "
                "them", path="plan.tensor_parallel",
                suggestion="train it with data parallelism, ZeRO-1/2 or FSDP "
                           "(--config.plan.tensor_parallel=None), or have the module call "
                           "titanax.parallel.collectives over the TP axis it is given "
                           "(docs/flax.md)")

    def _refuse_tensor_parallel(self, axes: Tuple[str, ...]) -> None:
        """An adapter that cannot run on split weights at all raises here (Linen)."""
        del axes

    # --- Calls -----------------------------------------------------------------------------------

    def _mode_kwargs(self, is_training: bool) -> Dict[str, bool]:
        name = self.mode_argument
        if name is None:
            return {}
        return {name: (not is_training) if name in EVALUATION_ARGUMENTS else is_training}

    @functools.cached_property
    def mode_argument(self) -> Optional[str]:
        """The call's keyword that switches training and evaluation (None: none)."""
        given = self.config.mode_argument
        if given != "auto":
            return given
        try:
            parameters = inspect.signature(self._call_signature()).parameters
        except (TypeError, ValueError):
            return None
        for name in TRAINING_ARGUMENTS + EVALUATION_ARGUMENTS:
            if name in parameters:
                return name
        return None

    def _full_call(self, is_training: bool) -> Callable[..., Any]:
        kwargs = self._mode_kwargs(is_training)
        return lambda module, *inputs: module(*inputs, **kwargs)

    def _values_from_state(self, state: Any) -> Dict[str, Any]:
        """``{path: value}`` from this call's (nested) params, FSDP shards made readable."""
        state = flax_gather.for_flax(state)
        flat = jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda x: isinstance(x, flax_gather.FlaxGatherOnUse))[0]
        return {path_string(path): value for path, value in flat}

    def forward(self, batch: Dict[str, jax.Array]) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        """``loss(module(*inputs), batch)``: the module called in this call's mode on the batch
        entries ``inputs``, its mutable state written back as state updates."""
        cfg = self.config
        missing = [name for name in cfg.inputs if name not in batch]
        if missing:
            raise errors.DataError(
                f"{self.title} takes batch entries {list(cfg.inputs)}; the batch has no "
                f"{missing}", path="model.inputs",
                suggestion=f"the batch holds {sorted(batch)}: name those in model.inputs")
        values = self._values_from_state(self.state)
        given_state = {v.path: values[v.path] for v in self.stored_variables()
                       if v.kind == "state"}
        # Mutable state is not trained (no gradient), and the module reads it in float32: a
        # moving average's small steps would round away in a bfloat16 copy (and NNX writes its
        # new value back in the variable's dtype).
        values.update({path: jax.lax.stop_gradient(value.astype(jnp.float32))
                       for path, value in given_state.items()})
        is_training = self.is_training
        call = self._full_call(is_training)

        def run(values, inputs, key):
            return self._run(values, call, inputs, is_training=is_training, key=key)

        inputs, key = [batch[name] for name in cfg.inputs], self._own_context().prng_key
        axes = gather_on_use.gathered_axes(values)
        if axes and is_training:
            # Gathered weights are recomputed for the backward pass, never kept (DESIGN 7.2):
            # the whole forward, and each iteration of the module's own scans (one layer's
            # weights at a time; layer_remat.py).
            policy = gather_on_use.never_saving_gathered(None, axes)
            outputs, new_state = jax.checkpoint(
                layer_remat.with_scans_rematerialised(run, policy), policy=policy,
                prevent_cse=False)(values, inputs, key)
        else:
            outputs, new_state = run(values, inputs, key)
        if is_training:
            self._write_state_updates(new_state, given_state)
        return self.loss(outputs, batch)

    def _write_state_updates(self, new_state: Dict[str, jax.Array],
                             given: Dict[str, jax.Array]) -> None:
        """Each new value of a mutable state variable, as the state update of its param: the
        value itself when the module was given the stored float32 value, else the step from
        the (rounded) value it was given, added to the stored one (train/state_updates.py)."""
        updates = self._own_context().output_collection.state_updates
        for path, value in new_state.items():
            value = jax.lax.stop_gradient(value.astype(jnp.float32))
            if given[path].dtype != jnp.float32:
                value = StateIncrement(value - given[path].astype(jnp.float32))
            set_at(updates, path, value)

    def loss(self, outputs: Any, batch: Dict[str, jax.Array]):
        """``(loss, aux)`` of the module's outputs (a pipeline's last stage ends here)."""
        return self.objective(outputs, batch)

    def loss_weight(self, batch: Dict[str, jax.Array]) -> jax.Array:
        """What ``loss`` is a mean over (tokens, examples, weights)."""
        return self.objective.loss_weight(batch)

    @nowrap
    def input_limits(self):
        """The objective's limits on the ids it reads (checked on the host)."""
        return self.objective.input_limits(field_prefix="loss")

    # --- Pipelines -------------------------------------------------------------------------------

    @nowrap
    def stage(self, fn: Callable[..., Any]) -> Callable[[Any, Any], Any]:
        """A pipeline ``Stage``'s ``fwd(params_subset, x)`` that runs ``fn(module, x)``.

        ``fn`` calls the part of the module the stage owns, e.g. ``lambda m, batch:
        m.blocks[0](m.embed(batch["input_ids"]))``; the stage's ``param_filter`` names the same
        params (their Flax paths). Explicit stages run without a PRNG key and in evaluation
        mode (no dropout), the same in training and in evaluation; a module with mutable state
        is refused (a pipeline carries no state updates)."""
        written = [v.path for v in self.stored_variables() if v.kind == "state"]
        if written:
            raise errors.PlanError(
                f"{self.title} keeps mutable state ({', '.join(written[:4])}), which pipeline "
                "stages do not carry to the train state", path="plan.pipeline_parallel.stages",
                suggestion="train this module without pipeline_parallel (DP, ZeRO and FSDP "
                           "carry its state updates)")
        stored = self.stored_variables()

        def fwd(params: Any, x: Any) -> Any:
            given = self._values_from_state(params)
            # The module needs every param to exist; the ones other stages own are zeros here
            # (never read: XLA drops them).
            values = {v.path: given[v.path] if v.path in given else jnp.zeros(v.shape, v.dtype)
                      for v in stored}
            return self._run(values, fn, (x,), is_training=False, key=None)[0]

        fwd.__qualname__ = f"{type(self).__name__}.stage({getattr(fn, '__qualname__', fn)})"
        fwd.__module__ = getattr(fn, "__module__", type(self).__module__)
        return fwd

    # --- RNG streams -----------------------------------------------------------------------------

    @staticmethod
    def stream_key(key: Optional[jax.Array], stream: str) -> jax.Array:
        """The key of Flax RNG stream ``stream`` for this call: Titanax's key for the call (its
        ``dropout`` stream, folded with the step and the data shard) folded with the stream's
        name; a fixed key when the call has none (evaluation: nothing random runs)."""
        if key is None:
            return jax.random.PRNGKey(0)
        return name_key(key, stream)

    # --- --explain -------------------------------------------------------------------------------

    @nowrap
    def explain_lines(self, *, gathers: Optional[str]) -> str:
        """What --explain says of the adapted module: its variables, its layer stacks, and how
        FSDP gathers its params (``gathers``: the strategy's, None when stored whole)."""
        stored = self.stored_variables()
        params = [v for v in stored if v.kind == "param"]
        state = [v for v in stored if v.kind == "state"]
        stacked = set(self.stacked_paths)
        lines = [f"adapted Flax module {self.title}: {len(params)} params, "
                 + (f"{len(state)} mutable state arrays, written back as state updates each "
                    f"training step: {', '.join(v.path for v in state[:4])}"
                    + (", ..." if len(state) > 4 else "") if state else "no mutable state")]
        mode = self.mode_argument
        flags = [text for text in (self._mode_text(), f"__call__({mode}=...)" if mode else None)
                 if text]
        lines.append("  train / evaluation: " + ("; ".join(flags) if flags else
                                                 "the module takes no train / eval switch"))
        if stacked:
            groups: Dict[str, List[FlaxVariable]] = {}
            for variable in stored:
                if variable.path in stacked:
                    name = "/".join(variable.path.split("/")[:self.stack_name_depth])
                    groups.setdefault(name, []).append(variable)
            lines.append("  layer stacks (the module scans over their leading dimension): " + ", ".join(
                f"{name}/* ({len(members)} params, {members[0].shape[0]} layers)"
                for name, members in groups.items()))
        else:
            lines.append("  layer stacks: none (the module runs no scan over its params)")
        if gathers == "per_step":
            lines.append("  FSDP: every param gathered once per step, before the microbatch loop")
        elif gathers is not None:
            if stacked:
                lines.append("  FSDP: the stacked params gathered one layer at a time inside the "
                             "module's scan (and again in the backward pass); the others where "
                             "the module reads them, once per forward")
            else:
                lines.append("  FSDP: no layer stack, so each param is gathered where the module "
                             "reads it, once per forward (and again in the backward pass)")
        return "\n".join(lines)

    def _mode_text(self) -> Optional[str]:
        """How the module is told train from eval besides its call's keyword (None: only
        that)."""
        return None
