"""The Titanax config system (no jax imports here: configs build and validate anywhere)."""

from titanax.config.base import (REQUIRED, ConfigBase, InstantiableConfig, Required,
                                 RequiredFieldValue, config_class)
from titanax.config.configurable import (ConfigOr, Configurable, checked_by, config_for_class,
                                         config_for_function, maybe_instantiate)
from titanax.config.overrides import Override, apply_overrides, config_diff, parse_value
from titanax.config.registry import (get_config, load_config_modules, register_experiment)

__all__ = [
    "REQUIRED", "ConfigBase", "InstantiableConfig", "Required", "RequiredFieldValue",
    "config_class", "ConfigOr", "Configurable", "checked_by", "config_for_class",
    "config_for_function",
    "maybe_instantiate", "Override", "apply_overrides", "config_diff", "parse_value",
    "get_config", "load_config_modules", "register_experiment",
]
