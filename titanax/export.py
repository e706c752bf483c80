"""``python -m titanax.export --trainer_dir=<run> [--step=N] --to=<dir> [--format=merged|peft]``: a
run as a Hugging Face model directory, or a LoRA run's adapters as a PEFT adapter directory.

The run's model (GPT-2 or the Llama / Qwen / Mistral ``Decoder``) is rebuilt from its config
record, its params restored from the checkpoint at ``--step`` (default: the newest) onto the
devices at hand -- split over all of them (FSDP), so no device holds the whole model -- and
written tensor by tensor as ``config.json`` + safetensors that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. A run fine-tuned from an HF
directory (``init_from``) keeps that model's family, token ids and tokenizer files.

    python -m titanax.export --trainer_dir=runs/llama_tiny_dp_tp --to=exported/llama_tiny
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from absl import flags

from titanax import command_line, errors
from titanax.runtime import cpu_devices

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """The command's flags (defined only when it runs: modules imported together
    must not define the same names twice)."""
    flags.DEFINE_string("trainer_dir", None, "The run directory to export.")
    flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the newest).")
    flags.DEFINE_string("to", None, "The Hugging Face directory to write (new or empty).")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                      "dtype of the written weights (default: the run's param dtype).")
    flags.DEFINE_enum("model_type", None, ["llama", "mistral", "qwen2", "qwen3"],
                      "HF family of a Decoder (default: its source's, or the one its "
                      "options need).")
    flags.DEFINE_enum("format", "merged", ["merged", "peft"],
                      "merged: the whole model (a LoRA run's adapters folded into their "
                      "weights); peft: a LoRA run's adapters as a PEFT adapter directory "
                      "(adapter_config.json + adapter_model.safetensors).")
    flags.DEFINE_integer("cpu_devices", None, "Simulate this many CPU devices (tests, no "
                         "accelerator).")


def export(argv: Sequence[str]) -> int:
    del argv  # (Positional arguments are refused by command_line.main_of.)
    for name in ("trainer_dir", "to"):
        if not getattr(FLAGS, name):
            raise errors.LaunchFlagError("missing", path=f"--{name}",
                                         suggestion="e.g. --trainer_dir=runs/llama_tiny_dp_tp "
                                                    "--to=exported/llama_tiny")
    if FLAGS.step is not None and FLAGS.step < 0:
        raise errors.LaunchFlagError(f"must be >= 0, got {FLAGS.step}", path="--step",
                                     suggestion="give a saved step (ls <run>/checkpoints)")
    if FLAGS.cpu_devices is not None:
        if FLAGS.cpu_devices < 1:
            raise errors.LaunchFlagError(f"must be >= 1, got {FLAGS.cpu_devices}",
                                         path="--cpu_devices", suggestion="e.g. --cpu_devices=8")
        cpu_devices.simulate_cpu_devices(FLAGS.cpu_devices)
    from titanax.hf import exporter  # pylint: disable=import-outside-toplevel
    target = exporter.check_target(FLAGS.to)  # Refused before anything is read.
    from titanax.parallel.plan import DP, Plan, ZeRO  # pylint: disable=import-outside-toplevel
    from titanax.runtime.mesh import MeshSpec  # pylint: disable=import-outside-toplevel
    from titanax.train import saved_run  # pylint: disable=import-outside-toplevel
    plan = Plan.default_config().set(data_parallel=DP.default_config(),
                                     zero=ZeRO.default_config().set(stage=3))
    trainer_dir = os.path.abspath(FLAGS.trainer_dir)
    run = saved_run.read_run_config(trainer_dir)
    engine = saved_run.restored_engine(trainer_dir, step=FLAGS.step, plan=plan, run=run,
                                       mesh=MeshSpec.default_config().set(axes=("data",)))
    source = saved_run.source_dir(run)
    tokenizer_dir = _trained_tokenizer_dir(run, source)
    params = engine.canonical_params()
    from titanax.modules.lora import LoRA  # pylint: disable=import-outside-toplevel
    adapters = next((c for c in engine.converters if isinstance(c, LoRA)), None)
    if FLAGS.format == "peft":
        written = _export_adapters(engine, adapters, params, target=target, source=source)
        template = _configured_chat_template(run)
        import jax  # pylint: disable=import-outside-toplevel
        if template is not None and jax.process_index() == 0:
            # (The base's tokenizer lacks the template the run trained with: carried here, as
            # TRL saves a tokenizer beside its adapters.)
            exporter.write_tokenizer(written, tokenizer_dir=tokenizer_dir, chat_template=template)
        print(f"titanax: exported the LoRA adapters of {engine.restored_from} to {written}"
              + (" (with the tokenizer and the chat template the run trained with)"
                 if template is not None and tokenizer_dir else ""), flush=True)
        return 0
    if adapters is not None:
        from titanax.modules import lora  # pylint: disable=import-outside-toplevel
        params = lora.merged_params(params, engine.model_specs(), scale=adapters.scale)
    written = exporter.export_params(params, model_cfg=engine.model.config,
                                     directory=target, dtype=FLAGS.dtype,
                                     model_type=FLAGS.model_type, source_dir=source,
                                     tokenizer_dir=tokenizer_dir,
                                     chat_template=_configured_chat_template(run))
    print(f"titanax: exported {engine.restored_from} to {written}", flush=True)
    return 0


def _export_adapters(engine, adapters, params, *, target: str, source: Optional[str]) -> str:
    """``--format=peft``: the run's LoRA adapters as a PEFT directory, refused (by what is
    missing) for a run without adapters, a model no HF family computes, or a base that came
    from no HF directory."""
    if adapters is None:
        raise errors.LaunchFlagError(
            "the run trained every weight (lora: None): it has no adapters",
            path="--format", suggestion="export it with --format=merged")
    from titanax.hf import peft_export  # pylint: disable=import-outside-toplevel
    from titanax.hf.model_configs import hf_config_from_model  # pylint: disable=import-outside-toplevel
    hf_config_from_model(engine.model.config)  # (A model no HF family computes: named.)
    if source is None:
        raise errors.LaunchFlagError(
            "the run's base weights come from no Hugging Face directory (init_from was "
            "not set): a PEFT adapter would have no base model to load onto",
            path="--format", suggestion="export the run with --format=merged (base and "
                                        "adapters in one model)")
    return peft_export.export_peft(params, model_cfg=engine.model.config,
                                   specs=engine.model_specs(), lora_cfg=adapters.config,
                                   directory=target, base_model=source)


def _configured_chat_template(run) -> Optional[str]:
    """The chat template the run's config chose (``train_input.tokenizer.chat_template``, "plain"
    read as its template), or None: the tokenizer's own, carried with its files."""
    from titanax.data import chat  # pylint: disable=import-outside-toplevel
    tokenizer = getattr(getattr(run, "train_input", None), "tokenizer", None)
    return chat.named_template(getattr(tokenizer, "chat_template", None))


def _trained_tokenizer_dir(run, source: Optional[str]) -> Optional[str]:
    """The directory of the tokenizer the run's weights were trained with (its train input's),
    whose files the export carries: not the source's when the run read something else -- bytes
    beside a BPE model's tokenizer would be a model that cannot be prompted."""
    train_input = getattr(run, "train_input", None)
    path = getattr(getattr(train_input, "tokenizer", None), "path", None)
    if train_input is None or not hasattr(train_input, "tokenizer"):
        return source  # A run without a configured input: the source's, as before.
    if path is None:
        if source:
            print(f"titanax: warning: the run read bytes, not {source}'s tokenizer: the export "
                  "carries no tokenizer files (its ids are bytes 0-255)", flush=True)
        return None
    from titanax.data import bundled  # pylint: disable=import-outside-toplevel
    path = bundled.resolve(path)  # (A `bundled:` tokenizer: Titanax's own files.)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    if not os.path.isdir(directory):
        print(f"titanax: warning: the run's tokenizer {path} is gone: the export carries no "
              "tokenizer files", flush=True)
        return None
    return directory


if __name__ == "__main__":
    command_line.run(export, name="titanax.export", define_flags=_define_flags)
