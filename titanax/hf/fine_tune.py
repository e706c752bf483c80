"""``--config.init_from=<HF dir>``: a run that starts from a Hugging Face checkpoint.

The model's *architecture* comes from the directory's ``config.json`` and replaces the
experiment's; how the experiment *runs* the model stays (the TP axis and sequence parallelism,
remat and unrolling, the param dtype, the vocabulary padding: choices of the plan, not of the
checkpoint). The launcher prints what changed and saves the resolved tree in the run record,
so the record says where the params came from (``init_from``) and what they are. The Engine
loads the weights into their shards when the run starts fresh (step 0, a fresh optimizer); a run
that already has checkpoints resumes from them instead.
"""

from __future__ import annotations

from typing import List, Tuple

from titanax import errors
from titanax.config import ConfigBase
from titanax.config import overrides as overrides_lib
from titanax.hf.importer import model_config

# Fields of the experiment's model that say how it runs, kept over the checkpoint's.
RUNTIME_FIELDS = ("name", "dtype", "remat_policy", "tp_axis", "sequence_parallel",
                  "layer_remat_policy", "unroll_layers", "vocab_pad_multiple")


def derive_model(cfg: ConfigBase) -> Tuple[ConfigBase, List[str]]:
    """``cfg`` (an Engine config with ``init_from`` set) with its model replaced by the
    checkpoint's architecture; and the model's changed leaves (``model.path: old -> new``)."""
    directory = cfg.init_from
    if cfg.model is None:
        raise errors.HFError("init_from needs a model in the experiment to fine-tune",
                             path="init_from", suggestion="use a language-model experiment, "
                                                          "e.g. --config=llama_tiny_dp_tp")
    derived = model_config(directory)
    for field in RUNTIME_FIELDS:
        if field in type(derived).__fields__ and field in type(cfg.model).__fields__:
            setattr(derived, field, getattr(cfg.model, field))
    changed = overrides_lib.config_diff(cfg.model, derived)
    out = cfg.clone()
    out.model = derived
    return out, [f"model.{line}" for line in changed]
