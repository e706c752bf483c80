"""``--config.init_from=<HF dir>``: a run that starts from a Hugging Face checkpoint.

The model's *architecture* comes from the directory's ``config.json`` and replaces the
experiment's; how the experiment *runs* the model stays (the TP axis and sequence parallelism,
remat and unrolling, the param dtype, the vocabulary padding, a mixture of experts' dispatch,
capacity and balancing weights: choices of the run, not of the checkpoint), and so do the user's own ``--config.model.*`` overrides (the launcher applies them
again on top: the user's word over the checkpoint's; a shape they change is refused when the
weights load). The launcher prints what changed and saves the resolved tree in the run record,
so the record says where the params came from (``init_from``, an absolute path) and what they
are. The Engine loads the weights into their shards when the run starts fresh (step 0, a fresh
optimizer) and checks first that its model is the one the directory describes; a run that
already has checkpoints resumes from them -- also once the HF directory is gone: the model then
comes from the run's own record.

The model's tokenizer comes with it: a train input that tokenizes text and names no tokenizer
(and no ``--config.train_input.tokenizer.*`` override) reads its data with the directory's
``tokenizer.json`` / ``tokenizer.model`` -- and its chat template -- and the launcher says so;
the evalers follow the train input (``train/inputs.py``). A directory that ships no tokenizer
leaves the data as bytes, said as a warning.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, List, Optional, Sequence

from titanax import errors
from titanax.config import ConfigBase
from titanax.config import overrides as overrides_lib
from titanax.hf.importer import check_tensor_shapes, model_config

_log = logging.getLogger("titanax")

# Fields of the experiment's model that say how it runs, kept over the checkpoint's.
RUNTIME_FIELDS = ("name", "dtype", "param_init", "remat_policy", "layer_remat_policy",
                  "unroll_layers", "vocab_pad_multiple", "loss_chunk_tokens",
                  "attention_implementation", "attention_block_size")
# Fields a user may set apart from the checkpoint's without changing what its weights compute
# (a shorter sequence limit -- a position table's shape is checked when the weights load --
# training-time dropout, and whether to train multi-token-prediction depths beside the model:
# a depth's weights are read from the checkpoint's MTP layers, which must hold it).
FREE_FIELDS = RUNTIME_FIELDS + ("max_seq_len", "dropout_rate", "attention_dropout_rate",
                                "mtp_depths", "mtp_loss_weight")
# A mixture of experts' fields that say how it runs or trains, not what its weights compute
# (how tokens are dispatched; balancing weights -- the expert and TP axes are the plan's):
# the experiment's are kept over the checkpoint's, and its router's runtime fields too.
MOE_RUNTIME_FIELDS = ("dtype", "param_init", "remat_policy", "output_param_init", "dispatch",
                      "capacity_factor", "aux_loss_weight", "z_loss_weight")
MOE_FREE_FIELDS = MOE_RUNTIME_FIELDS
ROUTER_RUNTIME_FIELDS = ("dtype", "param_init", "remat_policy")
# ... and those a user may set apart from the checkpoint's: how fast aux-loss-free balancing
# moves the expert bias (a training rule; the bias it starts from is the checkpoint's).
ROUTER_FREE_FIELDS = ROUTER_RUNTIME_FIELDS + ("balance_rate",)


def derive_model(cfg: ConfigBase, *, recorded: Optional[ConfigBase] = None) -> ConfigBase:
    """``cfg`` (an Engine config with ``init_from`` set) with its model replaced by the
    checkpoint's architecture and ``init_from`` made absolute. ``recorded``: the config of this
    run's record, if any -- its model is used when the HF directory can no longer be read and
    the record names the same directory (resuming after the source was moved away)."""
    directory = os.path.abspath(cfg.init_from)
    if cfg.model is None:
        raise errors.HFError("init_from needs a model in the experiment to fine-tune",
                             path="init_from", suggestion="use a language-model experiment, "
                                                          "e.g. --config=llama_tiny_dp_tp")
    try:
        derived = model_config(directory)
    except errors.HFError:
        if recorded is None or getattr(recorded, "init_from", None) != directory:
            raise
        _log.warning("init_from %s cannot be read; the model comes from this run's record",
                     directory)
        derived = recorded.model.clone()
    for field in RUNTIME_FIELDS:
        if field in type(derived).__fields__ and field in type(cfg.model).__fields__:
            setattr(derived, field, getattr(cfg.model, field))
    _keep_moe_fields(derived, cfg.model, MOE_RUNTIME_FIELDS, ROUTER_RUNTIME_FIELDS)
    out = cfg.clone()
    out.model = derived
    out.init_from = directory
    return out


def architecture_differences(model: ConfigBase, directory: str) -> List[str]:
    """How ``model`` differs from the model the HF directory describes (fields that say how
    the model runs aside): empty when the checkpoint's weights mean what they meant there."""
    derived = model_config(directory)
    if type(derived) is not type(model):
        return [f"model.klass: {type(model).__qualname__} -> {type(derived).__qualname__}"]
    for field in FREE_FIELDS:
        if field in type(derived).__fields__:
            setattr(derived, field, getattr(model, field))
    _keep_moe_fields(derived, model, MOE_FREE_FIELDS, ROUTER_FREE_FIELDS)
    return [f"model.{line}" for line in overrides_lib.config_diff(derived, model)]


