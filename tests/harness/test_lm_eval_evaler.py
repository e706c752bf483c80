"""The in-loop lm-eval evaler: a fine-tune of a tiny HF Llama logs ``lm_eval/<task>/<metric>``
at its configured steps (to metrics.csv), on the params of that step (the perplexity moves as
they train); and the run resumes with it. (That TitanaxLM's numbers are lm-eval's own:
test_lm_eval_parity.py.)"""

import csv
import os
import subprocess
import sys

import pytest

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


def test_two_processes_evaluate_as_one(folder):
    """The evaler in a job of 2 processes x 4 devices (each places its own rows and gathers the
    others'): the metrics of 1 process x 8 devices."""
    logged = {}
    for name, devices in (("one", ["--cpu_devices=8"]),
                          ("two", ["--local_processes=2", "--cpu_devices=4"])):
        result = subprocess.run(
            [sys.executable, "-m", "titanax.run", "--module=tests.harness.evaler_main:main",
             "--config=llama_tiny_sft", f"--trainer_dir=runs/{name}", *devices,
             "--config.init_from=tiny_chat/model", "--config.train_input.source.format=chat",
             "--config.train_input.source.files=['tiny_chat/chat.jsonl']",
             "--config.max_steps=2"], cwd=str(folder), env=child_environment(),
            capture_output=True, text=True, timeout=600, check=False)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        with open(folder / "runs" / name / "metrics.csv", encoding="utf-8") as f:
            rows = [r for r in csv.DictReader(f) if r.get("lm_eval/tiny_mc/acc")]
        assert [int(r["step"]) for r in rows] == [2]
        logged[name] = {k: float(v) for k, v in rows[0].items() if k.startswith("lm_eval/")}
    assert set(logged["one"]) == set(logged["two"]) and len(logged["one"]) >= 6
    for key, value in logged["one"].items():
        assert logged["two"][key] == pytest.approx(value, rel=1e-4), key
