"""Today's decoders (Llama 3 / Qwen 3 family: RoPE, RMSNorm, SwiGLU, grouped-query attention).

* ``llama_tiny_dp_tp``: a 4-layer, 128-wide Llama-style model on byte-level Shakespeare
  (vocabulary 256), data x tensor parallel on a ``data x model = -1 x 2`` mesh; trains on a CPU in
  minutes. With ``--config.init_from=<HF dir>`` it fine-tunes a Hugging Face Llama or Mistral
  instead (the model then comes from the directory's config.json).
* ``llama_tiny_packed``: the same model on documents packed into rows (segment ids, positions
  per document) from JSONL or text files and a tokenizer.json (defaults: the bundled plays as
  paragraphs, bytes); ``llama_tiny_sft``: on JSONL prompt/completion records, trained on the
  completion tokens only (``llama3_8b_sft_fsdp_tp``: the same on Llama 3.1 8B, for accelerators).
* ``llama3_1b_fsdp``: Llama 3.2 1B's shapes with FSDP over every device; ``llama3_8b_fsdp_tp``:
  Llama 3.1 8B with FSDP over ``data`` and TP=8 over ``model`` (a node of 8 accelerators per
  model replica); ``qwen3_0_6b_dp``: Qwen 3 0.6B, data parallel. Sized for accelerators; the
  text stays the bundled bytes until ``train_input`` names the user's data.
* ``llama_tiny_muon``: the same model, data and layout trained by Muon (matrices) and AdamW
  (the rest).
* ``llama_tiny_cp``: the tiny model data x context parallel (2 x 4): each row's 64 tokens split
  over 4 devices (``--config.plan.context_parallel.strategy=all_gather|ring|ulysses``);
  ``llama3_8b_cp``: Llama 3.1 8B on 64k-token rows, FSDP over ``data`` x ring attention over 8
  ``context`` devices, for accelerators.
"""

from typing import Optional

from titanax.config import config_for_function, register_experiment
from titanax.data.packed import PackedDocuments
from titanax.data.preference import PreferencePairs
from titanax.data.unpaired import UnpairedPreferences
from titanax.data.pipeline import Input
from titanax.modules.lora import LoRA
from titanax.modules.models.decoder import Decoder, llama_config, qwen3_config
from titanax.objectives.kto import KTO
from titanax.objectives.preference import Preference
from titanax.parallel.context_parallel import CP
from titanax.parallel.plan import ZeRO
from titanax.runtime.mesh import MeshSpec
from titanax.train import optimizers

from .language_runs import language_model_run


def _tiny_llama() -> Decoder.Config:
    return Decoder.default_config().set(
        name="llama", vocab_size=256, max_seq_len=64, num_layers=4, model_dim=128, num_heads=4,
        num_kv_heads=2, hidden_dim=352, norm_eps=1e-5, rope_theta=10000.0)


@register_experiment
def llama_tiny_dp_tp():
    """4-layer byte-level Llama-style model on Shakespeare, data x tensor parallel (-1 x 2)."""
    return language_model_run(model=_tiny_llama(), tp_axis="model", seq_len=64, batch_size=16,
                              steps=2000, peak_lr=2e-3, eval_batches=50)


@register_experiment
def llama_tiny_muon():
    """llama_tiny_dp_tp's model, data and layout trained by Muon (train/muon.py): the attention
    and MLP matrices by Newton-Schulz-orthogonalised Nesterov momentum, the embedding, head
    and norms by AdamW with llama_tiny_dp_tp's schedule. Muon's own schedule peaks at 0.02 (the
    Muon papers' rate for updates of spectral norm ~1). The mesh and plan overrides of
    llama_tiny_dp_tp apply; under TP, FSDP or ZeRO each split matrix's blocks are sent to the one
    device that runs its Newton-Schulz iterations, and the result's blocks back."""
    cfg = llama_tiny_dp_tp()
    adamw = cfg.learner.optimizer
    cfg.learner.optimizer = config_for_function(optimizers.muon).set(
        learning_rate=adamw.learning_rate.clone().set(peak_value=MUON_PEAK_LR,
                                                      end_value=MUON_PEAK_LR / 10),
        weight_decay=0.0, adam_learning_rate=adamw.learning_rate.clone(),
        adam_b2=adamw.b2, adam_weight_decay=adamw.weight_decay)
    return cfg


