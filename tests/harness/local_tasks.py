"""Local lm-eval tasks of four kinds (multiple choice, rolling perplexity, generate-until
with exact match, next-token loglikelihood): task YAMLs and JSONL data written into a folder -- nothing downloaded."""

import json
import os
import random

TASKS = ("tiny_mc", "tiny_ppl", "tiny_gen")
# A loglikelihood task: its perplexity is a continuous function of the prompt the model sees, so
# a chat template applied or dropped shows in it (accuracies over a few documents may not move).
NEXT_TOKENS_TASK = "tiny_next"


def write(folder: str, *, docs: int = 24, seed: int = 0) -> str:
    """Writes the four tasks into ``folder``; returns it (an lm-eval --include_path)."""
    rng = random.Random(seed)
    os.makedirs(folder, exist_ok=True)
    mc, ppl, gen, nxt = [], [], [], []
    for index in range(docs):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        wrong = [a + b + d for d in rng.sample([-3, -1, 2, 5, 9], 3)]
        label = rng.randrange(4)
        choices = wrong[:label] + [a + b] + wrong[label:]
        # Every sixth question has a preamble longer than the model's 128 positions: its
        # context is cut from the left, as lm-eval's hf model cuts it.
        preamble = "Sums come first. " * (40 if index % 6 == 0 else 0)
        mc.append({"question": f"{preamble}What is {a} plus {b}?",
                   "choices": [str(c) for c in choices], "label": label})
        # Documents of 1 to 4 windows of 128 tokens.
        words = " ".join(f"{rng.randint(0, 99)} plus {rng.randint(0, 99)} is many."
                         for _ in range(4 + 9 * (index % 4)))
        ppl.append({"text": f"Sums, written out. {words}"})
        gen.append({"a": a, "b": b, "answer": f"{a} plus {b} is {a + b}"})
        nxt.append({"a": a, "b": b, "sum": a + b})
    for name, rows in (("mc", mc), ("ppl", ppl), ("gen", gen), ("next", nxt)):
        with open(os.path.join(folder, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    def data(name):
        path = os.path.join(folder, f"{name}.jsonl")
        return (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\n"
                "test_split: test\n")

    yamls = {
        "tiny_mc": data("mc") + (
            "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
            "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
            "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
        "tiny_ppl": data("ppl") + (
            "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
            "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
            "  - metric: bits_per_byte\n"),
        "tiny_gen": data("gen") + (
            "output_type: generate_until\ndoc_to_text: \"What is {{a}} plus {{b}}?\"\n"
            "doc_to_target: \"{{answer}}\"\n"
            "generation_kwargs:\n  until: [\".\", \"?\"]\n  max_gen_toks: 12\n"
            "  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n"),
        NEXT_TOKENS_TASK: data("next") + (
            "output_type: loglikelihood\ndoc_to_text: \"What is {{a}} plus {{b}}?\"\n"
            "doc_to_target: \" {{sum}}\"\n"
            "metric_list:\n  - metric: perplexity\n  - metric: acc\n"),
    }
    for task, body in yamls.items():
        with open(os.path.join(folder, f"{task}.yaml"), "w", encoding="utf-8") as f:
            f.write(f"task: {task}\n{body}")
    return folder
