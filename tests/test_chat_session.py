"""``python -m titanax.generate --chat --interactive``: a multi-turn chat in one process, each turn
the answer transformers' greedy generate gives the same conversation (system prompt, earlier
turns as the template renders them), no special token printed; its flag mistakes refused by
name."""

import os

import pytest

from tests import forked_python
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = "Answer with the sum."
NEW_TOKENS = 12


def _generate(*args, stdin="", cwd=REPO_ROOT):
    return forked_python.run(["-m", "titanax.generate", *args], cwd=cwd,
                             env=child_environment(quick_backend=True), input=stdin, timeout=300)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    made = forked_python.run([os.path.join(REPO_ROOT, "examples", "tiny_chat_model.py"),
                              "--out=tiny_chat"], cwd=str(root), env=child_environment(),
                             timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    return str(root / "tiny_chat" / "model")


def _transformers_answer(model, messages):
    """transformers' greedy answer to ``messages`` (up to the end-of-turn token, its text without
    special tokens) and the smallest gap between its best and second-best logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = lm.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=end,
                          pad_token_id=end, output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack(out.scores).topk(2, dim=-1).values
    new = out.sequences[0, ids.shape[1]:].tolist()
    return (tokenizer.decode(new, skip_special_tokens=True),
            float((top2[..., 0] - top2[..., 1]).min()))


def test_each_turn_answers_the_whole_conversation_as_transformers(model):
    # (Messages whose answers stay clear of ties: transformers' logit gaps >= 2e-3.)
    turns = ["And 1 plus 1?", "What is 12 plus 30?", "/reset", "Hello"]
    result = _generate(f"--hf={model}", "--chat", "--interactive", f"--system={SYSTEM}",
                       f"--max_new_tokens={NEW_TOKENS}", "--cpu_devices=8",
                       stdin="\n".join(turns) + "\n")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    answers = [line[len("assistant: "):] for line in result.stdout.split("\n")
               if line.startswith("assistant: ")]  # (Not splitlines: answers hold \x0c.)
    assert len(answers) == 3 and "(a new conversation)" in result.stdout, result.stdout
    assert "<|im_end|>" not in result.stdout and "<|im_start|>" not in result.stdout
    system = [("system", SYSTEM)]
    conversations = [system + [("user", turns[0])],
                     system + [("user", turns[0]), ("assistant", answers[0]), ("user", turns[1])],
                     system + [("user", turns[3])]]  # (After /reset: the system prompt only.)
    for conversation, answer in zip(conversations, answers):
        expected, gap = _transformers_answer(model, conversation)
        assert gap > 1e-4, f"transformers came within {gap:.1e} of a tie: pick other messages"
        assert answer == expected, (conversation, answer, expected)


@pytest.mark.parametrize("args,flag", [
    (["--interactive"], "--interactive"),
    (["--prompt=hi", "--system=be brief"], "--system"),
    (["--chat", "--interactive", "--prompt_ids=1,2"], "--prompt_ids"),
])
def test_chat_flags_without_a_chat_are_refused_by_name(model, args, flag):
    result = _generate(f"--hf={model}", *args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"titanax.generate: error: {flag}" in result.stderr and "Traceback" not in \
        result.stderr, result.stderr