# Muon's peak rate in llama_tiny_muon.
MUON_PEAK_LR = 0.02


def _fsdp(cfg):
    cfg.plan.zero = ZeRO.default_config().set(stage=3, grad_sync="per_microbatch")
    return cfg


@register_experiment
def llama_tiny_cp():
    """llama_tiny's model, data x context parallel (2 x 4): each row's 64 tokens split over the
    4 context devices, load-balanced for the causal mask. With
    --config.plan.context_parallel=None "--config.mesh.axes=('data',)"
    "--config.mesh.shape=(None,)" it is the same model and batch on data=8."""
    cfg = language_model_run(model=_tiny_llama(), tp_axis=None, seq_len=64, batch_size=16,
                             steps=2000, peak_lr=2e-3, eval_batches=50)
    cfg.mesh = MeshSpec.default_config().set(axes=("data", "context"), shape=(2, 4))
    cfg.plan.context_parallel = CP.default_config().set(axis="context")
    return cfg


@register_experiment
def llama3_8b_cp():
    """Llama 3.1 8B on 64k-token rows: FSDP over ``data`` x ring attention over 8 ``context``
    devices (each holds 8k tokens of every row and one visiting K/V block). Sized for 64
    80 GB devices (data 8 x context 8): 61.6 GiB peak each by ``--compile_only
    --cpu_devices=64`` (docs/performance.md)."""
    model = llama_config("3.1-8b", layer_remat_policy="dots_with_no_batch_dims_saveable")
    cfg = _fsdp(language_model_run(model=model, tp_axis=None, seq_len=65536, batch_size=8,
                                   steps=2000, peak_lr=2e-4, eval_batches=10))
    cfg.mesh = MeshSpec.default_config().set(axes=("data", "context"), shape=(None, 8))
    cfg.plan.context_parallel = CP.default_config().set(axis="context", strategy="ring")
    return cfg


@register_experiment
def llama3_1b_fsdp():
    """Llama 3.2 1B (16 layers, 2048 wide, GQA 32/8, tied head) with FSDP over every device.
    Sized for 8 80 GB devices: 10.4 GiB peak each by ``--compile_only --cpu_devices=8``."""
    model = llama_config("3.2-1b", layer_remat_policy="dots_with_no_batch_dims_saveable")
    return _fsdp(language_model_run(model=model, tp_axis=None, seq_len=2048, batch_size=16,
                                    steps=5000, peak_lr=3e-4, eval_batches=20))


@register_experiment
def llama3_8b_fsdp_tp():
    """Llama 3.1 8B with FSDP over ``data`` and tensor parallelism (8) over ``model``. Sized
    for 32 80 GB devices (data 4 x model 8): 58.0 GiB peak each by ``--compile_only
    --cpu_devices=32``."""
    model = llama_config("3.1-8b", layer_remat_policy="dots_with_no_batch_dims_saveable")
    cfg = _fsdp(language_model_run(model=model, tp_axis="model", seq_len=4096, batch_size=32,
                                   steps=5000, peak_lr=2e-4, eval_batches=20))
    cfg.mesh = MeshSpec.default_config().set(axes=("data", "model"), shape=(None, 8))
    return cfg


@register_experiment
def qwen3_0_6b_dp():
    """Qwen 3 0.6B (28 layers, QK-norm, head_dim 128, tied head), data parallel."""
    model = qwen3_config("0.6b", layer_remat_policy="dots_with_no_batch_dims_saveable")
    return language_model_run(model=model, tp_axis=None, seq_len=2048, batch_size=16,
                              steps=5000, peak_lr=3e-4, eval_batches=20)


