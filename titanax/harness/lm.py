"""An lm-evaluation-harness ``LM`` over a Titanax model on its mesh.

lm-eval asks three things of a model; each runs here as one compiled program over the run's
mesh (rows over the data axis, heads and the vocabulary over TP), in batches of requests sorted
by length and padded to a few bucket lengths (so a benchmark compiles a handful of programs):

- ``loglikelihood`` (multiple choice): a context's continuation's summed log-prob and whether
  greedy decoding would produce it -- from ``token_scores`` (the head in chunks, the
  vocabulary's max and the target's logit reduced over TP: no full logits);
- ``loglikelihood_rolling`` (perplexity): a document's log-prob in lm-eval's own rolling
  windows of the model's length;
- ``generate_until``: greedy (or sampled) continuations by the decode engine (titanax/decoding:
  a batch's requests over a paged cache, each ending at its own end token; in one process --
  with several, the static KV-cache sampler over left-padded prompts), cut at the request's
  stop strings.

Tokenization is transformers' tokenizer of the model's directory (or of the run's tokenizer
file), called as lm-eval's ``hf`` model calls it -- context / continuation split, BOS handling,
left truncation -- so the requests are the same token ids and the numbers can be compared with
lm-eval's ``hf`` model on the same directory (``tests/harness/test_lm_eval_parity.py``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models import utils as model_utils

from titanax import errors
from titanax.decoding.engine import DecodeEngine, Request
from titanax.parallel import batch_shards
from titanax.utils.length_buckets import padded_length


class TitanaxLM(TemplateLM):
    """lm-eval's model interface over an Engine's model (see the module docstring)."""

    def __init__(self, *, engine: Any, tokenizer: Any, batch_size: int = 16,
                 max_gen_toks: int = 256, end_ids: Sequence[int] = (), seed: int = 0):
        """``engine``: a built Engine with its params (``saved_run.inference_engine``);
        ``tokenizer``: a transformers tokenizer of the model's vocabulary; ``end_ids``: the ids
        that end a generation besides the tokenizer's end of sequence (the model's
        generation_config.json: what transformers' generate stops at); ``seed``: of sampled
        generations."""
        super().__init__()
        self.engine, self.tokenizer = engine, tokenizer
        self.batch_size_value = int(batch_size)
        self._max_gen_toks = int(max_gen_toks)
        model_cfg = engine.model.config
        self._max_length = int(model_cfg.max_seq_len)
        if tokenizer.eos_token_id is None:
            raise errors.HFError("the tokenizer has no end-of-sequence token, which lm-eval "
                                 "uses as the end of every text", path="tokenizer",
                                 suggestion="give a tokenizer with an eos_token")
        self.end_ids = tuple(dict.fromkeys([int(i) for i in end_ids]
                                           + [tokenizer.eos_token_id]))
        # Rows of every compiled batch: a multiple of the batch shards.
        self._process_shards, self._num_shards = engine.process_batch_shards()
        self._scores = engine.steps.model_method("token_scores")
        self._samplers: Dict[Tuple[int, Optional[float], float], Any] = {}
        self._key = jax.random.PRNGKey(seed)
        self._generations = 0  # Batches sampled so far (each folds its number into the key).
        self._decoder: Optional[DecodeEngine] = None  # (Made at the first generation.)

    # --- What lm-eval reads of a model ------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "titanax").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   left_truncate_len: Optional[int] = None, **kwargs) -> List[int]:
        """As lm-eval's ``hf`` model encodes a string (its special-token rule: BOS where the
        tokenizer adds one, unless the string starts with it)."""
        special = model_utils._add_special_kwargs(add_special_tokens, None)  # pylint: disable=protected-access
        if add_special_tokens is None and model_utils.has_bos_prefix(
                string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **special)
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: List[Dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The model's chat template over a task's turns (lm-eval's ``--apply_chat_template``),
        as lm-eval's ``hf`` model renders them (a template refusing the system role gets the
        turns without it)."""
        import jinja2  # pylint: disable=import-outside-toplevel
        render = lambda turns: self.tokenizer.apply_chat_template(  # noqa: E731
            turns, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt)
        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            return render([m for m in chat_history if m["role"] != "system"])

    def _run(self, fn: Any, host: Dict[str, np.ndarray], *extra: Any) -> Dict[str, np.ndarray]:
        """``fn(params, *placed inputs, *extra)`` on a batch of whole rows that every process
        holds alike: each process places its batch shards' rows (the batch's rows only: no
        sequence is split), and gets every row of the outputs back (gathered from the others).
        """
        count = len(next(iter(host.values())))
        per_shard = count // self._num_shards
        mine = np.concatenate([np.arange(s * per_shard, (s + 1) * per_shard)
                               for s in self._process_shards])
        engine = self.engine
        placed = batch_shards.place_batch(engine.mesh, engine.inputs.batch.row_entry,
                                          {k: v[mine] for k, v in host.items()},
                                          self._process_shards, self._num_shards)
        out = fn(engine.state.params, *(placed[k] for k in host), *extra)
        if not isinstance(out, dict):
            out = {"out": out}
        gathered = {}
        for name, value in out.items():
            local = batch_shards.process_rows(value)
            flat = local.reshape(len(local), -1)
            merged, _ = batch_shards.global_rows(flat, self._process_shards)
            gathered[name] = merged.reshape((count,) + local.shape[1:])
        return gathered

    def _rows(self, count: int) -> int:
        return -(-count // self._num_shards) * self._num_shards

    # --- loglikelihood ------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              override_bs: Optional[int] = None) -> List[Tuple[float, bool]]:
        """``requests``: ``(key, context ids, continuation ids)``; per request, the
        continuation's summed log-prob and whether greedy decoding gives all of it -- the row
        ``(context + continuation)[-(max_length + 1):]`` scored as lm-eval's ``hf`` model
        scores it."""
        del disable_tqdm, override_bs
        rows = []
        for key, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self._max_length + 1):]
            if not continuation or len(continuation) > len(whole) - 1 or len(whole) < 2:
                raise errors.HFError(
                    f"a request scores {len(continuation)} continuation token(s) after "
                    f"{len(context)} context token(s) ({key!r}), which a model of "
                    f"{self._max_length} positions cannot", path="tasks",
                    suggestion="give requests with a continuation that fits the model")
            rows.append((whole[:-1], whole[1:], len(continuation)))
        out: List[Optional[Tuple[float, bool]]] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self.batch_size_value):
            chosen = order[start:start + self.batch_size_value]
            length = padded_length(max(len(rows[i][0]) for i in chosen), limit=self._max_length)
            count = self._rows(len(chosen))
            inputs = np.zeros((count, length), np.int32)
            targets = np.zeros((count, length), np.int32)
            for row, index in enumerate(chosen):
                inp, tgt, _ = rows[index]
                inputs[row, :len(inp)], targets[row, :len(tgt)] = inp, tgt
            scores = self._run(self._scores, {"input_ids": inputs,
                                              "target_ids": targets})["out"]
            for row, index in enumerate(chosen):
                inp, _, count_cont = rows[index]
                span = scores[row, len(inp) - count_cont:len(inp)]
                out[index] = (float(np.sum(span[:, 0], dtype=np.float64)),
                              bool(np.all(span[:, 1] > 0)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """A document's log-prob over lm-eval's rolling windows of ``max_length`` tokens (the
        first conditioned on the prefix token), as lm-eval's ``hf`` model sums them."""
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for window in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length, context_len=1)):
                windows.append((None,) + window)
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logp, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logp
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # --- generate_until -----------------------------------------------------------------------

    def _sampler(self, new_tokens: int, temperature: Optional[float], top_p: float):
        key = (new_tokens, temperature, top_p)
        if key not in self._samplers:
            self._samplers[key] = self.engine.steps.sampler(
                max_new_tokens=new_tokens, temperature=temperature, top_p=top_p,
                end_ids=self.end_ids)
        return self._samplers[key]

    def _decode_engine(self) -> DecodeEngine:
        """The decode engine on the run's mesh (titanax/decoding): ``batch_size`` requests at
        once over the batch shards, each with room for the model's whole length."""
        if self._decoder is None:
            placement = self.engine.steps.decode_placement()
            slots = -(-self.batch_size_value // placement.shards)
            self._decoder = DecodeEngine(
                model=self.engine.model, params=self.engine.state.params,
                pool_tokens=slots * -(-self._max_length // 16) * 16, block_size=16,
                slots=slots, placement=placement)
        # The run's params now (an evaler's run trains between evaluations, its state donated).
        self._decoder.params = self.engine.state.params
        return self._decoder

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Greedy continuations (sampled where a request asks: ``do_sample``, its
        temperature), the context left-truncated to ``max_length - max_gen_toks`` and encoded
        as lm-eval's ``hf`` model encodes a batch; cut at the end token and the stop strings."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        args = [req.args for req in requests]
        out: List[Optional[str]] = [None] * len(args)
        groups: Dict[str, List[int]] = {}
        for index, (_, gen_kwargs) in enumerate(args):
            groups.setdefault(repr(sorted(gen_kwargs.items())), []).append(index)
        for indices in groups.values():
            kwargs = model_utils.normalize_gen_kwargs(args[indices[0]][1], self._max_gen_toks)
            until = model_utils.handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            new_tokens = int(kwargs.pop("max_gen_toks"))
            sampled = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            top_p = float(kwargs.pop("top_p", None) or 1.0)
            unused = {k: v for k, v in kwargs.items()
                      if not (k in ("num_beams", "num_return_sequences") and v == 1)
                      and not (k == "top_k" and v in (0, None))}
            if unused:
                raise errors.HFError(
                    f"a task asks to generate with {unused}, which the sampler does not do "
                    "(greedy, or temperature / top_p sampling)", path="tasks",
                    suggestion="evaluate tasks that generate greedily or by temperature / "
                               "top_p")
            temperature = temperature if sampled and temperature > 0 else None
            max_context = self._max_length - new_tokens
            if max_context < 1:
                raise errors.HFError(
                    f"a task asks for {new_tokens} new tokens of a model that reads "
                    f"{self._max_length}", path="max_gen_toks",
                    suggestion="evaluate a model with a longer max_seq_len, or a task that "
                               "generates less")
            # Longest first, as lm-eval's hf model orders them.
            indices = sorted(indices, key=lambda i: (-len(self.tok_encode(args[i][0])),
                                                     args[i][0]))
            for start in range(0, len(indices), self.batch_size_value):
                chosen = indices[start:start + self.batch_size_value]
                texts = self._generate([args[i][0] for i in chosen], new_tokens=new_tokens,
                                       temperature=temperature, top_p=top_p,
                                       max_context=max_context)
                for index, text in zip(chosen, texts):
                    out[index] = model_utils.postprocess_generated_text(text, stop=until,
                                                                       think_end_token=None)
                    self.cache_hook.add_partial("generate_until", args[index], out[index])
        if self._decoder is not None:  # (Its pools let go: an evaler's run trains next.)
            self._decoder.release()
        return out

    def _generate(self, contexts: List[str], *, new_tokens: int, temperature: Optional[float],
                  top_p: float, max_context: int) -> List[str]:
        """Each context's continuation, to its first end id (left out): by the decode engine
        in one process (its book of blocks is one host's), else by the static sampler over
        every process's batch shards."""
        special = {}
        if model_utils.has_bos_prefix(contexts[0], getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        encoded = [self.tokenizer.encode(text, **special)[-max_context:] for text in contexts]
        key = jax.random.fold_in(self._key, self._generations)
        self._generations += 1
        if jax.process_count() == 1:
            done = self._decode_engine().generate([Request(
                prompt_ids=tuple(int(t) for t in ids), max_new_tokens=new_tokens,
                temperature=temperature or 0.0, top_p=top_p, stop_ids=self.end_ids)
                for ids in encoded], key=key)
            return [self.tok_decode([t for t in group[0].tokens if t not in self.end_ids])
                    for group in done]
        length = padded_length(max(len(e) for e in encoded), limit=max_context)
        count = self._rows(len(encoded))
        prompts = np.zeros((count, length), np.int32)
        lengths = np.ones((count,), np.int32)
        for row, ids in enumerate(encoded):
            prompts[row, length - len(ids):], lengths[row] = ids, len(ids)
        tokens = self._run(self._sampler(new_tokens, temperature, top_p),
                           {"prompt_ids": prompts, "prompt_lengths": lengths}, key)["tokens"]
        texts = []
        for row in range(len(encoded)):
            ids = tokens[row].tolist()
            ends = [i for i, token in enumerate(ids) if token in self.end_ids]
            texts.append(self.tok_decode(ids[:ends[0]] if ends else ids))
        return texts


def transformers_tokenizer(tokenizer_cfg: Any, source_dir: Optional[str]) -> Any:
    """The model's tokenizer as transformers loads it: its HF directory's (where the tokenizer
    file lies in one: its tokenizer_config.json -- chat template, special tokens -- with it),
    else the run's tokenizer.json with the start / end tokens Titanax reads it with; a chat
    template the run configured (``tokenizer.chat_template``) replaces the shipped one."""
    import os  # pylint: disable=import-outside-toplevel
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # pylint: disable=import-outside-toplevel
    from titanax.data import bundled  # pylint: disable=import-outside-toplevel
    from titanax.data.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
    path = getattr(tokenizer_cfg, "path", None) or source_dir
    if path is None:
        raise errors.HFError(
            "this model has no tokenizer lm-eval can use (its run reads bytes)",
            path="train_input.tokenizer.path", suggestion="evaluate a run trained with a "
                                                          "tokenizer (a tokenizer.json or HF dir)")
    path = bundled.resolve(path)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    if os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(directory)
    else:
        ours = (tokenizer_cfg if getattr(tokenizer_cfg, "path", None) else
                Tokenizer.default_config().set(path=path)).instantiate()
        if ours.file is None or not ours.file.endswith(".json"):
            raise errors.HFError(
                f"{path}: lm-eval reads a tokenizer.json (or an HF directory) through "
                "transformers", path="train_input.tokenizer.path",
                suggestion="convert the SentencePiece model to a tokenizer.json, or evaluate "
                           "the run's export")
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=ours.file,
                                            bos_token=ours.token(ours.bos_id) or None,
                                            eos_token=ours.token(ours.eos_id) or None)
    from titanax.data import chat  # pylint: disable=import-outside-toplevel
    template = chat.named_template(getattr(tokenizer_cfg, "chat_template", None))
    if template:
        tokenizer.chat_template = template
    return tokenizer
