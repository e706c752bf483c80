"""docs/agents.md, run as a newcomer would (tests/doc_walk.py): a Hugging Face chat model, prompt
records and the page's own environment (a class by import path, as the Interface names it) to a
trained policy that answers a chat prompt; its metrics.csv has each step's mean episode reward
and turns, and its samples show whole conversations."""

import csv
import json
import os
import re

from tests import doc_walk

PAGE = os.path.join(doc_walk.REPO_ROOT, "docs", "agents.md")


def test_the_page_trains_an_agent_on_its_environment_and_talks_to_it(tmp_path):
    outputs = doc_walk.walk(PAGE, tmp_path, quick_backend=True)
    trained = doc_walk.output(outputs, "titanax.launch")[0]
    assert re.search(r"step\s+10/10  reward \S+  turns/mean \S+  tool_calls/mean", trained)
    with open(tmp_path / "runs" / "agent" / "metrics.csv", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("reward")]
    assert len(rows) == 10
    for row in rows:
        assert 0 <= float(row["reward"]) <= 1 and 1 <= float(row["turns/mean"]) <= 3
        ended = sum(float(row[f"ended/{why}"]) for why in ("done", "max_turns", "tokens"))
        assert abs(ended - 1) < 1e-9, row
    # A wrong answer hears "No. Try again.": some episode took a second turn.
    assert max(float(r["turns/mean"]) for r in rows) > 1
    with open(tmp_path / "runs" / "agent" / "samples.jsonl", encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    assert samples and all("What is" in s["prompt"] for s in samples)
    assert any("No. Try again." in s["completion"] for s in samples)
    answer = doc_walk.output(outputs, "titanax.generate")[0]
    assert answer.strip()