def _packed_input(split: str, *, fmt: Optional[str], batch_size: int, seq_len: int,
                  seed: int = 0):
    return Input.default_config().set(
        source=PackedDocuments.default_config().set(format=fmt, seq_len=seq_len, split=split),
        global_batch_size=batch_size, seed=seed)


@register_experiment
def llama_tiny_packed():
    """llama_tiny_dp_tp on documents packed into rows (segment ids, per-document positions):
    JSONL {"text": ...} records or text files via --config.train_input.source.files (default:
    the bundled plays, one document per paragraph), tokenized by
    --config.train_input.tokenizer.path (default: bytes)."""
    cfg = llama_tiny_dp_tp()
    cfg.train_input = _packed_input("train", fmt=None, batch_size=16, seq_len=64)
    cfg.evalers["heldout"].input = _packed_input("test", fmt=None, batch_size=16, seq_len=64,
                                                 seed=1)
    return cfg


@register_experiment
def llama_tiny_sft():
    """llama_tiny_dp_tp fine-tuned on JSONL {"prompt": ..., "completion": ...} records given by
    --config.train_input.source.files (the evaler reads their held-out split), or on chat
    records with --config.train_input.source.format=chat: the loss is the mean over completion
    (assistant) tokens only; packed rows. With --config.init_from=<HF dir> the model and its
    tokenizer come from the directory (docs/fine_tune.md)."""
    cfg = llama_tiny_packed()
    # (The evaler reads the held-out split of the same files, in the train input's format.)
    cfg.train_input.source.format = "prompt_completion"
    for input_cfg in (cfg.train_input, cfg.evalers["heldout"].input):
        # A pair longer than a row keeps its completion and the end of its prompt.
        input_cfg.source.long_documents = "truncate"
    cfg.max_steps = 200
    cfg.log_every = 10  # (20 progress lines, not the pretraining runs' 2 of 200 steps.)
    cfg.evalers["heldout"].every_n_steps = 50
    cfg.evalers["heldout"].num_batches = 5
    return cfg


@register_experiment
def llama_tiny_lora_sft():
    """llama_tiny_sft with LoRA: rank-8 adapters (alpha 16) on every attention and MLP projection,
    every other weight frozen (no gradient, no reduction, no optimizer state). Usually with
    --config.init_from=<HF dir> (the base) and --config.train_input.source.files=<JSONL>;
    export the adapters with ``python -m titanax.export --format=peft``."""
    cfg = llama_tiny_sft()
    cfg.lora = LoRA.default_config()
    return cfg


def _preference_input(split: str, *, batch_size: int, seq_len: int, seed: int = 0):
    return Input.default_config().set(
        source=PreferencePairs.default_config().set(seq_len=seq_len, split=split),
        global_batch_size=batch_size, seed=seed)


@register_experiment
def llama_tiny_dpo():
    """llama_tiny's model tuned with DPO (the sigmoid loss, beta 0.1) on the user's JSONL
    {"prompt", "chosen", "rejected"} records (or TRL's conversational form) given by
    --config.train_input.source.files, usually with --config.init_from=<HF dir>; the reference
    is the starting weights (a frozen copy; with --config.lora: the base, adapters off) or
    --config.objective.reference_from=<HF dir>. The evaler reads the held-out pairs: its accuracy is
    rewards/accuracies there."""
    cfg = llama_tiny_dp_tp()
    cfg.train_input = _preference_input("train", batch_size=16, seq_len=64)
    # Every held-out pair, in one pass (the last batch padded: padding weighs 0).
    cfg.evalers["heldout"].input = _preference_input("test", batch_size=16, seq_len=64, seed=1)
    cfg.evalers["heldout"].input.set(num_epochs=1, last_batch="pad", shuffle=False)
    cfg.evalers["heldout"].num_batches = None
    cfg.evalers["heldout"].every_n_steps = 50
    cfg.objective = Preference.default_config()
    cfg.learner.optimizer.learning_rate.peak_value = 5e-4
    cfg.learner.optimizer.learning_rate.warmup_steps = 10
    cfg.learner.optimizer.weight_decay = 0.0
    cfg.max_steps = 200
    cfg.log_every = 10
    return cfg


