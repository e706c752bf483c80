"""The seed's recipe: a toy CNN in 2 explicit pipeline stages (conv stage, dense stage), 1F1B.

Stage 0 owns the two conv layers and turns an MNIST digit into pooled feature maps; stage 1 owns
the dense layer and the head and turns those into logits; the model's ``loss`` ends the pipeline.
The stages differ in params and in activation shape, so they run through ``lax.switch`` on the
pipe index (DESIGN section 7.1). The script trains the pipelined CNN on a data x pipe = 4 x 2
mesh of 8 simulated CPU devices and the same CNN without a pipeline from the same init, and
prints both loss curves (equal up to float rounding), the held-out accuracy and the pipeline's
``explain()`` summary.

    python examples/pipeline_cnn.py [--steps 60]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from titanax.runtime.cpu_devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import titanax as tx  # noqa: E402
from titanax.config import config_for_function  # noqa: E402
from titanax.data.pipeline import Input  # noqa: E402
from titanax.data.sources import MNIST  # noqa: E402
from titanax.modules import functional  # noqa: E402
from titanax.modules.models.classifier import CNNClassifier  # noqa: E402
from titanax.train import optimizers  # noqa: E402

CNN = CNNClassifier.default_config().set(name="cnn", channels=(8, 16), hidden_dim=64)


def stages():
    """The two stages: each a param filter and a pure function of its params and input."""
    model = CNN.instantiate()  # Stateless: params come in through functional().

    def conv(params, batch):  # Stage 0 receives the microbatch itself.
        return functional(model, None, params, (batch["image"],), method="features",
                          is_training=True)[0]

    def dense(params, features):
        return functional(model, None, params, (features,), method="classify",
                          is_training=True)[0]

    return [tx.Stage(name="conv", param_filter=["conv0/*", "conv1/*"], fwd=conv),
            tx.Stage(name="dense", param_filter=["dense/*", "head/*"], fwd=dense)]


def train(pipelined: bool, steps: int):
    plan = tx.Plan(data_parallel=tx.DP(axis="data"))
    mesh = tx.MeshSpec(axes=("data",), shape=(8,))
    if pipelined:
        plan = tx.Plan(data_parallel=tx.DP(axis="data"),
                       pipeline_parallel=tx.PP(axis="pipe", stages=stages(), microbatch_size=2,
                                               schedule="1f1b"))
        mesh = tx.MeshSpec(axes=("data", "pipe"), shape=(4, 2))
    engine = tx.Engine(
        mesh=mesh, plan=plan, model=CNN,
        learner=tx.Learner.default_config().set(optimizer=config_for_function(
            optimizers.adamw).set(learning_rate=3e-3)),
        train_input=Input.default_config().set(
            source=MNIST.default_config().set(split="train"), global_batch_size=64),
        loggers=[])
    engine.fit(steps=steps)
    test = Input.default_config().set(source=MNIST.default_config().set(split="test"),
                                      global_batch_size=200, shuffle=False, num_epochs=1)
    return engine, engine.eval(data=test.instantiate())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    runs = {"2 stages": train(True, args.steps), "1 stage": train(False, args.steps)}
    for name, (engine, metrics) in runs.items():
        losses = " ".join(f"{h['loss']:.4f}" for h in engine.history[:8])
        print(f"{name:8s} losses: {losses} ...; held-out accuracy {metrics['accuracy']:.3f}")
    piped, plain = runs["2 stages"][0], runs["1 stage"][0]
    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(piped.history, plain.history))
    print(f"largest per-step loss difference: {gap:.2e}")
    print(piped.explain().split("\n\n")[2])  # Mesh, params, then the pipeline.


if __name__ == "__main__":
    main()
