"""LoRA written out by hand, independently of modules/lora.py: the decoder's params with every
adapted weight replaced by ``W + scale * A B`` (one einsum per weight kind, the roles spelled
out here), so the base model's forward is the adapted model's."""

import jax.numpy as jnp

from titanax.modules.lora import A_SUFFIX, B_SUFFIX


def merged(params, scale: float):
    """``params`` (a Decoder's, stacked layers, adapters on q / k / v / o / gate_up / down)
    with the adapters folded into their weights and removed."""
    layer = dict(params["decoder"]["layer"])
    attn, mlp = dict(layer["attn"]), dict(layer["mlp"])

    def pop(tree, name):
        return tree.pop(name + A_SUFFIX), tree.pop(name + B_SUFFIX)

    for name in ("q_weight", "k_weight", "v_weight"):
        a, b = pop(attn, name)  # [L, d, r], [L, r, heads, head_dim]
        attn[name] = attn[name] + scale * jnp.einsum("ldr,lrhk->ldhk", a, b)
    o = dict(attn["o"])
    a, b = pop(o, "weight")
    o["weight"] = o["weight"] + scale * jnp.einsum("lir,lro->lio", a, b)
    attn["o"] = o
    a, b = pop(mlp, "gate_up_weight")  # [L, 2, d, r], [L, 2, r, hidden]: gate and up apart.
    mlp["gate_up_weight"] = mlp["gate_up_weight"] + scale * jnp.einsum("ltdr,ltrf->ldtf", a, b)
    down = dict(mlp["down"])
    a, b = pop(down, "weight")
    down["weight"] = down["weight"] + scale * jnp.einsum("lir,lro->lio", a, b)
    mlp["down"] = down
    layer["attn"], layer["mlp"] = attn, mlp
    return {**params, "decoder": {**params["decoder"], "layer": layer}}


def is_adapter(path: str) -> bool:
    return path.endswith((A_SUFFIX, B_SUFFIX))
