"""A fresh engine's params, drawn one param kind at a time (titanax/train/param_draws.py): the
draws of the one program that initialises the model, each param in its own sharding and storage
dtype, and a second run of the same model compiles no draw again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from titanax.parallel import sharding
from titanax.train import prng
from titanax.train.precision import Precision
from tests.numerics import assert_close
from tests.train.helpers import gpt_engine

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _one_program_draws(engine):
    """Every param as ``initialize_parameters_recursively`` draws them in one program (the
    path the model documents), uncast and on one device."""
    states = engine.states
    return jax.jit(lambda key: states.model.initialize_parameters_recursively(
        key, specs=states.model_specs))(prng.stream_key(states.seed, "init"))


@pytest.mark.parametrize("model_axis", [1, 2], ids=["dp8", "dp4-tp2"])
def test_the_draws_are_the_one_programs_in_their_shardings_and_storage_dtypes(model_axis):
    engine = gpt_engine(data=8 // model_axis, model_axis=model_axis,
                        precision=Precision.default_config().set(bfloat16=True))
    engine.init_state()
    params, want = engine.state.params, _one_program_draws(engine)
    shardings = sharding.named_shardings(engine.states.mesh, engine.states.layout.param_specs)
    for (path, got), placed, drawn in zip(jax.tree_util.tree_leaves_with_path(params),
                                          jax.tree_util.tree_leaves(shardings),
                                          jax.tree_util.tree_leaves(want)):
        name = jax.tree_util.keystr(path)
        assert got.sharding.is_equivalent_to(placed, got.ndim), (name, got.sharding, placed)
        assert got.dtype == jnp.bfloat16, (name, got.dtype)
        # The same key gives the same float32 draw (to the last bit or one rounding of the
        # inverse error function, compiled in another program), then one cast to bfloat16.
        assert_close(np.asarray(got, np.float32), np.asarray(drawn.astype(jnp.bfloat16),
                                                             np.float32),
                     bound=2.0 ** -7, scale="leaf", what=name)
    # The draws are draws, not constants (a program that dropped its key would give zeros).
    leaves = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(params)]
    assert any(np.std(x) > 0 for x in leaves)


def test_a_second_run_of_the_model_compiles_no_draw():
    gpt_engine(data=8).init_state()
    compiles = []

    def count(event, seconds, **kwargs):
        del seconds, kwargs
        if event == COMPILE_EVENT:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        gpt_engine(data=8, seed=1).init_state()
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    # The optimizer state's initialisation is compiled per engine; no param draw is.
    assert compiles.count(COMPILE_EVENT) <= 1, compiles
