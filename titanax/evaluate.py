"""``python -m titanax.evaluate``: lm-evaluation-harness tasks on a run's model or a Hugging Face
directory, on the devices at hand.

    python -m titanax.evaluate --hf=path/to/hf_dir --tasks=hellaswag,lambada_openai --output_path=results.json
    python -m titanax.evaluate --trainer_dir=runs/chat_sft --tasks=my_task --include_path=my_tasks/ --limit=100 --cpu_devices=8

The model runs on a data x model mesh (a run's own data x TP mesh, or for ``--hf`` data x
``--model_parallel``) through ``titanax.harness.lm.TitanaxLM``: multiple-choice log-likelihoods
and rolling perplexities from the sharded forward, generations from the KV-cache sampler.
lm-eval's table is printed and its results JSON (``results``, ``configs``, ``versions``,
``n-shot`` ...) written to ``--output_path``. Tasks are lm-eval's own or yours
(``--include_path``: a directory of task YAMLs; their data local files -- nothing needs the
network that the tasks themselves do not).
"""

from __future__ import annotations

import json
import math
import os
from typing import Sequence

from absl import flags

from titanax import command_line, errors
from titanax.runtime import cpu_devices

FLAGS = flags.FLAGS


def _define_flags() -> None:
    command_line.define_model_source_flags()
    flags.DEFINE_string("tasks", None, "Comma-separated lm-eval task (or group) names.")
    flags.DEFINE_string("include_path", None, "A directory of your own task YAMLs.")
    flags.DEFINE_integer("num_fewshot", None, "Few-shot examples per request (default: the "
                         "task's).")
    flags.DEFINE_float("limit", None, "Documents per task (a fraction below 1).")
    flags.DEFINE_integer("batch_size", 16, "Requests per compiled batch (a multiple of the "
                         "data-parallel size is used).")
    flags.DEFINE_integer("max_gen_toks", 256, "Tokens a generation may take when its task "
                         "does not say.")
    flags.DEFINE_string("output_path", None, "Where to write lm-eval's results JSON.")
    flags.DEFINE_bool("log_samples", False, "Keep every request's responses in the JSON "
                      "(its 'samples').")
    flags.DEFINE_integer("seed", None, "Seed of lm-eval's random choices (few-shot examples) "
                         "and of sampled generations (default: lm-eval's seeds, 0 for "
                         "sampling).")
    flags.DEFINE_bool("apply_chat_template", False, "Render each request through the model's "
                      "chat template (lm-eval's --apply_chat_template).")
    flags.DEFINE_bool("fewshot_as_multiturn", True, "With --apply_chat_template: few-shot "
                      "examples as earlier turns of the conversation (lm-eval's default "
                      "there; --nofewshot_as_multiturn: all in the first turn).")


def _check_flags() -> None:
    command_line.check_model_source_flags(FLAGS, command="evaluate")
    if not FLAGS.tasks or not [t for t in FLAGS.tasks.split(",") if t.strip()]:
        raise errors.LaunchFlagError("no task", path="--tasks",
                                     suggestion="e.g. --tasks=hellaswag,arc_easy")
    if FLAGS.include_path is not None and not os.path.isdir(FLAGS.include_path):
        raise errors.LaunchFlagError(f"{FLAGS.include_path} is not a directory",
                                     path="--include_path",
                                     suggestion="give the directory holding your task YAMLs")
    for name in ("batch_size", "max_gen_toks"):
        if getattr(FLAGS, name) < 1:
            raise errors.LaunchFlagError(f"must be >= 1, got {getattr(FLAGS, name)}",
                                         path=f"--{name}", suggestion="e.g. 8")
    if FLAGS.num_fewshot is not None and FLAGS.num_fewshot < 0:
        raise errors.LaunchFlagError(f"must be >= 0, got {FLAGS.num_fewshot}",
                                     path="--num_fewshot", suggestion="e.g. 0 or 5")
    if FLAGS.limit is not None and not (math.isfinite(FLAGS.limit) and FLAGS.limit > 0 and (
            FLAGS.limit < 1 or FLAGS.limit == int(FLAGS.limit))):
        raise errors.LaunchFlagError(f"must be a count >= 1 or a fraction in (0, 1), got "
                                     f"{FLAGS.limit}", path="--limit",
                                     suggestion="a number of documents, or a fraction < 1")
    command_line.check_seed_flag(FLAGS.seed)
    if FLAGS.output_path:  # (Before the evaluation: its results must have somewhere to go.)
        from titanax.utils.files import file_target_problem  # pylint: disable=import-outside-toplevel
        problem = file_target_problem(FLAGS.output_path)
        if problem:
            raise errors.LaunchFlagError(f"cannot write the results: {problem}",
                                         path="--output_path",
                                         suggestion="name a .json file in a directory you can "
                                                    "write (made if missing)")


