"""Small engines for tests: tiny MNIST MLPs and GPTs on real data, fixed batches, no loggers."""

import functools
from typing import List, Optional, Sequence

import jax
import numpy as np

from titanax.config import config_for_function
from titanax.data.sources import MNIST, TextWindows
from titanax.modules.models.classifier import MLPClassifier
from titanax.modules.models.decoder import Decoder, gpt_config
from titanax.parallel.plan import DP, TP, Plan, ZeRO
from titanax.runtime.mesh import MeshSpec
from titanax.train import optimizers
from titanax.train.engine import Engine
from titanax.train.learner import Learner
from titanax.train.precision import Precision
from tests.numerics import float64_mode


@functools.lru_cache(maxsize=None)
def mnist_batches(batch_size: int = 64, count: int = 20) -> List[dict]:
    source = MNIST.default_config().set(split="train").instantiate()
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        rows = rng.choice(len(source), batch_size, replace=False)
        out.append({"image": source.images[rows], "label": source.labels[rows]})
    return out


@functools.lru_cache(maxsize=None)
def text_batches(batch_size: int = 8, seq_len: int = 16, count: int = 10,
                 uneven: bool = False) -> List[dict]:
    """``uneven``: each row trains on a different number of its tokens (``weights``: a
    completion of random length after a prompt, some rows none at all), so the shards and
    microbatches of any split hold different token counts -- a mean of their means is not the
    token mean."""
    source = TextWindows.default_config().set(seq_len=seq_len).instantiate()
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        rows = rng.choice(len(source), batch_size, replace=False)
        records = [source[int(r)] for r in rows]
        batch = {k: np.stack([r[k] for r in records]) for k in records[0]}
        if uneven:
            trained = rng.integers(0, seq_len + 1, size=batch_size)
            trained[rng.integers(batch_size)] = 0
            batch["weights"] = (np.arange(seq_len)[None, :] >= seq_len - trained[:, None]
                                ).astype(np.float32)
        out.append(batch)
    return out


class SummarizingGPT(Decoder):
    """A decoder whose head also writes its loss with ``add_summary`` (tests of the summaries path:
    the model itself writes none -- it would only repeat the loss metric)."""

    def head_loss(self, decoded, batch):
        loss, aux = super().head_loss(decoded, batch)
        self.add_summary("loss", loss)
        return loss, aux


def summarizing(engine: Engine) -> Engine:
    """``engine`` rebuilt with SummarizingGPT as its model."""
    cfg = engine.config.clone()
    cfg.model.klass = SummarizingGPT
    return cfg.instantiate()


def sgd(learning_rate: float) -> Learner.Config:
    return Learner.default_config().set(
        optimizer=config_for_function(optimizers.sgd).set(learning_rate=learning_rate))


def adam(learning_rate: float = 1e-3) -> Learner.Config:
    return Learner.default_config().set(
        optimizer=config_for_function(optimizers.adamw).set(learning_rate=learning_rate))


def mesh(shape: Sequence[Optional[int]], axes: Sequence[str] = ("data",),
         devices: Optional[Sequence[int]] = None) -> MeshSpec.Config:
    cfg = MeshSpec.default_config().set(axes=tuple(axes), shape=tuple(shape))
    if devices is not None:
        cfg.devices = list(devices)
    return cfg


def zero_config(zero, **options) -> Optional[ZeRO.Config]:
    """``zero``: False (none), True (stage 1) or the stage; ``options``: other ZeRO fields."""
    if not zero:
        return None
    return ZeRO.default_config().set(stage=int(zero), **options)


def test_precision() -> Precision.Config:
    """float64 in jax's 64-bit mode (the parity tests: ``tests/numerics.py``), else the default
    float32."""
    return Precision.default_config().set(float64=float64_mode())


def with_test_precision(changes: dict) -> dict:
    """Engine config ``changes`` with the test precision unless they set one."""
    return changes if "precision" in changes else {**changes, "precision": test_precision()}


