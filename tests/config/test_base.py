"""Tests of ConfigBase: declaration, type checks, copying, paths, dumps, validation, freezing."""

import dataclasses
import enum
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Type, Union

import pytest

from titanax import errors
from titanax.config import REQUIRED, ConfigBase, Required, config_class, paths


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Leaf(ConfigBase):
    # Width of something.
    dim: Required[int] = REQUIRED
    # A rate.
    rate: float = 0.5
    # A name.
    name: str = "leaf"


class Branch(ConfigBase):
    leaf: Leaf = Leaf()
    leaves: List[Leaf] = []
    by_name: Dict[str, Leaf] = {}
    count: Required[int] = REQUIRED


class Typed(ConfigBase):
    an_int: int = 0
    a_float: float = 0.0
    a_bool: bool = False
    maybe_int: Optional[int] = None
    int_or_str: Union[int, str] = 0
    seq: Sequence[int] = ()
    fixed: Tuple[int, str] = (1, "a")
    homogeneous: Tuple[int, ...] = ()
    mapping: Dict[str, float] = {}
    choice: Literal["sgd", "adam"] = "sgd"
    fn: Optional[Callable] = None
    cls: Optional[Type[Exception]] = None
    color: Color = Color.RED
    anything: Any = None


def test_defaults_and_required_marker():
    cfg = Leaf()
    assert cfg.dim is REQUIRED
    assert cfg.rate == 0.5 and cfg.name == "leaf"
    assert Leaf.fields() == ("dim", "rate", "name")
    assert not hasattr(Leaf, "rate"), "class attributes become field specs, not shared values"


def test_set_is_chainable_and_constructor_kwargs():
    cfg = Leaf().set(dim=3).set(name="x")
    assert (cfg.dim, cfg.name) == (3, "x")
    assert Leaf(dim=7).dim == 7


def test_int_accepted_for_float_and_converted():
    cfg = Typed()
    cfg.a_float = 3
    assert cfg.a_float == 3.0 and isinstance(cfg.a_float, float)


@pytest.mark.parametrize("field,value", [
    ("an_int", "3"), ("an_int", 3.5), ("an_int", True), ("a_float", "x"), ("a_float", False),
    ("a_bool", 1), ("maybe_int", "x"), ("int_or_str", 1.5), ("seq", "abc"), ("seq", [1, "a"]),
    ("fixed", (1, 2)), ("fixed", (1,)), ("homogeneous", (1, 2.5)), ("mapping", {"a": "b"}),
    ("mapping", {1: 1.0}), ("choice", "lion"), ("fn", 3), ("cls", int), ("color", 1),
])
def test_assignment_type_errors_name_the_field(field, value):
    with pytest.raises(errors.ConfigTypeError) as info:
        setattr(Typed(), field, value)
    assert info.value.path == field
    assert "expected" in info.value.message


@pytest.mark.parametrize("field,value,stored", [
    ("maybe_int", None, None), ("maybe_int", 4, 4), ("int_or_str", "s", "s"),
    ("seq", [1, 2], [1, 2]), ("fixed", [2, "b"], (2, "b")), ("homogeneous", [1, 2], (1, 2)),
    ("mapping", {"a": 1}, {"a": 1.0}), ("choice", "adam", "adam"), ("fn", len, len),
    ("cls", ValueError, ValueError), ("color", Color.BLUE, Color.BLUE), ("anything", object, object),
])
def test_assignment_accepts_matching_types(field, value, stored):
    cfg = Typed()
    setattr(cfg, field, value)
    assert getattr(cfg, field) == stored
    assert type(getattr(cfg, field)) is type(stored)


def test_nested_config_type_is_checked():
    with pytest.raises(errors.ConfigTypeError):
        Branch().leaf = Typed()
    with pytest.raises(errors.ConfigTypeError):
        Branch().leaves = [Leaf(), Typed()]


def test_values_are_copied_on_assignment():
    leaf = Leaf(dim=1)
    branch = Branch()
    branch.leaf = leaf
    leaf.dim = 2
    assert branch.leaf.dim == 1
    items = [Leaf(dim=1)]
    branch.leaves = items
    items.append(Leaf(dim=3))
    items[0].dim = 9
    assert len(branch.leaves) == 1 and branch.leaves[0].dim == 1


