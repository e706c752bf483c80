"""Where a fresh run's params come from when they are not initialised: a Hugging Face directory
(``init_from``) for the model, and the objective's frozen models (their own directories, or the
starting weights), streamed into the run's shards."""

from __future__ import annotations

from typing import Any

import jax

from titanax.parallel import sharding


def frozen_from_hf(engine: Any, directory: str, *, key: str, model: Any = None) -> Any:
    """The weights of the HF ``directory`` as the frozen model under params ``key`` -- of the
    run's model architecture, or of ``model``'s (a teacher of its own) -- in its shards and
    storage dtype."""
    from titanax.hf import fine_tune, importer  # pylint: disable=import-outside-toplevel
    model = model if model is not None else engine.model
    fine_tune.check_model_matches(model.config, directory)
    imported = importer.import_params(
        directory, model_cfg=model.config,
        parameter_specs=model.create_parameter_specs_recursively(), mesh=engine.mesh,
        partition_specs=engine.layout.canonical_param_specs[key],
        dtype=engine.precision.param_dtype)
    return sharding.apply_named_sharding(engine.states.cast_frozen_for_storage(imported),
                                         engine.mesh, engine.layout.param_specs[key])


def params_from_hf(engine: Any) -> Any:
    """The ``init_from`` directory's weights in the run's canonical layout, with the objective's
    frozen models beside them and what the model converters add (LoRA's adapters) as a fresh
    run initialises it."""
    from titanax.hf import fine_tune, importer  # pylint: disable=import-outside-toplevel
    engine.build()
    directory = engine.config.init_from
    fine_tune.check_model_matches(engine.model.config, directory)
    params = importer.params_for_engine(engine, directory)
    params = dict(params, **engine.objective.frozen_params(start=params, run=engine))
    for converter in engine.converters:  # The directory holds the model; what they add
        params = converter.join_added(params, engine.states.initial_params(  # starts fresh.
            lambda tree, c=converter: c.split_added(tree)[1]))
    if jax.process_index() == 0:
        print(f"titanax: params from Hugging Face {directory} (step 0, fresh optimizer)",
              flush=True)
    return params
