"""``python -m titanax.evaluate`` against lm-eval's own ``hf`` model on the same tiny Llama
directory and local tasks of three kinds -- multiple choice (acc, acc_norm), rolling perplexity
(word / byte perplexity, bits per byte), generate-until (exact match) -- on 1 device and data 4 x
TP 2: accuracies and exact match equal, perplexities within 1e-4 relative, every
generation and every continuation's log-prob / greedy flag the same. And a fine-tuned run
evaluates from ``--trainer_dir`` as its export does."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests import forked_python
from tests.environment import child_environment
from tests.harness import local_tasks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = child_environment(PYTHONUNBUFFERED="1", quick_backend=True)


def _run(args, cwd, timeout=600):
    result = forked_python.run([*args], cwd=cwd, env=ENV, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _evaluate(folder, source, name, *extra):
    out = os.path.join(folder, f"{name}.json")
    _run(["-m", "titanax.evaluate", source, f"--tasks={','.join(local_tasks.TASKS)}",
          f"--include_path={folder}/tasks", f"--output_path={out}", "--log_samples", *extra],
         cwd=folder)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    _run([os.path.join(REPO_ROOT, "examples", "tiny_chat_model.py"), "--out=tiny_chat"],
         cwd=str(root))
    local_tasks.write(str(root / "tasks"))
    return str(root)


def _lm_eval_hf(folder, name, **options):
    """lm-eval's own hf model on the directory (float32, CPU)."""
    script = (
        "import json, lm_eval\nfrom lm_eval.tasks import TaskManager\n"
        "r = lm_eval.simple_evaluate(model='hf', model_args='pretrained=tiny_chat/model,"
        "dtype=float32', tasks=%r, task_manager=TaskManager(include_path='tasks', "
        "include_defaults=False), "
        "device='cpu', batch_size=8, log_samples=True, **%r)\n"
        "json.dump(r, open(%r, 'w'), default=str)\n" % (list(local_tasks.TASKS), options,
                                                         name))
    _run(["-c", script], cwd=folder)
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def lm_eval_hf(folder):
    return _lm_eval_hf(folder, "hf.json")


def _metrics(results, task):
    return {k: v for k, v in results["results"][task].items()
            if "," in k and not k.startswith(("alias", "sample")) and "stderr" not in k}


def assert_same_results(ours, want):
    for task in local_tasks.TASKS:
        got, expected = _metrics(ours, task), _metrics(want, task)
        assert set(got) == set(expected) and got, (task, got, expected)
        for key, value in expected.items():
            if "perplexity" in key or "bits_per_byte" in key:
                assert got[key] == pytest.approx(value, rel=1e-4), (task, key)
            else:
                assert got[key] == value, (task, key, got[key], value)
    generations = [s["resps"] for s in ours["samples"]["tiny_gen"]]
    assert generations == [s["resps"] for s in want["samples"]["tiny_gen"]]
    assert len({str(g) for g in generations}) >= 3, "generations this alike prove little"
    scores = [[r[0] for r in s["resps"]] for s in ours["samples"]["tiny_mc"]]
    expected = [[r[0] for r in s["resps"]] for s in want["samples"]["tiny_mc"]]
    np.testing.assert_allclose(np.array([[float(x[0]) for x in row] for row in scores]),
                               np.array([[float(x[0]) for x in row] for row in expected]),
                               rtol=1e-5, atol=1e-5)
    assert [[str(x[1]) for x in row] for row in scores] == \
        [[str(x[1]) for x in row] for row in expected]


# (Data 4 x TP 2 places rows over data shards and splits heads and the vocabulary: a data-only
# mesh proves nothing more.)
@pytest.mark.parametrize("layout", [["--cpu_devices=1"], ["--cpu_devices=8", "--model_parallel=2"]],
                         ids=["one-device", "dp4-tp2"])
def test_every_metric_equals_lm_evals_hf_model(folder, lm_eval_hf, layout):
    ours = _evaluate(folder, "--hf=tiny_chat/model", "-".join(layout).replace("-", "_"),
                     *layout)
    assert_same_results(ours, lm_eval_hf)


def test_chat_templated_requests_equal_lm_evals(folder):
    """--apply_chat_template (two few-shot examples as earlier turns): the model's ChatML
    template renders every request as lm-eval's hf model renders it."""
    want = _lm_eval_hf(folder, "hf_chat.json", apply_chat_template=True,
                       fewshot_as_multiturn=True, num_fewshot=2)
    ours = _evaluate(folder, "--hf=tiny_chat/model", "chat", "--cpu_devices=8",
                     "--apply_chat_template", "--num_fewshot=2")
    assert "<|im_start|>" in str(ours["samples"]["tiny_gen"][0]["arguments"])
    assert_same_results(ours, want)


def test_a_fine_tuned_run_evaluates_as_its_export(folder):
    _run(["-m", "titanax.launch", "--config=llama_tiny_sft", "--cpu_devices=8",
          "--trainer_dir=runs/sft", "--config.init_from=tiny_chat/model",
          "--config.train_input.source.format=chat",
          "--config.train_input.source.files=['tiny_chat/chat.jsonl']",
          "--config.max_steps=4", "--config.evalers={}"], cwd=folder)
    _run(["-m", "titanax.export", "--trainer_dir=runs/sft", "--to=exported",
          "--cpu_devices=8"], cwd=folder)
    from_run = _evaluate(folder, "--trainer_dir=runs/sft", "from_run", "--cpu_devices=8")
    from_export = _evaluate(folder, "--hf=exported", "from_export", "--cpu_devices=8")
    assert_same_results(from_run, from_export)


