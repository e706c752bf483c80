"""``python -m titanax.generate``: text from a run's model or a Hugging Face directory.

    python -m titanax.generate --trainer_dir=runs/llama_tiny_dp_tp --prompt="ROMEO:" --max_new_tokens=64
    python -m titanax.generate --hf=path/to/hf_dir --prompt_ids=1,2,3 --max_new_tokens=32 --temperature=0.8 --top_p=0.9
    python -m titanax.generate --trainer_dir=runs/chat_sft --chat --prompt="What is 7 x 6?" --max_new_tokens=64
    python -m titanax.generate --trainer_dir=runs/chat_sft --chat --interactive --system="Be brief."
    python -m titanax.generate --hf=path/to/hf_dir --prompts_file=prompts.jsonl --num_samples=16 --max_new_tokens=128 --temperature=1.0 --output=completions.jsonl

The model runs with a key/value cache (the prompt once, then one token at a time) inside one
compiled program on a mesh of the devices at hand: a run's own mesh and tensor parallelism (its
pipe axis, if any, folded into data: checkpoints restore onto any mesh), or for ``--hf`` data x
``--model_parallel``. Greedy unless ``--temperature`` is given. Prints one line ``ids: ...`` with
the generated ids (the prompt excluded; up to and including an end-of-sequence id), then the text
when a tokenizer is known: the one the run trained with (its train input's), the HF directory's
``tokenizer.json`` / ``tokenizer.model``, or bytes for a model with a 256-id vocabulary.

``--prompt`` is read as transformers' ``tokenizer(text)`` reads it (special tokens as such, BOS
first where the tokenizer starts documents with one). ``--chat`` makes it a user message
rendered by the tokenizer's chat template with the generation prompt -- the ids of
``apply_chat_template(..., add_generation_prompt=True)`` -- and the answer stops at the
template's end-of-turn token (or an end-of-sequence id of the HF directory's
generation_config.json / config.json), whose text is printed without it. ``--system`` opens the
conversation with a system prompt; ``--interactive`` chats over several turns in this process,
one message per input line (``chat_session.py``).

``--prompts_file`` generates for every line of a JSONL file (``prompts_file.py``: a line's
``prompt_ids`` or ``prompt`` text, and its own ``max_new_tokens`` at most the flag's),
``--num_samples`` completions each, by the decode engine (``batch_generation.py``: one
prefill per prompt, its samples in continuously refilled slots over a paged cache), and writes
``--output``: one line per prompt, in order, ``{"completions": [[ids], ...], "texts":
[...]}`` (texts where a tokenizer is known; each completion ends after its end id, which the
text leaves out). The last line printed is one JSON object: ``prompts``,
``completion_tokens``, ``seconds`` (generation alone: its wall time less what jax spent
compiling inside it) and ``compile_seconds``.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

from absl import flags

from titanax import command_line, errors
from titanax.runtime import cpu_devices

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """The command's flags (defined only when it runs: modules imported together
    must not define the same names twice)."""
    command_line.define_model_source_flags(dtype_help="; bfloat16 halves the memory")
    flags.DEFINE_string("prompt", None, "The prompt as text (needs a tokenizer).")
    flags.DEFINE_string("prompt_ids", None, "The prompt as comma-separated token ids.")
    flags.DEFINE_bool("chat", False, "--prompt is a user message: rendered through the "
                      "tokenizer's chat template with the generation prompt (special tokens read "
                      "as such: the ids of transformers' apply_chat_template(..., "
                      "add_generation_prompt=True)); the answer stops at the template's "
                      "end-of-turn token.")
    flags.DEFINE_bool("interactive", False, "With --chat: a multi-turn chat in this process, "
                      "one user message per line of the input (--prompt, if given, the first); "
                      "/reset starts over, /exit or the end of the input quits.")
    flags.DEFINE_string("system", None, "With --chat: a system prompt opening the "
                        "conversation.")
    flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate.")
    flags.DEFINE_float("temperature", None, "Sampling temperature (default: greedy).")
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep the most likely tokens up to "
                      "this probability (with --temperature).")
    flags.DEFINE_integer("seed", 0, "Seed of the sampling.")
    flags.DEFINE_string("prompts_file", None, "A JSONL file of prompts, one {\"prompt_ids\": "
                        "[...]} or {\"prompt\": \"...\"} per line (optionally its own "
                        "\"max_new_tokens\", at most --max_new_tokens); needs --output.")
    flags.DEFINE_integer("num_samples", 1, "With --prompts_file: completions per prompt.")
    flags.DEFINE_string("output", None, "With --prompts_file: the JSONL file to write, one line "
                        "per prompt in order with its \"completions\" (and \"texts\").")


def _check_flags() -> None:
    command_line.check_model_source_flags(FLAGS, command="generate")
    for flag in ("interactive", "system"):
        if getattr(FLAGS, flag) not in (None, False) and not FLAGS.chat:
            raise errors.LaunchFlagError("is a chat option", path=f"--{flag}",
                                         suggestion="add --chat")
    if FLAGS.interactive and FLAGS.prompt_ids is not None:
        raise errors.LaunchFlagError("a chat reads text messages", path="--prompt_ids",
                                     suggestion="type the messages (or give the first as "
                                                "--prompt='...')")
    _check_sampling_flags()
    if FLAGS.prompts_file is not None:
        _check_file_flags()
        return
    for flag in ("output", "num_samples"):
        if getattr(FLAGS, flag) != FLAGS[flag].default:
            raise errors.LaunchFlagError("is a --prompts_file option", path=f"--{flag}",
                                         suggestion="add --prompts_file=P.jsonl")
    if not FLAGS.interactive and (FLAGS.prompt is None) == (FLAGS.prompt_ids is None):
        raise errors.LaunchFlagError("give exactly one prompt", path="--prompt/--prompt_ids",
                                     suggestion="--prompt='text' or --prompt_ids=1,2,3 (or "
                                                "--chat --interactive)")
    if FLAGS.chat and not FLAGS.interactive and FLAGS.prompt is None:
        raise errors.LaunchFlagError("--chat renders a text message", path="--chat",
                                     suggestion="give the user message as --prompt='...'")


def _check_sampling_flags() -> None:
    """What every prompt samples with -- a single one, a chat or a file's."""
    if FLAGS.max_new_tokens < 1:
        raise errors.LaunchFlagError(f"must be >= 1, got {FLAGS.max_new_tokens}",
                                     path="--max_new_tokens", suggestion="e.g. 32")
    if FLAGS.temperature is not None and not (math.isfinite(FLAGS.temperature)
                                              and FLAGS.temperature >= 0):
        raise errors.LaunchFlagError(f"must be a finite number >= 0, got {FLAGS.temperature}",
                                     path="--temperature", suggestion="0 or no flag: greedy")
    if not 0 < FLAGS.top_p <= 1:
        raise errors.LaunchFlagError(f"must be in (0, 1], got {FLAGS.top_p}", path="--top_p",
                                     suggestion="e.g. 0.9")
    command_line.check_seed_flag(FLAGS.seed)