def _unpaired_input(split: str, *, batch_size: int, seq_len: int, seed: int = 0):
    return Input.default_config().set(
        source=UnpairedPreferences.default_config().set(seq_len=seq_len, split=split),
        global_batch_size=batch_size, seed=seed)


@register_experiment
def llama_tiny_kto():
    """llama_tiny's model tuned with KTO (beta 0.1, both labels weighted 1) on the user's JSONL
    {"prompt", "completion", "label": true|false} records (or TRL's conversational form) given
    by --config.train_input.source.files, usually with --config.init_from=<HF dir>; the
    reference is the starting weights (a frozen copy; with --config.lora: the base, adapters
    off) or --config.objective.reference_from=<HF dir>. The evaler reads the held-out records:
    its accuracy is the share whose implied reward has their label's sign."""
    cfg = llama_tiny_dpo()
    cfg.train_input = _unpaired_input("train", batch_size=16, seq_len=64)
    cfg.evalers["heldout"].input = _unpaired_input("test", batch_size=16, seq_len=64, seed=1)
    cfg.evalers["heldout"].input.set(num_epochs=1, last_batch="pad", shuffle=False)
    cfg.objective = KTO.default_config()
    return cfg


@register_experiment
def llama3_8b_sft_fsdp_tp():
    """llama3_8b_fsdp_tp fine-tuned on the user's JSONL prompt/completion records
    (--config.train_input.source.files, usually with --config.init_from=<the HF model>, whose
    tokenizer then reads them): completion tokens only, packed rows of 4096; for
    accelerators: 32 80 GB devices (data 4 x model 8), 58.0 GiB peak each by
    ``--compile_only --cpu_devices=32``."""
    cfg = llama3_8b_fsdp_tp()
    cfg.train_input = _packed_input("train", fmt="prompt_completion", batch_size=32,
                                    seq_len=4096)
    cfg.evalers["heldout"].input = _packed_input("test", fmt=None, batch_size=32,
                                                 seq_len=4096, seed=1)
    for input_cfg in (cfg.train_input, cfg.evalers["heldout"].input):
        input_cfg.source.long_documents = "truncate"
    cfg.learner.optimizer.learning_rate.peak_value = 2e-5
    cfg.max_steps = 1000
    return cfg


@register_experiment
def llama3_8b_lora_sft():
    """llama3_8b_sft_fsdp_tp with LoRA: rank-16 adapters (alpha 32) on every attention and MLP
    projection of Llama 3.1 8B, the base frozen (no gradient, no reduction, no optimizer state);
    usually with --config.init_from=<the HF model>. Sized for 32 80 GB devices (data 4 x
    model 8) by ``--compile_only --cpu_devices=32`` (docs/performance.md)."""
    cfg = llama3_8b_sft_fsdp_tp()
    cfg.lora = LoRA.default_config().set(rank=16, alpha=32.0)
    cfg.learner.optimizer.learning_rate.peak_value = 2e-4
    return cfg


@register_experiment
def llama3_8b_dpo():
    """Llama 3.1 8B tuned with DPO (sigmoid, beta 0.1) on the user's preference pairs
    (--config.train_input.source.files, usually --config.init_from=<the HF model>): pairs of
    2048-token rows, 32 pairs a step, the reference a frozen copy of the starting weights split
    like the policy. FSDP over ``data`` x TP (8) over ``model``; sized for 32 80 GB devices by
    ``--compile_only --cpu_devices=32`` (docs/performance.md)."""
    cfg = llama3_8b_fsdp_tp()
    cfg.train_input = _preference_input("train", batch_size=32, seq_len=2048)
    cfg.evalers["heldout"].input = _preference_input("test", batch_size=32, seq_len=2048,
                                                     seed=1)
    cfg.model.max_seq_len = 2048
    cfg.objective = Preference.default_config()
    cfg.learner.optimizer.learning_rate.peak_value = 5e-7
    cfg.learner.optimizer.weight_decay = 0.0
    cfg.max_steps = 1000
    return cfg
