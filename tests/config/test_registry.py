"""Tests of the experiment registry and the golden dumps."""

import os
import sys
import types

import pytest

from titanax import errors
from titanax.config import golden, registry
from tests import forked_python
from tests.config import fixture_experiments

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_decorator_registers_with_function_name_and_explicit_name():
    registry.load_config_modules(["tests.config.fixture_experiments"])
    assert {"fixture_model", "fixture_incomplete"} <= set(registry.experiment_names())
    experiment = registry.get_experiment("fixture_model")
    assert experiment.module == "tests.config.fixture_experiments"
    assert experiment.summary == "A fixture experiment with nested fields of many types."


def test_each_lookup_returns_a_fresh_tree():
    first = registry.get_config("fixture_model")
    first.decoder.num_heads = 99
    assert registry.get_config("fixture_model").decoder.num_heads == 4


def test_misspelled_experiment_suggests_names():
    registry.load_config_modules(["tests.config.fixture_experiments"])
    with pytest.raises(errors.UnknownExperimentError) as info:
        registry.get_config("fixture_modle")
    assert "did you mean 'fixture_model'" in info.value.suggestion
    assert "--list" in info.value.suggestion
    assert info.value.path == "--config"


def test_duplicate_names_from_different_modules_fail():
    def fixture_model():
        return fixture_experiments.Model.default_config()

    fixture_model.__module__ = "somewhere.else"
    with pytest.raises(errors.ConfigError) as info:
        registry.register_experiment(fixture_model)
    assert "registered twice" in info.value.message and "somewhere.else" in info.value.message


def test_named_configs_function_and_packages_are_loaded(monkeypatch):
    module = types.ModuleType("third_party_exps")
    module.named_configs = lambda: {"third_party_run": fixture_experiments.fixture_model}
    monkeypatch.setitem(sys.modules, "third_party_exps", module)
    registry.load_config_modules(["third_party_exps"])
    assert registry.get_experiment("third_party_run").module == "third_party_exps"


def test_unimportable_config_module_names_the_flag():
    with pytest.raises(errors.ConfigError) as info:
        registry.load_config_modules(["no_such_module_anywhere"])
    assert info.value.path == "--config_module"


def test_factory_must_return_a_config():
    registry.register_experiment("returns_int")(lambda: 3)
    with pytest.raises(errors.ConfigError):
        registry.get_config("returns_int")


def test_golden_dumps_match_every_registered_experiment():
    """Fails on any change of an experiment's config; regenerate with the printed command."""
    dumps = golden.expected_dumps()
    assert dumps, "the experiments package registers nothing"
    problems = golden.golden_problems(os.path.join(REPO_ROOT, "tests", "golden"), dumps)
    assert not problems, "\n".join(problems)


def test_golden_check_reports_diffs_missing_and_stale_files(tmp_path):
    dumps = {"a": "x: 1\n", "b": "y: 2\n"}
    golden.write_goldens(str(tmp_path), dumps)
    assert golden.golden_problems(str(tmp_path), dumps) == []
    (tmp_path / "stale.txt").write_text("z: 3\n")
    os.remove(tmp_path / "b.txt")
    problems = golden.golden_problems(str(tmp_path), {"a": "x: 5\n", "b": "y: 2\n"})
    text = "\n".join(problems)
    assert "-x: 1" in text and "+x: 5" in text
    assert "b.txt: missing" in text and "stale.txt: stale" in text
    assert "python -m titanax.config.golden --update" in text


def test_golden_command_checks_the_checkout():
    result = forked_python.run(["-m", "titanax.config.golden"], cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "golden dumps match" in result.stdout
