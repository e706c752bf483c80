"""Today's open models at their real sizes, each sized by ``--compile_only`` for 80 GB devices.

* ``gemma3_27b``: Gemma 3 27B, FSDP over ``data`` x tensor parallel 8 (32 devices).
* ``qwen3_5_27b``: Qwen 3.5 27B's language model, FSDP over ``data`` x tensor parallel 8 (32).
* ``gpt_oss_20b``: gpt-oss 20B, FSDP over ``data`` x experts over 8 ``expert`` devices (16).
* ``deepseek_v3_671b``: DeepSeek-V3 671B with its multi-token-prediction depth, FSDP over
  ``data`` x experts over 32 ``expert`` devices (256).

And each family's switches at CPU size (byte vocabulary, width 64), on the layout it needs:

* ``gemma3_tiny``: sliding and global layers 5:1 with a tail layer, data x tensor parallel (4 x 2).
* ``qwen3_5_tiny``: Gated DeltaNet and gated full attention 3:1, data x pipeline (4 x 2).
* ``gpt_oss_tiny``: sliding / full layers with sinks, 8 experts, data x experts (2 x 4).
* ``deepseek_v3_tiny``: latent attention, a dense first layer, 8 grouped sigmoid-routed experts
  with a shared one and a balancing bias, one MTP depth, data x experts (2 x 4).

Each trains on the bundled text as every language-model experiment does; start one from the
published weights with ``--config.init_from=DIR`` (docs/huggingface.md). A tiny one takes the
same flags to change its layout as the others (``tests/test_todays_experiments.py`` trains each
on its own layout, on every other layout its layers take and on data parallelism alone, in
float64, and compares them).
"""

from titanax.config import register_experiment
from titanax.modules.models.deepseek_v3 import deepseek_v3_config
from titanax.modules.models.gemma3 import gemma3_config
from titanax.modules.models.gpt_oss import gpt_oss_config
from titanax.parallel.expert_parallel import EP
from titanax.modules.models.qwen3_5 import qwen3_5_config
from titanax.parallel.plan import PP, ZeRO
from titanax.runtime.mesh import MeshSpec

from .language_runs import language_model_run


def _fsdp_tp(model, *, seq_len: int, batch_size: int):
    """FSDP over ``data`` (params, gradients and optimizer state split, gathered per layer) x
    tensor parallel 8 over ``model``."""
    cfg = language_model_run(model=model, tp_axis="model", seq_len=seq_len,
                             batch_size=batch_size, steps=5000, peak_lr=1e-4, eval_batches=20)
    cfg.plan.zero = ZeRO.default_config().set(stage=3, grad_sync="per_microbatch")
    cfg.mesh = MeshSpec.default_config().set(axes=("data", "model"), shape=(None, 8))
    return cfg


@register_experiment
def gemma3_27b():
    """Gemma 3 27B (62 layers: ten repetitions of five sliding and one global layer, then two
    sliding ones; 262k vocabulary, tied head). Sized for 32 80 GB devices (data 4 x model 8) at
    4,096 tokens x 32 rows: 64.6 GiB peak each by ``--compile_only --cpu_devices=32``
    (docs/performance.md; saving the matmuls' outputs instead of recomputing them needs 199)."""
    model = gemma3_config("27b", layer_remat_policy="nothing_saveable")
    return _fsdp_tp(model, seq_len=4096, batch_size=32)


@register_experiment
def qwen3_5_27b():
    """Qwen 3.5 27B's language model (64 layers: three Gated DeltaNet layers then a gated full
    attention, sixteen times; 248k vocabulary). Sized for 32 80 GB devices (data 4 x model 8)
    at 4,096 tokens x 32 rows: 44.4 GiB peak each by ``--compile_only --cpu_devices=32``
    (docs/performance.md; saving the matmuls' outputs instead of recomputing them needs 164)."""
    model = qwen3_5_config("27b", layer_remat_policy="nothing_saveable")
    return _fsdp_tp(model, seq_len=4096, batch_size=32)


@register_experiment
def gpt_oss_20b():
    """gpt-oss 20B (24 layers of sliding and full attention in turn, 32 experts of which 4 per
    token): its experts over 8 ``expert`` devices (4 each), FSDP over ``data``. Sized for 16
    80 GB devices (data 2 x expert 8) at 4,096 tokens x 16 rows: 50.8 GiB peak each by
    ``--compile_only --cpu_devices=16`` (docs/performance.md; 48.3 recomputing everything)."""
    model = gpt_oss_config("20b", layer_remat_policy="dots_with_no_batch_dims_saveable")
    cfg = language_model_run(model=model, tp_axis=None, seq_len=4096, batch_size=16,
                             steps=5000, peak_lr=1e-4, eval_batches=20)
    cfg.plan.zero = ZeRO.default_config().set(stage=3, grad_sync="per_microbatch")
    cfg.plan.expert_parallel = EP.default_config().set(axis="expert")
    cfg.mesh = MeshSpec.default_config().set(axes=("data", "expert"), shape=(None, 8))
    return cfg


