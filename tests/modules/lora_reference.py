"""LoRA written out by hand, independently of modules/lora.py: a decoder's params with every
adapted weight replaced by ``W + scale * A B`` (one einsum per weight kind, its roles spelled out
here), so the base model's forward is the adapted model's."""

import zlib

import jax
import jax.numpy as jnp

from titanax.modules.lora import A_SUFFIX, B_SUFFIX

# Weight name -> how its (stacked) A and B make its delta.
DELTAS = {
    "q_weight": "ldr,lrhk->ldhk",        # [L, d, r] x [L, r, heads, head_dim]
    "k_weight": "ldr,lrhk->ldhk",
    "v_weight": "ldr,lrhk->ldhk",
    "qkv_weight": "ldr,lrthk->ldthk",    # GPT-2's fused q/k/v: one A, B over (3, heads, dim)
    "gate_up_weight": "ltdr,ltrf->ldtf",  # [L, 2, d, r] x [L, 2, r, hidden]: gate, up apart
    "weight": "lir,lro->lio",            # A Linear (o, down, GPT-2's up).
    # Latent attention: low-rank query / latent projections [L, d, n], head expansions.
    "q_a_weight": "ldr,lro->ldo",
    "kv_a_weight": "ldr,lro->ldo",
    "q_b_weight": "ldr,lrhk->ldhk",
    "kv_b_weight": "ldr,lrhk->ldhk",
    # Gated DeltaNet: the output gate by heads, the decay and write-strength projections.
    "z_weight": "ldr,lrhk->ldhk",
    "a_weight": "ldr,lrh->ldh",
    "b_weight": "ldr,lrh->ldh",
}


def merged(params, scale: float):
    """``params`` (a Decoder's, stacked layers) with each adapter pair folded into its weight
    and removed."""
    out = {}
    for name, value in params.items():
        if isinstance(value, dict):
            out[name] = merged(value, scale)
        elif not is_adapter(name):
            a, b = params.get(name + A_SUFFIX), params.get(name + B_SUFFIX)
            out[name] = value if a is None else value + scale * jnp.einsum(DELTAS[name], a, b)
    return out


def is_adapter(path: str) -> bool:
    return path.endswith((A_SUFFIX, B_SUFFIX))


def with_moved_adapters(params, *, scale: float):
    """``params`` with every LoRA B moved off zero (fixed random values, ``scale`` their spread,
    each from its path): B starts at zero, and an adapter whose B is zero has no gradient by A
    and leaves the model its base's."""
    def moved(path, value):
        where = jax.tree_util.keystr(path)
        if not where.endswith(B_SUFFIX + "']"):
            return value
        key = jax.random.PRNGKey(zlib.crc32(where.encode()))
        return value + scale * jax.random.normal(key, value.shape, value.dtype)
    return jax.tree_util.tree_map_with_path(moved, params)
