"""Building, restoring and saving an Engine's train state: the state manager an Engine composes.

A state is built in its shards: params initialised under ``jit`` with the plan's shardings (or the
user's params placed), the optimizer state initialised in local view inside ``shard_map`` (split
along real param dimensions with ZeRO / FSDP). The same description, as ``ShapeDtypeStruct``s with shardings,
is the restore target -- which is why a checkpoint resumes on whatever mesh the run has now.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from titanax import errors
from titanax.config import overrides
from titanax.io import checkpointer as checkpoint_lib
from titanax.io.checkpointer import OrbaxCheckpoint
from titanax.parallel import rules, sharding
from titanax.train import state_sharding as state_sharding_lib
from titanax.train import prng
from titanax.train import step as step_lib
from titanax.train.train_state import TrainState

_log = logging.getLogger("titanax")


class StateManager:
    """Builds, restores, converts and saves an Engine's train state (the engine composes one).

    It reads what ``Engine.build`` made -- mesh, plan, param layouts (and the circular view),
    precision, the optimizer adapter, the model -- and keeps ``engine.state`` (the one place the
    state lives) current. It owns the checkpointer and the layout conversions.
    """

    def __init__(self, engine: Any):
        self._engine = engine
        self._checkpointer: Optional[OrbaxCheckpoint] = None
        # The jitted view <-> canonical conversions, built once each (see _layout_converter).
        self._converters: Dict[str, Any] = {}
        # The state-sharding strategy (see state_sharding), made on first use.
        self._strategy: Optional[state_sharding_lib.Replicated] = None

    # --- What Engine.build made (read here; the engine owns it) --------------------------------

    mesh = property(lambda self: self._engine.mesh)
    plan = property(lambda self: self._engine.plan)
    precision = property(lambda self: self._engine.precision)
    adapter = property(lambda self: self._engine.adapter)
    model = property(lambda self: self._engine.model)
    stack_view = property(lambda self: self._engine.stack_view)
    config = property(lambda self: self._engine.config)
    param_specs = property(lambda self: self._engine.param_specs)
    parameter_specs = property(lambda self: self._engine.parameter_specs)

    def _local_param_shapes(self) -> Any:
        mesh_shape = dict(self.mesh.shape)
        return jax.tree_util.tree_map(
            lambda s, spec: jax.ShapeDtypeStruct(rules.local_shape(s.shape, spec, mesh_shape),
                                                 self.precision.param_dtype
                                                 if jnp.issubdtype(s.dtype, jnp.floating)
                                                 else s.dtype),
            self.parameter_specs, self.param_specs, is_leaf=rules.is_param_leaf)

    @property
    def state_sharding(self) -> state_sharding_lib.Replicated:
        """How the optimizer state is laid out and updated (for the plan and mesh; built once
        the param layouts are known)."""
        if self._strategy is None or self._strategy.param_specs is not self.param_specs:
            self._strategy = state_sharding_lib.for_plan(
                self.plan, param_specs=self.param_specs, mesh_shape=dict(self.mesh.shape),
                zero_dims=self._engine.zero_dims)
        return self._strategy

    def opt_state_specs(self) -> Any:
        return self.state_sharding.opt_state_specs(self.adapter, self._local_param_shapes())

    def state_specs(self) -> TrainState:
        return TrainState(params=self.param_specs, opt_state=self.opt_state_specs(),
                          step=PartitionSpec(), rngs={k: PartitionSpec() for k in prng.STREAMS},
                          loss_scale=None if self.precision.initial_scale_state() is None
                          else {"scale": PartitionSpec(), "good_steps": PartitionSpec()},
                          tx=self.adapter.tx)


    def _declare_user_params(self, params: Any) -> None:
        """Layouts for params given by the user (hand-written steps): plan rules only."""
        if self.param_specs is None:
            self._engine.parameter_specs = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype), params)
            self._engine.param_specs = self.plan.param_partition_specs(self.parameter_specs,
                                                                       self.mesh)
            self._engine._shard_state_dims()
            self._engine._make_adapter(None)

    def _init_opt_fn(self):
        setup = self._engine._setup()
        return jax.jit(self._engine._shard_map(
            lambda p: step_lib.local_init_opt_state(setup, p), in_specs=(self.param_specs,),
            out_specs=self.opt_state_specs()))

    def init_state(self, params: Any = None) -> TrainState:
        """A fresh state: params initialised (or ``params`` placed) in their shards."""
        self._engine.build()
        if params is None:
            if self.model is None:
                raise errors.StepError("there is no model to initialise params from",
                                       path="engine.model",
                                       suggestion="pass params= to fit() or init_state()")
            shardings = sharding.named_shardings(self.mesh, self.param_specs)
            init = jax.jit(lambda key: self._as_view(self.precision.cast_params_for_storage(
                self.model.initialize_parameters_recursively(key))), out_shardings=shardings)
            params = init(prng.stream_key(self.config.seed, "init"))
        else:
            self._declare_user_params(params)
            params = sharding.apply_named_sharding(
                self._as_view(self.precision.cast_params_for_storage(params)), self.mesh,
                self.param_specs)
        self._engine.state = self._state_around(params, self._init_opt_fn()(params))
        return self._engine.state

    def _state_around(self, params: Any, opt_state: Any, step: Any = None, rngs: Any = None,
                      loss_scale: Any = None) -> TrainState:
        replicated = NamedSharding(self.mesh, PartitionSpec())
        if rngs is None:
            rngs = {k: jax.device_put(v, replicated)
                    for k, v in prng.streams(self.config.seed).items()}
        if loss_scale is None:
            scale = self.precision.initial_scale_state()
            loss_scale = None if scale is None else jax.device_put(scale, replicated)
        if step is None:
            step = jax.device_put(jnp.int32(0), replicated)
        return TrainState(params=params, opt_state=opt_state, step=step, rngs=rngs,
                          loss_scale=loss_scale, tx=self.adapter.tx)

    def state_template(self, params: Any = None) -> TrainState:
        """The train state as ShapeDtypeStructs with this run's shardings (restore targets)."""
        self._engine.build()
        if params is not None:
            self._declare_user_params(params)
        mesh_dtype = self.precision.param_dtype
        params_shapes = jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct(tuple(s.shape), mesh_dtype
                                           if jnp.issubdtype(s.dtype, jnp.floating) else s.dtype),
            self.parameter_specs, is_leaf=rules.is_param_leaf)
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
            params=with_sharding(params_shapes, self.param_specs),
            opt_state=with_sharding(opt_shapes, self.opt_state_specs()),
            step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
            rngs={k: jax.ShapeDtypeStruct(key_shape.shape, key_shape.dtype, sharding=replicated)
                  for k in prng.STREAMS},
            loss_scale=None if scale is None else {
                k: jax.ShapeDtypeStruct((), jnp.asarray(v).dtype, sharding=replicated)
                for k, v in scale.items()},
            tx=self.adapter.tx)

    def close(self) -> None:
        """Waits for checkpoint writes and closes the checkpointer."""
        if self._checkpointer is not None:
            self._checkpointer.close()

    def checkpointer(self) -> Optional[OrbaxCheckpoint]:
        if self._checkpointer is None and self.config.checkpoint is not None:
            self._checkpointer = self.config.checkpoint.instantiate(
                trainer_dir=self._engine.trainer_dir)
        return self._checkpointer

    def restore(self, *, params: Any = None, step: Optional[int] = None,
                mode: Optional[str] = None) -> bool:
        """Loads the newest good checkpoint (or ``step``) onto this run's mesh and plan.

        Returns False when there is none. ``params`` (hand-written steps) gives the param tree's
        structure. With mode "params" only the params are loaded; the rest starts fresh.
        """
        ckpt = self.checkpointer()
        if ckpt is None or step is None and not ckpt.all_steps():
            return False
        template = self._canonical_state(self.state_template(params))
        mode = mode or ckpt.config.restore_mode
        restored = ckpt.restore(params_target=template.params,
                                train_state_target=checkpoint_lib.train_state_tree(template),
                                step=step, mode=mode, check_metadata=self._check_state_layout)
        if restored is None:
            return False
        if mode == "params" or restored.train_state is None:
            restored_params = self._viewed_state(restored.params, None)[0]
            self._engine.state = self._state_around(restored_params,
                                            self._init_opt_fn()(restored_params))
        else:
            train = restored.train_state
            restored_params, opt_state = self._viewed_state(restored.params, train["opt_state"])
            self._engine.state = self._state_around(restored_params, opt_state,
                                            step=train["step"], rngs=train["rngs"],
                                            loss_scale=train.get("loss_scale"))
            self._engine._restored_data_state = restored.data_state
            self._engine._resumed = True
        self._engine.restored_from = restored.path
        message = f"restored {'params' if mode == 'params' else 'the run'} from {restored.path}"
        _log.info(message)
        print(f"titanax: {message}", flush=True)
        self._report_config_changes(restored)
        return True

    def _report_config_changes(self, restored) -> None:
        """Resuming with another learning rate, batch or seed is allowed, but said."""
        saved_text = (restored.metadata or {}).get("config")
        if not saved_text:
            return
        changes = overrides.diff_debug_strings(saved_text, self.config.debug_string())
        if not changes:
            return
        shown = changes[:20] + ([f"... and {len(changes) - 20} more"] if len(changes) > 20 else [])
        print(f"titanax: this run's config differs from the one saved with step "
              f"{restored.step} ({len(changes)} change{'s' if len(changes) != 1 else ''}):\n"
              + "\n".join(f"  {line}" for line in shown), flush=True)

    # --- The circular schedule's view <-> the canonical layout of checkpoints ---------------------

    def _as_view(self, params: Any) -> Any:
        return params if self.stack_view is None else self.stack_view.view(params)

    def _canonical_state(self, state: TrainState) -> TrainState:
        """``state`` (arrays, or ShapeDtypeStructs as a restore target) in the layout checkpoints
        use: the circular schedule's view of the stacked layers reshaped back to ``[L, ...]``."""
        view = self.stack_view
        if view is None:
            return state
        paths = sharding.tree_paths(self.parameter_specs, is_leaf=rules.is_param_leaf)
        if isinstance(jax.tree_util.tree_leaves(state.params)[0], jax.ShapeDtypeStruct):
            opt_state = view.map_optimizer_state(state.tx or self.adapter.tx, state.opt_state,
                                                 paths, view.canonical_struct)
            return state.replace(params=view.canonical_targets(state.params),
                                 opt_state=opt_state)
        params, opt_state = self._layout_converter("to_canonical")(state.params,
                                                                   state.opt_state)
        return state.replace(params=params, opt_state=opt_state)

    def _layout_converter(self, direction: str):
        """The jitted conversion between the view and the canonical layout (built once per
        direction: a save must not trace and compile it again). ``params_to_canonical`` converts
        the params alone."""
        cache = self._converters
        if direction in cache:
            return cache[direction]
        view = self.stack_view
        paths = sharding.tree_paths(self.parameter_specs, is_leaf=rules.is_param_leaf)
        tx = self.adapter.tx
        view_params = sharding.named_shardings(self.mesh, self.param_specs)
        canonical_params = sharding.named_shardings(
            self.mesh, view.canonical_partition_specs(self.param_specs))
        view_opt_specs = self.opt_state_specs()
        canonical_opt_specs = view.map_optimizer_state(tx, view_opt_specs, paths,
                                                       view.canonical_spec)

        def convert_state(opt_state, shape_of):
            if opt_state is None:
                return opt_state
            return view.map_optimizer_state(tx, opt_state, paths,
                                            lambda x: x.reshape(shape_of(x.shape)))

        if direction == "params_to_canonical":
            fn = jax.jit(view.canonical, out_shardings=canonical_params)
        elif direction == "to_canonical":
            fn = jax.jit(lambda p, o: (view.canonical(p), convert_state(o, view.canonical_shape)),
                         out_shardings=(canonical_params, sharding.named_shardings(
                             self.mesh, canonical_opt_specs)))
        elif direction == "params_to_view":  # A params-only restore.
            fn = jax.jit(view.view, out_shardings=view_params)
        else:
            fn = jax.jit(lambda p, o: (view.view(p), convert_state(o, view.view_shape)),
                         out_shardings=(view_params, sharding.named_shardings(
                             self.mesh, view_opt_specs)))
        cache[direction] = fn
        return fn

    def _viewed_state(self, params: Any, opt_state: Any) -> Any:
        """Restored canonical ``(params, opt_state)`` (opt_state may be None) in this run's
        layout."""
        if self.stack_view is None:
            return params, opt_state
        if opt_state is None:
            return self._layout_converter("params_to_view")(params), None
        return self._layout_converter("to_view")(params, opt_state)

    def _check_state_layout(self, metadata: Dict[str, Any], where: str) -> None:
        """Refuses a full restore whose optimizer state would load without error but mean other
        numbers here. Every layout written now is the params' own (ZeRO and FSDP split real
        dimensions), which restores onto any mesh and strategy; checkpoints written before that
        may hold ZeRO-1's flattened, padded chunks, cut for the mesh they were saved on."""
        saved = metadata.get("optimizer_state_layout")
        if saved is None and "\nplan.zero.stage:" in f"\n{metadata.get('config', '')}":
            # Written before layouts were recorded, by a ZeRO run: wave 1's flat chunks.
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

    def init_or_restore(self, *, params: Any = None) -> TrainState:
        """Resumes from the newest good checkpoint (when configured to), else starts fresh.

        ``params`` are the initial params of a hand-written step's model (ignored on resume).
        """
        ckpt = self.checkpointer()
        if not (ckpt is not None and ckpt.config.resume == "auto" and self.restore(params=params)):
            self.init_state(params)
        return self._engine.state

    def save(self, *, data_iterator: Any = None, force: bool = False) -> bool:
        """Starts saving the current state (async when configured); False if it exists already."""
        ckpt = self.checkpointer()
        if ckpt is None:
            raise errors.CheckpointError("no checkpoint is configured", path="engine.checkpoint",
                                         suggestion="set checkpoint=OrbaxCheckpoint.Config(...)")
        self._engine._claim_checkpoint_dir()
        step = int(jax.device_get(self._engine.state.step))
        data_state = data_iterator.get_state() if hasattr(data_iterator, "get_state") else None
        state = self._canonical_state(self._engine.state)
        param_specs = (self.param_specs if self.stack_view is None
                       else self.stack_view.canonical_partition_specs(self.param_specs))
        metadata = checkpoint_lib.run_metadata(
            mesh=self.mesh, param_specs=param_specs, params=state.params,
            optimizer_text=self.config.learner.debug_string()
            + repr(type(self.config.optimizer)), config_text=self.config.debug_string(),
            process_count=jax.process_count())
        metadata["optimizer_state_layout"] = dict(state_sharding_lib.CHECKPOINT_LAYOUT)
        return ckpt.save(state, step, data_state=data_state, metadata=metadata, force=force)

    def canonical_params(self) -> Any:
        """The params in the layout checkpoints hold and every mesh shares: ``engine.state.params``
        except under the circular schedule, whose stacked layers the state keeps as the view
        ``[v, S, L/(vS), ...]`` (these come back as ``[L, ...]``)."""
        if self.stack_view is None:
            return self._engine.state.params
        return self._layout_converter("params_to_canonical")(self._engine.state.params)

    def state_dict(self) -> Dict[str, Any]:
        """The train state as a plain dict of (global) arrays, in the run's own layout (under
        the circular schedule the stacked layers are the view; ``canonical_params()`` and
        checkpoints hold ``[L, ...]``)."""
        state = self._engine.state
        return {"params": state.params, "opt_state": state.opt_state, "step": state.step,
                "rngs": state.rngs, "loss_scale": state.loss_scale}

