"""LoRA: low-rank adapters on chosen weights, the weights themselves frozen.

A weight ``W`` (any projection: ``[in, out]``, attention's ``[model, heads, head_dim]``, the
gated MLP's ``[model, 2, hidden]``, an expert stack) gets two trained arrays beside it in its
layer's params, ``<name>_lora_a`` and ``<name>_lora_b``, and the layer computes

    y = x W + scale * (dropout(x) A) B,        scale = alpha / rank   (rsLoRA: alpha / sqrt(rank))

never forming ``A B`` (so no gradient the size of ``W`` exists). The weight's *declared* roles
say which dimension is which (``ParameterSpec.fan_axes``): ``A`` spans the weight's input
dimensions and the rank, ``B`` the rank and its output dimensions; a dimension that is neither
(the gate / up pair of a gated MLP, an expert) keeps a separate adapter per index, as separate
Hugging Face modules have (PEFT's ``gate_proj`` and ``up_proj`` each have their own A and B).

``A`` and ``B`` take their weight's layout: under TP a column-parallel weight's ``B`` is split
like its outputs (``A`` whole), a row-parallel one's ``A`` like its inputs -- its partial sums
meet the weight's in the same all-reduce; FSDP / ZeRO split and gather them as any param;
stacked layers (scan, PP) stack them. ``A`` starts random (the variance of PEFT's
Kaiming-uniform), ``B`` at zero, so the adapted model starts equal to its base.

Frozen params are marked ``ParameterSpec.trainable = False``: the step computes, reduces and
stores optimizer state for the trainable ones only (train/trainable.py).

``LoRA.adapter_specs`` adds the adapters to a model's specs; ``low_rank_update`` is what layers
add to their product; ``scope`` carries the run's scale and dropout to them while the step is traced
(``disabled()`` runs the base: a preference loss's reference model without a second copy).
"""

from __future__ import annotations

import contextlib
import functools
import dataclasses
import math
import re
import threading
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.config import Configurable, value_checks
from titanax.parallel.axis_binding import SEQUENCE
from titanax.modules.initializers import Constant, FanAxes, VarianceScaling

# The adapters' names beside their weight.
A_SUFFIX = "_lora_a"
B_SUFFIX = "_lora_b"

# The default targets: attention's q / k / v / output projections and the MLP's, in the decoder
# family (GPT-2's fused qkv and c_fc / c_proj, latent attention's low-rank query and key/value
# projections, Gated DeltaNet's q / k / v included), as regular expressions over param paths
# ('/'-joined, e.g. "decoder/layer/attn/q_weight").
DEFAULT_TARGETS = (
    r"(^|/)attn/(q|k|v|qkv)_weight$",
    r"(^|/)attn/(q_a|q_b|kv_a|kv_b)_weight$",
    r"(^|/)attn/o/weight$",
    r"(^|/)mlp/gate_up_weight$",
    r"(^|/)mlp/(up|down)/weight$",
)


@dataclasses.dataclass(frozen=True)
class AdapterSettings:
    """What layers need while the step is traced: the update's scale, its input dropout, and
    whether the adapters run at all."""

    scale: float
    dropout_rate: float = 0.0
    enabled: bool = True


