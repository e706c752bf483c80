"""Model converters (modules/converters.py): LoRA seen through the protocol the Engine uses --
its fields on the run's config, a refusal without a model, the specs it converts, the params it
adds split from and joined back to the model's own, the scopes a step is traced in."""

import jax
import pytest

from titanax import errors
from titanax.modules import converters, lora
from titanax.modules.lora import LoRA
from titanax.modules.models.decoder import Decoder
from titanax.train.engine import Engine

MODEL = dict(name="llama", vocab_size=32, max_seq_len=16, num_layers=2, model_dim=32,
             num_heads=4, num_kv_heads=2, hidden_dim=48)


def test_the_engine_config_declares_the_converters_fields_and_applies_them():
    cfg = Engine.default_config()
    assert cfg.lora is None and converters.instantiate_converters(cfg, model=None) == []
    cfg.lora = LoRA.default_config().set(rank=4, frozen_dtype="bfloat16")
    with pytest.raises(errors.ConfigError, match="hand-written step has none") as info:
        converters.instantiate_converters(cfg, model=None)
    assert info.value.path == "lora"
    model = Decoder.default_config().set(**MODEL).instantiate()
    applied = converters.instantiate_converters(cfg, model=model)
    assert [type(c) for c in applied] == [LoRA]
    assert converters.frozen_dtype(applied) == "bfloat16"


def test_specs_added_params_and_scopes():
    model = Decoder.default_config().set(**MODEL).instantiate()
    applied = [LoRA.default_config().set(rank=4).instantiate()]
    own = model.create_parameter_specs_recursively()
    specs = converters.convert_specs(applied, own, model=model)
    flat = lambda tree: {jax.tree_util.keystr(p) for p, _ in  # noqa: E731
                         jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(
                             x, "trainable"))[0]}
    added = flat(specs) - flat(own)
    assert added and all(lora.A_SUFFIX in k or lora.B_SUFFIX in k for k in added)
    assert flat(converters.own_params(applied, specs)) == flat(own)
    base, extra = applied[0].split_added(specs)
    assert flat(applied[0].join_added(base, extra)) == flat(specs)
    with converters.scopes(applied):
        assert lora.current_settings().scale == applied[0].scale
        with converters.base_scopes(applied):
            assert not lora.current_settings().enabled
    assert lora.current_settings() is None
