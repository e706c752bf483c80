"""Titanax: explicit-parallel training for JAX.

``import titanax as tx`` gives the seed's user-facing names (``tx.MeshSpec``, ``tx.Plan``,
``tx.DP``, ``tx.TP``, ``tx.Engine``, ``tx.step_fn``, ``tx.collectives``, ``tx.Precision``,
``tx.loggers``, ``tx.optax``...). They are imported on first use, so ``import titanax`` itself is
cheap and does not start jax (the config system and the launcher rely on that).
"""

import importlib

__version__ = "0.1.0"

# name -> (module, attribute or None for the module itself)
_EXPORTS = {
    "MeshSpec": ("titanax.runtime.mesh", "MeshSpec"),
    "ProcessGroups": ("titanax.runtime.mesh", "ProcessGroups"),
    "Plan": ("titanax.parallel.plan", "Plan"),
    "DP": ("titanax.parallel.plan", "DP"),
    "TP": ("titanax.parallel.plan", "TP"),
    "PP": ("titanax.parallel.plan", "PP"),
    "Stage": ("titanax.parallel.stages", "Stage"),
    "ZeRO": ("titanax.parallel.plan", "ZeRO"),
    "collectives": ("titanax.parallel.collectives", None),
    "apply_named_sharding": ("titanax.parallel.sharding", "apply_named_sharding"),
    "shard_batch_specs": ("titanax.parallel.sharding", "shard_batch_specs"),
    "Engine": ("titanax.train.engine", "Engine"),
    "TrainState": ("titanax.train.train_state", "TrainState"),
    "step_fn": ("titanax.train.user_step", "step_fn"),
    "Precision": ("titanax.train.precision", "Precision"),
    "Learner": ("titanax.train.learner", "Learner"),
    "OptimizerAdapter": ("titanax.train.learner", "OptimizerAdapter"),
    "loggers": ("titanax.observe.loggers", None),
    "optax": ("optax", None),
    "OrbaxCheckpoint": ("titanax.io.checkpointer", "OrbaxCheckpoint"),
    "ShardedDataLoader": ("titanax.data.loader", "ShardedDataLoader"),
    "TitanaxError": ("titanax.errors", "TitanaxError"),
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'titanax' has no attribute {name!r}")
    module_name, attribute = _EXPORTS[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value
