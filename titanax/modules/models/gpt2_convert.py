"""Hugging Face GPT-2 weights -> Titanax GPT params.

Input is a state dict of numpy arrays with Hugging Face's names (``transformer.h.0.attn.c_attn
.weight``...). GPT-2's ``Conv1D`` layers already store weights ``[in, out]``, as Titanax does;
only the fused QKV is reshaped to ``[model_dim, 3, heads, head_dim]`` and per-layer tensors are
stacked for the scanned decoder. Buffers (``attn.bias`` masks) and the tied ``lm_head`` are ignored.
"""

from __future__ import annotations

from typing import Dict, Mapping

import numpy as np

from titanax import errors
from titanax.modules.models.gpt import GPT


def _take(state: Mapping[str, np.ndarray], name: str, shape) -> np.ndarray:
    if name not in state:
        raise errors.ModuleError(f"the state dict has no {name!r}", path=name,
                                 suggestion="pass a GPT-2 state dict (GPT2LMHeadModel or "
                                            "GPT2Model names, with or without 'transformer.')")
    value = np.asarray(state[name], np.float32)
    if value.shape != tuple(shape):
        raise errors.ModuleError(f"expected shape {tuple(shape)}, got {value.shape}", path=name,
                                 suggestion="check the GPT config sizes against the checkpoint")
    return value


def params_from_hf_gpt2(state_dict: Mapping[str, np.ndarray], cfg: GPT.Config) -> Dict:
    """Titanax GPT params (numpy, float32) from a Hugging Face GPT-2 state dict."""
    state = {(k if k.startswith("transformer.") or k.startswith("lm_head") else f"transformer.{k}"): v
             for k, v in state_dict.items()}
    d, heads, layers = cfg.model_dim, cfg.num_heads, cfg.num_layers
    hidden = cfg.hidden_dim or 4 * d
    head_dim = d // heads
    vocab = cfg.vocab_size
    padded = -(-vocab // cfg.vocab_pad_multiple) * cfg.vocab_pad_multiple
    wte = np.zeros((padded, d), np.float32)
    wte[:vocab] = _take(state, "transformer.wte.weight", (vocab, d))

    def stacked(suffix: str, shape) -> np.ndarray:
        return np.stack([_take(state, f"transformer.h.{i}.{suffix}", shape)
                         for i in range(layers)])

    def norm(prefix: str) -> Dict[str, np.ndarray]:
        return {"scale": stacked(f"{prefix}.weight", (d,)), "bias": stacked(f"{prefix}.bias", (d,))}

    layer = {
        "ln1": norm("ln_1"),
        "attn": {
            "qkv_weight": stacked("attn.c_attn.weight", (d, 3 * d)).reshape(
                layers, d, 3, heads, head_dim),
            "qkv_bias": stacked("attn.c_attn.bias", (3 * d,)).reshape(layers, 3, heads, head_dim),
            "out": {"weight": stacked("attn.c_proj.weight", (d, d)),
                    "bias": stacked("attn.c_proj.bias", (d,))},
        },
        "ln2": norm("ln_2"),
        "mlp": {
            "wi": {"weight": stacked("mlp.c_fc.weight", (d, hidden)),
                   "bias": stacked("mlp.c_fc.bias", (hidden,))},
            "wo": {"weight": stacked("mlp.c_proj.weight", (hidden, d)),
                   "bias": stacked("mlp.c_proj.bias", (d,))},
        },
    }
    return {
        "token_emb": {"weight": wte},
        "pos_emb": {"weight": _take(state, "transformer.wpe.weight", (cfg.max_seq_len, d))},
        "decoder": {"layer": layer},
        "final_norm": {"scale": _take(state, "transformer.ln_f.weight", (d,)),
                       "bias": _take(state, "transformer.ln_f.bias", (d,))},
    }
