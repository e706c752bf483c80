"""A mixture-of-experts feed-forward block: a router, routed SwiGLU experts, optional shared ones.

``y = sum_j gate_j(x) expert_{e_j}(x) + shared(x)`` over the ``top_k`` experts ``e_j`` the router
picks for each token (``router.py``). It takes the place of the decoder block's gated ``MLP``
(Mixtral, Qwen 3 MoE, DeepSeek-V3's routed layers).

**Expert parallelism** (the logical ``experts`` dimension, which the axis binding puts on
``plan.expert_parallel.axis``): the experts' weights ``[E, ...]`` are split over the axis on
their first dimension, and the batch is split over it too
(it is a batch axis: each rank routes its own tokens). Tokens reach their experts with one
``all_to_all`` over the axis and come back with another (``expert_dispatch.py``); autodiff gives
the same two in the backward pass. An expert's gradient therefore already sums every rank's
tokens when the backward pass ends: the reducer does not reduce it over the expert axis.

**Dispatch.** ``"capacity"``: each expert takes at most
``C = ceil(capacity_factor x T x top_k / E)`` of a group's ``T`` tokens (a group: the tokens of
one device, or one microbatch of them); the rest are dropped and counted (``dropped_fraction``).
``capacity_factor >= E / top_k`` never drops. ``"dropless"``: without expert parallelism, the
tokens are sorted by expert and run through ``jax.lax.ragged_dot`` (nothing dropped, nothing
padded). With it, a dropless exchange needs ``ragged_all_to_all``, which XLA:CPU does not
implement; here it is emulated by slots for every token (``C = T``: nothing can drop, at E / top_k
times the slots' memory) -- said by ``--explain``.

**Tensor parallelism** splits each expert's hidden features (the logical ``mlp`` dimension, as
in the gated ``MLP``); the partial outputs of the routed and shared experts are summed over it once, at
the end (a reduce-scatter under sequence parallelism).

**Losses and metrics.** Training adds ``aux_loss_weight x`` the load-balancing loss and
``z_loss_weight x`` the router z-loss of every MoE layer to the objective (the model's ``loss``
stays the language-model loss: ``add_moe_objective``). Each call writes summaries: the aux and z
losses, the dropped fraction, each expert's assignments over the mean (``expert_load``, a vector
summary: averaged over the data shards, then reported as ``expert_load/max`` -- the imbalance
max / mean, 1.0 is perfect balance -- and ``expert_load/min``), and the most loaded expert of
the device's own token group (``group_load_max``: what the capacity meets).
"""

from __future__ import annotations

import math
from typing import Any, List, Literal, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from titanax import errors
from titanax.config import REQUIRED, Required
from titanax.parallel.axis_binding import EXPERTS, MLP, RESIDUAL_SEQUENCE, STAGES
from titanax.modules import float8, projection
from titanax.modules.base_layer import BaseLayer, ParameterSpec, constant
from titanax.modules.context import VectorSummary
from titanax.modules.initializers import FanAxes, Initializer
from titanax.modules.layers import expert_dispatch
from titanax.modules.layers.mlp import ACTIVATIONS
from titanax.modules.layers.router import Router, load_balancing_loss, router_z_loss
from titanax.modules.module import nowrap
from titanax.modules.saved_values import EXPERT_EXCHANGE
from titanax.parallel import collectives

# The module output every MoE layer writes its training objective under (read by the model).
MOE_OBJECTIVE = "moe_objective"


