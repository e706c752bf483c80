"""Objectives that sample: reinforcement learning from verifiable rewards (GRPO and its
variants: titanax/rl/) and on-policy distillation.

* ``llama_tiny_grpo``: a 2-layer Llama-style model learns one-digit sums ("3+4=" -> "7", every
  a + b <= 9: 55 prompts bundled with Titanax, a 16-token tokenizer of digits, "+", "=" and
  start / end tokens) from scratch, by GRPO alone: 8 completions of each prompt sampled on the
  training mesh (two tokens: the answer, then the end token), rewarded 1 for the right number
  (the built-in ``AnswerMatch``: the completion's last number), 0 otherwise. 32 prompts a step.
  From ~0.06 at the start (a random model) to 0.85 over its last 20 steps (the mean of 8
  seeds; 0.62 to 0.95), in about a minute on 2 CPU cores (data 4 x model 2 of 8 simulated
  devices).
* ``qwen3_0_6b_grpo``: Qwen 3 0.6B with GRPO on the user's grade-school arithmetic prompts
  (``--config.train_input.source.files``, GSM8K-style ``{"prompt": ..., "answer": ...}``;
  usually ``--config.init_from=<the HF model>``): 16 prompts x 8 completions of 512 tokens a
  step, the KL to the starting weights (beta 0.04, a frozen copy). Sized for 8 80 GB devices
  (FSDP over 8) by ``--compile_only --cpu_devices=8``: 20.3 GiB peak each in the train step,
  6.1 GiB while sampling (the train state plus the decode engine's paged key/value pool;
  docs/grpo.md).
* ``llama_tiny_distill``: on-policy distillation of a student toward a teacher (both HF
  directories: ``--config.init_from``, ``--config.objective.teacher_from``) on the same prompts.
"""

from typing import Any

from titanax.config import config_for_function, register_experiment
from titanax.data.pipeline import Input
from titanax.data.prompts import Prompts
from titanax.decoding.rollout_sampler import PagedDecoding
from titanax.io.checkpointer import OrbaxCheckpoint
from titanax.modules.models.decoder import Decoder, qwen3_config
from titanax.objectives.distillation import Distillation
from titanax.objectives.grpo import GRPO
from titanax.observe.loggers import CSV, Basic, TensorBoard
from titanax.parallel.plan import DP, TP, Plan, ZeRO
from titanax.rl.rewards import AnswerMatch
from titanax.runtime.mesh import MeshSpec
from titanax.train import optimizers
from titanax.train.engine import Engine
from titanax.train.learner import Learner



def grpo_run(*, model, prompts: Input.Config, grpo: Any, steps: int, peak_lr: float,
             mesh: MeshSpec.Config, plan: Plan.Config) -> Engine.Config:
    """What every sampling experiment (GRPO, distillation: ``grpo`` its objective) shares: AdamW at a constant rate after a short warmup, no
    weight decay, clipping at 1, every step logged (the reward is the point), checkpoints."""
    return Engine.default_config().set(
        mesh=mesh, plan=plan, model=model, train_input=prompts, objective=grpo,
        learner=Learner.default_config().set(
            optimizer=config_for_function(optimizers.adamw).set(
                learning_rate=config_for_function(optimizers.warmup_cosine).set(
                    peak_value=peak_lr, warmup_steps=max(1, steps // 20),
                    end_value=peak_lr),
                b2=0.99, weight_decay=0.0),
            max_grad_norm=1.0),
        evalers={},
        loggers=[Basic.default_config(), CSV.default_config(), TensorBoard.default_config()],
        checkpoint=OrbaxCheckpoint.default_config().set(save_every_n_steps=50),
        max_steps=steps, log_every=1)


def _sums_model_and_prompts():
    """The bundled sums' tiny Llama (a 16-token vocabulary) and its 55 prompts, 32 a step."""
    model = Decoder.default_config().set(
        name="llama", vocab_size=16, max_seq_len=16, num_layers=2, model_dim=64, num_heads=4,
        num_kv_heads=2, hidden_dim=176, norm_eps=1e-5, rope_theta=10000.0)
    prompts = Input.default_config().set(
        source=Prompts.default_config().set(files=["bundled:sums/prompts.jsonl"],
                                            max_prompt_tokens=5),
        global_batch_size=32)
    prompts.tokenizer.path = "bundled:sums"
    return model, prompts


def _data_x_model():
    """Data x TP (model 2): fresh configs for each experiment."""
    return dict(mesh=MeshSpec.default_config().set(axes=("data", "model"), shape=(None, 2)),
                plan=Plan.default_config().set(data_parallel=DP.default_config(),
                                               tensor_parallel=TP.default_config()))


@register_experiment
def llama_tiny_grpo():
    """A tiny Llama learns one-digit sums by GRPO from scratch (see the module docstring):
    the mean reward goes from ~0.05 to 0.85 (8 seeds' mean; docs/grpo.md)."""
    model, prompts = _sums_model_and_prompts()
    grpo = GRPO.default_config().set(
        num_generations=8, max_new_tokens=2,
        rewards={"answer": AnswerMatch.default_config()})
    return grpo_run(model=model, prompts=prompts, grpo=grpo, steps=500, peak_lr=1.5e-3,
                    **_data_x_model())


@register_experiment
def qwen3_0_6b_grpo():
    """Qwen 3 0.6B with GRPO on the user's arithmetic prompts (see the module docstring), its
    rollouts on the decode engine; 8 80 GB devices, 20.3 GiB peak each by ``--compile_only
    --cpu_devices=8``."""
    model = qwen3_config("0.6b", layer_remat_policy="dots_with_no_batch_dims_saveable")
    prompts = Input.default_config().set(
        source=Prompts.default_config().set(chat=True, max_prompt_tokens=256),
        global_batch_size=16)
    # Rollouts on the decode engine (each prompt prefilled once for its 8 samples, a finished
    # sample's slot and blocks refilled): at 256-token prompts and answers of up to 512 tokens
    # that end apart, the static sampler would prefill each prompt 8 times and decode every row
    # to the longest.
    grpo = GRPO.default_config().set(
        num_generations=8, max_new_tokens=512, beta=0.04, temperature=1.0,
        rewards={"answer": AnswerMatch.default_config()},
        decoding=PagedDecoding.default_config())
    plan = Plan.default_config().set(data_parallel=DP.default_config(),
                                     zero=ZeRO.default_config().set(stage=3))
    return grpo_run(model=model, prompts=prompts, grpo=grpo, steps=500, peak_lr=1e-6,
                    mesh=MeshSpec.default_config().set(axes=("data",)), plan=plan)


@register_experiment
def llama_tiny_distill():
    """On-policy distillation (objectives/distillation.py): a student -- usually
    --config.init_from=<HF dir>, whose tokenizer reads the prompts -- samples one completion per
    prompt and learns the teacher's next-token distributions at every sampled position
    (per-token reverse KL over the whole vocabulary), the teacher
    --config.objective.teacher_from=<HF dir> frozen beside it. Prompts as llama_tiny_grpo reads
    them (--config.train_input.source.files); metrics.csv has loss and reverse_kl."""
    model, prompts = _sums_model_and_prompts()
    distill = Distillation.default_config().set(max_new_tokens=8)
    return grpo_run(model=model, prompts=prompts, grpo=distill, steps=200, peak_lr=1e-3,
                    **_data_x_model())

