"""Building, restoring and saving train states in a run's layout.

A state is built in its shards: params drawn under ``jit`` straight into the layout's
shardings, one small program per kind of param (titanax/train/param_draws.py), or the user's
params placed; the optimizer state initialised in local view inside ``shard_map`` by the
state-sharding strategy (split along real param dimensions with ZeRO / FSDP). The same
description, as ``ShapeDtypeStruct``s with shardings, is the restore target -- which is why a
checkpoint resumes on whatever mesh the run has now. Checkpoints hold the canonical layout (the
circular schedule's view of the stack reshaped back to ``[L, ...]``).

The manager is given everything it reads (mesh, layout, strategy, optimizer adapter, model,
precision, checkpointer) and returns states; the Engine keeps the current one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from titanax import errors
from titanax.config import overrides
from titanax.io import checkpointer as checkpoint_lib
from titanax.io.checkpointer import OrbaxCheckpoint
from titanax.parallel import axis_binding
from titanax.parallel import rules, sharding
from titanax.parallel.layout import Layout
from titanax.modules.base_layer import ParameterSpec
from titanax.train import param_draws, prng
from titanax.train import state_sharding as state_sharding_lib
from titanax.train.learner import OptimizerAdapter
from titanax.train.precision import Precision
from titanax.train.train_state import TrainState



@dataclasses.dataclass(frozen=True)
class RestoredState:
    """A state read from a checkpoint, and where it came from."""

    state: TrainState
    # The checkpoint's path.
    path: str
    # True for a full restore (the run continues); False when only the params were read.
    resumed: bool
    # The input iterator's saved position (full restores), else None.
    data_state: Optional[Dict[str, Any]] = None


class StateManager:
    """Builds, restores, converts and saves train states of one layout."""

    def __init__(self, *, mesh: Mesh, layout: Layout, strategy: state_sharding_lib.StateSharding,
                 adapter: OptimizerAdapter, precision: Precision, model: Any = None,
                 seed: int = 0, checkpointer: Optional[OrbaxCheckpoint] = None,
                 model_specs: Any = None, frozen_dtype: Optional[str] = None,
                 batch_axes: Tuple[str, ...] = ()):
        self.mesh = mesh
        self.layout = layout
        self.strategy = strategy
        self.adapter = adapter
        self.precision = precision
        self.model = model
        self.seed = seed
        self.checkpointer = checkpointer
        # The model's ParameterSpecs as the run declares them (LoRA adapters included; None:
        # the model's own).
        self.model_specs = model_specs
        # The storage dtype of frozen params (LoRA's base: "bfloat16" halves it); None: the
        # precision's param dtype, as every other param.
        self.frozen_dtype = jnp.dtype(frozen_dtype) if frozen_dtype is not None else None
        # The mesh axes the plan splits the batch over: a restore on another mesh says how each
        # data shard's part of the global batch changed.
        self.batch_axes = tuple(batch_axes)
        # The jitted view <-> canonical conversions, built once each (see _layout_converter).
        self._converters: Dict[str, Any] = {}
        self._init_opt = None

    # --- Layouts of the state ------------------------------------------------------------------

    def _local_param_shapes(self) -> Any:
        dtype = self.precision.param_dtype
        return self.layout.local_shapes(
            lambda d: dtype if jnp.issubdtype(d, jnp.floating) else d)

    def opt_state_specs(self) -> Any:
        return self.strategy.opt_state_specs(self.adapter, self._local_param_shapes())

    def state_specs(self) -> TrainState:
        return TrainState(params=self.layout.param_specs, opt_state=self.opt_state_specs(),
                          step=PartitionSpec(), rngs={k: PartitionSpec() for k in prng.STREAMS},
                          loss_scale=None if self.precision.initial_scale_state() is None
                          else {"scale": PartitionSpec(), "good_steps": PartitionSpec()},
                          tx=self.adapter.tx)

    def _init_opt_fn(self):
        if self._init_opt is None:
            self._init_opt = jax.jit(jax.shard_map(
                lambda p: self.strategy.init(self.adapter, p), mesh=self.mesh,
                in_specs=(self.layout.param_specs,), out_specs=self.opt_state_specs()))
        return self._init_opt

    # --- Fresh states --------------------------------------------------------------------------

    def init_state(self, params: Any = None) -> TrainState:
        """A fresh state: the model's params initialised (or ``params`` placed) in their shards."""
        if params is None:
            if self.model is None:
                raise errors.StepError("there is no model to initialise params from",
                                       path="engine.model",
                                       suggestion="pass params= to fit() or init_state()")
            params = self._drawn(self.model_specs, self.layout.canonical_param_specs,
                                 self._one_dtype(self.model_specs)
                                 if self.frozen_dtype is None else self.storage_dtypes())
            if self.layout.stack_view is not None:  # (The circular schedule's view.)
                params = jax.jit(self.layout.as_view, donate_argnums=0, out_shardings=(
                    sharding.named_shardings(self.mesh, self.layout.param_specs)))(params)
        else:
            params = sharding.apply_named_sharding(
                self.layout.as_view(self.cast_for_storage(params)), self.mesh,
                self.layout.param_specs)
        return self.state_around(params, self._init_opt_fn()(params))

    def storage_dtypes(self) -> Any:
        """Per param, the float dtype it is stored in: the precision's param dtype, or for a
        frozen param the run's ``frozen_dtype`` when it has one."""
        dtype, frozen = self.precision.param_dtype, self.frozen_dtype
        return jax.tree_util.tree_map(
            lambda trained: dtype if trained or frozen is None else frozen,
            self.strategy.trainable.mask)

    def cast_for_storage(self, params: Any) -> Any:
        """``params``' floats in their storage dtypes (``storage_dtypes``)."""
        if self.frozen_dtype is None:
            return self.precision.cast_params_for_storage(params)
        return jax.tree_util.tree_map(
            lambda p, dtype: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p,
            params, self.storage_dtypes())

    def cast_frozen_for_storage(self, params: Any) -> Any:
        """Params of a frozen model (every one frozen) in their storage dtype."""
        if self.frozen_dtype is None:
            return self.precision.cast_params_for_storage(params)
        return jax.tree_util.tree_map(
            lambda p: p.astype(self.frozen_dtype) if jnp.issubdtype(p.dtype, jnp.floating)
            else p, params)

    def initial_params(self, pick: Any) -> Any:
        """The params ``pick(tree)`` selects (the same subtree of the specs and of the layout's
        partition specs: e.g. what a model converter added) as a fresh run initialises them
        (the same keys: each param's comes from its path), in the canonical layout: what joins
        a model loaded from elsewhere (``init_from``)."""
        specs = pick(self.model_specs)
        return self._drawn(specs, pick(self.layout.canonical_param_specs), self._one_dtype(specs))

    def _one_dtype(self, specs: Any) -> Any:
        """The precision's param dtype for every param of ``specs``."""
        dtype = self.precision.param_dtype
        return jax.tree_util.tree_map(lambda _: dtype, specs,
                                      is_leaf=lambda x: isinstance(x, ParameterSpec))

    def _drawn(self, specs: Any, partition_specs: Any, dtypes: Any) -> Any:
        """Fresh params for ``specs`` from the run's init key, in the canonical layout's
        ``partition_specs``, floats stored in ``dtypes`` (trees shaped like ``specs``)."""
        with axis_binding.bound(self.layout.axis_binding):  # (Traced here: a Flax factory
            return param_draws.initial_params(              # is told the TP axis.)
                model=self.model, specs=specs, key=prng.stream_key(self.seed, "init"),
                shardings=sharding.named_shardings(self.mesh, partition_specs), dtypes=dtypes)

    def state_around(self, params: Any, opt_state: Any, step: Any = None, rngs: Any = None,
                     loss_scale: Any = None) -> TrainState:
        """A state of ``params`` and ``opt_state``; the rest fresh unless given."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        if rngs is None:
            rngs = {k: jax.device_put(v, replicated)
                    for k, v in prng.streams(self.seed).items()}
        if loss_scale is None:
            scale = self.precision.initial_scale_state()
            loss_scale = None if scale is None else jax.device_put(scale, replicated)
        if step is None:
            step = jax.device_put(jnp.int32(0), replicated)
        return TrainState(params=params, opt_state=opt_state, step=step, rngs=rngs,
                          loss_scale=loss_scale, tx=self.adapter.tx)

    def state_template(self) -> TrainState:
        """The train state as ShapeDtypeStructs with this run's shardings (restore targets)."""
        params_shapes = jax.tree_util.tree_map(
            lambda s, dtype: jax.ShapeDtypeStruct(
                tuple(s.shape), dtype if jnp.issubdtype(s.dtype, jnp.floating) else s.dtype),
            self.layout.parameter_specs, self.storage_dtypes(), is_leaf=rules.is_param_leaf)
        opt_shapes = jax.eval_shape(self._init_opt_fn(), params_shapes)

        def with_sharding(shapes, specs):
            return jax.tree_util.tree_map(
                lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                     sharding=NamedSharding(self.mesh, spec)),
                shapes, specs)

        replicated = NamedSharding(self.mesh, PartitionSpec())
        key_shape = jax.eval_shape(lambda: prng.stream_key(0, "init"))
        scale = self.precision.initial_scale_state()
        return TrainState(
            params=with_sharding(params_shapes, self.layout.param_specs),
            opt_state=with_sharding(opt_shapes, self.opt_state_specs()),
            step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
            rngs={k: jax.ShapeDtypeStruct(key_shape.shape, key_shape.dtype, sharding=replicated)
                  for k in prng.STREAMS},
            loss_scale=None if scale is None else {
                k: jax.ShapeDtypeStruct((), jnp.asarray(v).dtype, sharding=replicated)
                for k, v in scale.items()},
            tx=self.adapter.tx)

    # --- Checkpoints ---------------------------------------------------------------------------

    def restore(self, *, step: Optional[int] = None, mode: Optional[str] = None,
                config_text: str = "") -> Optional[RestoredState]:
        """The newest good checkpoint (or ``step``) onto this run's mesh and layout; None when
        there is none. With mode "params" only the params are read; the rest starts fresh.
        ``config_text``: this run's config, to say how the checkpoint's differs."""
        ckpt = self.checkpointer
        if ckpt is None or step is None and not ckpt.all_steps() and ckpt.local is None:
            return None
        template = self.canonical_state(self.state_template())
        mode = mode or ckpt.config.restore_mode
        restored = ckpt.restore(params_target=template.params,
                                train_state_target=checkpoint_lib.train_state_tree(template),
                                step=step, mode=mode, check_metadata=check_state_layout,
                                renames=getattr(self.model, "checkpoint_renames", None))
        if restored is None:
            return None
        if mode == "params" or restored.train_state is None:
            params = self._viewed_state(restored.params, None)[0]
            result = RestoredState(state=self.state_around(params, self._init_opt_fn()(params)),
                                   path=restored.path, resumed=False)
        else:
            train = restored.train_state
            params, opt_state = self._viewed_state(restored.params, train["opt_state"])
            result = RestoredState(
                state=self.state_around(params, opt_state, step=train["step"],
                                        rngs=train["rngs"], loss_scale=train.get("loss_scale")),
                path=restored.path, resumed=True, data_state=restored.data_state)
        message = f"restored {'the run' if result.resumed else 'params'} from {restored.path}"
        print(f"titanax: {message}", flush=True)
        _report_config_changes(restored, config_text)
        _report_layout_change(restored, mesh=self.mesh, batch_axes=self.batch_axes)
        return result

    def save(self, state: TrainState, *, data_state: Any, config_text: str,
             optimizer_text: str, force: bool = False, local: bool = False) -> bool:
        """Starts saving ``state`` (async when configured); False if that step exists already.
        ``local``: to the local tier instead (checkpoint.local_dir)."""
        ckpt = self.checkpointer
        if ckpt is None:
            raise errors.CheckpointError("no checkpoint is configured", path="engine.checkpoint",
                                         suggestion="set checkpoint=OrbaxCheckpoint.Config(...)")
        step = int(jax.device_get(state.step))
        canonical = self.canonical_state(state)
        metadata = checkpoint_lib.run_metadata(
            mesh=self.mesh, param_specs=self.layout.canonical_param_specs,
            params=canonical.params, optimizer_text=optimizer_text, config_text=config_text,
            process_count=jax.process_count())
        metadata["optimizer_state_layout"] = dict(state_sharding_lib.CHECKPOINT_LAYOUT)
        if local:
            ckpt.save_local(canonical, step, data_state=data_state, metadata=metadata)
            return True
        return ckpt.save(canonical, step, data_state=data_state, metadata=metadata, force=force)

    # --- The circular schedule's view <-> the canonical layout of checkpoints ---------------------

    def canonical_params(self, params: Any) -> Any:
        """``params`` in the layout checkpoints hold and every mesh shares (the circular view of
        the stack comes back as ``[L, ...]``)."""
        if self.layout.stack_view is None:
            return params
        return self._layout_converter("params_to_canonical")(params)

    def canonical_state(self, state: TrainState) -> TrainState:
        """``state`` (arrays, or ShapeDtypeStructs as a restore target) in the layout checkpoints
        use: the circular schedule's view of the stacked layers reshaped back to ``[L, ...]``."""
        view = self.layout.stack_view
        if view is None:
            return state
        if isinstance(jax.tree_util.tree_leaves(state.params)[0], jax.ShapeDtypeStruct):
            opt_state = view.map_optimizer_state(state.tx or self.adapter.tx, state.opt_state,
                                                 self._paths(), view.canonical_struct)
            return state.replace(params=view.canonical_targets(state.params),
                                 opt_state=opt_state)
        params, opt_state = self._layout_converter("to_canonical")(state.params,
                                                                   state.opt_state)
        return state.replace(params=params, opt_state=opt_state)

    def _paths(self) -> Any:
        """The paths of the params the optimizer state covers (the trainable ones): how the
        stack view finds each state leaf's param."""
        return self.strategy.trainable.select(
            sharding.tree_paths(self.layout.parameter_specs, is_leaf=rules.is_param_leaf))

    def _layout_converter(self, direction: str):
        """The jitted conversion between the view and the canonical layout (built once per
        direction: a save must not trace and compile it again)."""
        if direction not in self._converters:
            self._converters[direction] = self._make_converter(direction)
        return self._converters[direction]

    def _make_converter(self, direction: str):
        view, tx, paths = self.layout.stack_view, self.adapter.tx, self._paths()
        view_params = sharding.named_shardings(self.mesh, self.layout.param_specs)
        canonical_params = sharding.named_shardings(self.mesh, self.layout.canonical_param_specs)
        view_opt_specs = self.opt_state_specs()
        canonical_opt = sharding.named_shardings(self.mesh, view.map_optimizer_state(
            tx, view_opt_specs, paths, view.canonical_spec))

        def convert_state(opt_state, shape_of):
            return view.map_optimizer_state(tx, opt_state, paths,
                                            lambda x: x.reshape(shape_of(x.shape)))

        if direction == "params_to_canonical":
            return jax.jit(view.canonical, out_shardings=canonical_params)
        if direction == "to_canonical":
            return jax.jit(lambda p, o: (view.canonical(p), convert_state(o, view.canonical_shape)),
                           out_shardings=(canonical_params, canonical_opt))
        if direction == "params_to_view":  # A params-only restore.
            return jax.jit(view.view, out_shardings=view_params)
        return jax.jit(lambda p, o: (view.view(p), convert_state(o, view.view_shape)),
                       out_shardings=(view_params,
                                      sharding.named_shardings(self.mesh, view_opt_specs)))

    def _viewed_state(self, params: Any, opt_state: Any) -> Any:
        """Restored canonical ``(params, opt_state)`` (opt_state may be None) in this layout."""
        if self.layout.stack_view is None:
            return params, opt_state
        if opt_state is None:
            return self._layout_converter("params_to_view")(params), None
        return self._layout_converter("to_view")(params, opt_state)


