"""Tests of Configurable, config_for_function / config_for_class, ConfigOr and maybe_instantiate."""

import numpy as np
import optax
import pytest

from titanax import errors
from titanax.config import (REQUIRED, ConfigOr, Configurable, InstantiableConfig, Required,
                            config_for_class, config_for_function, maybe_instantiate)
from tests.numerics import ADAM, assert_close


class Encoder(Configurable):
    class Config(Configurable.Config):
        # Width.
        dim: Required[int] = REQUIRED
        # Optional learning-rate-like value, or a config that builds one.
        scale: ConfigOr[float] = 1.0

    def __init__(self, cfg, *, tag="none"):
        super().__init__(cfg)
        self.tag = tag
        self.scale = maybe_instantiate(self.config.scale)


class Pair(Configurable):
    class Config(Configurable.Config):
        left: Encoder.Config = Encoder.default_config()
        right: Encoder.Config = Encoder.default_config()

    def __init__(self, cfg):
        super().__init__(cfg)
        self.left = self.config.left.instantiate(tag="L")
        self.right = self.config.right.instantiate(tag="R")


def test_default_config_sets_klass_and_instantiate_passes_extra():
    cfg = Encoder.default_config().set(dim=4)
    assert cfg.klass is Encoder
    encoder = cfg.instantiate(tag="t")
    assert isinstance(encoder, Encoder) and encoder.tag == "t" and encoder.config.dim == 4


def test_instance_config_is_a_frozen_copy():
    cfg = Encoder.default_config().set(dim=4)
    encoder = cfg.instantiate()
    cfg.dim = 8
    assert encoder.config.dim == 4
    with pytest.raises(errors.FrozenConfigError):
        encoder.config.dim = 2


def test_instantiate_validates_the_whole_subtree_first():
    cfg = Pair.default_config()
    cfg.left.dim = 2
    with pytest.raises(errors.ConfigValidationError) as info:
        cfg.instantiate()
    assert [p.path for p in info.value.problems] == ["right.dim"]


def test_wrong_config_class_is_rejected():
    with pytest.raises(errors.ConfigError) as info:
        Pair(Encoder.default_config().set(dim=1))
    assert "Pair" in str(info.value)


def test_config_or_and_maybe_instantiate():
    cfg = Encoder.default_config().set(dim=1, scale=config_for_function(lambda: 0.25))
    assert cfg.instantiate().scale == 0.25
    assert maybe_instantiate(3) == 3
    with pytest.raises(errors.ConfigTypeError):
        Encoder.default_config().scale = "big"


def test_config_for_function_on_optax_adamw_builds_a_working_optimizer():
    cfg = config_for_function(optax.adamw).set(learning_rate=0.1, weight_decay=0.0)
    assert cfg.fn is optax.adamw
    assert cfg.learning_rate == 0.1 and cfg.b1 == 0.9
    text = cfg.debug_string()
    assert "fn: optax." in text and "learning_rate: 0.1" in text
    optimizer = cfg.instantiate()
    assert isinstance(optimizer, optax.GradientTransformation)
    params = {"w": np.array([1.0, -2.0], np.float32)}
    state = optimizer.init(params)
    updates, _ = optimizer.update({"w": np.array([0.5, -0.5], np.float32)}, state, params)
    # Adam's first step moves each coordinate by -lr * sign(grad) -- up to float32's rounding of
    # the bias correction 1 - b2 (1.3e-5 of it, halved by the square root).
    assert_close(updates["w"], [-0.1, 0.1], bound=ADAM, what="Adam's first update")


def test_config_for_function_requires_parameters_without_defaults():
    cfg = config_for_function(optax.adamw)
    assert cfg.learning_rate is REQUIRED
    with pytest.raises(errors.ConfigValidationError) as info:
        cfg.instantiate()
    assert info.value.problems[0].path == "learning_rate"


def test_nested_function_configs_are_instantiated_before_the_call():
    schedule = config_for_function(optax.warmup_cosine_decay_schedule).set(
        init_value=0.0, peak_value=1.0, warmup_steps=10, decay_steps=100)
    cfg = config_for_function(optax.sgd).set(learning_rate=schedule)
    optimizer = cfg.instantiate()
    state = optimizer.init({"w": np.zeros(1, np.float32)})
    updates, _ = optimizer.update({"w": np.ones(1, np.float32)}, state)
    assert float(updates["w"][0]) == 0.0  # Warm-up starts at init_value=0.
    assert "learning_rate.fn: optax." in cfg.debug_string()


def test_config_for_function_type_checks_annotated_parameters():
    def scaled(x: int, factor: float = 2.0) -> float:
        return x * factor

    cfg = config_for_function(scaled)
    with pytest.raises(errors.ConfigTypeError):
        cfg.x = "three"
    assert cfg.set(x=3).instantiate() == 6.0
    assert cfg.instantiate(factor=3.0) == 9.0


class Point:
    def __init__(self, x: float, y: float = 0.0):
        self.x, self.y = x, y


def test_config_for_class():
    cfg = config_for_class(Point).set(x=1)
    assert isinstance(cfg, InstantiableConfig) and cfg.fields() == ("fn", "x", "y")
    point = cfg.instantiate()
    assert (point.x, point.y) == (1.0, 0.0)
    with pytest.raises(errors.ConfigError):
        config_for_class(len)
