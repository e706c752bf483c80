"""Titanax param tree -> each peer's own param tree, so all three start from the same numbers.

Input: the nested dict Titanax's engine holds (``engine.state.params``): ``token_emb``,
``pos_emb``, ``decoder/layer/...`` stacked ``[L, ...]``, ``final_norm``. Output trees hold host
numpy arrays; each peer places them on its mesh with its own shardings. Pure renames and one
reshape (the Flax attention out-projection is kept ``[L, H, Dh, D]``, MaxText's layout); no
arithmetic, so the converted model computes exactly what Titanax's does.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np


def _host(tree: Any) -> Any:
    return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def titanax_to_flax(params: Mapping[str, Any]) -> dict:
    """The pure-dict form of ``flax_gpt.GPT``'s ``nnx.Param`` state."""
    p = _host(params)
    layer = p["decoder"]["layer"]
    attn, mlp = layer["attn"], layer["mlp"]
    num_layers, _, _, heads, head_dim = attn["qkv_weight"].shape
    out_weight = attn["o"]["weight"]
    return {
        "wte": {"embedding": p["token_emb"]["weight"]},
        "wpe": {"embedding": p["pos_emb"]["weight"]},
        "blocks": {
            "ln1": dict(layer["input_norm"]),
            "ln2": dict(layer["post_attention_norm"]),
            "attn": {
                "qkv": {"kernel": attn["qkv_weight"], "bias": attn["qkv_bias"]},
                "out": {"kernel": out_weight.reshape(num_layers, heads, head_dim, -1),
                        "bias": attn["o"]["bias"]},
            },
            "fc_in": {"kernel": mlp["up"]["weight"], "bias": mlp["up"]["bias"]},
            "fc_out": {"kernel": mlp["down"]["weight"], "bias": mlp["down"]["bias"]},
        },
        "ln_f": dict(p["final_norm"]),
    }


def titanax_to_plain(params: Mapping[str, Any]) -> dict:
    """``plain_jax_gpt``'s flat-named tree (layer params stacked ``[L, ...]``)."""
    p = _host(params)
    layer = p["decoder"]["layer"]
    attn, mlp = layer["attn"], layer["mlp"]
    return {
        "wte": p["token_emb"]["weight"],
        "wpe": p["pos_emb"]["weight"],
        "layers": {
            "ln1_g": layer["input_norm"]["scale"], "ln1_b": layer["input_norm"]["bias"],
            "w_qkv": attn["qkv_weight"], "b_qkv": attn["qkv_bias"],
            "w_attn_out": attn["o"]["weight"], "b_attn_out": attn["o"]["bias"],
            "ln2_g": layer["post_attention_norm"]["scale"], "ln2_b": layer["post_attention_norm"]["bias"],
            "w_fc": mlp["up"]["weight"], "b_fc": mlp["up"]["bias"],
            "w_proj": mlp["down"]["weight"], "b_proj": mlp["down"]["bias"],
        },
        "lnf_g": p["final_norm"]["scale"], "lnf_b": p["final_norm"]["bias"],
    }
