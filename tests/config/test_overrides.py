"""Tests of command-line overrides: typed parsing, paths, errors and diffs."""

import pytest

from titanax import errors
from titanax.config import apply_overrides, config_diff
from titanax.config.overrides import Override, split_override_args
from tests.config import fixture_experiments


def _model():
    return fixture_experiments.fixture_model()


def _apply(cfg, **kv):
    return apply_overrides(cfg, [Override(path=k.replace("__", "."), text=v)
                                 for k, v in kv.items()])


def test_split_override_args():
    rest, found = split_override_args(
        ["prog", "--config=x", "--config.a.b=1", "--config.c", "2", "--config.flag", "--list"])
    assert rest == ["prog", "--config=x", "--list"]
    assert [(o.path, o.text) for o in found] == [("a.b", "1"), ("c", "2"), ("flag", "true")]


@pytest.mark.parametrize("path,text,expected", [
    ("decoder.num_heads", "8", 8),
    ("decoder.num_heads", "0x10", 16),
    ("decoder.num_heads", "1e3", 1000),
    ("decoder.dropout_rate", "0.1", 0.1),
    ("decoder.dropout_rate", "1", 1.0),
    ("decoder.norm", "post", "post"),
    ("decoder.norm", "'quoted'", "quoted"),
    ("decoder.use_bias", "false", False),
    ("decoder.use_bias", "True", True),
    ("decoder.max_len", "None", None),
    ("decoder.max_len", "128", 128),
    ("mesh_shape", "(4, 2)", (4, 2)),
    ("mesh_shape", "4,2", (4, 2)),
    ("mesh_shape", "[8]", (8,)),
    ("axis_names", "('data', 'model')", ("data", "model")),
    ("axis_names", "data,model", ["data", "model"]),
    ("rules", "{'a/*': ('model', None)}", {"a/*": ("model", None)}),
])
def test_typed_overrides(path, text, expected):
    cfg = apply_overrides(_model(), [Override(path=path, text=text)])
    value = cfg.get_recursively(path)
    assert value == expected and type(value) is type(expected)


def test_override_into_a_dict_entry_and_list_index():
    cfg = _model()
    cfg.rules = {"a": ("model", None)}
    apply_overrides(cfg, [Override("rules['a']", "(None, 'model')"),
                          Override("mesh_shape", "(2, 4)"), Override("mesh_shape[1]", "8")])
    assert cfg.rules == {"a": (None, "model")} and cfg.mesh_shape == (2, 8)


def test_every_bad_override_is_reported_with_path_and_suggestion():
    with pytest.raises(errors.ConfigValidationError) as info:
        apply_overrides(_model(), [
            Override("decoder.num_hedas", "2"),
            Override("decoder.num_heads", "two"),
            Override("decoder.use_bias", "maybe"),
            Override("decoder.norm.x", "1"),
            Override("decoder", "big"),
            Override("mesh_shape", "(1, 'a')"),
            Override("decoder.dropout_rate", "None"),
        ])
    problems = {p.path: p for p in info.value.problems}
    assert list(problems) == ["config.decoder.num_hedas", "config.decoder.num_heads",
                              "config.decoder.use_bias", "config.decoder.norm.x",
                              "config.decoder", "config.mesh_shape",
                              "config.decoder.dropout_rate"]
    assert isinstance(problems["config.decoder.num_hedas"], errors.UnknownFieldError)
    assert "did you mean 'num_heads'" in problems["config.decoder.num_hedas"].suggestion
    assert "valid fields of Decoder.Config" in problems["config.decoder.num_hedas"].suggestion
    assert isinstance(problems["config.decoder.num_heads"], errors.ConfigTypeError)
    assert "int" in problems["config.decoder.num_heads"].suggestion
    assert "bool" in problems["config.decoder.use_bias"].message
    assert "override its fields" in problems["config.decoder"].suggestion
    assert "float" in problems["config.decoder.dropout_rate"].suggestion


def test_none_only_where_the_annotation_allows_it():
    with pytest.raises(errors.ConfigValidationError):
        _apply(_model(), decoder__num_heads="None")
    assert _apply(_model(), decoder__max_len="null").decoder.max_len is None


def test_config_diff_lists_changed_leaves():
    named = _model()
    changed = _apply(named.clone(), decoder__num_heads="8", mesh_shape="(2,2)")
    assert config_diff(named, changed) == ["decoder.num_heads: 4 -> 8",
                                           "mesh_shape: (1,) -> (2, 2)"]
    assert config_diff(named, named.clone()) == []
    grown = named.clone(rules={"x": (None,)})
    assert config_diff(named, grown) == ["rules['x']: <absent> -> (None,)", "rules: {} -> <absent>"]


def test_a_list_and_a_tuple_of_the_same_items_are_no_config_change():
    """A sequence field set from the command line holds a list, restored from a saved config a
    tuple: resuming must not report that as a change."""
    from titanax.config.overrides import diff_debug_strings
    before = "grpo.reward_functions: ['my.fn']\nseed: 0\nfiles: ['a', 'b']"
    after = "grpo.reward_functions: ('my.fn',)\nseed: 1\nfiles: ('b', 'a')"
    assert diff_debug_strings(before, after) == ["seed: 0 -> 1",
                                                 "files: ['a', 'b'] -> ('b', 'a')"]


@pytest.mark.parametrize("old,new", [
    ("preference.loss", "objective.loss"), ("grpo.beta", "objective.beta"),
    ("grpo.rewards['answer'].weight", "objective.rewards['answer'].weight"),
    ("reference_from", "objective.reference_from")])
def test_a_moved_path_is_refused_naming_where_it_lives_now(old, new):
    """Wave 5 moved every objective's fields under ``objective``: a command line written for the
    old tree names the new path (the launcher exits 2 on it: tests/test_launch_errors.py)."""
    from titanax.train.engine import Engine  # pylint: disable=import-outside-toplevel
    with pytest.raises(errors.ConfigValidationError) as info:
        apply_overrides(Engine.default_config(), [Override(old, "1")])
    assert f"has moved to --config.{new}" in str(info.value), str(info.value)
    assert f"config.{old}" in str(info.value)


def test_a_record_written_before_wave_5_reads_into_the_objective():
    """An old run's config.json (export, generate, evaluate read it): ``preference`` / ``grpo``
    and ``reference_from`` land in ``objective``, the old class paths in their new modules."""
    from titanax.config.from_json import config_from_json  # pylint: disable=import-outside-toplevel
    from titanax.objectives.preference import Preference  # pylint: disable=import-outside-toplevel
    from titanax.train.engine import Engine  # pylint: disable=import-outside-toplevel
    record = Engine.default_config().to_json()
    record.pop("objective")
    record.update(preference={"klass": "titanax.modules.preference.Preference", "loss": "ipo",
                              "beta": 0.2, "simpo_gamma": 0.5},
                  grpo=None, reference_from="/some/dir")
    cfg = config_from_json(record)
    assert isinstance(cfg.objective, Preference.Config)
    assert (cfg.objective.loss, cfg.objective.beta, cfg.objective.reference_from) == (
        "ipo", 0.2, "/some/dir")
