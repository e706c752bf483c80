"""Mixtures of experts with expert parallelism (the decoder's MLPs replaced by routed experts).

* ``moe_tiny_ep``: llama_tiny's model with 8 SwiGLU experts per layer (top-2, each half the dense
  MLP's width: the same active params), on a ``data x expert = 2 x 4`` mesh: each expert rank
  holds 2 experts and routes its own rows. The capacity factor is E / top_k = 4, so no token is
  ever dropped, and with ``--config.plan.expert_parallel=None "--config.mesh.axes=('data',)"
  "--config.mesh.shape=(None,)"`` it is the same model and batch on data=8. A small load-balancing
  loss is on; aux-loss-free balancing is off
  (``--config.model.moe.router.balance_rate=0.01`` turns it on).
* ``qwen3_30b_a3b_ep``: Qwen 3 30B-A3B (48 layers, 128 experts, 8 per token) with the experts
  over 8 ``expert`` devices and FSDP over ``data``; ``mixtral_8x7b_ep``: Mixtral 8x7B, the same
  plan. Sized for accelerators.
"""

from titanax.config import register_experiment
from titanax.modules.layers.moe import MoE
from titanax.modules.models.decoder import Decoder, mixtral_config, qwen3_moe_config
from titanax.parallel.expert_parallel import EP
from titanax.parallel.plan import ZeRO
from titanax.runtime.mesh import MeshSpec

from .language_runs import language_model_run


def _tiny_moe() -> Decoder.Config:
    moe = MoE.default_config().set(hidden_dim=176, num_experts=8, top_k=2, capacity_factor=4.0,
                                   aux_loss_weight=0.01)
    return Decoder.default_config().set(
        name="llama_moe", vocab_size=256, max_seq_len=64, num_layers=4, model_dim=128,
        num_heads=4, num_kv_heads=2, hidden_dim=352, norm_eps=1e-5, rope_theta=10000.0, moe=moe)


def _expert_parallel(cfg, *, experts: int, shape=(None,)):
    cfg.mesh = MeshSpec.default_config().set(axes=("data", "expert"),
                                             shape=tuple(shape) + (experts,))
    cfg.plan.expert_parallel = EP.default_config().set(axis="expert")
    return cfg


@register_experiment
def moe_tiny_ep():
    """llama_tiny with 8 experts per layer (top-2), data x expert parallel (2 x 4); capacity
    E / top_k: nothing is dropped."""
    cfg = language_model_run(model=_tiny_moe(), tp_axis=None, seq_len=64, batch_size=16,
                             steps=2000, peak_lr=2e-3, eval_batches=50)
    return _expert_parallel(cfg, experts=4, shape=(2,))


def _accelerator_run(model):
    cfg = language_model_run(model=model, tp_axis=None, seq_len=4096, batch_size=64,
                             steps=5000, peak_lr=3e-4, eval_batches=20)
    cfg.plan.zero = ZeRO.default_config().set(stage=3, grad_sync="per_microbatch")
    return _expert_parallel(cfg, experts=8)


@register_experiment
def qwen3_30b_a3b_ep():
    """Qwen 3 30B-A3B: experts over 8 ``expert`` devices (16 each), FSDP over ``data``. Sized
    for 64 80 GB devices (data 8 x expert 8): 49.7 GiB peak each by ``--compile_only
    --cpu_devices=64``."""
    model = qwen3_moe_config("30b-a3b", layer_remat_policy="dots_with_no_batch_dims_saveable")
    model.moe.aux_loss_weight = 0.001 / model.num_layers  # HF's router_aux_loss_coef.
    return _accelerator_run(model)


@register_experiment
def mixtral_8x7b_ep():
    """Mixtral 8x7B: one expert on each of 8 ``expert`` devices, FSDP over ``data``. Sized for
    64 80 GB devices (data 8 x expert 8): 37.3 GiB peak each by ``--compile_only
    --cpu_devices=64``."""
    model = mixtral_config("8x7b", layer_remat_policy="dots_with_no_batch_dims_saveable")
    model.moe.aux_loss_weight = 0.02 / model.num_layers  # HF's router_aux_loss_coef.
    return _accelerator_run(model)
