"""``python -m titanax.export``'s choice of the tokenizer files an export carries."""

import os

from titanax import export
from titanax.config import registry


def test_a_run_on_a_bundled_tokenizer_exports_its_files():
    """llama_tiny_grpo reads ``bundled:sums`` (a path the config names by installation-free
    prefix): the export carries that tokenizer, not a warning that it is gone."""
    registry.load_config_modules(list(registry.DEFAULT_CONFIG_MODULES))
    cfg = registry.get_config("llama_tiny_grpo")
    assert cfg.train_input.tokenizer.path.startswith("bundled:")
    directory = export._trained_tokenizer_dir(cfg, None)  # pylint: disable=protected-access
    assert directory is not None and os.path.isfile(os.path.join(directory, "tokenizer.json"))
