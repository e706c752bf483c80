"""Model converters: transformations of a model applied before its layout (TorchTitan's sense).

A converter changes what the run's params are and how the model's layers run, without the
Engine naming it: LoRA (``lora.py``) adds low-rank adapters beside the targeted weights and
freezes the rest; FP8 (``float8.py``) runs the projections in float8. The Engine's config
declares the converters' fields (``ConverterFields``: ``--config.lora.*``; FP8's are the
precision policy's, ``--config.precision.fp8``) and the run asks each converter, through the
protocol below, for

* ``check_model(model)``: a refusal when the run's model cannot be converted (no model);
* ``convert_specs(specs, model=...)``: the model's ParameterSpecs as the run holds them;
* ``scope()``: the context its layers are traced in (the adapters' scale and dropout);
* ``base_scope()``: the context in which the model runs as it was before conversion (a
  reference model that is the LoRA base: the adapters off, no second copy);
* ``split_added(tree)`` / ``join_added(base, added)``: the params the converter added, apart
  from and back into the model's own (an HF directory holds only the model's own);
* ``frozen_dtype``: the storage dtype of the params it freezes (None: the precision's).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from titanax.config import Configurable
from titanax.modules.float8 import Float8
from titanax.modules.lora import LoRA


class ConverterFields(Configurable.Config):
    """The converters' fields of a run's config (a base of ``Engine.Config``)."""

    # Low-rank adapters on the model's weights, every other param frozen (modules/lora.py);
    # None: every param is trained.
    lora: Optional[LoRA.Config] = None

    def converter_configs(self) -> List[Tuple[str, Any]]:
        """``(field, config)`` of each converter the run applies, in order: LoRA, then FP8
        (``precision.fp8`` of the run's precision policy)."""
        configs = [(name, getattr(self, name)) for name in ("lora",)
                   if getattr(self, name) is not None]
        precision = getattr(self, "precision", None)
        if precision is not None and precision.fp8:
            configs.append(("precision.fp8", Float8.default_config().set(
                rowwise=precision.fp8_rowwise)))
        return configs


def instantiate_converters(cfg: ConverterFields, *, model: Any) -> List[Any]:
    """The run's converters, each checked against its model."""
    converters = [config.instantiate() for _, config in cfg.converter_configs()]
    for converter in converters:
        converter.check_model(model)
    return converters


def convert_specs(converters: Sequence[Any], specs: Dict[str, Any], *, model: Any
                  ) -> Dict[str, Any]:
    for converter in converters:
        specs = converter.convert_specs(specs, model=model)
    return specs


def scopes(converters: Sequence[Any]) -> ContextManager[None]:
    """Every converter's ``scope()`` at once (the context a step is traced in)."""
    return _all(converter.scope() for converter in converters)


def base_scopes(converters: Sequence[Any]) -> ContextManager[None]:
    """The model as it was before conversion, for the block."""
    return _all(converter.base_scope() for converter in converters)


@contextlib.contextmanager
def _all(contexts: Iterable[ContextManager[None]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def own_params(converters: Sequence[Any], tree: Dict[str, Any]) -> Dict[str, Any]:
    """``tree`` without what the converters added."""
    for converter in converters:
        tree, _ = converter.split_added(tree)
    return tree


def frozen_dtype(converters: Sequence[Any]) -> Optional[str]:
    """The storage dtype of frozen params a converter asks for (None: the precision's)."""
    dtypes = [c.frozen_dtype for c in converters if c.frozen_dtype is not None]
    return dtypes[0] if dtypes else None
