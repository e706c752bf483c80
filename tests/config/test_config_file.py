"""--config_file: YAML / JSON overrides applied like --config.<path>=<value>."""

import json

import pytest

from titanax import errors
from titanax.config import config_file, overrides, registry


def _gpt_tiny_dp():
    registry.load_config_modules(registry.DEFAULT_CONFIG_MODULES)
    return registry.get_config("gpt_tiny_dp")


def test_nested_and_dotted_entries_are_typed_like_the_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("max_steps: 7\n"
                    "plan:\n  zero: {stage: 3, dim_overrides: {'**/wi/weight': 1}}\n"
                    "mesh.shape: [null]\n"
                    "config.learner.optimizer.learning_rate.peak_value: 0.01\n")
    cfg = _gpt_tiny_dp()
    found = config_file.read_overrides(str(path), cfg)
    assert [o.path for o in found] == ["max_steps", "plan.zero.stage", "plan.zero.dim_overrides",
                                       "mesh.shape", "learner.optimizer.learning_rate.peak_value"]
    cfg = overrides.apply_overrides(cfg, found)
    cfg.validate()
    assert cfg.max_steps == 7 and cfg.plan.zero.stage == 3
    assert cfg.plan.zero.dim_overrides == {"**/wi/weight": 1}  # A dict field: the value.
    assert cfg.mesh.shape == (None,)
    assert cfg.learner.optimizer.learning_rate.peak_value == 0.01


def test_json_works_and_bad_values_name_the_field(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"max_steps": "many"}))
    cfg = _gpt_tiny_dp()
    with pytest.raises(errors.ConfigError) as info:
        overrides.apply_overrides(cfg, config_file.read_overrides(str(path), cfg))
    assert "config.max_steps" in str(info.value)


@pytest.mark.parametrize("text,problem", [("- 1\n- 2\n", "not a mapping"),
                                          ("a: [\n", "cannot read")])
def test_a_file_that_is_not_a_mapping_is_refused(tmp_path, text, problem):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(errors.LaunchFlagError) as info:
        config_file.read_overrides(str(path), _gpt_tiny_dp())
    assert problem in info.value.message and info.value.path == "--config_file"


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(errors.LaunchFlagError) as info:
        config_file.read_overrides(str(tmp_path / "nope.yaml"), _gpt_tiny_dp())
    assert "no such file" in info.value.message


def test_dicts_of_configs_and_optional_parts_are_descended(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("evalers: {heldout: {every_n_steps: 5}}\n"
                    "plan: {pipeline_parallel: {microbatch_size: 4}}\n"
                    "checkpoint: {path: 'None'}\n")
    cfg = _gpt_tiny_dp()
    found = config_file.read_overrides(str(path), cfg)
    assert [o.path for o in found] == ["evalers['heldout'].every_n_steps",
                                       "plan.pipeline_parallel.microbatch_size",
                                       "checkpoint.path"]
    cfg = overrides.apply_overrides(cfg, found)
    assert cfg.evalers["heldout"].every_n_steps == 5
    assert cfg.plan.pipeline_parallel.microbatch_size == 4
    assert cfg.checkpoint.path == "None"  # Quoted in YAML: the text, not None.


def test_unquoted_yaml_numbers_are_numbers_and_quoted_json_strings_text(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learner.optimizer.learning_rate.peak_value: 1e-3\nmax_steps: 20\n"
                    "plan: {pipeline_parallel: {schedule: gpipe}}\n")
    cfg = _gpt_tiny_dp()
    cfg = overrides.apply_overrides(cfg, config_file.read_overrides(str(path), cfg))
    assert cfg.learner.optimizer.learning_rate.peak_value == 1e-3 and cfg.max_steps == 20
    assert cfg.plan.pipeline_parallel.schedule == "gpipe"
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"checkpoint": {"path": "1e-3"},
                                "plan": {"pipeline_parallel": {"schedule": "circular"}}}))
    cfg = _gpt_tiny_dp()
    cfg = overrides.apply_overrides(cfg, config_file.read_overrides(str(path), cfg))
    assert cfg.checkpoint.path == "1e-3" and cfg.plan.pipeline_parallel.schedule == "circular"