class LoRA(Configurable):
    """The run's adapters (``--config.lora``; None trains every weight)."""

    class Config(Configurable.Config):
        # The adapters' rank r.
        rank: int = 8
        # The update's numerator: scale = alpha / rank (rsLoRA: alpha / sqrt(rank)).
        alpha: float = 16.0
        # Dropout on the adapters' input (training only; PEFT's lora_dropout).
        dropout_rate: float = 0.0
        # Rank-stabilised scaling, alpha / sqrt(rank) (PEFT's use_rslora).
        rslora: bool = False
        # Storage dtype of the frozen params (e.g. "bfloat16": half the memory of a float32
        # base; they are cast to the compute dtype where used, as every param); None: the
        # precision's param dtype.
        frozen_dtype: Optional[str] = None
        # Regular expressions over '/'-joined param paths; a matching weight is adapted
        # (default: attention q / k / v / output and the MLP projections, passing over those
        # whose layer does not adapt them -- a mixture of experts' experts; a pattern of your
        # own that matches such a weight is refused).
        targets: Sequence[str] = DEFAULT_TARGETS

        def _validate_values(self):
            if self.rank < 1:
                yield "rank", f"must be >= 1, got {self.rank}"
            if not (math.isfinite(self.alpha) and self.alpha > 0):
                yield "alpha", f"must be a finite number > 0, got {self.alpha}"
            if not 0.0 <= self.dropout_rate < 1.0:
                yield "dropout_rate", f"must be in [0, 1), got {self.dropout_rate}"
            if not self.targets:
                yield "targets", "name at least one weight pattern"
            if self.frozen_dtype is not None:
                try:
                    floating = jnp.issubdtype(jnp.dtype(self.frozen_dtype), jnp.floating)
                except TypeError:
                    floating = False
                if not floating:
                    yield "frozen_dtype", f"must be a float dtype, got {self.frozen_dtype!r}"
            yield from value_checks.regexes("targets", self.targets)

    @property
    def scale(self) -> float:
        cfg = self.config
        return cfg.alpha / (math.sqrt(cfg.rank) if cfg.rslora else cfg.rank)

    def settings(self) -> AdapterSettings:
        return AdapterSettings(scale=self.scale, dropout_rate=self.config.dropout_rate)

    # --- The model-converter protocol (modules/converters.py) ----------------------------------

    def check_model(self, model: Any) -> None:
        if model is None:
            raise errors.ConfigError("LoRA adapts a configured model's weights; a hand-written "
                                     "step has none", path="lora",
                                     suggestion="configure a model, or set lora=None")

    def convert_specs(self, specs: Dict[str, Any], *, model: Any) -> Dict[str, Any]:
        return self.adapter_specs(specs, adaptable=model.adaptable_weight_paths())

    def scope(self) -> ContextManager[None]:
        return scope(self.settings())

    @staticmethod
    def base_scope() -> ContextManager[None]:
        return disabled()

    @staticmethod
    def split_added(tree: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        return split_adapters(tree)

    @staticmethod
    def join_added(base: Dict[str, Any], added: Dict[str, Any]) -> Dict[str, Any]:
        return join_adapters(base, added)

    @property
    def frozen_dtype(self) -> Optional[str]:
        return self.config.frozen_dtype

    def adapter_specs(self, specs: Dict[str, Any], *, adaptable: Sequence[str]) -> Dict[str, Any]:
        """``specs`` (a model's resolved ParameterSpecs) with every param frozen and an adapter
        pair beside each targeted weight. ``adaptable``: the paths of the weights whose layers
        add the update (``BaseLayer.adaptable_weight_paths``). A default pattern passes over a
        weight its layer does not adapt (a mixture's experts; GPT-2 has no gated MLP); a pattern
        of the user's must match adaptable weights only, and at least one -- a misspelled or
        unadaptable target would otherwise train nothing, silently."""
        from titanax.modules.base_layer import ParameterSpec  # pylint: disable=import-outside-toplevel
        cfg = self.config
        patterns = [(p, re.compile(p), p in DEFAULT_TARGETS) for p in cfg.targets]
        used = {p: False for p in cfg.targets}
        adapted: List[str] = []

        def visit(tree: Dict[str, Any], prefix: str) -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for name, spec in tree.items():
                path = f"{prefix}/{name}" if prefix else name
                if not isinstance(spec, ParameterSpec):
                    out[name] = visit(spec, path)
                    continue
                out[name] = self._frozen(spec)
                matching = [(text, default) for text, pattern, default in patterns
                            if pattern.search(path)]
                if not matching:
                    continue
                if path not in adaptable:
                    mine = [text for text, default in matching if not default]
                    if mine:
                        raise errors.ConfigError(
                            f"the LoRA target {mine[0]!r} matches {path}, which its layer does "
                            "not adapt", path="lora.targets", suggestion=_adaptable_text(adaptable))
                    continue
                for text, _ in matching:
                    used[text] = True
                out[name + A_SUFFIX], out[name + B_SUFFIX] = self._pair(spec, path)
                adapted.append(path)
            return out

        result = visit(specs, "")
        unused = [text for text, _, default in patterns if not default and not used[text]]
        if unused or not adapted:
            what = (f"the LoRA target {unused[0]!r} matches no adaptable weight" if unused else
                    f"no weight of the model matches the LoRA targets {list(cfg.targets)}")
            raise errors.ConfigError(what, path="lora.targets",
                                     suggestion=_adaptable_text(adaptable))
        return result

    @staticmethod
    def _frozen(spec):
        return dataclasses.replace(spec, trainable=False)

    def _pair(self, spec, path: str):
        """The A and B specs of weight ``spec`` at ``path``."""
        roles = weight_roles(spec, path=path)
        stacked = tuple(range(spec.stacked_dims))
        rank = self.config.rank
        fan_in = math.prod(spec.shape[d] for d in roles.inputs)
        fan_out = math.prod(spec.shape[d] for d in roles.outputs)
        if rank > min(fan_in, fan_out):
            raise errors.ConfigError(
                f"rank {rank} is larger than {path}'s smaller side ({fan_in} inputs x {fan_out} "
                f"outputs): A x B can never exceed rank {min(fan_in, fan_out)}, so the extra "
                f"rank only adds parameters", path="lora.rank",
                suggestion=f"use a rank <= {min(fan_in, fan_out)} (or leave this weight out of "
                           f"lora.targets)")

        def pick(dims: Sequence[int], values, fill):
            return tuple(values[d] for d in dims) if values is not None else (fill,) * len(dims)

        a_dims = stacked + roles.batch + roles.inputs
        b_dims = stacked + roles.batch
        mesh = spec.mesh_axes
        logical = spec.logical_axes
        a_fan = FanAxes(in_axes=range(len(a_dims) - len(roles.inputs), len(a_dims)),
                        out_axes=(len(a_dims),))
        a = dataclasses.replace(
            spec, shape=tuple(spec.shape[d] for d in a_dims) + (rank,),
            mesh_axes=(pick(a_dims, mesh, None) + (None,)) if mesh is not None else None,
            logical_axes=(pick(a_dims, logical, None) + (None,)) if logical is not None else None,
            # PEFT's Kaiming-uniform A has variance 1 / (3 fan_in): the same, normal.
            initializer=VarianceScaling.default_config().set(scale=1.0 / 3).instantiate(),
            fan_axes=a_fan, trainable=True)
        b = dataclasses.replace(
            spec, shape=tuple(spec.shape[d] for d in b_dims) + (rank,)
            + tuple(spec.shape[d] for d in roles.outputs),
            mesh_axes=(pick(b_dims, mesh, None) + (None,) + pick(roles.outputs, mesh, None))
            if mesh is not None else None,
            logical_axes=(pick(b_dims, logical, None) + (None,)
                          + pick(roles.outputs, logical, None)) if logical is not None else None,
            initializer=Constant.default_config().set(value=0.0).instantiate(),
            fan_axes=FanAxes(in_axes=(len(b_dims),),
                             out_axes=range(len(b_dims) + 1, len(b_dims) + 1 + len(roles.outputs))),
            trainable=True)
        return a, b


def _adaptable_text(adaptable: Sequence[str]) -> str:
    if not adaptable:
        return ("this model's layers adapt no weight (a Flax module's do not): train it without "
                "LoRA (lora=None)")
    shown = sorted(adaptable)
    return ("patterns over these paths (regular expressions): " + ", ".join(shown[:12])
            + (f" and {len(shown) - 12} more" if len(shown) > 12 else ""))


def is_adapter(name: str) -> bool:
    """Whether a param's name (or path) is a LoRA adapter's."""
    return name.endswith((A_SUFFIX, B_SUFFIX))


def split_adapters(tree: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(base, adapters)``: a param-shaped nested dict cut into the model's own params and the
    LoRA adapters (dicts left empty dropped)."""
    base: Dict[str, Any] = {}
    adapters: Dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            sub_base, sub_adapters = split_adapters(value)
            if sub_base:
                base[name] = sub_base
            if sub_adapters:
                adapters[name] = sub_adapters
        elif is_adapter(name):
            adapters[name] = value
        else:
            base[name] = value
    return base, adapters


def join_adapters(base: Dict[str, Any], adapters: Dict[str, Any]) -> Dict[str, Any]:
    """The inverse of ``split_adapters``."""
    out = dict(base)
    for name, value in adapters.items():
        out[name] = join_adapters(out.get(name, {}), value) if isinstance(value, dict) else value
    return out


@dataclasses.dataclass(frozen=True)
class WeightRoles:
    """A weight's per-layer dimensions by role (indices into the stacked shape)."""

    inputs: Tuple[int, ...]
    outputs: Tuple[int, ...]
    # Neither: one adapter per index (gate / up, experts).
    batch: Tuple[int, ...]


def weight_roles(spec, *, path: str) -> WeightRoles:
    """The roles ``spec`` declares (its fan axes, past its stacked layer dimensions)."""
    if spec.fan_axes is None or not spec.fan_axes.declared or \
            len(spec.shape) - spec.stacked_dims < 2:
        raise errors.ConfigError(
            f"{path} (shape {tuple(spec.shape)}) is not a weight with declared input and output "
            "dimensions, so it cannot take a low-rank adapter", path="lora.targets",
            suggestion="target projection weights only (biases, norms and embeddings are not)")
    # Repeat shifts the per-layer fan axes past the stacked dimensions already.
    inputs, outputs = tuple(spec.fan_axes.in_axes), tuple(spec.fan_axes.out_axes)
    batch = tuple(d for d in range(spec.stacked_dims, len(spec.shape))
                  if d not in inputs and d not in outputs)
    return WeightRoles(inputs=inputs, outputs=outputs, batch=batch)


# --- The adapted product (layers call it) ----------------------------------------------------


def low_rank_update(layer, equation: str, x: jax.Array, name: str, *,
                    whole_sequence: bool = False) -> Optional[jax.Array]:
    """``scale * (dropout(x) A) B`` for ``layer``'s weight ``name`` used as ``einsum(equation,
    x, W)``: what the layer adds to that product when it holds an adapter for the weight and
    the scope enables adapters; None otherwise (the layer's code is then unchanged).
    ``whole_sequence``: ``x`` holds the whole row on every rank even under context parallelism
    (a row gathered there), so its dropout mask is the one one device draws."""
    params = layer.parameters
    a = params.get(name + A_SUFFIX) if isinstance(params, dict) else None
    settings = current_settings()
    if a is None or (settings is not None and not settings.enabled):
        return None
    if settings is None:
        raise errors.ModuleError(
            f"{type(layer).__qualname__} holds a LoRA adapter for {name} but runs outside a "
            "LoRA scope (its scale unknown)", path=name,
            suggestion="run the model through the engine, or inside lora.scope(settings)")
    b = params[name + B_SUFFIX]
    spec = layer._create_layer_parameter_specs()[name]  # pylint: disable=protected-access
    a_eq, b_eq = _adapter_equations(equation, spec)
    rate = settings.dropout_rate if layer.is_training else 0.0
    x_in = x
    if rate:
        key = _dropout_key(layer, spec, name, whole_sequence=whole_sequence)
        keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
        x_in = jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
    return _low_rank_product(x_in, a.astype(x.dtype), b.astype(x.dtype), a_eq=a_eq, b_eq=b_eq,
                             scale=settings.scale)


def _dropout_key(layer, spec, name: str, *, whole_sequence: bool) -> jax.Array:
    """The key of the dropout on the adapter's input: the layer's, salted by the weight, and
    folded with this device's place along every dimension of ``x`` split across devices -- the
    weight's input features (a row-parallel projection's heads / mlp) and a context-parallel
    sequence -- so each shard of ``x`` gets its own mask, as one device would draw (a dimension
    whose copies every device holds keeps one mask)."""
    key = jax.random.fold_in(layer.prng_key, _name_salt(name))
    binding = layer.axis_binding
    names = [spec.logical_axes[d] for d in weight_roles(spec, path=name).inputs] \
        if spec.logical_axes is not None else []
    for dim in names + ([] if whole_sequence else [SEQUENCE]):
        if dim is not None and binding.active(dim) is not None:
            key = jax.random.fold_in(key, binding.rank(dim))
    return key


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _low_rank_product(x, a, b, a_eq: str, b_eq: str, scale: float):
    """``scale * (x A) B``. Its own VJP so that no remat policy keeps its output: a policy that
    saves dot outputs (dots_with_no_batch_dims_saveable) would keep this weight-output-sized
    update beside the weight's own product in every layer (llama3_8b_lora_sft: 58 -> 77 GiB
    peak); the backward recomputes the rank-r ``x A`` instead (two small products)."""
    return scale * jnp.einsum(b_eq, jnp.einsum(a_eq, x, a), b)


def _low_rank_product_fwd(x, a, b, a_eq, b_eq, scale):
    return _low_rank_product(x, a, b, a_eq, b_eq, scale), (x, a, b)


def _low_rank_product_bwd(a_eq, b_eq, scale, residuals, d_out):
    x, a, b = residuals
    low, low_vjp = jax.vjp(lambda x, a: jnp.einsum(a_eq, x, a), x, a)
    (scaled_low, d_b) = jax.vjp(lambda l, b: scale * jnp.einsum(b_eq, l, b), low, b)[1](d_out)
    d_x, d_a = low_vjp(scaled_low)
    return d_x, d_a, d_b


_low_rank_product.defvjp(_low_rank_product_fwd, _low_rank_product_bwd)


def _adapter_equations(equation: str, spec) -> Tuple[str, str]:
    """The einsums through A and B for a weight used as ``equation`` (``x, W -> y``), its
    letters' roles from ``spec``'s fan axes."""
    operands, out = equation.replace(" ", "").split("->")
    x_sub, w_sub = operands.split(",")
    if len(w_sub) != len(spec.shape) - spec.stacked_dims:
        raise errors.ModuleError(f"einsum {equation!r} does not index the weight's "
                                 f"{len(spec.shape)} dimensions", path="lora")
    roles = weight_roles(dataclasses.replace(spec, stacked_dims=0), path="")
    rank = next(c for c in "RQZYXWVUTSPONMLKJIHGFEDCBA" if c not in equation)
    inputs = "".join(w_sub[d] for d in roles.inputs)
    outputs = "".join(w_sub[d] for d in roles.outputs)
    batch = "".join(w_sub[d] for d in roles.batch)
    low = "".join(c for c in x_sub if c not in inputs) + "".join(
        c for c in batch if c not in x_sub) + rank
    return (f"{x_sub},{batch}{inputs}{rank}->{low}", f"{low},{batch}{rank}{outputs}->{out}")


def _name_salt(name: str) -> int:
    import zlib  # pylint: disable=import-outside-toplevel
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


# --- The scope ---------------------------------------------------------------------------------


class _Scope(threading.local):
    def __init__(self):
        super().__init__()
        self.stack: List[Optional[AdapterSettings]] = []


_SCOPE = _Scope()


def current_settings() -> Optional[AdapterSettings]:
    return _SCOPE.stack[-1] if _SCOPE.stack else None


@contextlib.contextmanager
def scope(settings: Optional[AdapterSettings]) -> Iterator[None]:
    """Layers traced in the block apply their adapters with ``settings`` (None: no change)."""
    if settings is None:
        yield
        return
    _SCOPE.stack.append(settings)
    try:
        yield
    finally:
        _SCOPE.stack.pop()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Layers traced in the block run their base weights only (the reference of a preference
    loss under LoRA)."""
    _SCOPE.stack.append(AdapterSettings(scale=0.0, enabled=False))
    try:
        yield
    finally:
        _SCOPE.stack.pop()


# --- Export: the adapters folded into their weights, or as PEFT's lora_A / lora_B ---------------


def adapted_paths(specs: Dict[str, Any]) -> List[str]:
    """'/'-joined paths of the weights that hold adapters in ``specs`` (a LoRA run's)."""
    paths: List[str] = []

    def visit(tree, prefix):
        for name, value in tree.items():
            path = f"{prefix}/{name}" if prefix else name
            if isinstance(value, dict):
                visit(value, path)
            elif name.endswith(A_SUFFIX):
                paths.append(path[:-len(A_SUFFIX)])

    visit(specs, "")
    return paths


def merged_weight(weight, a, b, *, spec, scale: float):
    """``weight + scale * A B`` (stacked dimensions included), in ``weight``'s dtype: the
    weight a merged export writes."""
    roles = weight_roles(spec, path="")
    letters = "abcdefghijklmnopqrstuvwxyz"[:len(spec.shape)]
    stacked = letters[:spec.stacked_dims]
    pick = lambda dims: "".join(letters[d] for d in dims)  # noqa: E731
    batch, inputs, outputs = pick(roles.batch), pick(roles.inputs), pick(roles.outputs)
    delta = jnp.einsum(f"{stacked}{batch}{inputs}R,{stacked}{batch}R{outputs}->{letters}",
                       a.astype(jnp.float32), b.astype(jnp.float32))
    return (weight.astype(jnp.float32) + scale * delta).astype(weight.dtype)


def as_weights(a, b, *, spec) -> Tuple[Any, Any]:
    """One layer's A and B laid out as weights of their own, in the order of ``spec``'s
    dimensions (per layer: no stacked dimension): A with the output dimensions replaced by the
    rank (a projection from the weight's inputs to r), B with the inputs replaced by it (from r
    to its outputs). A Hugging Face form that turns the weight into ``[out, in]`` tensors turns
    these into PEFT's ``lora_A.weight [r, in]`` and ``lora_B.weight [out, r]``."""
    roles = weight_roles(dataclasses.replace(spec, stacked_dims=0), path="")

    def arranged(x, replaced: Sequence[int], kept_order: Sequence[int]):
        # x is laid out [batch..., kept..., r] (A) or [batch..., r, kept...] (B); the result
        # follows the weight's dimension order with ``replaced`` collapsed into r.
        order: List[int] = []
        for d in range(len(spec.shape)):
            if d in replaced:
                if d == replaced[0]:
                    order.append(-1)
            else:
                order.append(d)
        source = {d: i for i, d in enumerate(kept_order)}
        return jnp.transpose(x, [source[d] for d in order])

    a_order = list(roles.batch) + list(roles.inputs) + [-1]
    b_order = list(roles.batch) + [-1] + list(roles.outputs)
    return (arranged(a, roles.outputs, a_order), arranged(b, roles.inputs, b_order))


def per_layer(spec):
    """A stacked weight's spec for one layer (its stacked dimensions dropped)."""
    k = spec.stacked_dims
    fan = spec.fan_axes
    return dataclasses.replace(
        spec, shape=tuple(spec.shape[k:]), stacked_dims=0,
        fan_axes=fan.shifted(-k) if fan is not None else None,
        mesh_axes=None, logical_axes=None)


def merged_params(params: Dict[str, Any], specs: Dict[str, Any], *, scale: float
                  ) -> Dict[str, Any]:
    """``params`` (a LoRA run's, canonical layout) with each adapter pair folded into its
    weight and removed: the model a merged export writes."""
    base, adapters = split_adapters(params)
    out = base
    for path in adapted_paths(specs):
        *parents, name = path.split("/")
        weights, pairs, spec_node = out, adapters, specs
        for parent in parents:
            weights, pairs, spec_node = weights[parent], pairs[parent], spec_node[parent]
        weights[name] = jax.jit(functools.partial(merged_weight, spec=spec_node[name],
                                                  scale=scale))(
            weights[name], pairs[name + A_SUFFIX], pairs[name + B_SUFFIX])
    return out