def test_defaults_are_not_shared_between_instances():
    first, second = Branch(), Branch()
    first.leaf.dim = 5
    first.by_name["x"] = Leaf(dim=1)
    assert second.leaf.dim is REQUIRED and second.by_name == {}


def test_clone_is_deep_and_applies_values():
    cfg = Branch(count=1)
    cfg.leaf.dim = 2
    copy = cfg.clone(count=3)
    copy.leaf.dim = 4
    assert (cfg.count, cfg.leaf.dim) == (1, 2)
    assert (copy.count, copy.leaf.dim) == (3, 4)


def test_unknown_field_suggests_close_names():
    with pytest.raises(errors.UnknownFieldError) as info:
        Leaf().rtae = 1.0
    assert "did you mean 'rate'" in info.value.suggestion
    assert "dim, rate, name" in info.value.suggestion


def test_validate_reports_every_problem_with_full_paths():
    cfg = Branch()
    cfg.leaves = [Leaf(dim=1), Leaf()]
    cfg.by_name = {"a": Leaf()}
    with pytest.raises(errors.ConfigValidationError) as info:
        cfg.validate()
    paths = sorted(p.path for p in info.value.problems)
    assert paths == ["by_name['a'].dim", "count", "leaf.dim", "leaves[1].dim"]
    assert all(isinstance(p, errors.RequiredFieldError) for p in info.value.problems)
    assert "4 problems" in str(info.value)
    assert "leaves[1].dim: REQUIRED field not set" in str(info.value)


def test_validate_catches_in_place_mutation_of_containers():
    cfg = Typed()
    cfg.seq = [1, 2]
    cfg.seq.append("three")
    with pytest.raises(errors.ConfigValidationError) as info:
        cfg.validate()
    assert info.value.problems[0].path == "seq"
    assert "element [2]" in info.value.problems[0].message


def test_validate_with_prefix_and_success_returns_self():
    cfg = Branch(count=1)
    cfg.leaf.dim = 1
    assert cfg.validate() is cfg
    cfg.leaf.dim = REQUIRED
    with pytest.raises(errors.ConfigValidationError) as info:
        cfg.validate(prefix="model")
    assert info.value.problems[0].path == "model.leaf.dim"


class Heads(ConfigBase):
    model_dim: int = 64
    num_heads: int = 4

    def _validate_values(self):
        if self.model_dim % self.num_heads:
            yield "num_heads", f"must divide model_dim={self.model_dim}"


def test_cross_field_hook_reports_with_path():
    outer = type("Outer", (ConfigBase,), {"__annotations__": {"heads": Heads}, "heads": Heads()})()
    outer.heads.num_heads = 5
    with pytest.raises(errors.ConfigValidationError) as info:
        outer.validate()
    assert info.value.problems[0].path == "heads.num_heads"
    assert "must divide model_dim=64" in info.value.problems[0].message


def test_get_and_set_recursively_through_lists_and_dicts():
    cfg = Branch(count=1)
    cfg.leaves = [Leaf(dim=1), Leaf(dim=2)]
    cfg.by_name = {"a/b": Leaf(dim=3)}
    assert cfg.get_recursively("leaves[1].dim") == 2
    assert cfg.get_recursively(["by_name", paths.Key("a/b"), "dim"]) == 3
    cfg.set_recursively("leaves[0].dim", 10)
    cfg.set_recursively("by_name['a/b'].rate", 2)
    cfg.set_recursively("leaf.name", "n")
    assert cfg.leaves[0].dim == 10 and cfg.by_name["a/b"].rate == 2.0 and cfg.leaf.name == "n"
    typed = Typed()
    typed.homogeneous = (1, 2, 3)
    typed.set_recursively("homogeneous[1]", 7)
    assert typed.homogeneous == (1, 7, 3)
    with pytest.raises(errors.ConfigTypeError) as info:
        typed.set_recursively("homogeneous[1]", "x")
    assert info.value.path == "homogeneous"


def test_recursive_path_errors():
    cfg = Branch()
    with pytest.raises(errors.UnknownFieldError) as info:
        cfg.get_recursively("leaf.dimm")
    assert info.value.path == "leaf.dimm" and "'dim'" in info.value.suggestion
    with pytest.raises(errors.UnknownFieldError):
        cfg.get_recursively("leaves[3]")
    with pytest.raises(errors.UnknownFieldError):
        cfg.get_recursively("count.x")
    with pytest.raises(errors.ConfigTypeError) as info:
        cfg.set_recursively("leaf.dim", "x")
    assert info.value.path == "leaf.dim"


