"""docs/fine_tune.md, run as a newcomer would: its commands in order, in a fresh folder.

Every ``bash`` block is run line by line (``python`` is this interpreter; ``examples/`` the
repository's), every ``python`` block as a script. Then what the page promises is checked on
what the commands printed and wrote: the model's tokenizer came with ``init_from`` (for training
and for the evaluation), the run trained, and ``generate --chat`` -- from the run and from its
export -- gives transformers' greedy answer to ``apply_chat_template`` token for token.
"""

import os
import re

import numpy as np
import pytest

from tests import doc_walk

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO_ROOT, "docs", "fine_tune.md")


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    """``(folder, [(command, stdout)])`` after running the whole page."""
    folder = tmp_path_factory.mktemp("newcomer")
    return folder, doc_walk.walk(PAGE, folder)


_output = doc_walk.output


def test_the_models_tokenizer_reads_the_training_and_evaluation_data(walked):
    folder, outputs = walked
    trained = _output(outputs, "titanax.launch")[0]
    model = os.path.join(folder, "tiny_chat", "model")
    assert f"data tokenized with the model's tokenizer {model}/tokenizer.json" in trained
    record = (folder / "runs" / "chat_sft" / "config.txt").read_text()
    assert f"train_input.tokenizer.path: '{model}'" in record
    assert f"evalers['heldout'].input.tokenizer.path: '{model}'" in record
    assert "evalers['heldout'].input.source.format: 'chat'" in record
    losses = [float(m) for m in re.findall(r"^step\s+\d+/\d+\s+loss (\S+)", trained, re.M)]
    held_out = [float(m) for m in re.findall(r"heldout/loss (\S+)", trained)]
    # The page's numbers: loss about 5.5 at step 10, below 0.5 at 200; held-out about 3.0 at
    # step 50, below 1.0 at the end.
    assert len(losses) == 20 and losses[0] > 5.0 and losses[-1] < 0.5, losses
    assert len(held_out) >= 4 and held_out[0] > 2.5 and held_out[-1] < 1.0, held_out


def test_chat_generation_equals_transformers_greedy_on_apply_chat_template(walked):
    folder, outputs = walked
    found = [re.search(r"^ids: (.*)$", out, re.M)
             for out in _output(outputs, "titanax.generate") + _output(outputs, "snippet_")]
    answers = [m.group(1).split() for m in found if m]  # (The PEFT snippet prints no ids.)
    from_run, from_export, transformers_ids = answers
    assert from_run == from_export == transformers_ids, answers
    assert len(from_run) >= 2
    # Token equality means something only away from ties: transformers' own margins.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    exported = str(folder / "exported" / "chat_sft")
    tokenizer = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 plus 30?"}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=20, output_scores=True,
                             return_dict_in_generate=True)
    top2 = torch.stack(out.scores).topk(2, dim=-1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-4, "a near tie: pick another prompt"
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert int(from_run[-1]) == end, "the answer stops at the template's end-of-turn token"
    np.testing.assert_array_equal(
        np.asarray(from_run, np.int64), out.sequences[0, ids.shape[1]:].numpy()[:len(from_run)])


def test_the_lora_run_trains_adapters_only_and_exports_them_for_peft(walked):
    folder, outputs = walked
    record = (folder / "runs" / "chat_lora" / "config.txt").read_text()
    assert "lora.rank: 8" in record
    adapter = folder / "exported" / "chat_lora"
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert _output(outputs, "snippet_")  # The page's PEFT snippet loaded it (exit 0).