@register_experiment
def deepseek_v3_671b():
    """DeepSeek-V3 671B (61 layers of latent attention, the first 3 dense, then 256 experts of
    which 8 per token beside a shared one; one multi-token-prediction depth): its experts over
    32 ``expert`` devices (8 each), FSDP over ``data`` x ``expert`` for the rest. Sized for 256
    80 GB devices (data 8 x expert 32) at 4,096 tokens x 256 rows: 71.95 GiB peak each by
    ``--compile_only --cpu_devices=256`` (docs/performance.md: what it took)."""
    model = deepseek_v3_config("671b", layer_remat_policy="nothing_saveable",
                               attention_block_size=1024)
    # Each expert's slots at its balanced share (capacity factor 1, as DeepSeek-V2 trained;
    # dropless dispatch sizes its exchanges for the worst case), the exchanged tokens sent
    # again in the backward pass rather than held.
    model.moe.set(dispatch="capacity", capacity_factor=1.0, keep_exchanged_tokens=False)
    cfg = language_model_run(model=model, tp_axis=None, seq_len=4096, batch_size=256,
                             steps=5000, peak_lr=2.2e-4, eval_batches=20)
    # As DeepSeek-V3 trained: bfloat16 compute over float32 master params, AdamW's moments
    # stored in bfloat16.
    cfg.precision.set(bfloat16=True, enable_x32_params=True)
    cfg.learner.optimizer.set(moments_dtype="bfloat16", b2=0.95)  # (The paper's b2.)
    # FSDP over data x expert for every param the experts' split leaves free (the dense ones
    # spread over all 256 devices, the experts over data on top of their expert split).
    cfg.plan.zero = ZeRO.default_config().set(stage=3, grad_sync="per_microbatch",
                                              also_over=("expert",))
    cfg.plan.expert_parallel = EP.default_config().set(axis="expert")
    cfg.mesh = MeshSpec.default_config().set(axes=("data", "expert"), shape=(None, 32))
    return cfg


# The shapes every tiny family shares (the family's own switches are kept).
_TINY = dict(vocab_size=256, max_seq_len=64, model_dim=64, num_heads=4, num_kv_heads=2,
             head_dim=16, hidden_dim=128)


def _tiny_run(model, *, tp_axis=None):
    return language_model_run(model=model, tp_axis=tp_axis, seq_len=64, batch_size=16,
                              steps=500, peak_lr=3e-3, eval_batches=10)


def _tiny_experts(cfg):
    cfg.mesh = MeshSpec.default_config().set(axes=("data", "expert"), shape=(None, 4))
    cfg.plan.expert_parallel = EP.default_config().set(axis="expert")
    return cfg


@register_experiment
def gemma3_tiny():
    """Gemma 3's switches (five sliding layers then a global one, and a sliding tail layer;
    sandwich norms, QK-norm, scaled embeddings, tied head) at CPU size, data x TP (4 x 2)."""
    return _tiny_run(gemma3_config("1b", **_TINY, num_layers=7, sliding_window=16,
                                   embedding_multiplier=8.0, attention_scale=None),
                     tp_axis="model")


@register_experiment
def qwen3_5_tiny():
    """Qwen 3.5's switches (three Gated DeltaNet layers then one of gated full attention with
    partial RoPE, twice) at CPU size, in two pipeline stages (data x pipe = 4 x 2, 1F1B)."""
    model = qwen3_5_config("27b", **_TINY, num_layers=8, tie_embeddings=True)
    model.linear_attention.set(num_key_heads=2, num_value_heads=4, key_head_dim=16,
                               value_head_dim=16, chunk_size=16)
    cfg = _tiny_run(model)
    cfg.mesh = MeshSpec.default_config().set(axes=("data", "pipe"), shape=(None, 2))
    cfg.plan.pipeline_parallel = PP.default_config().set(axis="pipe", schedule="1f1b",
                                                         microbatch_size=1)
    return cfg


@register_experiment
def gpt_oss_tiny():
    """gpt-oss's switches (sliding and full layers in turn, sinks, biased projections, YaRN,
    clamped-SwiGLU experts behind a biased router) at CPU size: 8 experts (top 2), data x
    experts (2 x 4)."""
    model = gpt_oss_config("20b", **_TINY, num_layers=4, sliding_window=16)
    model.moe.set(hidden_dim=64, num_experts=8, top_k=2, dispatch="dropless")
    model.rope_scaling.set(factor=4.0, original_max_position_embeddings=16)
    return _tiny_experts(_tiny_run(model))


@register_experiment
def deepseek_v3_tiny():
    """DeepSeek-V3's switches (latent attention with low-rank queries, a dense first layer,
    sigmoid routing over the best groups with a balancing bias, a shared expert, one MTP
    depth) at CPU size: 8 experts (top 2), data x experts (2 x 4)."""
    model = deepseek_v3_config("671b", **_TINY, num_layers=3, first_dense_layers=1)
    model.moe.set(hidden_dim=32, num_experts=8, top_k=2, shared_hidden_dim=32)
    model.moe.router.set(num_groups=4, top_groups=2)
    model.latent_attention.set(num_heads=4, q_lora_rank=24, kv_lora_rank=16,
                               qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    model.rope_scaling.set(factor=4.0, original_max_position_embeddings=16)
    return _tiny_experts(_tiny_run(model))