def _without_chat_template(folder):
    """``no_template``: the tiny model, its tokenizer without a chat template (a base model's)."""
    no_template = Path(folder) / "no_template"
    if not no_template.exists():
        shutil.copytree(Path(folder) / "tiny_chat" / "model", no_template)
        (no_template / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((no_template / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    return str(no_template)


@pytest.mark.parametrize("args,path", [
    (["--tasks=x"], "--trainer_dir/--hf"),
    (["--hf=tiny_chat/model"], "--tasks"),
    (["--hf=tiny_chat/model", "--tasks=x", "--include_path=nowhere"], "--include_path"),
    (["--hf=tiny_chat/model", "--tasks=x", "--step=3"], "--step"),
    (["--trainer_dir=runs/sft", "--tasks=x", "--model_parallel=2"], "--model_parallel"),
    (["--hf=tiny_chat/model", "--tasks=no_such_task", "--include_path=tasks",
      "--cpu_devices=1"], "--tasks"),
    # Tracebacks before (the results path at the end of the evaluation; lm-eval's template).
    (["--hf=tiny_chat/model", "--tasks=tiny_mc", "--include_path=tasks",
      "--output_path=a_file/out.json"], "--output_path"),
    (["--hf=tiny_chat/model", "--tasks=tiny_mc", "--include_path=tasks", "--cpu_devices=8",
      "--model_parallel=3"], "--model_parallel"),  # (Reported as a mesh shape before.)
    (["--hf=no_template", "--tasks=tiny_mc", "--include_path=tasks", "--cpu_devices=1",
      "--apply_chat_template"], "--apply_chat_template"),
    # A count that is no whole number (1.5 ran 1 document before; inf a traceback).
    (["--hf=tiny_chat/model", "--tasks=tiny_mc", "--include_path=tasks", "--limit=1.5"],
     "--limit"),
    (["--hf=tiny_chat/model", "--tasks=tiny_mc", "--include_path=tasks", "--limit=inf"],
     "--limit"),
])
def test_bad_flags_are_refused_by_name(folder, args, path):
    (Path(folder) / "a_file").write_text("not a directory")
    _without_chat_template(folder)
    result = forked_python.run(["-m", "titanax.evaluate", *args], cwd=folder,
                               env=ENV, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert path in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


def _broken_task_folders(folder):
    """``bad_yaml``: the local tasks with tiny_mc's YAML unparsable (lm-eval's index skipped it:
    "no task tiny_mc" before); ``no_data``: tiny_mc's data file gone (a FileNotFoundError from
    ``datasets`` after the model loaded, before)."""
    root = Path(folder)
    for name in ("bad_yaml", "no_data"):
        if not (root / name).exists():
            shutil.copytree(root / "tasks", root / name)
    (root / "bad_yaml" / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\n  data_files: [\noutput_type: multiple_choice\n")
    mc = (root / "no_data" / "tiny_mc.yaml").read_text()
    (root / "no_data" / "tiny_mc.yaml").write_text(
        mc.replace(str(root / "tasks" / "mc.jsonl"), str(root / "no_data" / "gone.jsonl")))


@pytest.mark.parametrize("args,path,said", [
    (["--include_path=bad_yaml", "--tasks=tiny_mc"], "--include_path",
     "bad_yaml/tiny_mc.yaml: mapping values are not allowed here (line 3)"),
    (["--include_path=no_data", "--tasks=tiny_ppl,tiny_mc"], "--tasks",
     "task tiny_mc does not load: FileNotFoundError"),
    # 24 documents, none of another split: 24-shot asks for every one (lm-eval's random.sample
    # raised ValueError deep in building the requests before).
    (["--include_path=tasks", "--tasks=tiny_gen", "--num_fewshot=25"], "--num_fewshot",
     "task tiny_gen holds 24 few-shot example(s); 25-shot needs 25"),
], ids=["task yaml that does not parse", "task data file missing", "more shots than documents"])
def test_tasks_that_cannot_run_are_refused_before_the_model_loads(folder, args, path, said):
    _broken_task_folders(folder)
    result = forked_python.run(["-m", "titanax.evaluate", "--hf=tiny_chat/model",
                                "--cpu_devices=1", *args], cwd=folder, env=ENV, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{path}: " in result.stderr and said in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "params from" not in result.stdout  # (No model.)


def test_chat_with_a_tokenizer_that_ships_no_template_is_refused_by_name(folder):
    """``generate --chat`` on a model whose tokenizer has no chat template: exit 2 at
    ``--chat`` (a "### <role>" format of Titanax's was rendered before, one
    transformers cannot render for this model)."""
    _without_chat_template(folder)
    result = forked_python.run(["-m", "titanax.generate", "--hf=no_template",
                                "--chat", "--prompt=Hi", "--cpu_devices=1"], cwd=folder, env=ENV,
                               timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--chat: " in result.stderr and "ships no chat template" in result.stderr and \
        "drop --chat" in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
