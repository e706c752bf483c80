"""``titanax.generate --prompts_file``: every line of a JSONL file of prompts completed
``--num_samples`` times into ``--output``, as a user runs it (a child process): greedy ids equal
transformers' greedy generate per prompt (prompts of mixed lengths batched left-padded, a line
with its own ``max_new_tokens``, data x model = 4 x 2); samples seeded; the figures line; bad
files and flags refused by name before anything is generated."""

import json
import os

import numpy as np
import pytest

from titanax.train import saved_run
from tests.commands import run_module
from tests.hf import reference_models as ref
from tests.hf.test_generate import hf_greedy

NEW_TOKENS = 12
# (prompt length, its line's own max_new_tokens or None, seed of its ids)
PROMPTS = ((7, None, 3), (4, 5, 4), (9, None, 5))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return ref.saved_model("llama", tmp_path_factory.mktemp("hf_models"))


def _write_prompts(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def _prompt_lines():
    lines = []
    for length, own, seed in PROMPTS:
        line = {"prompt_ids": ref.token_ids(rows=1, length=length, seed=seed)[0].tolist()}
        lines.append(line if own is None else {**line, "max_new_tokens": own})
    return lines


def _generate(hf_dir, prompts, output, *extra, expect=0):
    result = run_module("titanax.generate", f"--hf={hf_dir}", f"--prompts_file={prompts}",
                        f"--max_new_tokens={NEW_TOKENS}", f"--output={output}",
                        "--cpu_devices=8", *extra, expect=expect)
    if expect:
        return result.stderr
    with open(output, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    return lines, json.loads(result.stdout.strip().splitlines()[-1])


def _cut(tokens, end_ids):
    for index, token in enumerate(tokens):
        if token in end_ids:
            return tokens[:index + 1]
    return tokens


def test_each_prompt_completes_as_transformers_greedy_generate(hf_dir, tmp_path):
    lines = _prompt_lines()
    prompts = _write_prompts(tmp_path / "prompts.jsonl", lines)
    got, figures = _generate(hf_dir, prompts, tmp_path / "out.jsonl", "--num_samples=2",
                             "--model_parallel=2")
    assert len(got) == len(lines)
    end_ids = saved_run.generation_end_ids(hf_dir)
    for line, out, (_, own, _) in zip(lines, got, PROMPTS):
        expected, gap = hf_greedy(hf_dir, np.asarray([line["prompt_ids"]]),
                                  new_tokens=own or NEW_TOKENS)
        assert gap > 1e-4, f"the reference came within {gap:.1e} of a tie: pick other prompts"
        want = _cut(expected[0].tolist(), end_ids)
        assert out["completions"] == [want, want], (line, out, want)
    assert figures["prompts"] == len(lines)
    assert figures["completion_tokens"] == sum(len(s) for out in got for s in out["completions"])
    assert figures["seconds"] > 0 and figures["compile_seconds"] > 0, figures


def test_samples_are_seeded_and_independent_across_a_prompts_rows(hf_dir, tmp_path):
    prompts = _write_prompts(tmp_path / "prompts.jsonl", _prompt_lines()[:1])
    runs = [_generate(hf_dir, prompts, tmp_path / f"out{seed}-{n}.jsonl", "--num_samples=4",
                      "--temperature=1.0", f"--seed={seed}")[0][0]["completions"]
            for n, seed in enumerate((1, 1, 2))]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len({tuple(sample) for sample in runs[0]}) > 1  # (Each row draws its own.)
    assert all(0 <= t < ref.VOCAB for sample in runs[0] for t in sample)


@pytest.mark.parametrize("line,said", [
    ("not json", "is not JSON"),
    ('{"prompt_ids": [1, 2], "prompt": "x"}', 'exactly one of "prompt" and "prompt_ids"'),
    ('{"prompt_ids": [1, 2], "max_new_tokens": 13}', "must be an integer in [1, 12]"),
    ('{"prompt_ids": [1, 2], "max_tokens": 3}', "does not read: ['max_tokens']"),
    (f'{{"prompt_ids": [1, {ref.VOCAB}]}}', f"ids must be in [0, {ref.VOCAB})"),
], ids=["not json", "two prompts", "too many new tokens", "unknown field", "id past the vocab"])
def test_a_bad_line_is_refused_naming_it_before_anything_is_generated(hf_dir, tmp_path, line,
                                                                       said):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [3, 4, 5]}\n\n' + line + "\n")
    stderr = _generate(hf_dir, str(prompts), tmp_path / "out.jsonl", expect=2)
    assert "--prompts_file line 3: " in stderr and said in stderr, stderr[-2000:]
    assert not {"out.jsonl", "out.jsonl.partial"} & set(os.listdir(tmp_path))


def test_bad_flags_and_an_empty_file_are_refused_by_name(hf_dir, tmp_path):
    """The flags before the model loads; a file of blank lines once it has."""
    prompts = _write_prompts(tmp_path / "prompts.jsonl", _prompt_lines()[:1])
    (tmp_path / "taken.jsonl").write_text("kept\n")
    for extra, output, path in (
            (["--num_samples=0"], tmp_path / "out.jsonl", "--num_samples"),
            ([], tmp_path / "taken.jsonl", "--output"),
            ([], tmp_path / "missing" / "out.jsonl", "--output"),
            (["--prompt_ids=1,2"], tmp_path / "out.jsonl", "--prompts_file"),
            (["--prompts_file=nowhere.jsonl"], tmp_path / "out.jsonl", "--prompts_file"),
            (["--temperature=-1"], tmp_path / "out.jsonl", "--temperature"),
            (["--top_p=1.5"], tmp_path / "out.jsonl", "--top_p"),
            (["--max_new_tokens=0"], tmp_path / "out.jsonl", "--max_new_tokens")):
        stderr = _generate(hf_dir, prompts, output, *extra, expect=2)
        assert f"{path}: " in stderr and "Traceback" not in stderr, stderr[-2000:]
    assert (tmp_path / "taken.jsonl").read_text() == "kept\n"  # Nothing written over.
    (tmp_path / "blank.jsonl").write_text("\n\n")
    stderr = _generate(hf_dir, str(tmp_path / "blank.jsonl"), tmp_path / "out.jsonl", expect=2)
    assert "holds no prompt" in stderr, stderr[-2000:]
    missing = run_module("titanax.generate", f"--hf={hf_dir}", "--num_samples=2",
                         "--prompt_ids=1,2", expect=2)
    assert "--num_samples: is a --prompts_file option" in missing.stderr, missing.stderr
