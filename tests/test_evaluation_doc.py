"""docs/evaluation.md, run as a newcomer would (tests/doc_walk.py): a local task, evaluated on an
HF directory and on a run; the results JSON has the task's metrics under lm-eval's keys; the
run's command-line lm-eval evaler scored the task at step 0 and after training, as evaluate
scores the run."""

import csv
import json
import os

from tests import doc_walk

PAGE = os.path.join(doc_walk.REPO_ROOT, "docs", "evaluation.md")


def test_the_page_evaluates_a_directory_and_a_run_on_a_local_task(tmp_path):
    outputs = doc_walk.walk(PAGE, tmp_path, quick_backend=True)
    for name in ("hf", "run"):
        with open(tmp_path / "results" / f"{name}.json", encoding="utf-8") as f:
            results = json.load(f)["results"]["sums"]
        assert 0.0 <= results["acc,none"] <= 1.0 and "acc_norm,none" in results
    assert "|sums" in doc_walk.output(outputs, "titanax.evaluate")[0]
    with open(tmp_path / "runs" / "sft" / "metrics.csv", encoding="utf-8") as f:
        logged = {int(r["step"]): float(r["lm_eval/sums/acc"]) for r in csv.DictReader(f)
                  if r.get("lm_eval/sums/acc")}
    assert sorted(logged) == [0, 10], logged
    assert logged[10] == results["acc,none"]  # (results: the run's, the same step-10 params.)
