"""Adapted Flax models trained by the Engine, and the same models trained by plain Flax + optax
in a loop written here (the reference the adapters' parity tests compare against).

The models are the experiments' own (an NNX GPT with scanned or listed blocks, a Linen CNN with
BatchNorm), shrunk. The reference starts from the module's own init with the run's init key --
what the adapter must reproduce -- and takes the same batches in the same order with plain SGD
in float32.
"""

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from titanax.config import config_for_function
from titanax.modules.adapters.flax_linen import FlaxLinen
from titanax.modules.adapters.objectives import ClassificationLoss
from titanax.parallel import collectives
from titanax.parallel.plan import DP, Plan, ZeRO
from titanax.train import prng
from titanax.train.engine import Engine
from titanax_experiments import flax_linen, flax_nnx
from tests.train import helpers

LEARNING_RATE = 0.5
SEED = 0
# Small enough that every matrix and most vectors of the tiny models are split by ZeRO / FSDP.
MIN_SHARD_SIZE = 32
GPT_SIZES = dict(vocab_size=256, num_layers=2, model_dim=32, num_heads=2)
GPT_SEQ = 16
CNN_SIZES = dict(channels=(4, 8), hidden_dim=32)


def init_key() -> jax.Array:
    """The key the engine initialises params with (the run's ``init`` stream)."""
    return prng.stream_key(SEED, "init")


def text_batches() -> List[Dict[str, np.ndarray]]:
    return helpers.text_batches(batch_size=16, seq_len=GPT_SEQ, count=3)


def image_batches() -> List[Dict[str, np.ndarray]]:
    return helpers.mnist_batches(batch_size=32, count=3)


def plan(*, zero: int = 0, data_axis: str = "data", **zero_options) -> Plan.Config:
    return Plan.default_config().set(
        data_parallel=DP.default_config().set(axis=data_axis),
        zero=ZeRO.default_config().set(stage=zero, min_shard_size=MIN_SHARD_SIZE,
                                       **zero_options) if zero else None)


def engine(model: Any, *, data: int = 8, zero: int = 0, **changes) -> Engine:
    cfg = Engine.default_config().set(
        mesh=helpers.mesh((data,), devices=list(range(data))), plan=plan(zero=zero),
        model=model, learner=helpers.sgd(LEARNING_RATE), loggers=[], log_every=1000, seed=SEED)
    return cfg.set(**changes).instantiate()


# --- NNX ------------------------------------------------------------------------------------------

def nnx_model(*, scan_layers: bool = True) -> Any:
    return flax_nnx.nnx_gpt(seq_len=GPT_SEQ, scan_layers=scan_layers, **GPT_SIZES)