def check_state_layout(metadata: Dict[str, Any], where: str) -> None:
    """Refuses a full restore whose optimizer state would load without error but mean other
    numbers here. Every layout written now is the params' own (ZeRO and FSDP split real
    dimensions), which restores onto any mesh and strategy; checkpoints written before that
    may hold ZeRO-1's flattened, padded chunks, cut for the mesh they were saved on."""
    saved = metadata.get("optimizer_state_layout")
    if saved is None and "\nplan.zero.stage:" in f"\n{metadata.get('config', '')}":
        # Written before layouts were recorded, by a ZeRO run: flat chunks.
        saved = {"kind": "zero1_flat_chunks",
                 "mesh": dict(zip(metadata.get("mesh_axes", []),
                                  metadata.get("mesh_shape", [])))}
    if saved is None or saved.get("kind") != "zero1_flat_chunks":
        return
    mesh = " x ".join(f"{k}={v}" for k, v in saved.get("mesh", {}).items())
    if saved.get("virtual_stages"):
        mesh += f" from the circular view with {saved['virtual_stages']} virtual stages"
    raise errors.CheckpointError(
        f"the optimizer state was saved as ZeRO-1 flat chunks cut for mesh {mesh} (the "
        "layout of checkpoints written before ZeRO split real dimensions); loaded into "
        "this run's layout the same arrays would hold other params' moments",
        path=f"{where}/train_state",
        suggestion="restore the params only (--config.checkpoint.restore_mode=params: the "
                   "optimizer starts fresh)")


