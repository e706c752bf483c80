"""A CNN with batch normalisation written in Flax Linen, trained by Titanax through the
``FlaxLinen`` adapter.

The CNN (``flax_models/linen_cnn.py``, imported when the experiment is built: listing the
experiments imports no flax) is plain Flax Linen: two ``conv 3x3 -> BatchNorm -> ReLU -> 2x2 average pool``
stages, then a dense layer and the class logits. Its ``batch_stats`` are mutable state: each
training step's new running statistics are state updates, averaged over the data shards. With
``batch_norm_axis`` set (the experiment sets the data axis), BatchNorm averages its batch
statistics over that axis (``axis_name``: Flax's own cross-device batch norm), so every shard
normalises by the whole batch's statistics -- what one device with the whole batch computes.
Kernels name their dimensions (``in``, ``out``) with ``nn.with_logical_partitioning``.

* ``flax_linen_cnn_fsdp``: the Linen CNN on MNIST (the 5,000 bundled digits offline), FSDP over
  every device: params, gradients and optimizer state sharded on the dimension the logical axis
  rules name (``out``), each param gathered where the CNN reads it (it has no layer stack).
"""

from typing import TYPE_CHECKING, Optional, Tuple

from titanax.config import checked_by, config_for_function, register_experiment
from titanax.config import value_checks as check
from titanax.data.pipeline import Input
from titanax.data.sources import MNIST
from titanax.io.checkpointer import OrbaxCheckpoint
from titanax.observe.loggers import CSV, Basic, TensorBoard
from titanax.parallel.plan import DP, Plan, ZeRO
from titanax.runtime.mesh import MeshSpec
from titanax.train import optimizers
from titanax.train.engine import Engine
from titanax.train.evaler import Evaler
from titanax.train.learner import Learner

if TYPE_CHECKING:  # (flax is imported when the experiment is built, not when it is listed.)
    from titanax.modules.adapters.flax_linen import FlaxLinen

    from .flax_models.linen_cnn import CNN


def _cnn_sizes(*, num_classes=10, channels=(16, 32), hidden_dim=128, **_):
    """The factory's arguments, checked where the config is validated (named by path)."""
    yield from check.at_least("num_classes", num_classes, 1)
    yield from check.at_least("hidden_dim", hidden_dim, 1)
    if isinstance(channels, (list, tuple)) and any(
            isinstance(c, int) and c < 1 for c in channels):
        yield "channels", f"every channel count must be >= 1, got {tuple(channels)}"


@checked_by(_cnn_sizes)
def make_cnn(*, num_classes: int = 10, channels: Tuple[int, int] = (16, 32),
             hidden_dim: int = 128, batch_norm_axis: Optional[str] = None) -> "CNN":
    """The factory the adapter calls."""
    from .flax_models.linen_cnn import CNN  # pylint: disable=import-outside-toplevel
    return CNN(num_classes=num_classes, channels=tuple(channels), hidden_dim=hidden_dim,
               batch_norm_axis=batch_norm_axis)


def linen_cnn(**changes) -> "FlaxLinen.Config":
    """The adapted Linen CNN: class logits trained on the labels."""
    from titanax.modules.adapters.flax_linen import FlaxLinen  # pylint: disable=import-outside-toplevel
    from titanax.modules.adapters.objectives import ClassificationLoss  # pylint: disable=import-outside-toplevel
    return FlaxLinen.default_config().set(
        name="linen_cnn", module=config_for_function(make_cnn).set(**changes),
        inputs=("image",), example_inputs={"image": "float32[2,28,28]"},
        loss=ClassificationLoss.default_config().set(num_classes=10))


def _mnist(split: str, batch_size: int, **changes) -> Input.Config:
    return Input.default_config().set(source=MNIST.default_config().set(split=split),
                                      global_batch_size=batch_size, **changes)


@register_experiment
def flax_linen_cnn_fsdp():
    """A Linen CNN with BatchNorm (adapted by FlaxLinen) on MNIST, FSDP over every device."""
    steps = 400
    return Engine.default_config().set(
        mesh=MeshSpec.default_config().set(axes=("data",)),
        plan=Plan.default_config().set(
            data_parallel=DP.default_config().set(axis="data"),
            zero=ZeRO.default_config().set(stage=3),
            logical_axis_rules={"in": None, "out": "data"}),
        model=linen_cnn(batch_norm_axis="data"),
        learner=Learner.default_config().set(
            optimizer=config_for_function(optimizers.adamw).set(
                learning_rate=config_for_function(optimizers.warmup_cosine).set(
                    peak_value=3e-3, warmup_steps=20, end_value=1e-4),
                weight_decay=1e-4)),
        train_input=_mnist("train", 128),
        evalers={"test": Evaler.default_config().set(
            input=_mnist("test", 200, shuffle=False, num_epochs=1), every_n_steps=200)},
        loggers=[Basic.default_config(), CSV.default_config(), TensorBoard.default_config()],
        checkpoint=OrbaxCheckpoint.default_config().set(save_every_n_steps=100),
        max_steps=steps, log_every=50)