def _check_file_flags() -> None:
    """``--prompts_file``: a file that exists and no other prompt, an output that is new
    (nothing written over) in a directory that exists, samples >= 1 -- before the model
    loads."""
    import os  # pylint: disable=import-outside-toplevel
    given = [f"--{f}" for f in ("prompt", "prompt_ids", "chat", "interactive", "system")
             if getattr(FLAGS, f) not in (None, False)]
    if given:
        raise errors.LaunchFlagError(f"reads its prompts from the file, not {given[0]}",
                                     path="--prompts_file", suggestion=f"drop {given[0]}")
    if not os.path.isfile(FLAGS.prompts_file):
        raise errors.LaunchFlagError(f"no such file: {FLAGS.prompts_file}",
                                     path="--prompts_file", suggestion="a JSONL file of prompts "
                                                                       "(docs/huggingface.md)")
    if FLAGS.num_samples < 1:
        raise errors.LaunchFlagError(f"must be >= 1, got {FLAGS.num_samples}",
                                     path="--num_samples", suggestion="e.g. 16 for GRPO-style "
                                                                      "groups")
    if not FLAGS.output:
        raise errors.LaunchFlagError("--prompts_file writes its completions to a file",
                                     path="--output", suggestion="--output=completions.jsonl")
    output = os.path.abspath(FLAGS.output)
    if os.path.exists(output):
        raise errors.LaunchFlagError(f"{FLAGS.output} exists: nothing is written over",
                                     path="--output", suggestion="remove it or name a new file")
    if not os.path.isdir(os.path.dirname(output)):
        raise errors.LaunchFlagError(f"no such directory: {os.path.dirname(output)}",
                                     path="--output", suggestion="create it first")


