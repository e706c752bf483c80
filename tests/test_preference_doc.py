"""docs/preference_tuning.md, run as a newcomer would (tests/doc_walk.py): the pairs go through
the model's chat template, the run tunes adapters against the base -- learning the preference
with the numbers the page states -- and the exported adapter loads in PEFT; KTO tunes the same
model on labelled answers, also to the numbers stated."""

import csv
import os

import pytest

from tests import doc_walk

PAGE = os.path.join(doc_walk.REPO_ROOT, "docs", "preference_tuning.md")


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    folder = tmp_path_factory.mktemp("newcomer")
    return folder, doc_walk.walk(PAGE, folder)


def test_the_page_tunes_adapters_on_preference_pairs_and_exports_them(walked):
    folder, outputs = walked
    trained = doc_walk.output(outputs, "titanax.launch")[0]
    assert "data tokenized with the model's tokenizer" in trained
    # What DPO is judged by is on the console, not only in metrics.csv.
    progress = [line for line in trained.splitlines() if " learning_rate " in line]
    assert progress and all("rewards/accuracies" in line and "rewards/margins" in line
                            for line in progress), trained[-2000:]
    with open(folder / "runs" / "dpo" / "metrics.csv", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("rewards/margins")]
    assert rows and all(0.0 < float(r["loss"]) < 5.0 for r in rows), rows
    # The numbers the page states: below log 2 at step 10, below 0.1 by step 50, the held-out
    # pairs ranked right at the end.
    by_step = {int(r["step"]): r for r in rows}
    assert float(by_step[10]["loss"]) < 0.6931, by_step[10]
    assert float(by_step[50]["loss"]) < 0.1 and float(by_step[50]["rewards/margins"]) > 2
    assert float(by_step[100]["loss"]) < 0.05 and float(by_step[100]["rewards/margins"]) > 3
    assert "final heldout: accuracy 1.0000" in trained, trained[-2000:]
    assert "lora.rank: 8" in (folder / "runs" / "dpo" / "config.txt").read_text()
    assert sorted(os.listdir(folder / "exported" / "dpo_adapter")) == [
        "adapter_config.json", "adapter_model.safetensors"]
    assert "loaded PeftModel" in "".join(doc_walk.output(outputs, "snippet_"))
    with open(folder / "runs" / "kto" / "metrics.csv", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    assert rows and all(name in rows[0] for name in ("kl", "rewards/chosen", "rewards/rejected"))
    by_step = {int(r["step"]): r for r in rows}  # (The page's numbers: from 0.5 down.)
    assert float(by_step[10]["loss"]) < 0.5 and float(by_step[50]["loss"]) < 0.15, by_step
    assert all(float(by_step[s]["loss"]) < 0.1 for s in range(60, 101, 10)), by_step
    assert float(by_step[100]["rewards/margins"]) > 6, by_step[100]
    assert float(by_step[100]["rewards/chosen"]) > 0 > float(by_step[100]["rewards/rejected"])
    assert "final heldout: accuracy 1.0000" in doc_walk.output(outputs, "titanax.launch")[1]
