"""Config trees rebuilt from their JSON record (a run's config.json)."""

import json

import pytest

from titanax import errors
from titanax.config import registry
from titanax.config.from_json import config_from_json


def _registered():
    registry.load_config_modules(list(registry.DEFAULT_CONFIG_MODULES))
    return [e.name for e in registry.experiments()]


@pytest.mark.parametrize("name", _registered())
def test_every_experiment_comes_back_from_its_record(name):
    cfg = registry.get_config(name)
    rebuilt = config_from_json(json.loads(json.dumps(cfg.to_json())))
    assert rebuilt.debug_string() == cfg.debug_string()


def test_non_finite_floats_come_back_as_floats():
    cfg = registry.get_config("gpt_tiny_dp")
    cfg.learner.max_grad_norm = float("inf")
    rebuilt = config_from_json(json.loads(json.dumps(cfg.to_json())))
    assert rebuilt.learner.max_grad_norm == float("inf")


def test_a_field_the_class_no_longer_has_is_named():
    record = registry.get_config("mnist_dp").to_json()
    record["learner"]["gone_field"] = 1
    with pytest.raises(errors.ConfigError, match="no field 'gone_field'") as e:
        config_from_json(record)
    assert e.value.path == "config.learner.gone_field"


def test_a_record_written_before_the_axis_binding_comes_back(tmp_path):
    """Runs recorded their layers' mesh axes on the model (tp_axis, sequence_parallel, ...);
    the plan says all of it now: those fields are dropped, and a sequence-parallel model's
    record comes back with the plan's sequence parallelism on."""
    from titanax.train import saved_run  # pylint: disable=import-outside-toplevel
    record = registry.get_config("gpt_tiny_dp_tp").to_json()
    record["model"].update(tp_axis=None, sequence_parallel=True, cp_axis=None,
                           cp_strategy="all_gather")
    retired = {}
    cfg = config_from_json(json.loads(json.dumps(record)), retired=retired)
    assert retired == {"config.model.tp_axis": None, "config.model.sequence_parallel": True,
                       "config.model.cp_axis": None, "config.model.cp_strategy": "all_gather"}
    assert not cfg.plan.tensor_parallel.sequence_parallel
    (tmp_path / "config.json").write_text(json.dumps(record))
    restored = saved_run.read_run_config(str(tmp_path))
    assert restored.plan.tensor_parallel.sequence_parallel
    assert "tp_axis" not in restored.model.keys()