def mnist_engine(*, data: int = 8, accumulate: int = 1, learner=None, zero=False,
                 zero_options=None, hooks=(), **changes) -> Engine:
    plan = Plan.default_config().set(
        data_parallel=DP.default_config().set(accumulate_steps=accumulate),
        zero=zero_config(zero, **(zero_options or {})))
    cfg = Engine.default_config().set(
        mesh=mesh((data,), devices=list(range(data))), plan=plan,
        model=MLPClassifier.default_config().set(name="mlp", hidden_dims=(64,)),
        learner=learner or adam(), loggers=[], log_every=1000, **with_test_precision(changes))
    return cfg.instantiate(hooks=hooks)


def gpt_engine(*, data: int, model_axis: int = 1, accumulate: int = 1, learner=None,
               zero=False, zero_options=None, fsdp: int = 1, **changes) -> Engine:
    """A tiny GPT engine on a data (x fsdp) (x model) mesh; ``fsdp > 1`` puts ZeRO on an axis
    of its own next to data (HSDP)."""
    tp = model_axis > 1
    sizes = {"data": data, "fsdp": fsdp, "model": model_axis}
    axes = tuple(a for a in sizes if a == "data" or sizes[a] > 1)
    shape = tuple(sizes[a] for a in axes)
    zero_options = dict(zero_options or {})
    if fsdp > 1:
        zero_options["axis"] = "fsdp"
    plan = Plan.default_config().set(
        data_parallel=DP.default_config().set(accumulate_steps=accumulate),
        tensor_parallel=TP.default_config() if tp else None,
        zero=zero_config(zero, **zero_options))
    model = gpt_config().set(name="gpt", vocab_size=256, max_seq_len=16, num_layers=2,
                                     model_dim=32, num_heads=4)
    cfg = Engine.default_config().set(
        mesh=mesh(shape, axes, devices=list(range(data * fsdp * model_axis))), plan=plan,
        model=model,
        learner=learner or adam(), loggers=[], log_every=1000, **with_test_precision(changes))
    return cfg.instantiate()


def train(engine: Engine, batches: Sequence[dict], steps: Optional[int] = None):
    """Trains on ``batches`` in order; returns (per-step losses, final params as numpy)."""
    steps = steps or len(batches)
    engine.fit(data=iter(batches), steps=steps)
    losses = [h["loss"] for h in engine.history]
    return losses, jax.tree_util.tree_map(np.asarray, jax.device_get(engine.canonical_params()))


def fp16_precision(loss_scaling: bool) -> Precision.Config:
    return Precision.default_config().set(fp16=True, enable_x32_params=True,
                                          loss_scaling=loss_scaling, growth_interval=1000,
                                          allow_unscaled_fp16=not loss_scaling)


def flat(tree) -> dict:
    """``{"a/b/c": numpy array}`` of a nested dict of params (or gradients)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
            for path, leaf in leaves}


def straight_and_resumed(make_engine, *, root, steps: int = 4, stop: int = 2):
    """``(straight, resumed)``: ``make_engine(checkpoint config)`` trained ``steps`` steps at
    once, and trained ``stop`` steps, closed and resumed (a new engine on the same checkpoint
    directory under ``root``) up to ``steps`` -- what a resume test compares."""
    from titanax.io.checkpointer import OrbaxCheckpoint  # pylint: disable=import-outside-toplevel

    def engine(name):
        return make_engine(OrbaxCheckpoint.default_config().set(path=f"{root}/{name}"))

    straight = engine("straight")
    straight.fit(steps=steps)
    first = engine("resumed")
    first.fit(steps=stop)
    first.close()
    resumed = engine("resumed")
    resumed.fit(steps=steps)
    assert resumed.restored_from.endswith(f"/{stop}"), resumed.restored_from
    return straight, resumed
