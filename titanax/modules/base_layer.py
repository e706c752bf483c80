"""BaseLayer and ParameterSpec: layers that declare their params instead of creating them.

A layer describes each param with a ``ParameterSpec`` -- the *global* shape, dtype, the mesh axes
it is split over, its initializer, which dims are fan-in/fan-out, and how much weight decay it
gets. The tree of specs is known before any array exists, which is what lets Titanax print the
layout of a model, check it against the plan, initialise params directly into their shards under
``jit`` and restore checkpoints onto another mesh. Layer *code*, by contrast, runs in local view
inside ``shard_map`` and sees only its shard.

``dtype`` and ``param_init`` cascade: a child whose config leaves them ``None`` takes its parent's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from titanax import errors
from titanax.modules import gather_on_use
from titanax.parallel import axis_binding as axis_binding_lib
from titanax.modules.context import OutputCollection, current_context, name_key, set_current_context
from titanax.modules.initializers import Constant, FanAxes, Initializer, Normal
from titanax.modules.module import Module, nowrap
from titanax.modules.saved_values import keeping_exchanges

# Names accepted by BaseLayer.Config.remat_policy.
REMAT_POLICIES: Dict[str, Callable] = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

DEFAULT_DTYPE = "float32"


@dataclasses.dataclass(frozen=True)
class ParameterSpec:
    """Everything about one param except its value."""

    # Global shape (the whole param, not a shard).
    shape: Tuple[int, ...]
    # Storage dtype; None means the layer's dtype.
    dtype: Any = None
    # Mesh axis (or None) per dimension: the declared layout. None: taken from ``logical_axes``
    # through the run's axis binding (parallel/axis_binding.py), else replicated. Titanax's
    # layers name logical dimensions only; a param written out by hand may name mesh axes.
    mesh_axes: Optional[Tuple[Any, ...]] = None
    # How to initialise it; None means the layer's param_init.
    initializer: Optional[Initializer] = None
    # Which dims are fan-in / fan-out (for variance-scaling initializers).
    fan_axes: Optional[FanAxes] = None
    # Multiplier of the optimizer's weight decay (0 for biases and norm params).
    weight_decay_scale: float = 1.0
    # Leading dims that stack copies of a layer (Repeat adds one): a layer scan slices them, so
    # FSDP/ZeRO never put their axis there (parallel/state_dims.py).
    stacked_dims: int = 0
    # The layer runs this param whole as well as split: where a mesh axis of ``mesh_axes``
    # does not divide its dimension (e.g. 2 kv heads on TP=4), the layout keeps that dimension
    # whole instead of refusing (parallel/rules.py). The layer tells which from its shard.
    replicated_if_indivisible: bool = False
    # The share of this param each token multiplies by: 1 for a dense weight, top_k / E for a
    # routed expert's (the FLOPs and MFU count active params only).
    active_fraction: float = 1.0
    # A logical dimension name (or None) per dimension, e.g. ("embed", "mlp"), from a Titanax
    # layer or a Flax model's partitioning metadata: the run's axis binding maps them to mesh
    # axes (the TP-bound ones become the declared layout), and the plan's
    # ``logical_axis_rules`` can also put the ZeRO / FSDP split on them
    # (parallel/logical_axes.py). None: the layer names none.
    logical_axes: Optional[Tuple[Optional[str], ...]] = None
    # Not trained: the layer writes its next value itself (``add_state_update``: running
    # statistics). ZeRO / FSDP keep it whole, since the update replaces the whole value.
    layer_state: bool = False
    # Trained by the optimizer. False: frozen (a LoRA run's base weights, modules/lora.py) --
    # no gradient is computed, reduced or given optimizer state (train/trainable.py).
    trainable: bool = True

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def describe(self) -> str:
        init = self.initializer
        if init is None:
            init_text = "default"
        else:
            fields = ", ".join(f"{k}={v}" for k, v in init.config.items() if k != "klass")
            init_text = f"{type(init).__name__}({fields})"
        return (f"shape={self.shape} dtype={jnp.dtype(self.dtype).name if self.dtype else None} "
                f"mesh_axes={self.mesh_axes} init={init_text} wd_scale={self.weight_decay_scale}")


def remat_policy(name: Optional[str]) -> Optional[Callable]:
    if name is None:
        return None
    if name not in REMAT_POLICIES:
        raise errors.ConfigError(f"unknown remat policy {name!r}", path="remat_policy",
                                 suggestion=f"one of {', '.join(REMAT_POLICIES)}")
    return keeping_exchanges(REMAT_POLICIES[name])


class BaseLayer(Module):
    """A Module with parameters."""

    # Weights whose product this layer's code adds a LoRA update to (modules/lora.py).
    ADAPTABLE_WEIGHTS: Tuple[str, ...] = ()

    class Config(Module.Config):
        # Param storage dtype, e.g. "float32" or "bfloat16"; None: inherit from the parent
        # (float32 at the root).
        dtype: Optional[str] = None
        # Initializer of params whose spec names none; None: inherit (Normal(0.02) at the root).
        param_init: Optional[Initializer.Config] = None
        # Rematerialise this layer's forward in training with this jax.checkpoint policy
        # (see REMAT_POLICIES); None: keep activations.
        remat_policy: Optional[str] = None

        def _validate_values(self):
            if self.remat_policy is not None and self.remat_policy not in REMAT_POLICIES:
                yield "remat_policy", (f"unknown policy {self.remat_policy!r}; one of "
                                       f"{', '.join(REMAT_POLICIES)}")
            if self.dtype is not None:
                try:
                    jnp.dtype(self.dtype)
                except TypeError:
                    yield "dtype", f"{self.dtype!r} is not a dtype name"

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        self.dtype = jnp.dtype(cfg.dtype or DEFAULT_DTYPE)
        init_cfg = cfg.param_init if cfg.param_init is not None else Normal.default_config()
        self.param_init: Initializer = init_cfg.instantiate()

    def _prepare_child_config(self, child_config):
        if isinstance(child_config, BaseLayer.Config):
            if child_config.dtype is None:
                child_config.dtype = self.dtype.name
            if child_config.param_init is None:
                child_config.param_init = self.param_init.config.clone()
        return child_config

    # --- What the axis binding splits ----------------------------------------------------------

    @property
    def axis_binding(self) -> axis_binding_lib.AxisBinding:
        """Which mesh axis holds each logical dimension in this call (parallel/axis_binding.py)."""
        return axis_binding_lib.current_binding()

    def _own_implemented_dims(self) -> Sequence[str]:
        """Logical dimensions whose split needs this layer's own code beyond its param layouts
        (attention: the context-parallel sequence; a mixture of experts: the experts)."""
        return ()

    @nowrap
    def implemented_dims(self) -> set:
        """``_own_implemented_dims`` of this layer and every descendant: a plan that splits a
        dimension no layer implements is refused before anything compiles."""
        dims = set(self._own_implemented_dims())
        for child in self._children.values():
            if isinstance(child, BaseLayer):
                dims |= child.implemented_dims()
        return dims

    @nowrap
    def check_axis_binding(self, binding: axis_binding_lib.AxisBinding, *, path: str) -> None:
        """Raises PlanError for a binding this layer (or a descendant) cannot run under, before
        anything compiles; ``path`` is this layer's config path, for the error. A layer whose
        options some split cannot carry overrides it (and calls ``super()``)."""
        for name, child in self._children.items():
            if isinstance(child, BaseLayer):
                child.check_axis_binding(binding, path=f"{path}.{name}")

    # --- Declaring params ------------------------------------------------------------------------

    def _create_layer_parameter_specs(self) -> Dict[str, ParameterSpec]:
        """This layer's own params (children excluded). Override in layers with params."""
        return {}

    @nowrap
    def create_parameter_specs_recursively(self) -> Dict[str, Any]:
        """Nested dict of fully resolved ParameterSpecs (dtype and initializer filled in)."""
        specs: Dict[str, Any] = {}
        for name, spec in self._create_layer_parameter_specs().items():
            specs[name] = dataclasses.replace(
                spec, shape=tuple(spec.shape), dtype=jnp.dtype(spec.dtype or self.dtype),
                initializer=spec.initializer or self.param_init,
                mesh_axes=declared_mesh_axes(spec))
        for name, child in self._children.items():
            if isinstance(child, BaseLayer):
                child_specs = child.create_parameter_specs_recursively()
                if child_specs:
                    specs[name] = child_specs
        return specs

    @nowrap
    def adaptable_weight_paths(self, prefix: str = "") -> List[str]:
        """'/'-joined paths (as in the spec tree) of the weights whose layers add a LoRA update
        to their product (``ADAPTABLE_WEIGHTS``: modules/lora.py; those the layer's config
        gives it)."""
        own = self._create_layer_parameter_specs() if self.ADAPTABLE_WEIGHTS else {}
        paths = [f"{prefix}{name}" for name in self.ADAPTABLE_WEIGHTS if name in own]
        for name, child in self._children.items():
            if isinstance(child, BaseLayer):
                paths += child.adaptable_weight_paths(f"{prefix}{name}/")
        return paths

    @nowrap
    def initialize_parameters_recursively(self, prng_key: jax.Array,
                                          specs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Params for every spec; each key is derived from the param's path, not from order.

        Pure and jit-able: ``jax.jit(layer.initialize_parameters_recursively,
        out_shardings=...)(key)`` creates each param directly in its shards.
        """
        specs = self.create_parameter_specs_recursively() if specs is None else specs
        return _initialize(specs, prng_key, prefix=self.name)

    @nowrap
    def draws_each_param_from_its_path(self) -> bool:
        """Whether ``initialize_parameters_recursively`` is this class's: ``draw_param`` of each
        spec with ``name_key(key, param_path(...))``, so a caller may draw the params one at a
        time (titanax/train/param_draws.py). A class with its own initialisation (an adapted
        Flax module) is initialised by it."""
        return (type(self).initialize_parameters_recursively
                is BaseLayer.initialize_parameters_recursively)

    @nowrap
    def param_partition_specs(self) -> Dict[str, Any]:
        """The layer's declared layout of every param, as PartitionSpecs."""
        return jax.tree_util.tree_map(lambda s: PartitionSpec(*s.mesh_axes),
                                      self.create_parameter_specs_recursively(),
                                      is_leaf=lambda x: isinstance(x, ParameterSpec))

    @nowrap
    def check_partition_specs(self, specs: Dict[str, Any], *, prefix: str = "",
                              mesh_shape: Optional[Dict[str, int]] = None) -> None:
        """Raises ShardingError for a spec this layer (or a descendant) cannot implement.
        ``mesh_shape``: the mesh's axis sizes, for a model whose check needs them (given to the
        root by the engine)."""
        del mesh_shape
        prefix = prefix or self.name
        own = self._create_layer_parameter_specs()
        for name, declared in own.items():
            if name not in specs:
                continue
            given = tuple(specs[name])
            declared_axes = declared_mesh_axes(declared)
            supported = [declared_axes, (None,) * len(declared.shape)]
            if _pad(given, len(declared.shape)) not in supported:
                raise errors.ShardingError(
                    f"{type(self).__qualname__} cannot run with spec {PartitionSpec(*given)} for "
                    f"this param", path=f"{prefix}/{name}",
                    suggestion="layouts it supports, given its config: "
                               + ", ".join(str(PartitionSpec(*s)) for s in supported)
                               + " (the axis binding decides what the layer splits: change "
                                 "plan.logical_axis_rules, not only the rule)")
        for name, child in self._children.items():
            if isinstance(child, BaseLayer) and isinstance(specs.get(name), dict):
                child.check_partition_specs(specs[name], prefix=f"{prefix}/{name}")

    # --- Remat -----------------------------------------------------------------------------------

    def _call_in_own_context(self, method, args, kwargs):
        policy = remat_policy(self.config.remat_policy)
        context = current_context()
        if policy is None or not context.is_training or method.__name__ != "forward":
            return method(self, *args, **kwargs)
        fsdp_axes = gather_on_use.gathered_axes(context.state)
        if fsdp_axes:
            policy = gather_on_use.never_saving_gathered(policy, fsdp_axes)

        def pure(state, key, call_args):
            inner = context.clone(state=state, prng_key=key, output_collection=OutputCollection())
            with set_current_context(inner):
                return method(self, *call_args, **kwargs), inner.output_collection

        outputs, collection = jax.checkpoint(pure, policy=policy, prevent_cse=False)(
            context.state, context.prng_key, args)
        for field in ("summaries", "state_updates", "module_outputs"):
            getattr(context.output_collection, field).update(getattr(collection, field))
        return outputs


def declared_mesh_axes(spec: ParameterSpec) -> Tuple[Any, ...]:
    """A spec's mesh axes: its own, else its logical dimensions' under the current axis
    binding, else none (replicated)."""
    if spec.mesh_axes is not None:
        return tuple(spec.mesh_axes)
    resolved = axis_binding_lib.current_binding().mesh_axes(spec.logical_axes)
    return resolved if resolved is not None else (None,) * len(spec.shape)


def _pad(spec: Sequence[Any], rank: int) -> Tuple[Any, ...]:
    return tuple(spec) + (None,) * (rank - len(spec))


def param_path(prefix: str, tree_path: Sequence[Any]) -> str:
    """The path a param's key is derived from (``name_key``): the root's name and the dict keys
    down to it (``tree_path``: ``jax.tree_util`` keys), joined by ``/``."""
    return "/".join([prefix, *(str(entry.key) for entry in tree_path)])


def draw_param(spec: ParameterSpec, key: jax.Array) -> jax.Array:
    """The param ``spec`` initialises from its own ``key`` (``name_key`` of the root's key and
    its ``param_path``)."""
    return spec.initializer.init(key, spec.shape, spec.dtype, fan_axes=spec.fan_axes)


def _initialize(specs: Dict[str, Any], key: jax.Array, *, prefix: str) -> Dict[str, Any]:
    """Every param of ``specs`` drawn from its path's key; params of one kind (initializer,
    shape, dtype, fan axes) are drawn together, by one ``vmap`` over their keys.

    Why together: each draw is a random-number generator (a threefry hash, a normal's inverse
    error function) that XLA compiles once per copy in the program, so a program drawing each
    param on its own compiles in time growing with the param count -- the same draws batched
    compile once per kind (measured, the one jitted init on CPU: qwen3_5_tiny 6.0 s -> 3.3 s,
    deepseek_v3_tiny 4.4 s -> 3.5 s). A vmapped threefry draw gives each key the values of
    that key's own draw (tests/modules/test_base_layer.py); other generators draw one param at
    a time. (Under ``jit`` with ``out_shardings``, a kind's draws are made together and then
    cut into their params' shardings: briefly twice that kind's memory.)"""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, ParameterSpec))
    kinds: Dict[Any, list] = {}
    for index, (_, spec) in enumerate(leaves):
        kinds.setdefault(draw_kind(spec), []).append(index)
    drawn: list = [None] * len(leaves)
    together = _draws_batch_exactly(key)
    for indices in kinds.values():
        keys = [name_key(key, param_path(prefix, leaves[i][0])) for i in indices]
        if together and len(indices) > 1:
            spec = leaves[indices[0]][1]
            values = jax.vmap(lambda k, spec=spec: draw_param(spec, k))(jnp.stack(keys))
            for position, i in enumerate(indices):
                drawn[i] = values[position]
        else:
            for i, param_key in zip(indices, keys):
                drawn[i] = draw_param(leaves[i][1], param_key)
    return jax.tree_util.tree_unflatten(treedef, drawn)