class _Tokens:
    """The model's tokenizer, when one is known; and the ids that end its answer."""

    def __init__(self, tokenizer_cfg: Optional[Any], source_dir: Optional[str], vocab_size: int):
        """``tokenizer_cfg``: the tokenizer the model was trained with (a run's record, or the
        HF directory's); None: bytes for a 256-id vocabulary, else none. ``source_dir``: the HF
        directory whose generation_config.json / config.json name end-of-sequence ids."""
        from titanax.data.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
        self.tokenizer = None
        if tokenizer_cfg is not None:
            self.tokenizer = tokenizer_cfg.instantiate()
        elif vocab_size == 256:
            self.tokenizer = Tokenizer.default_config().instantiate()  # Bytes.
        from titanax.train import saved_run  # pylint: disable=import-outside-toplevel
        self.end_ids: List[int] = saved_run.generation_end_ids(source_dir)
        eos = getattr(self.tokenizer, "eos_id", None)
        if eos is not None and eos not in self.end_ids:
            self.end_ids.append(eos)

    def _needed(self, flag: str):
        if self.tokenizer is None:
            raise errors.LaunchFlagError(
                "this model has no known tokenizer (no tokenizer.json or tokenizer.model, and "
                "its vocabulary is not bytes)", path=flag,
                suggestion="give the prompt as --prompt_ids=...")
        return self.tokenizer

    def encode(self, text: str, *, flag: str = "--prompt") -> List[int]:
        """A plain prompt, special tokens read as such, after BOS where the tokenizer has one
        (as transformers' ``tokenizer(text)`` and packed documents); ``flag``: where it came
        from (what a missing tokenizer's refusal names)."""
        return self._needed(flag).encode_prompt(text)

    def encode_chat(self, messages: Sequence[Tuple[str, str]]) -> List[int]:
        """``messages`` ((role, content), ...) through the chat template, with the generation
        prompt; the template's end-of-turn token ends the answer."""
        from titanax.data import chat  # pylint: disable=import-outside-toplevel
        tokenizer = self._needed("--chat")
        try:
            ids = tokenizer.encode_chat_prompt(list(messages))
        except chat.TemplateError as e:
            raise errors.LaunchFlagError(str(e), path="--chat",
                                         suggestion="check the tokenizer's chat template") from e
        except errors.MissingChatTemplateError as e:
            raise errors.LaunchFlagError(
                e.message, path="--chat",
                suggestion="drop --chat to prompt with plain text, or use a model whose "
                           "tokenizer carries its chat template (a run that trained on "
                           "conversations names the one it used)") from None
        self.end_ids += [i for i in tokenizer.chat_end_ids() if i not in self.end_ids]
        return ids

    def decode(self, ids: Sequence[int]) -> Optional[str]:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(ids))


def _engine():
    """The model on this process's devices (--hf or --trainer_dir), its HF source dir and its
    tokenizer's config (``saved_run.inference_engine``)."""
    from titanax.train import saved_run  # pylint: disable=import-outside-toplevel
    return saved_run.inference_engine(hf=FLAGS.hf, trainer_dir=FLAGS.trainer_dir,
                                      model_parallel=FLAGS.model_parallel, dtype=FLAGS.dtype,
                                      step=FLAGS.step)


def generate(argv: Sequence[str]) -> int:
    del argv  # (Positional arguments are refused by command_line.main_of.)
    _check_flags()
    if FLAGS.cpu_devices is not None:
        cpu_devices.simulate_cpu_devices(FLAGS.cpu_devices)
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    engine, source, tokenizer_cfg = _engine()
    cfg = engine.model.config
    if not hasattr(engine.model, "generate"):
        raise errors.LaunchFlagError(
            f"{type(engine.model).__name__} has no key/value-cache decoding", path="model",
            suggestion="generation runs the Llama / Qwen / Mistral Decoder family")
    tokens = _Tokens(tokenizer_cfg, source, cfg.vocab_size)
    if FLAGS.prompts_file is not None:
        return _generate_file(engine, tokens)
    system = [("system", FLAGS.system)] if FLAGS.system else []
    if FLAGS.interactive:
        return _interactive(engine, tokens, system)
    if FLAGS.prompt_ids is not None:
        try:
            prompt = [int(t) for t in FLAGS.prompt_ids.split(",") if t.strip()]
        except ValueError as e:
            raise errors.LaunchFlagError(f"not comma-separated integers: {FLAGS.prompt_ids!r}",
                                         path="--prompt_ids", suggestion="e.g. 1,2,3") from e
    elif FLAGS.chat:
        prompt = tokens.encode_chat(system + [("user", FLAGS.prompt)])
    else:
        prompt = tokens.encode(FLAGS.prompt)
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if not prompt or bad:
        raise errors.LaunchFlagError(
            f"ids must be in [0, {cfg.vocab_size}) (model.vocab_size)" + (f"; got {bad[:5]}"
                                                                          if bad else "; empty"),
            path="--prompt_ids" if FLAGS.prompt_ids is not None else "--prompt",
            suggestion="give ids of this model's vocabulary")
    if len(prompt) + FLAGS.max_new_tokens > cfg.max_seq_len:
        raise errors.LaunchFlagError(
            f"prompt ({len(prompt)}) + --max_new_tokens ({FLAGS.max_new_tokens}) exceeds the "
            f"model's max_seq_len {cfg.max_seq_len}", path="--max_new_tokens",
            suggestion="generate fewer tokens or shorten the prompt")
    rows = engine.plan.batch_shards(engine.mesh)  # One copy of the prompt per batch shard.
    fn = engine.steps.generation(max_new_tokens=FLAGS.max_new_tokens,
                                 temperature=FLAGS.temperature or None, top_p=FLAGS.top_p)
    ids = fn(engine.state.params, np.asarray([prompt] * rows, np.int32),
             jax.random.PRNGKey(FLAGS.seed))
    from titanax import batch_generation  # pylint: disable=import-outside-toplevel
    out = batch_generation.through_first_end(
        [int(t) for t in np.asarray(jax.device_get(ids))[0]], tokens.end_ids)
    print("ids: " + " ".join(str(t) for t in out), flush=True)
    # A chat answer's text leaves out the end-of-turn token that closed it (its id is above).
    shown = out[:-1] if FLAGS.chat and out and out[-1] in tokens.end_ids else out
    text = tokens.decode(shown)
    if text is not None:
        print(f"text: {text}", flush=True)
    return 0