class MoE(BaseLayer):
    """Routed experts (and shared ones) in place of a dense MLP."""

    class Config(BaseLayer.Config):
        # Input and output width (inside a Decoder: the model's, which sets it).
        model_dim: Optional[int] = None
        # Hidden width of each routed expert (HF moe_intermediate_size; Mixtral's
        # intermediate_size).
        hidden_dim: Required[int] = REQUIRED
        # Routed experts.
        num_experts: int = 8
        # Experts per token.
        top_k: int = 2
        # How tokens choose (its model_dim, num_experts and top_k follow this config's).
        router: Router.Config = Router.default_config()
        # Hidden width of the shared expert every token also goes through (DeepSeek's
        # n_shared_experts x moe_intermediate_size); 0: none.
        shared_hidden_dim: int = 0
        # The shared expert's output scaled per token by sigmoid(x . w), a learned gate of its
        # own (Qwen 3.5 MoE's and Qwen3-Next's shared_expert_gate; param shared_gate_weight).
        shared_gate: bool = False
        # The gate's activation: "silu" (SwiGLU), "gelu_tanh", or gpt-oss's "clamped_swiglu":
        # gate clamped above and up on both sides at swiglu_limit, then
        # (up + 1) * gate * sigmoid(swiglu_alpha * gate).
        activation: Literal["silu", "gelu_tanh", "clamped_swiglu"] = "silu"
        # clamped_swiglu's sigmoid sharpness and clamp (gpt-oss: 1.702 and 7).
        swiglu_alpha: float = 1.702
        swiglu_limit: float = 7.0
        # Biases on every routed expert's projections (gpt-oss): gate_up_bias [E, 2, F],
        # down_bias [E, D] (added once per token: the gate-weighted sum of its experts').
        expert_bias: bool = False
        # "capacity": at most capacity_factor x the balanced share of a group's assignments per
        # expert, the rest dropped and counted; "dropless": none dropped (see the docstring).
        dispatch: Literal["capacity", "dropless"] = "capacity"
        # Slots per expert over the balanced share (capacity dispatch); E / top_k or more never
        # drops.
        capacity_factor: float = 1.25
        # Weight of the load-balancing loss of this layer in the training objective.
        aux_loss_weight: float = 0.0
        # Weight of the router z-loss of this layer in the training objective.
        z_loss_weight: float = 0.0
        # Initializer of the down projections; None: the layer's param_init.
        output_param_init: Optional[Initializer.Config] = None
        # Under expert parallelism with a remat policy: keep the tokens the all-to-alls
        # exchanged for the backward pass (modules/saved_values.py: two [E, C, D] buffers per
        # layer -- 2.3 GB per layer and device at DeepSeek-V3 671B's size) instead of
        # exchanging them again (two more all-to-alls per layer).
        keep_exchanged_tokens: bool = True

        def _validate_values(self):
            for name in ("num_experts", "top_k", "hidden_dim", "model_dim"):
                value = getattr(self, name)
                if isinstance(value, int) and value < 1:
                    yield name, f"must be >= 1, got {value}"
            if isinstance(self.top_k, int) and self.top_k > self.num_experts:
                yield "top_k", f"must be <= num_experts={self.num_experts}, got {self.top_k}"
            if not (math.isfinite(self.capacity_factor) and self.capacity_factor > 0):
                yield "capacity_factor", f"must be a finite number > 0, got {self.capacity_factor}"
            if self.shared_hidden_dim < 0:
                yield "shared_hidden_dim", f"must be >= 0, got {self.shared_hidden_dim}"
            if self.shared_gate and not self.shared_hidden_dim:
                yield "shared_gate", "gates the shared expert: set shared_hidden_dim too"
            for name in ("aux_loss_weight", "z_loss_weight"):
                if getattr(self, name) < 0:
                    yield name, f"must be >= 0, got {getattr(self, name)}"

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        self._add_child("router", cfg.router.clone(model_dim=cfg.model_dim,
                                                   num_experts=cfg.num_experts, top_k=cfg.top_k))

    def _create_layer_parameter_specs(self):
        cfg = self.config
        experts, width, hidden = cfg.num_experts, cfg.model_dim, cfg.hidden_dim
        output_init = (cfg.output_param_init.instantiate()
                       if cfg.output_param_init is not None else None)
        # Each token multiplies by top_k of the E experts (FLOPs and MFU count those only).
        active = cfg.top_k / experts
        specs = {
            "gate_up_weight": ParameterSpec(
                shape=(experts, width, 2, hidden), logical_axes=(EXPERTS, None, None, MLP),
                fan_axes=FanAxes(in_axes=(1,), out_axes=(3,)), active_fraction=active),
            "down_weight": ParameterSpec(
                shape=(experts, hidden, width), logical_axes=(EXPERTS, MLP, None),
                initializer=output_init, fan_axes=FanAxes(in_axes=(1,), out_axes=(2,)),
                active_fraction=active),
        }
        if cfg.expert_bias:
            bias = dict(initializer=constant(0.0), weight_decay_scale=0.0)
            specs["gate_up_bias"] = ParameterSpec(shape=(experts, 2, hidden),
                                                  logical_axes=(EXPERTS, None, MLP), **bias)
            # (Whole on every device: each token adds its experts' after the exchange back.)
            specs["down_bias"] = ParameterSpec(shape=(experts, width), logical_axes=(None, None),
                                               **bias)
        if cfg.shared_hidden_dim:
            shared = cfg.shared_hidden_dim
            specs["shared_gate_up_weight"] = ParameterSpec(
                shape=(width, 2, shared), logical_axes=(None, None, MLP),
                fan_axes=FanAxes(in_axes=(0,), out_axes=(2,)))
            specs["shared_down_weight"] = ParameterSpec(
                shape=(shared, width), logical_axes=(MLP, None), initializer=output_init,
                fan_axes=FanAxes(in_axes=(0,), out_axes=(1,)))
            if cfg.shared_gate:
                specs["shared_gate_weight"] = ParameterSpec(
                    shape=(width,), logical_axes=(None,),
                    fan_axes=FanAxes(in_axes=(0,), out_axes=()))
        return specs

    def _own_implemented_dims(self):
        return (EXPERTS,)

    @nowrap
    def check_axis_binding(self, binding, *, path):
        check_moe_binding(self.config, binding, path=path)
        super().check_axis_binding(binding, path=path)

    def forward(self, x: jax.Array, *, segment_ids: Optional[jax.Array] = None) -> jax.Array:
        """``segment_ids`` ``[batch, seq]`` (packed rows): tokens of segment 0 are padding and
        are not routed (their routed output is 0)."""
        cfg = self.config
        params = self.parameters
        binding = self.axis_binding
        tensor_parallel, sequence = binding.active(MLP), binding.active(RESIDUAL_SEQUENCE)
        if sequence is not None and tensor_parallel is not None:
            x = collectives.all_gather(x, sequence, axis_index=1)
        tokens = x.reshape(-1, x.shape[-1])
        valid = None if segment_ids is None else (segment_ids.reshape(-1) != 0)
        routing = self.router(tokens, valid)
        glu = self._glu()
        gate_up_bias = params["gate_up_bias"] if cfg.expert_bias else None
        kept_assignments = None
        if cfg.dispatch == "dropless" and binding.active(EXPERTS) is None:
            if float8.current() is not None and tokens.dtype == float8.QUANTIZED_INPUT:
                raise errors.ConfigError(
                    f"{self.path}: dropless experts without an expert axis multiply by "
                    "ragged_dot, which FP8 does not compute (they would stay bfloat16 "
                    "unnoticed)", path="precision.fp8",
                    suggestion="set the mixture's dispatch to 'capacity', put the experts on "
                               "an expert axis, or leave precision.fp8 off")
            out = expert_dispatch.ragged_experts(
                tokens, routing.expert_ids, routing.gates, params["gate_up_weight"],
                params["down_weight"], glu, gate_up_bias)
            kept = jnp.sum(routing.valid) * cfg.top_k
        else:
            out, kept, kept_assignments = self._through_slots(tokens, routing, glu)
        if cfg.shared_hidden_dim:
            both = projection.project(self, "td,dsf->tsf", tokens, "shared_gate_up_weight")
            hidden = glu(both[:, 0], both[:, 1])
            shared = projection.project(self, "tf,fd->td", hidden, "shared_down_weight")
            if cfg.shared_gate:  # (Linear in the output: a TP rank's part scales alike.)
                shared = shared * jax.nn.sigmoid(
                    tokens @ params["shared_gate_weight"].astype(tokens.dtype))[:, None]
            out = out + shared
        if cfg.expert_bias:  # sum_k gate_k b_down[expert_k], of the assignments kept ...
            gates = routing.gates if kept_assignments is None else \
                routing.gates * kept_assignments
            term = jnp.einsum("tk,tkd->td", gates.astype(out.dtype),
                              params["down_bias"].astype(out.dtype)[routing.expert_ids])
            if tensor_parallel is not None:  # ... once: the sum over the split carries it.
                term = jnp.where(collectives.axis_index(tensor_parallel) == 0, term, 0.0)
            out = out + term
        out = out.reshape(x.shape)
        if tensor_parallel is not None:  # Every expert's hidden features are split: sum once.
            out = (collectives.reduce_scatter(out, tensor_parallel, scatter_dimension=1)
                   if sequence is not None else collectives.psum(out, tensor_parallel))
        self._report(routing, kept)
        return out

    def slots_per_expert(self, num_tokens: int) -> int:
        """``C`` for a group of ``num_tokens`` (every token under an emulated dropless
        exchange)."""
        cfg = self.config
        if cfg.dispatch == "dropless":
            return num_tokens
        return expert_dispatch.capacity(tokens=num_tokens, top_k=cfg.top_k,
                                        num_experts=cfg.num_experts, factor=cfg.capacity_factor)

    def _glu(self):
        """``(gate, up) -> hidden`` of the configured activation."""
        cfg = self.config
        if cfg.activation != "clamped_swiglu":
            activation = ACTIVATIONS[cfg.activation]
            return lambda gate, up: activation(gate) * up
        alpha, limit = cfg.swiglu_alpha, cfg.swiglu_limit

        def clamped(gate, up):
            gate = jnp.minimum(gate, limit)
            up = jnp.clip(up, -limit, limit)
            return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))
        return clamped

    def _through_slots(self, tokens, routing, glu):
        """The capacity path (see expert_dispatch.py): scatter into slots, exchange over the
        expert axis, run the local experts, exchange back, combine. Returns the output, the
        number of assignments kept and which (``[T, top_k]``, 1.0 / 0.0)."""
        cfg = self.config
        params = self.parameters
        slots = self.slots_per_expert(tokens.shape[0])
        positions = expert_dispatch.slot_positions(routing.expert_ids, cfg.num_experts,
                                                   valid=routing.valid, slots=slots)
        buffer = expert_dispatch.dispatch(tokens, routing.expert_ids, positions,
                                          num_experts=cfg.num_experts, slots=slots)
        parallel = self.axis_binding.active(EXPERTS)
        kept = (lambda x: checkpoint_name(x, EXPERT_EXCHANGE)) if cfg.keep_exchanged_tokens \
            else (lambda x: x)
        if parallel is not None:
            buffer = kept(expert_dispatch.exchange(buffer, parallel))
        local_experts = params["gate_up_weight"].shape[0]
        # [E, C, D] -> [local experts, ranks x C, D]: every rank's slots for each local expert.
        grouped = buffer.reshape(-1, local_experts, slots, buffer.shape[-1]).transpose(1, 0, 2, 3)
        outputs = expert_dispatch.gated_experts(
            grouped.reshape(local_experts, -1, buffer.shape[-1]), params["gate_up_weight"],
            params["down_weight"], glu, params["gate_up_bias"] if cfg.expert_bias else None)
        outputs = outputs.reshape(grouped.shape).transpose(1, 0, 2, 3).reshape(buffer.shape)
        if parallel is not None:  # (Both exchanges are named: remat policies save them.)
            outputs = kept(expert_dispatch.exchange(outputs, parallel))
        kept_assignments = (positions < slots).astype(float)  # (jax's default float.)
        return (expert_dispatch.combine(outputs, routing.expert_ids, positions, routing.gates),
                jnp.sum(kept_assignments), kept_assignments)

    def _report(self, routing, kept):
        """Summaries of this call, and its part of the training objective."""
        cfg = self.config
        assignments = jnp.maximum(jnp.sum(routing.valid) * cfg.top_k, 1.0)
        load = routing.counts * (cfg.num_experts / assignments)
        aux = load_balancing_loss(routing, cfg.num_experts)
        z = router_z_loss(routing)
        self.add_summary("aux_loss", aux)
        self.add_summary("z_loss", z)
        self.add_summary("dropped_fraction", 1.0 - kept / assignments)
        # Over every device's tokens once averaged (the balance the experts see) ...
        self.add_summary("expert_load", VectorSummary(load))
        # ... and the most loaded expert of this device's group (what its capacity meets).
        self.add_summary("group_load_max", jnp.max(load))
        if self.is_training and (cfg.aux_loss_weight or cfg.z_loss_weight):
            self.add_module_output(MOE_OBJECTIVE, cfg.aux_loss_weight * aux
                                   + cfg.z_loss_weight * z)


