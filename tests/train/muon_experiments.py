"""Experiments used only by tests (``--config_module=tests.train.muon_experiments``): today's
families trained by Muon, the optimizer ``llama_tiny_muon`` sets (experiments/llama.py)."""

from titanax.config import register_experiment

from titanax_experiments.llama import llama3_1b_fsdp, llama_tiny_muon
from titanax_experiments.todays_models import gpt_oss_tiny


@register_experiment
def gpt_oss_tiny_muon():
    """gpt_oss_tiny (8 experts over an ``expert`` axis of 4) trained by llama_tiny_muon's
    Muon: every expert's matrices orthogonalised where its expert lives."""
    cfg = gpt_oss_tiny()
    cfg.learner.optimizer = llama_tiny_muon().learner.optimizer
    return cfg


@register_experiment
def llama3_1b_fsdp_muon():
    """llama3_1b_fsdp (Llama 3.2 1B, FSDP over every device) trained by llama_tiny_muon's Muon:
    its --compile_only shows what Muon's update costs per device at a real size."""
    cfg = llama3_1b_fsdp()
    cfg.learner.optimizer = llama_tiny_muon().learner.optimizer
    return cfg
