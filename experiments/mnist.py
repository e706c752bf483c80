"""MNIST classification with data parallelism.

``mnist_dp`` trains an MLP on every device of a 1-D ``data`` mesh. Offline it uses the 5,000 real
digits shipped with Titanax (4,000 to train, 1,000 held out); point
``--config.train_input.source.data_dir`` (and the evaler's) at the standard IDX files for the
full dataset.
"""

from titanax.config import config_for_function, register_experiment
from titanax.data.pipeline import Input
from titanax.data.sources import MNIST
from titanax.io.checkpointer import OrbaxCheckpoint
from titanax.modules.models.classifier import MLPClassifier
from titanax.observe.loggers import CSV, Basic, TensorBoard
from titanax.parallel.plan import DP, Plan
from titanax.runtime.mesh import MeshSpec
from titanax.train import optimizers
from titanax.train.engine import Engine
from titanax.train.evaler import Evaler
from titanax.train.learner import Learner


def _mnist_input(split: str, batch_size: int, **changes) -> Input.Config:
    return Input.default_config().set(
        source=MNIST.default_config().set(split=split), global_batch_size=batch_size, **changes)


@register_experiment
def mnist_dp():
    """MLP on MNIST, data parallel over every device (held-out accuracy >= 93%)."""
    steps = 600
    return Engine.default_config().set(
        mesh=MeshSpec.default_config().set(axes=("data",)),
        plan=Plan.default_config().set(data_parallel=DP.default_config().set(axis="data")),
        model=MLPClassifier.default_config().set(name="mlp", hidden_dims=(256, 128)),
        learner=Learner.default_config().set(
            optimizer=config_for_function(optimizers.adamw).set(
                learning_rate=config_for_function(optimizers.warmup_cosine).set(
                    peak_value=2e-3, warmup_steps=30, end_value=1e-4),
                weight_decay=1e-4)),
        train_input=_mnist_input("train", 128),
        evalers={"test": Evaler.default_config().set(
            input=_mnist_input("test", 200, shuffle=False, num_epochs=1), every_n_steps=200)},
        loggers=[Basic.default_config(), CSV.default_config(), TensorBoard.default_config()],
        checkpoint=OrbaxCheckpoint.default_config().set(save_every_n_steps=200),
        max_steps=steps, log_every=50)