def _next_token_loss(logits, batch) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, batch["target_ids"][..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


@functools.lru_cache(maxsize=None)
def plain_nnx(*, scan_layers: bool = True) -> Tuple[Any, List[float], Any]:
    """(initial params, per-step losses, final params) of the NNX GPT trained by hand."""
    with nnx.use_eager_sharding(False):  # Its partitioning names are for the rules only.
        model = flax_nnx.make_gpt(max_seq_len=GPT_SEQ, scan_layers=scan_layers, **GPT_SIZES,
                                  rngs=nnx.Rngs(init_key()))
    optimizer = nnx.Optimizer(model, optax.sgd(LEARNING_RATE), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        def loss_fn(model):
            return _next_token_loss(model(batch["input_ids"]), batch)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    initial = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    losses = [float(step(model, optimizer, batch)) for batch in text_batches()]
    return initial, losses, nnx.to_pure_dict(nnx.state(model, nnx.Param))


# --- Linen ----------------------------------------------------------------------------------------

def linen_model(**changes) -> Any:
    return flax_linen.linen_cnn(batch_norm_axis="data", **CNN_SIZES, **changes)


@functools.lru_cache(maxsize=None)
def plain_linen() -> Tuple[Any, List[float], Any]:
    """(initial variables, per-step losses, final variables) of the Linen CNN trained by hand
    on whole batches (BatchNorm's statistics of the whole batch, as the run's cross-device
    BatchNorm computes them)."""
    model = flax_linen.make_cnn(**CNN_SIZES)
    images = image_batches()
    # Unboxed: the logical partitioning names are for the rules only.
    variables = nn.meta.unbox(model.init({"params": init_key()}, jnp.zeros((2, 28, 28)),
                                         train=False))
    params, batch_stats = variables["params"], variables["batch_stats"]
    tx = optax.sgd(LEARNING_RATE)
    opt_state = tx.init(params)

    def loss_fn(params, batch_stats, batch):
        logits, updated = model.apply({"params": params, "batch_stats": batch_stats},
                                      batch["image"], train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, updated["batch_stats"]

    @jax.jit
    def step(params, batch_stats, opt_state, batch):
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, batch_stats, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    losses = []
    for batch in images:
        params, batch_stats, opt_state, loss = step(params, batch_stats, opt_state, batch)
        losses.append(float(loss))
    return variables, losses, {"params": params, "batch_stats": batch_stats}


class ScannedMLP(nn.Module):
    """A Linen classifier whose hidden layers are one ``nn.scan`` stack (for FSDP per layer)."""

    width: int = 64
    num_layers: int = 3

    @nn.compact
    def __call__(self, image):
        x = nn.Dense(self.width)(image.reshape(image.shape[0], -1))

        class Layer(nn.Module):
            @nn.compact
            def __call__(self, x, _):
                return x + jax.nn.tanh(nn.Dense(x.shape[-1])(x)), None

        stack = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=self.num_layers)
        x, _ = stack()(x, None)
        return nn.Dense(10)(x)


def make_scanned_mlp() -> ScannedMLP:
    return ScannedMLP()


def scanned_mlp_model() -> Any:
    return FlaxLinen.default_config().set(
        name="scanned_mlp", module=config_for_function(make_scanned_mlp), inputs=("image",),
        example_inputs={"image": "float32[2,28,28]"}, loss=ClassificationLoss.default_config())


@functools.lru_cache(maxsize=None)
def plain_scanned_mlp() -> Tuple[Any, List[float], Any]:
    model = make_scanned_mlp()
    params = model.init({"params": init_key()}, jnp.zeros((2, 28, 28)))["params"]
    tx = optax.sgd(LEARNING_RATE)
    opt_state = tx.init(params)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    initial, losses = {"params": params}, []
    for batch in image_batches():
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return initial, losses, {"params": params}


def in_loop_gathers(engine: Engine, axis: str = "data") -> Dict[str, int]:
    """All-gathers over ``axis`` inside a loop of the compiled train step, by pass."""
    counts = {"forward": 0, "backward": 0}
    for op in engine.collectives():
        if op.op == "all-gather" and op.in_loop and axis in op.axes:
            counts[op.pass_name] = counts.get(op.pass_name, 0) + 1
    return counts


def numpy_tree(tree: Any) -> Any:
    return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def as_strings(tree: Any) -> Any:
    """A pure dict with every key a string (NNX's list indices are ints; the adapter's paths
    are strings)."""
    if isinstance(tree, dict):
        return {str(k): as_strings(v) for k, v in tree.items()}
    return tree


def train(engine: Engine, batches: Sequence[Dict[str, np.ndarray]]):
    """(initial params, per-step losses, final params) of the engine."""
    engine.init_state()
    initial = numpy_tree(engine.canonical_params())
    losses, final = helpers.train(engine, batches)
    return initial, losses, final


def nnx_stages(model: Any) -> List[Any]:
    """The untied, listed NNX GPT in two explicit stages: embeddings and the first block, then
    the second block and the head (each ``fwd`` calls the module's own submodules)."""
    from titanax.parallel.stages import Stage  # pylint: disable=import-outside-toplevel
    adapter = model.instantiate()
    return [Stage(name="embed_block0", param_filter=["tok_emb/*", "pos_emb/*", "blocks/0/*"],
                  fwd=adapter.stage(lambda m, batch: m.blocks[0](m.embed(batch["input_ids"])))),
            Stage(name="block1_head", param_filter=["blocks/1/*", "ln_f/*", "lm_head/*"],
                  fwd=adapter.stage(lambda m, x: m.head(m.blocks[1](x))))]


class MegatronMLP(nnx.Module):
    """An NNX classifier that splits itself over a TP axis when given one: the hidden features
    column-parallel (``mlp``), the output row-parallel and summed with Titanax's collectives."""

    def __init__(self, *, hidden: int, tp_axis: Optional[str], rngs: nnx.Rngs):
        self.tp_axis = tp_axis
        self.hidden = hidden
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(784, hidden, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, ("pixels", "mlp")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)))
        self.down = nnx.Linear(hidden, 10, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init, ("mlp", "classes")))
        self.bias = nnx.Param(jnp.zeros((10,)))

    def __call__(self, image):
        hidden = self.up(image.reshape(image.shape[0], -1))
        if self.tp_axis is not None:  # Its share of the features, as Megatron code counts it.
            hidden = hidden.reshape(hidden.shape[0],
                                    self.hidden // collectives.axis_size(self.tp_axis))
        y = self.down(jax.nn.relu(hidden))
        if self.tp_axis is not None:  # Each rank holds part of the hidden features' sum.
            y = collectives.psum(y, self.tp_axis)
        return y + self.bias[...]


def make_megatron_mlp(*, hidden: int = 64, tp_axis: Optional[str] = None, rngs: nnx.Rngs):
    return MegatronMLP(hidden=hidden, tp_axis=tp_axis, rngs=rngs)


def megatron_model() -> Any:
    from titanax.modules.adapters.flax_nnx import FlaxNNX  # pylint: disable=import-outside-toplevel
    return FlaxNNX.default_config().set(
        name="megatron", module=config_for_function(make_megatron_mlp), inputs=("image",),
        example_inputs={"image": "float32[2,28,28]"}, loss=ClassificationLoss.default_config())


class SlowAverage(nnx.Module):
    """A moving average (momentum 0.999) of its input's mean, kept in a BatchStat: each step
    moves it by less than half a bfloat16 step at 1.0."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.ones((4,)))
        self.average = nnx.BatchStat(jnp.ones(()))

    def __call__(self, x):
        self.average[...] = 0.999 * self.average[...] + 0.001 * jnp.mean(x)
        return jnp.mean((x * self.scale[...]) ** 2)


def make_slow_average(*, rngs: nnx.Rngs):
    return SlowAverage(rngs=rngs)


def slow_average_model() -> Any:
    from titanax.modules.adapters.flax_nnx import FlaxNNX  # pylint: disable=import-outside-toplevel
    from titanax.modules.adapters.objectives import ReturnedLoss  # pylint: disable=import-outside-toplevel
    return FlaxNNX.default_config().set(
        name="slow_average", module=config_for_function(make_slow_average), inputs=("x",),
        example_inputs={"x": "float32[2,4]"},
        loss=ReturnedLoss.default_config().set(count="examples"))


def hlo_shape(spec: Any) -> str:
    """``f32[2,32,128]``: how a compiled program names an array of ``spec``'s global shape."""
    return f"f32[{','.join(str(d) for d in spec.shape)}]"
