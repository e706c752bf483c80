"""The seed's `import titanax as tx` surface."""

import subprocess
import sys

import pytest

import titanax as tx


def test_seed_names_resolve():
    from titanax.parallel import collectives  # pylint: disable=import-outside-toplevel
    assert tx.collectives is collectives
    plan = tx.Plan(data_parallel=tx.DP(axis="data"),
                   tensor_parallel=tx.TP(axis="model", rules={"**/up/weight": (None, "model")}))
    assert plan.dp_axis == "data" and plan.tp_axis == "model"
    engine = tx.Engine(mesh=tx.MeshSpec(devices="all", axes=("data",)),
                       plan=tx.Plan(data_parallel=tx.DP(axis="data")),
                       optimizer=tx.optax.adamw(3e-4),
                       precision=tx.Precision(bfloat16=True),
                       loggers=[tx.loggers.Basic()])
    assert engine.config.precision.bfloat16 and len(engine.config.loggers) == 1
    assert callable(tx.step_fn)
    with pytest.raises(AttributeError):
        _ = tx.NoSuchThing


def test_import_titanax_does_not_start_jax():
    code = "import sys, titanax; sys.exit(1 if 'jax' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