# Where a task's problems are reported (titanax/harness/task_loading.py).
FLAG_PATHS = {"tasks": "--tasks", "include_path": "--include_path", "num_fewshot": "--num_fewshot"}


def evaluate(argv: Sequence[str]) -> int:
    del argv
    _check_flags()
    if FLAGS.cpu_devices is not None:
        cpu_devices.simulate_cpu_devices(FLAGS.cpu_devices)
    import lm_eval  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    from lm_eval.utils import handle_non_serializable, make_table  # pylint: disable=import-outside-toplevel
    from titanax.harness import task_index, task_loading  # pylint: disable=import-outside-toplevel
    from titanax.harness.lm import TitanaxLM, transformers_tokenizer  # pylint: disable=import-outside-toplevel
    from titanax.train import saved_run  # pylint: disable=import-outside-toplevel
    tasks = [t.strip() for t in FLAGS.tasks.split(",") if t.strip()]
    manager = task_index.task_manager(include_path=FLAGS.include_path, tasks=tasks)
    # (Before the model loads: the tasks named, loaded and able to give their few-shot examples.)
    task_loading.unknown_tasks(manager=manager, tasks=tasks, include_path=FLAGS.include_path,
                               paths=FLAG_PATHS)
    task_loading.check_loadable(manager=manager, tasks=tasks, num_fewshot=FLAGS.num_fewshot,
                                paths=FLAG_PATHS)
    engine, source, tokenizer_cfg = saved_run.inference_engine(
        hf=FLAGS.hf, trainer_dir=FLAGS.trainer_dir, model_parallel=FLAGS.model_parallel,
        dtype=FLAGS.dtype, step=FLAGS.step)
    if not hasattr(engine.model, "token_scores") or not hasattr(engine.model, "sample"):
        raise errors.LaunchFlagError(
            f"{type(engine.model).__name__} is no causal language model with a sampler",
            path="model", suggestion="evaluate a decoder (GPT-2, Llama, Qwen, Mistral, MoE)")
    tokenizer = transformers_tokenizer(tokenizer_cfg, source)
    if FLAGS.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise errors.LaunchFlagError(
            "the model's tokenizer has no chat template to render the requests with",
            path="--apply_chat_template",
            suggestion="drop it (plain requests), or evaluate a model whose tokenizer_config.json "
                       "or chat_template.jinja carries one")
    lm = TitanaxLM(engine=engine, tokenizer=tokenizer,
                   batch_size=FLAGS.batch_size, max_gen_toks=FLAGS.max_gen_toks,
                   end_ids=saved_run.generation_end_ids(source), seed=FLAGS.seed or 0)
    seeds = ({} if FLAGS.seed is None else
             {"random_seed": FLAGS.seed, "numpy_random_seed": FLAGS.seed,
              "torch_random_seed": FLAGS.seed, "fewshot_random_seed": FLAGS.seed})
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=FLAGS.num_fewshot,
        limit=int(FLAGS.limit) if FLAGS.limit and FLAGS.limit >= 1 else FLAGS.limit,
        task_manager=manager, log_samples=FLAGS.log_samples,
        **({"apply_chat_template": True, "fewshot_as_multiturn": FLAGS.fewshot_as_multiturn}
           if FLAGS.apply_chat_template else {}), **seeds)
    if results is None:
        raise errors.LaunchFlagError(
            "lm-eval returned no results on this process (it keeps them on its rank 0: "
            "LOCAL_RANK is set)", path="LOCAL_RANK",
            suggestion="run python -m titanax.evaluate without torch's distributed variables")
    if jax.process_index() == 0:
        print(make_table(results), flush=True)
        if FLAGS.output_path:
            directory = os.path.dirname(os.path.abspath(FLAGS.output_path))
            os.makedirs(directory, exist_ok=True)
            with open(FLAGS.output_path, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=1, default=handle_non_serializable)
            print(f"titanax: results written to {FLAGS.output_path}", flush=True)
    return 0


if __name__ == "__main__":
    command_line.run(evaluate, name="titanax.evaluate", define_flags=_define_flags)
