"""The benchmark peers compute what Titanax computes: same first loss, same loss after a step.

A timing comparison means something only if the peers train the same model from the same numbers.
Each case builds a Titanax Engine for the tiny GPT, converts its initialised params into both
peers, and compares two losses. SGD (with weight decay and two microbatches) exposes any
gradient-scale error, e.g. a factor of the TP or data size, which Adam would normalise away;
AdamW checks the optimizer the benchmark uses.
"""

import ast
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax", reason="install the 'benchmarks' extra: pip install -e '.[benchmarks]'")

from benchmarks.peers import common, flax_gpt, plain_jax_gpt  # noqa: E402
from titanax.config import config_for_function  # noqa: E402
from titanax.modules.models.decoder import gpt_config  # noqa: E402
from titanax.parallel.plan import DP, TP, Plan  # noqa: E402
from titanax.runtime.mesh import MeshSpec  # noqa: E402
from titanax.train import optimizers  # noqa: E402
from titanax.train.engine import Engine  # noqa: E402
from titanax.train.learner import Learner  # noqa: E402
from tests.train import helpers  # noqa: E402
from tests.numerics import assert_close  # noqa: E402

PEERS = {"flax": flax_gpt, "plain_jax": plain_jax_gpt}
WEIGHT_DECAY = 0.1
LEARNING_RATES = {"sgd": 0.5, "adamw": 1e-3}
# (data, model, optimizer, microbatches)
CASES = [(4, 2, "sgd", 2), (8, 1, "adamw", 1)]


def _batch():
    return helpers.text_batches(batch_size=16, seq_len=64, count=1)[0]


@functools.lru_cache(maxsize=None)
def _titanax_run(data: int, model: int, optimizer: str, accumulate: int):
    """(initial params as numpy, [loss before step 1, loss before step 2]) of the Engine."""
    factory = optimizers.sgd if optimizer == "sgd" else optimizers.adamw
    learner = Learner.default_config().set(optimizer=config_for_function(factory).set(
        learning_rate=LEARNING_RATES[optimizer], weight_decay=WEIGHT_DECAY))
    engine = Engine.default_config().set(
        mesh=MeshSpec.default_config().set(axes=("data", "model"), shape=(data, model),
                                           devices=list(range(data * model))),
        plan=Plan.default_config().set(
            data_parallel=DP.default_config().set(accumulate_steps=accumulate),
            tensor_parallel=TP.default_config()),
        model=gpt_config().set(name="gpt", vocab_size=256, max_seq_len=64, num_layers=4,
                                       model_dim=128, num_heads=4),
        learner=learner, loggers=[]).instantiate()
    state = engine.init_state()
    initial = jax.tree_util.tree_map(np.asarray, jax.device_get(state.params))
    batch = engine.global_batch(_batch())
    step = engine.compile(example_batch=batch)
    losses = []
    for _ in range(2):
        engine.state, metrics = step(engine.state, batch)
        losses.append(float(metrics["loss"]))
    return initial, losses


@pytest.mark.parametrize("peer", sorted(PEERS))
@pytest.mark.parametrize("data,model,optimizer,accumulate", CASES,
                         ids=[f"{d}x{m}-{o}-k{k}" for d, m, o, k in CASES])
def test_peer_losses_match_titanax(peer, data, model, optimizer, accumulate):
    initial, expected = _titanax_run(data, model, optimizer, accumulate)
    mesh = jax.make_mesh((data, model), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    state, step_fn = PEERS[peer].build(
        initial, mesh=mesh, accumulate_steps=accumulate, dtype=jnp.float32,
        learning_rate=LEARNING_RATES[optimizer], weight_decay=WEIGHT_DECAY, optimizer=optimizer)
    batch = common.place_batch(_batch(), mesh=mesh)
    losses = []
    for _ in range(2):
        state, loss = step_fn(state, batch)
        losses.append(float(loss))
    assert_close(losses, expected, what=f"{peer}'s losses")
    assert expected[1] < expected[0] - 0.1  # The step moved the params measurably.


def test_peers_import_nothing_from_titanax():
    """Independence is the point of a peer: no titanax import anywhere in the package."""
    folder = os.path.dirname(flax_gpt.__file__)
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(m.split(".")[0] == "titanax" for m in modules), (name, modules)
