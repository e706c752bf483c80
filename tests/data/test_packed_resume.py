"""A packed JSONL run stopped at step 7 and resumed continues exactly like an uninterrupted one
(the same batches, bit for bit), in one process and in two."""

import csv
import json
import os

import pytest

from tests import forked_python
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("jsonl") / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(600):
            words = " ".join(f"w{(i * 7 + j) % 97}" for j in range(5 + i % 23))
            f.write(json.dumps({"text": f"Record {i}: {words}."}) + "\n")
    return str(path)


def _run(trainer_dir, corpus, steps, *extra):
    result = forked_python.run(
        ["-m", "titanax.launch", "--config=llama_tiny_packed",
         f"--trainer_dir={trainer_dir}", f"--config.train_input.source.files=['{corpus}']",
         "--config.evalers={}", f"--config.max_steps={steps}", "--config.log_every=1", *extra],
        cwd=REPO_ROOT, env=child_environment(quick_backend=True),
        timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _losses(trainer_dir):
    with open(os.path.join(trainer_dir, "metrics.csv"), encoding="utf-8") as f:
        return {int(row["step"]): row["loss"] for row in csv.DictReader(f) if row.get("loss")}


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    """The losses of the run that was never stopped (one process, 8 devices)."""
    straight = str(tmp_path_factory.mktemp("straight") / "run")
    _run(straight, corpus, 10, "--cpu_devices=8")
    return _losses(straight)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_resumed_packed_run_gives_the_uninterrupted_losses(corpus, uninterrupted, tmp_path,
                                                             processes):
    devices = ("--cpu_devices=8",) if processes == 1 else ("--local_processes=2",
                                                           "--cpu_devices=4")
    resumed = str(tmp_path / "resumed")
    _run(resumed, corpus, 7, *devices)
    _run(resumed, corpus, 10, *devices)
    want, got = uninterrupted, _losses(resumed)
    assert sorted(got) == list(range(1, 11)) == sorted(want)
    if processes == 1:  # The same program on the same devices: the same bits.
        assert got == want
    else:  # Two processes add in another order; the batches are still the same.
        assert all(abs(float(got[s]) - float(want[s])) <= 1e-5 * abs(float(want[s]))
                   for s in want), (got, want)
