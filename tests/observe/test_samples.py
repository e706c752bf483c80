"""The sample log: which rollouts it shows, its console table, samples.jsonl across a new run and
a resumed one."""

import json
import os

from titanax.observe.samples import SampleLog


def _entries(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_the_first_rollout_and_each_holding_a_multiple_of_every_are_shown():
    log = SampleLog(trainer_dir=None, every=10, count=2)
    one_step = [s for s in range(1, 41) if log.due(first_step=s, steps=1)]
    assert one_step == [1, 10, 20, 30, 40]
    # Rollouts of 4 steps (updates_per_rollout x iterations) start at 1, 5, 9, ...
    four_steps = [s for s in range(1, 41, 4) if log.due(first_step=s, steps=4)]
    assert four_steps == [1, 9, 17, 29, 37]  # 9-12 holds 10, 17-20 20, 29-32 30, 37-40 40.
    assert not SampleLog(trainer_dir=None, every=0, count=2).due(first_step=1, steps=1)
    assert not SampleLog(trainer_dir=None, every=10, count=0).due(first_step=1, steps=1)
    assert not SampleLog(trainer_dir=None, every=10, count=2, writes=False).due(
        first_step=1, steps=1)


def test_the_table_and_the_file_hold_the_first_completions_with_their_rewards(tmp_path, capsys):
    log = SampleLog(trainer_dir=str(tmp_path), every=10, count=2)
    log.show(step=10, prompts=["2+3=", "4+4="], completions=["5", "." * 200, "ignored"],
             rewards=[1.0, 0.0, 1.0])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "samples at step 10 (2 of 3 completions):"
    assert out[1] == '  reward 1.0000  prompt "2+3="  completion "5"'
    assert out[2].startswith('  reward 0.0000  prompt "4+4="  completion "....')
    assert out[2].endswith('..."') and len(out[2]) < 120  # Cut on the console ...
    assert _entries(tmp_path / "samples.jsonl") == [  # ... whole in the file.
        {"step": 10, "prompt": "2+3=", "completion": "5", "reward": 1.0},
        {"step": 10, "prompt": "4+4=", "completion": "." * 200, "reward": 0.0}]
    unrewarded = SampleLog(trainer_dir=None, every=10, count=1)
    unrewarded.show(step=1, prompts=["a\nb"], completions=["c"])
    assert capsys.readouterr().out.splitlines()[1] == '  prompt "a\\nb"  completion "c"'


def test_a_resumed_run_drops_the_entries_it_samples_again_and_a_new_run_keeps_them_aside(
        tmp_path):
    first = SampleLog(trainer_dir=str(tmp_path), every=10, count=1)
    for step in (1, 10, 20, 30):
        first.show(step=step, prompts=["p"], completions=[f"c{step}"])
    resumed = SampleLog(trainer_dir=str(tmp_path), every=10, count=1)  # Resumed at step 19.
    resumed.show(step=20, prompts=["p"], completions=["again"])
    assert [(e["step"], e["completion"]) for e in _entries(tmp_path / "samples.jsonl")] == [
        (1, "c1"), (10, "c10"), (20, "again")]
    fresh = SampleLog(trainer_dir=str(tmp_path), every=10, count=1)
    fresh.show(step=1, prompts=["p"], completions=["new"])
    assert [e["completion"] for e in _entries(tmp_path / "samples.jsonl")] == ["new"]
    aside = [name for name in os.listdir(tmp_path) if name != "samples.jsonl"]
    assert len(aside) == 1 and aside[0].startswith("samples.") and aside[0].endswith(".jsonl")
    assert [e["completion"] for e in _entries(tmp_path / aside[0])] == ["c1", "c10", "again"]
