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