def _generate_file(engine: Any, tokens: _Tokens) -> int:
    """``--prompts_file``: every line checked first, then generated (batch_generation.py);
    the output written whole (a temporary file renamed: never half a file), then one JSON
    line of figures."""
    import json  # pylint: disable=import-outside-toplevel
    import os  # pylint: disable=import-outside-toplevel
    from titanax import batch_generation, prompts_file  # pylint: disable=import-outside-toplevel
    cfg = engine.model.config
    requests = prompts_file.read_prompts(
        FLAGS.prompts_file, encode=lambda text: tokens.encode(text, flag="--prompts_file"),
        vocab_size=cfg.vocab_size,
        max_new_tokens=FLAGS.max_new_tokens, max_seq_len=cfg.max_seq_len)
    done = batch_generation.generate_all(
        engine, requests, num_samples=FLAGS.num_samples, sampling=batch_generation.Sampling(
            temperature=FLAGS.temperature or None, top_p=FLAGS.top_p, seed=FLAGS.seed,
            end_ids=tokens.end_ids))
    partial = f"{FLAGS.output}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        for samples in done.completions:
            line = {"completions": samples}
            if tokens.tokenizer is not None:  # (The text without the end id that closed it.)
                line["texts"] = [tokens.decode(s[:-1] if s and s[-1] in tokens.end_ids else s)
                                 for s in samples]
            f.write(json.dumps(line) + "\n")
    os.replace(partial, FLAGS.output)
    print(json.dumps({"prompts": len(requests),
                      "completion_tokens": sum(len(s) for c in done.completions for s in c),
                      "seconds": round(done.seconds, 6),
                      "compile_seconds": round(done.compile_seconds, 6)}), flush=True)
    return 0


def _interactive(engine: Any, tokens: _Tokens, system: List[Tuple[str, str]]) -> int:
    """``--chat --interactive``: titanax/chat_session.py on stdin."""
    import sys  # pylint: disable=import-outside-toplevel
    from titanax import chat_session  # pylint: disable=import-outside-toplevel
    tokens.encode_chat(system + [("user", "")])  # (The template checked; its end ids known.)
    session = chat_session.ChatSession(
        engine=engine, tokenizer=tokens.tokenizer, end_ids=tokens.end_ids,
        system=FLAGS.system, max_new_tokens=FLAGS.max_new_tokens,
        temperature=FLAGS.temperature or None, top_p=FLAGS.top_p, seed=FLAGS.seed)
    if session.window < 1:
        raise errors.LaunchFlagError(
            f"leaves no room for the conversation in the model's max_seq_len "
            f"{engine.model.config.max_seq_len}", path="--max_new_tokens",
            suggestion="generate fewer tokens per answer")
    return chat_session.run(session, lines=sys.stdin,
                            write=lambda line: print(line, flush=True), first=FLAGS.prompt)


if __name__ == "__main__":
    command_line.run(generate, name="titanax.generate", define_flags=_define_flags)