def _report_layout_change(restored: checkpoint_lib.Restored, *, mesh: Mesh,
                          batch_axes: Tuple[str, ...] = ()) -> None:
    """A run continued on other processes or another mesh (fewer hosts after a failure, say):
    its arrays were resharded onto this one; the global batch and the data position are the
    saved ones (each data shard takes its part of the same global batch). When the shards
    became fewer, each takes more rows, and the activation memory per device grows with them:
    said, with the accumulation that keeps it."""
    metadata = restored.metadata or {}
    if "mesh_shape" not in metadata:
        return
    saved = (int(metadata.get("process_count", 1)),
             dict(zip(metadata.get("mesh_axes", []), metadata["mesh_shape"])))
    now = (jax.process_count(), dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape))))
    if saved == now:
        return

    def layout(processes: int, shape: Dict[str, int]) -> str:
        devices = math.prod(shape.values())
        return (f"{processes} process{'es' if processes != 1 else ''}, mesh "
                f"{' x '.join(f'{a}={n}' for a, n in shape.items())} ({devices} devices)")

    message = (f"titanax: step {restored.step} was saved on {layout(*saved)}; the run continues "
               f"on {layout(*now)}: resharded, with the same global batch and data position")
    shards = [math.prod(int(shape.get(a, 1)) for a in batch_axes) for shape in (saved[1], now[1])]
    if batch_axes and shards[0] > shards[1] and shards[0] % shards[1] == 0:
        grown = shards[0] // shards[1]
        message += (f"; each of the {shards[1]} data shards (was {shards[0]}) takes {grown}x "
                    "the rows: to keep each device's activation memory, resume with "
                    f"plan.data_parallel.accumulate_steps {grown}x the saved run's")
    print(message, flush=True)


def _report_config_changes(restored: checkpoint_lib.Restored, config_text: str) -> None:
    """Resuming with another learning rate, batch or seed is allowed, but said."""
    saved_text = (restored.metadata or {}).get("config")
    if not saved_text or not config_text:
        return
    changes = overrides.diff_debug_strings(saved_text, config_text)
    if not changes:
        return
    shown = changes[:20] + ([f"... and {len(changes) - 20} more"] if len(changes) > 20 else [])
    print(f"titanax: this run's config differs from the one saved with step "
          f"{restored.step} ({len(changes)} change{'s' if len(changes) != 1 else ''}):\n"
          + "\n".join(f"  {line}" for line in shown), flush=True)
