"""docs/grpo.md, run as a newcomer would (tests/doc_walk.py): an HF directory, a prompt file and
a reward function by import path to a trained policy that answers a chat prompt."""

import csv
import os

from tests import doc_walk

PAGE = os.path.join(doc_walk.REPO_ROOT, "docs", "grpo.md")


def test_the_page_trains_a_policy_on_its_reward_and_samples_from_it(tmp_path):
    outputs = doc_walk.walk(PAGE, tmp_path)
    trained = doc_walk.output(outputs, "titanax.launch")[0]
    assert "data tokenized with the model's tokenizer" in trained
    with open(tmp_path / "runs" / "grpo" / "metrics.csv", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("reward")]
    assert len(rows) == 10
    assert all("rewards/correct/mean" in r for r in rows)
    assert all(0.0 < float(r["completions/mean_length"]) <= 16 for r in rows)
    sampled = doc_walk.output(outputs, "titanax.generate")[0]
    assert "ids:" in sampled