def check_moe_binding(config: MoE.Config, binding, *, path: str) -> None:
    """What the plan cannot split or carry, refused before anything compiles: experts that do not
    divide over the expert axis, and, under a pipeline, what a stage cannot return (it returns
    only its activations, so a balancing loss or a bias update written inside it is dropped).
    ``path``: the MoE config's path (a model that builds its layers from one MoE config checks
    it under that config's path)."""
    experts, split = config.num_experts, binding.size(EXPERTS)
    if experts % split:
        raise errors.PlanError(
            f"{experts} experts do not split evenly over the {split} devices of the expert "
            f"axis {binding.axis(EXPERTS)!r}", path=f"{path}.num_experts",
            suggestion=f"use a multiple of {split} experts, or an expert axis whose size "
                       f"divides {experts} (--config.mesh.shape=...)")
    if binding.axis(STAGES) is None:
        return
    for field in ("aux_loss_weight", "z_loss_weight"):
        if getattr(config, field):
            raise errors.PlanError(
                "a pipeline stage carries only its activations, so the MoE layers' balancing "
                "losses would not reach the objective", path=f"{path}.{field}",
                suggestion="set it to 0 under pipeline_parallel (aux-loss-free balancing is "
                           "refused there too), or train without a pipeline")
    if config.router is not None and config.router.balance_rate:
        raise errors.PlanError(
            "aux-loss-free balancing writes a state update, which pipelined steps do not carry",
            path=f"{path}.router.balance_rate",
            suggestion="set it to 0 under pipeline_parallel, or train without a pipeline")


def add_moe_objective(loss: jax.Array, module_outputs) -> jax.Array:
    """``loss`` with the MoE layers' objective terms (found under ``module_outputs``, stacked
    over a Repeat's layers or not) added to its gradient but not to its value: the reported loss
    stays the language model's, the optimizer sees both."""
    terms = [jnp.sum(value) for value in _named_outputs(module_outputs, MOE_OBJECTIVE)]
    if not terms:
        return loss
    extra = sum(terms).astype(loss.dtype)
    return loss + (extra - jax.lax.stop_gradient(extra))


def _named_outputs(tree, name):
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key == name and not isinstance(value, dict):
                yield value
            else:
                yield from _named_outputs(value, name)


def moe_layers(module: Any, path: str = "") -> List[Tuple[str, Any]]:
    """``(path, layer)`` of every mixture-of-experts layer under ``module``."""
    path = path or module.name
    found = [(path, module)] if isinstance(module, MoE) else []
    for name, child in getattr(module, "_children", {}).items():
        found += moe_layers(child, f"{path}/{name}")
    return found
