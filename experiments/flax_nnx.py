"""A GPT written in Flax NNX, trained by Titanax through the ``FlaxNNX`` adapter.

The decoder (``flax_models/nnx_gpt.py``, imported when the experiment is built: listing the
experiments imports no flax) is plain Flax NNX -- nothing of Titanax in it -- the way a user
brings their own model: pre-LayerNorm blocks (causal self-attention, a GELU MLP), learned token and position
embeddings, the LM head tied to the token table. Its layers are stacked at construction
(``nnx.vmap``) and run by ``nnx.scan``, so FSDP gathers them one layer at a time; with
``scan_layers=False`` they are an ``nnx.List`` run one after another (what a pipeline of explicit
stages splits, with ``tie_embeddings=False`` so that each stage owns its table). Params name
their dimensions (``embed``, ``mlp``, ``heads``, ``vocab``, ``layers``) with
``nnx.with_partitioning``; the plan's ``logical_axis_rules`` map them to mesh axes.

* ``flax_nnx_gpt_dp``: the 4-layer, 128-wide NNX GPT on byte-level Shakespeare, data parallel
  over every device. ``--config.plan.zero.stage=1|2|3`` shards its optimizer state, gradients
  and params as for Titanax's own models (the rules put the ZeRO split on ``embed``).
"""

from typing import TYPE_CHECKING

from titanax.config import checked_by, config_for_function, register_experiment
from titanax.config import value_checks as check

if TYPE_CHECKING:  # (flax is imported when the experiment is built, not when it is listed.)
    from flax import nnx

    from titanax.modules.adapters.flax_nnx import FlaxNNX

    from .flax_models.nnx_gpt import GPT

from .language_runs import language_model_run

def _gpt_sizes(*, vocab_size=256, max_seq_len=64, num_layers=4, model_dim=128, num_heads=4,
               dropout_rate=0.0, **_):
    """The factory's arguments, checked where the config is validated (named by path)."""
    for name, value in (("vocab_size", vocab_size), ("max_seq_len", max_seq_len),
                        ("num_layers", num_layers), ("model_dim", model_dim),
                        ("num_heads", num_heads)):
        yield from check.at_least(name, value, 1)
    yield from check.fraction("dropout_rate", dropout_rate)
    if isinstance(model_dim, int) and isinstance(num_heads, int) and num_heads >= 1 and \
            model_dim % num_heads:
        yield "num_heads", f"must divide model_dim={model_dim}, got {num_heads}"


@checked_by(_gpt_sizes)
def make_gpt(*, vocab_size: int = 256, max_seq_len: int = 64, num_layers: int = 4,
             model_dim: int = 128, num_heads: int = 4, dropout_rate: float = 0.0,
             scan_layers: bool = True, tie_embeddings: bool = True,
             rngs: "nnx.Rngs") -> "GPT":
    """The factory the adapter calls (it passes ``rngs``, seeded with the run's init key)."""
    from .flax_models.nnx_gpt import GPT  # pylint: disable=import-outside-toplevel
    return GPT(vocab_size=vocab_size, max_seq_len=max_seq_len, num_layers=num_layers,
               model_dim=model_dim, num_heads=num_heads, dropout_rate=dropout_rate,
               scan_layers=scan_layers, tie_embeddings=tie_embeddings, rngs=rngs)


def nnx_gpt(*, seq_len: int = 64, **sizes) -> "FlaxNNX.Config":
    """The adapted NNX GPT: logits trained on the next byte."""
    from titanax.modules.adapters.flax_nnx import FlaxNNX  # pylint: disable=import-outside-toplevel
    from titanax.modules.adapters.objectives import CausalLMLoss  # pylint: disable=import-outside-toplevel
    factory = config_for_function(make_gpt).set(max_seq_len=seq_len, **sizes)
    return FlaxNNX.default_config().set(
        name="nnx_gpt", module=factory, inputs=("input_ids",),
        example_inputs={"input_ids": f"int32[2,{seq_len}]"},
        loss=CausalLMLoss.default_config().set(vocab_size=factory.vocab_size,
                                               max_seq_len=seq_len))


@register_experiment
def flax_nnx_gpt_dp():
    """A 4-layer NNX GPT (written in Flax, adapted by FlaxNNX) on Shakespeare, data parallel."""
    cfg = language_model_run(model=nnx_gpt(), tp_axis=None, seq_len=64, batch_size=16,
                             steps=1000, peak_lr=2e-3, eval_batches=50)
    cfg.plan.logical_axis_rules = {"embed": "data", "mlp": None, "heads": None, "vocab": None,
                                   "layers": None}
    cfg.checkpoint.save_every_n_steps = 250
    return cfg