def test_debug_string_and_flat_dict():
    cfg = Branch(count=2)
    cfg.leaves = [Leaf(dim=1)]
    cfg.by_name = {"k": Leaf(dim=3, name="z")}
    expected = (
        "leaf.dim: REQUIRED\n"
        "leaf.rate: 0.5\n"
        "leaf.name: 'leaf'\n"
        "leaves[0].dim: 1\n"
        "leaves[0].rate: 0.5\n"
        "leaves[0].name: 'leaf'\n"
        "by_name['k'].dim: 3\n"
        "by_name['k'].rate: 0.5\n"
        "by_name['k'].name: 'z'\n"
        "count: 2\n")
    assert cfg.debug_string() == expected
    flat = cfg.to_flat_dict()
    assert flat["by_name['k'].name"] == "z" and flat["leaf.dim"] is REQUIRED


def test_debug_string_prints_functions_and_classes_by_import_path():
    cfg = Typed(fn=len, cls=KeyError, color=Color.BLUE)
    text = cfg.debug_string()
    assert "fn: builtins.len\n" in text
    assert "cls: builtins.KeyError\n" in text
    assert "color: Color.BLUE\n" in text
    assert " at 0x" not in text


def test_to_dict_and_to_json():
    cfg = Branch(count=2)
    cfg.leaf.dim = 1
    assert cfg.to_dict()["leaf"] == {"dim": 1, "rate": 0.5, "name": "leaf"}
    typed = Typed(fn=len, homogeneous=(1, 2))
    as_json = typed.to_json()
    assert as_json["fn"] == "builtins.len" and as_json["homogeneous"] == [1, 2]
    assert typed.to_dict()["homogeneous"] == (1, 2)
    import json
    json.dumps(Branch().to_json())  # REQUIRED serialises too.


def test_visit_and_enter_fn():
    cfg = Branch(count=1)
    seen = []
    cfg.visit(lambda path, value: seen.append(path))
    assert seen == ["leaf.dim", "leaf.rate", "leaf.name", "leaves", "by_name", "count"]
    seen.clear()
    cfg.visit(lambda path, value: seen.append((path, type(value).__name__)),
              enter_fn=lambda path, value: False)
    assert seen[0] == ("leaf", "Leaf")


def test_freeze_blocks_assignment_everywhere_and_clone_unfreezes():
    cfg = Branch(count=1)
    cfg.leaves = [Leaf(dim=1)]
    cfg.freeze()
    assert cfg.is_frozen
    for action in (lambda: setattr(cfg, "count", 2), lambda: setattr(cfg.leaf, "dim", 2),
                   lambda: setattr(cfg.leaves[0], "dim", 2), lambda: cfg.set(count=3)):
        with pytest.raises(errors.FrozenConfigError):
            action()
    thawed = cfg.clone()
    thawed.leaf.dim = 5
    assert not thawed.is_frozen and cfg.leaf.dim is REQUIRED


def test_subclass_adds_fields_and_changes_defaults():
    class Wider(Leaf):
        rate = 0.9
        extra: int = 1

    assert Wider.fields() == ("dim", "rate", "name", "extra")
    assert Wider().rate == 0.9 and Leaf().rate == 0.5


def test_bad_declarations_fail_at_class_creation_or_first_use():
    with pytest.raises(errors.ConfigError):
        class Shadow(ConfigBase):  # pylint: disable=unused-variable
            set: int = 1
    class BadDefault(ConfigBase):
        width: int = "wide"
    with pytest.raises(errors.ConfigTypeError) as info:
        BadDefault()
    assert "BadDefault.width" in info.value.path


def test_string_annotations_are_resolved():
    from tests.config.late_annotations import Inner, Late
    late = Late()
    late.size = 3
    late.inner = Inner(width=2)
    with pytest.raises(errors.ConfigTypeError):
        late.size = "x"
    with pytest.raises(errors.ConfigTypeError):
        late.inner = Leaf()


def test_config_class_decorator_accepts_configs_only():
    assert config_class(Leaf) is Leaf
    with pytest.raises(errors.ConfigError):
        config_class(dataclasses.dataclass(type("NotConfig", (), {})))


def test_equality():
    assert Leaf(dim=1) == Leaf(dim=1)
    assert Leaf(dim=1) != Leaf(dim=2)
    assert Leaf(dim=1) != Typed()