def _keep_moe_fields(derived: ConfigBase, model: ConfigBase, fields, router_fields) -> None:
    """``derived``'s mixture of experts with ``fields`` (and its router's ``router_fields``)
    taken from ``model``'s, when both have one."""
    ours, theirs = getattr(model, "moe", None), getattr(derived, "moe", None)
    if ours is None or theirs is None:
        return
    for field in fields:
        setattr(theirs, field, getattr(ours, field))
    for field in router_fields:
        setattr(theirs.router, field, getattr(ours.router, field))


def check_model_matches(model: ConfigBase, directory: str) -> None:
    """Refuses to load the directory's weights into a model of another architecture (same
    shapes, other numbers: another rope_theta, eps, scaling...), or weights whose shapes are not
    the ones its config.json implies."""
    differences = architecture_differences(model, directory)
    if not differences:
        check_tensor_shapes(directory, model)  # (Also before anything loads or compiles.)
        return
    if differences:
        raise errors.HFError(
            "the model differs from the one the checkpoint describes: "
            + "; ".join(differences[:6]) + (" ..." if len(differences) > 6 else ""),
            path=f"{directory}/config.json", suggestion="derive the model from the directory "
            "(the launcher does with --config.init_from; in code: "
            "titanax.hf.importer.model_config(dir)), keeping only how it runs")


def with_model_tokenizer(cfg: ConfigBase, *, given: Sequence[Any]) -> ConfigBase:
    """``cfg`` (with ``init_from`` set) whose train input reads with the HF directory's
    tokenizer, unless the user chose one (``given``: the overrides applied; naming its path or
    class chooses, setting its chat template or special tokens does not) or the input does
    not tokenize text -- also where the experiment names its own (a tokenizer for its bundled
    data cannot read for another model); what was decided is printed."""
    train = getattr(cfg, "train_input", None)
    if train is None or "tokenizer" not in train.keys():
        return cfg
    # (Choosing the tokenizer is naming its path; its other fields -- a chat template, the
    # start and end tokens -- refine the model's own.)
    if any(o.path in ("train_input.tokenizer", "train_input.tokenizer.path",
                      "train_input.tokenizer.klass") for o in given):
        return cfg
    klass = getattr(train.source, "klass", None)
    if klass is None or "tokenizer" not in inspect.signature(klass.__init__).parameters:
        return cfg
    from titanax.data.tokenizer import SENTENCEPIECE_FILE, TOKENIZER_FILE  # pylint: disable=import-outside-toplevel
    if not any(os.path.isfile(os.path.join(cfg.init_from, name))
               for name in (TOKENIZER_FILE, SENTENCEPIECE_FILE)):
        print(f"titanax: warning: {cfg.init_from} ships no {TOKENIZER_FILE} or "
              f"{SENTENCEPIECE_FILE}: the data is read as bytes (ids 0-255), not as this model's "
              "tokens; set --config.train_input.tokenizer.path to its tokenizer", flush=True)
        return cfg
    out = cfg.clone()
    replaced = train.tokenizer.path
    out.train_input.tokenizer.path = cfg.init_from
    tokenizer = out.train_input.tokenizer.instantiate()
    print(f"titanax: data tokenized with the model's tokenizer {tokenizer.file} "
          f"({tokenizer.vocab_size} tokens; from init_from"
          + (f", instead of the experiment's {replaced}" if replaced else "")
          + " -- --config.train_input.tokenizer.path=... chooses another)", flush=True)
    return out
