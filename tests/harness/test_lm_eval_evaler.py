"""The in-loop lm-eval evaler: a fine-tune of a tiny HF Llama logs ``lm_eval/<task>/<metric>``
at its configured steps (to metrics.csv), on the params of that step (the perplexity moves as
they train); and the run resumes with it. (That TitanaxLM's numbers are lm-eval's own:
test_lm_eval_parity.py.)"""

import csv
import json
import os
import subprocess
import sys

import pytest

from tests import forked_python
from tests.harness import local_tasks
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaler")
    subprocess.run([sys.executable, os.path.join(REPO_ROOT, "examples", "tiny_chat_model.py"),
                    "--out=tiny_chat"], cwd=str(root), env=child_environment(), check=True,
                   capture_output=True)
    local_tasks.write(str(root / "tasks"), docs=8)
    return root


def _engine(folder, steps):
    from titanax.config import registry  # pylint: disable=import-outside-toplevel
    from titanax.harness.evaler import LMEvalEvaler  # pylint: disable=import-outside-toplevel
    from titanax.hf import importer  # pylint: disable=import-outside-toplevel
    from titanax.observe.loggers import CSV  # pylint: disable=import-outside-toplevel
    from titanax.train.engine import Engine  # pylint: disable=import-outside-toplevel
    registry.load_config_modules(list(registry.DEFAULT_CONFIG_MODULES))
    cfg = registry.get_config("llama_tiny_sft")
    model_dir = str(folder / "tiny_chat" / "model")
    cfg.model = importer.model_config(model_dir)
    cfg.init_from = model_dir
    cfg.train_input.source.format = "chat"
    cfg.train_input.source.files = [str(folder / "tiny_chat" / "chat.jsonl")]
    cfg.train_input.tokenizer.path = model_dir
    cfg.evalers = {"lm_eval": LMEvalEvaler.default_config().set(
        tasks=list(local_tasks.TASKS), include_path=str(folder / "tasks"), every_n_steps=2,
        max_gen_toks=8)}
    cfg.checkpoint.path = str(folder / "run" / "checkpoints")
    cfg.checkpoint.save_every_n_steps = 2
    cfg.loggers = [CSV.default_config()]
    cfg.max_steps = steps
    return Engine(cfg, trainer_dir=str(folder / "run"))


def test_the_evaler_logs_lm_eval_metrics_at_its_steps_and_resumes(folder):
    first = _engine(folder, 4)
    first.fit()
    first.close()
    second = _engine(folder, 6)
    second.init_or_restore()
    assert second.restored_from.endswith("/4")
    # The restored step-4 params give the numbers the first run logged at step 4.
    again = second.evaluation.evalers["lm_eval"].evaluate_engine(second)
    second.fit()
    second.close()
    with open(folder / "run" / "metrics.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    logged = {int(r["step"]): r for r in rows if r.get("lm_eval/tiny_mc/acc")}
    assert sorted(logged) == [2, 4, 6]
    for row in logged.values():
        assert 0.0 <= float(row["lm_eval/tiny_mc/acc"]) <= 1.0
        assert float(row["lm_eval/tiny_ppl/byte_perplexity"]) > 1.0
        assert row["lm_eval/tiny_gen/exact_match"] != ""
    for name, value in again.items():
        assert float(logged[4][f"lm_eval/{name}"]) == pytest.approx(value, rel=1e-6), name
    # Training moves the params: the perplexity the evaler measures moves with them.
    perplexities = [float(logged[s]["lm_eval/tiny_ppl/byte_perplexity"]) for s in (2, 4, 6)]
    assert len(set(perplexities)) == 3, perplexities


# The lm-eval evaler from the command line alone (Engine.Config.new_entries): the chat template,
# one few-shot example, a step-0 baseline and every 2 steps. The loglikelihood task's perplexity
# moves with the prompt's every token: a template dropped or changed on the way shows there.
TEMPLATE_TASKS = (*local_tasks.TASKS, local_tasks.NEXT_TOKENS_TASK)
EVALER_FLAGS = ["--config.evalers={}",
                f"--config.evalers['lm_eval'].tasks={list(TEMPLATE_TASKS)}",
                "--config.evalers['lm_eval'].include_path=tasks",
                "--config.evalers['lm_eval'].every_n_steps=2",
                "--config.evalers['lm_eval'].max_gen_toks=8",
                "--config.evalers['lm_eval'].at_start=true",
                "--config.evalers['lm_eval'].apply_chat_template=true",
                "--config.evalers['lm_eval'].num_fewshot=1"]


def test_the_command_line_evaler_starts_at_evaluates_baseline_and_two_processes_give_one(folder):
    """``--config.evalers['lm_eval'].*`` on llama_tiny_sft: lm-eval's metrics at steps 0 and 2;
    at step 0 (the HF model's weights) those of ``titanax.evaluate`` with the same chat template
    and few-shot; in a job of 2 processes x 4 devices (each places its own rows and gathers the
    others') those of 1 process x 8 devices."""
    logged = {}
    for name, devices in (("one", ["--cpu_devices=8"]),
                          ("two", ["--local_processes=2", "--cpu_devices=4"])):
        result = forked_python.run(
            ["-m", "titanax.launch", "--config=llama_tiny_sft",
             f"--trainer_dir=runs/{name}", *devices, "--config.init_from=tiny_chat/model",
             "--config.train_input.source.format=chat",
             "--config.train_input.source.files=['tiny_chat/chat.jsonl']",
             "--config.max_steps=2", *EVALER_FLAGS], cwd=str(folder),
            env=child_environment(quick_backend=True), timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        with open(folder / "runs" / name / "metrics.csv", encoding="utf-8") as f:
            rows = [r for r in csv.DictReader(f) if r.get("lm_eval/tiny_mc/acc")]
        assert [int(r["step"]) for r in rows] == [0, 2]
        logged[name] = {int(r["step"]): {k: float(v) for k, v in r.items()
                                         if k.startswith("lm_eval/")} for r in rows}
    one, two = logged["one"], logged["two"]
    assert set(one[2]) == set(two[2]) and len(one[2]) >= 8
    assert f"lm_eval/{local_tasks.NEXT_TOKENS_TASK}/perplexity" in one[0]
    for step in (0, 2):
        for key, value in one[step].items():
            assert two[step][key] == pytest.approx(value, rel=1e-4), (step, key)
    assert one[0] != one[2]  # (Two steps of training moved the numbers.)
    out = folder / "baseline.json"
    evaluated = forked_python.run(
        ["-m", "titanax.evaluate", "--hf=tiny_chat/model",
         f"--tasks={','.join(TEMPLATE_TASKS)}", "--include_path=tasks", "--cpu_devices=8",
         "--apply_chat_template", "--num_fewshot=1", "--max_gen_toks=8",
         f"--output_path={out}"], cwd=str(folder), env=child_environment(quick_backend=True),
        timeout=600)
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    from titanax.harness.evaler import metrics_by_name  # pylint: disable=import-outside-toplevel
    with open(out, encoding="utf-8") as f:
        baseline = {f"lm_eval/{k}": v for k, v in metrics_by_name(json.load(f)).items()}
    assert set(baseline) == set(one[0])
    for key, value in baseline.items():
        assert one[0][key] == pytest.approx(value, rel=1e-4), key
