"""Experiments used only by tests (loaded with --config_module=tests.config.fixture_experiments).

They are plain Configurables with nested configs of several field types, so the launcher's
overrides, diffs and errors can be exercised on every kind of field.
"""

from typing import Dict, Optional, Sequence, Tuple

from titanax.config import REQUIRED, Configurable, Required, register_experiment


class Decoder(Configurable):
    class Config(Configurable.Config):
        # Attention heads.
        num_heads: Required[int] = REQUIRED
        # Hidden size.
        model_dim: int = 64
        # Dropout probability.
        dropout_rate: float = 0.0
        # Pre- or post-norm.
        norm: str = "pre"
        # Whether to use bias terms.
        use_bias: bool = True
        # Optional cap on sequence length.
        max_len: Optional[int] = None


class Model(Configurable):
    class Config(Configurable.Config):
        decoder: Decoder.Config = Decoder.default_config()
        # Mesh shape.
        mesh_shape: Tuple[int, ...] = (1,)
        # Named axes.
        axis_names: Sequence[str] = ("data",)
        # Arbitrary rules.
        rules: Dict[str, Tuple[Optional[str], ...]] = {}

    def run(self, *, trainer_dir=None, cluster=None):
        print(f"running fixture model with {self.config.decoder.num_heads} heads")
        return 0


@register_experiment
def fixture_model():
    """A fixture experiment with nested fields of many types."""
    cfg = Model.default_config()
    cfg.decoder.num_heads = 4
    return cfg


@register_experiment("fixture_incomplete")
def _incomplete():
    """A fixture experiment with a REQUIRED field left unset."""
    return Model.default_config()
