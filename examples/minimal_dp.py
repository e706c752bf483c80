"""The seed's "Minimal DP training script", as written, with the user-supplied parts filled in.

The seed leaves `model_apply`, `cross_entropy`, `train_data` (and the initial params) to the
user; they are defined first, then comes the seed's code unchanged (one line added: where the
initial params come from). Run it on 8 simulated CPU devices with

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/minimal_dp.py

It trains an MLP on the 5,000 MNIST digits shipped with Titanax, checkpoints to ckpts/run1 and, run
again, resumes from there. MINIMAL_DP_EPOCHS (default 2) bounds the data, so the run ends when it
runs out, well before 10,000 steps.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np

import titanax as tx
from titanax.data.sources import MNIST

# --- User-supplied: the model, the loss, the data and the initial params ------------------------


def model_apply(params, x):
    hidden = jax.nn.relu(x.reshape(x.shape[0], -1) @ params["w1"] + params["b1"])
    return hidden @ params["w2"] + params["b2"]


def cross_entropy(logits, labels):
    logits = logits.astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


train_data = tx.ShardedDataLoader(MNIST.default_config().instantiate(),
                                  dp_axis_size=jax.device_count(), batch_size=128, seed=0,
                                  num_epochs=int(os.environ.get("MINIMAL_DP_EPOCHS", "2")))
train_data = ({"x": b["image"], "y": b["label"]} for b in train_data)
rng = np.random.default_rng(0)
init_params = {"w1": rng.normal(size=(784, 128)).astype(np.float32) * np.sqrt(2 / 784),
               "b1": np.zeros(128, np.float32),
               "w2": rng.normal(size=(128, 10)).astype(np.float32) * np.sqrt(2 / 128),
               "b2": np.zeros(10, np.float32)}

# --- The seed's script --------------------------------------------------------------------------

mesh = tx.MeshSpec(devices="all", axes=("data",))
plan = tx.Plan(data_parallel=tx.DP(axis="data"))

engine = tx.Engine(mesh=mesh, plan=plan,
                   optimizer=tx.optax.adamw(3e-4),
                   precision=tx.Precision(bfloat16=True),
                   checkpoint=tx.OrbaxCheckpoint("ckpts/run1"),
                   loggers=[tx.loggers.Basic()])


@tx.step_fn
def train_step(state, batch):
    def loss_fn(p):
        logits = model_apply(p, batch["x"])  # pure function
        return cross_entropy(logits, batch["y"])
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = tx.collectives.psum(grads, axis="data")  # explicit collective
    state = state.apply_gradients(grads=grads)
    return state, {"loss": loss}


engine.init_or_restore(params=init_params)  # Added: the initial params (or the last checkpoint).
engine.fit(train_step, data=train_data, steps=10_000)