def _draws_batch_exactly(key: jax.Array) -> bool:
    """Whether draws vmapped over keys of ``key``'s generator are each key's own: threefry's
    are (each bit a hash of its key and its index); ``rbg``'s are not (its vmap draws the whole
    batch from the first key)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        implementation = str(jax.random.key_impl(key))
    else:
        implementation = str(jax.config.jax_default_prng_impl)
    return "threefry" in implementation


def draw_kind(spec: ParameterSpec) -> Any:
    """What decides a param's draw program (initializer, shape, dtype, fan axes): params alike
    in it are drawn by one program (here together; ``train/param_draws.py`` reuses one)."""
    initializer, fan = spec.initializer, spec.fan_axes
    described = None if initializer is None else initializer.config.debug_string()
    return (type(initializer), described, tuple(spec.shape), str(spec.dtype),
            None if fan is None else (fan.in_axes, fan.out_axes))


def describe_parameter_specs(specs: Dict[str, Any]) -> str:
    """One line per param: path, global shape, dtype, mesh axes, initializer, decay scale."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, ParameterSpec))
    rows = [("/".join(str(k.key) for k in path), spec.describe()) for path, spec in leaves]
    width = max((len(p) for p, _ in rows), default=0)
    return "\n".join(f"{p:<{width}}  {d}" for p, d in rows)



def constant(value: float) -> Initializer:
    return Constant.default_config().set(value=value).instantiate()
