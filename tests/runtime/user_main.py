"""A user's own script for ``python -m titanax.run --module=tests.runtime.user_main:main``
(run by tests/test_multi_process.py, not by pytest): builds the engine from the config it is
handed and trains, in every process of the job."""

import jax


def main(config, trainer_dir):
    engine = config.instantiate(trainer_dir=trainer_dir)
    engine.fit()
    loss = engine.history[-1]["loss"]
    print(f"user main: process {jax.process_index()} of {jax.process_count()}, "
          f"step {int(jax.device_get(engine.state.step))}, loss {loss:.4f}", flush=True)
    engine.close()


def fail_in_one(config):  # pylint: disable=unused-argument
    """Fails in process 1 only: the launcher must stop process 0 and name process 1."""
    if jax.process_index() == 1:
        raise RuntimeError("a user error in process 1")
    print("process 0 is done", flush=True)
