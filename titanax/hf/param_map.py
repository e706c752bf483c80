"""Which Hugging Face tensors make each Titanax param, and how (both ways).

A ``TensorMap`` ties one Titanax param path to the HF tensor(s) it is made of, per layer for the
stacked decoder (``{i}`` in the HF name), with a ``Form`` that turns the HF tensors of one layer
into the Titanax array and back. The forms are plain reshapes and transposes -- HF stores
``nn.Linear`` weights ``[out, in]``, Titanax ``[in, out]`` with heads as their own dimension --
so they are exact: import then export gives the same bytes. RoPE needs no permutation: Titanax
rotates in HF's rotate-half pairing (``modules/layers/rotary.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from titanax.config import ConfigBase
from titanax.modules.models.decoder import Decoder, is_gpt2


@dataclasses.dataclass(frozen=True)
class Part:
    """Where a Titanax param sits in an HF tensor it shares with other params (Qwen 3.5's
    ``in_proj_qkv`` holds the q, k and v projections; its gated ``q_proj`` the queries and the
    gates, head by head): ``tensor.reshape(view_shape)[index]`` is the param's part."""

    # The whole HF tensor's shape.
    full_shape: Tuple[int, ...]
    # The shape the tensor is viewed in to pick the part (full_shape itself for row ranges).
    view_shape: Tuple[int, ...]
    # The part, an index into that view.
    index: Tuple


@dataclasses.dataclass(frozen=True)
class Form:
    """HF tensors of one layer <-> the Titanax array (shapes without the layer dimension)."""

    # HF tensors -> Titanax array (views where numpy can).
    to_titanax: Callable[[Sequence[np.ndarray]], np.ndarray]
    # Titanax array -> HF tensors, in the order of TensorMap.hf_names (with ``part``: the part,
    # which the exporter places into the shared tensor).
    to_hf: Callable[[np.ndarray], List[np.ndarray]]
    # Set when the param is one part of its single HF tensor (hf_names has one name).
    part: Optional[Part] = None


def same() -> Form:
    return Form(lambda ts: ts[0], lambda a: [a])


def reshaped(shape: Tuple[int, ...], hf_shape: Tuple[int, ...]) -> Form:
    return Form(lambda ts: ts[0].reshape(shape), lambda a: [a.reshape(hf_shape)])


def transposed(shape: Tuple[int, ...]) -> Form:
    """HF ``[out, in]`` (``nn.Linear``) <-> Titanax ``[in, *out]``."""
    def to_hf(a):
        return [a.reshape(a.shape[0], -1).T]
    return Form(lambda ts: ts[0].T.reshape(shape), to_hf)


def stacked_transposed(count: int, shape: Tuple[int, ...]) -> Form:
    """Several HF ``[out, in]`` weights <-> one Titanax ``[in, count, out]`` (gate and up)."""
    def to_titanax(ts):
        return np.stack([t.T for t in ts], axis=1).reshape(shape)

    def to_hf(a):
        return [a[:, k].T for k in range(count)]
    return Form(to_titanax, to_hf)


def stacked(count: int) -> Form:
    """Several HF vectors <-> one Titanax ``[count, n]`` (gate and up biases)."""
    return Form(lambda ts: np.stack(list(ts)), lambda a: [a[k] for k in range(count)])


def experts_transposed(count: int, parts: int, shape: Tuple[int, ...]) -> Form:
    """``count`` experts' HF ``[out, in]`` weights, ``parts`` of them per expert (gate and up:
    2; down: 1), in expert-major order <-> one Titanax ``[E, in, (parts,) out]``."""
    def to_titanax(ts):
        per_expert = [np.stack([t.T for t in ts[e * parts:(e + 1) * parts]], axis=1)
                      for e in range(count)]
        return np.stack(per_expert).reshape(shape)

    def to_hf(a):
        a = a.reshape(count, a.shape[1], parts, -1)
        return [a[e, :, k].T for e in range(count) for k in range(parts)]
    return Form(to_titanax, to_hf)


def padded_rows(rows: int, vocab: int) -> Form:
    """The ``[vocab, D]`` table <-> Titanax's, padded to ``rows`` (``vocab_pad_multiple``:
    padding rows are zeros and are dropped on export). A table of any other number of rows than
    ``vocab`` -- config.json's vocabulary -- is refused: its missing rows are not padding."""
    def to_titanax(ts):
        table = ts[0]
        if table.shape[0] != vocab:
            raise ValueError(f"the table has {table.shape[0]} rows; config.json's vocab_size is "
                             f"{vocab}")
        if table.shape[0] == rows:
            return table
        out = np.zeros((rows,) + table.shape[1:], table.dtype)
        out[:table.shape[0]] = table
        return out

    return Form(to_titanax, lambda a: [a[:vocab]])


def rows_transposed(full_shape: Tuple[int, int], start: int, stop: int,
                    shape: Tuple[int, ...]) -> Form:
    """Rows ``start:stop`` of an HF ``[out, in]`` weight <-> Titanax ``[in, *out]``."""
    def to_titanax(ts):
        return ts[0][start:stop].T.reshape(shape)

    return Form(to_titanax, lambda a: [a.reshape(a.shape[0], -1).T],
                Part(full_shape, full_shape, (slice(start, stop),)))


def taps_rows(full_shape: Tuple[int, int, int], start: int, stop: int,
              shape: Tuple[int, ...]) -> Form:
    """Channels ``start:stop`` of an HF depthwise ``Conv1d`` weight ``[channels, 1, taps]`` <->
    Titanax ``[taps, heads, width]``."""
    def to_titanax(ts):
        return ts[0][start:stop, 0, :].T.reshape(shape)

    return Form(to_titanax, lambda a: [a.reshape(a.shape[0], -1).T[:, None, :]],
                Part(full_shape, full_shape, (slice(start, stop),)))


def head_part_transposed(heads: int, parts: int, which: int, width: int, inputs: int) -> Form:
    """Part ``which`` of each head in an HF ``[heads * parts * width, in]`` weight (Qwen 3.5's
    ``q_proj``: each head's query, then its gate) <-> Titanax ``[in, heads, width]``."""
    view = (heads, parts, width, inputs)

    def to_titanax(ts):
        return np.transpose(ts[0].reshape(view)[:, which], (2, 0, 1))

    return Form(to_titanax, lambda a: [np.transpose(a, (1, 2, 0))],
                Part((heads * parts * width, inputs), view, (slice(None), which)))


def hf_shapes(form: Form, shape: Tuple[int, ...]) -> List[Tuple[int, ...]]:
    """The shapes of the HF tensors that make a Titanax array of ``shape`` (one layer): the form
    run backwards on a zero-strided array (views only: nothing of that size is allocated); the
    whole shared tensor's for a part."""
    if form.part is not None:
        return [form.part.full_shape]
    placeholder = np.broadcast_to(np.zeros((), np.uint8), shape)
    return [tuple(t.shape) for t in form.to_hf(placeholder)]


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One Titanax param and the HF tensors it is made of."""

    # Titanax param path ("decoder/layer/attn/q_weight").
    path: str
    # HF tensor names; "{i}" stands for the layer of a stacked param.
    hf_names: Tuple[str, ...]
    # How they become the param (per layer) and back.
    form: Form
    # Number of stacked layers (0: not stacked).
    layers: int = 0
    # A member of a layer pattern's group (Decoder.Config.layer_pattern): slice g of the
    # stacked param is the model's layer g * layer_stride + layer_offset.
    layer_stride: int = 1
    layer_offset: int = 0

    def names_for(self, layer: int) -> Tuple[str, ...]:
        """The HF tensors of slice ``layer`` of the stacked param."""
        index = layer * self.layer_stride + self.layer_offset
        return tuple(n.format(i=index) for n in self.hf_names)


def tensor_maps(cfg: ConfigBase) -> List[TensorMap]:
    """Every param of a Decoder config (GPT-2's configuration of it: GPT-2's names), with its
    HF tensors."""
    if is_gpt2(cfg):
        return _gpt2(cfg)
    return _decoder(cfg)


def _padded(cfg) -> int:
    return -(-cfg.vocab_size // cfg.vocab_pad_multiple) * cfg.vocab_pad_multiple


def _gpt2(cfg: Decoder.Config) -> List[TensorMap]:
    d, heads, layers = cfg.model_dim, cfg.num_heads, cfg.num_layers
    head_dim = d // heads
    pre = "transformer.h.{i}."

    def layer(path, name, form=None):
        return TensorMap(f"decoder/layer/{path}", (pre + name,), form or same(), layers=layers)

    return [
        TensorMap("token_emb/weight", ("transformer.wte.weight",),
                  padded_rows(_padded(cfg), cfg.vocab_size)),
        TensorMap("pos_emb/weight", ("transformer.wpe.weight",), same()),
        layer("input_norm/scale", "ln_1.weight"), layer("input_norm/bias", "ln_1.bias"),
        layer("attn/qkv_weight", "attn.c_attn.weight",
              reshaped((d, 3, heads, head_dim), (d, 3 * d))),
        layer("attn/qkv_bias", "attn.c_attn.bias", reshaped((3, heads, head_dim), (3 * d,))),
        layer("attn/o/weight", "attn.c_proj.weight"), layer("attn/o/bias", "attn.c_proj.bias"),
        layer("post_attention_norm/scale", "ln_2.weight"),
        layer("post_attention_norm/bias", "ln_2.bias"),
        layer("mlp/up/weight", "mlp.c_fc.weight"), layer("mlp/up/bias", "mlp.c_fc.bias"),
        layer("mlp/down/weight", "mlp.c_proj.weight"), layer("mlp/down/bias", "mlp.c_proj.bias"),
        TensorMap("final_norm/scale", ("transformer.ln_f.weight",), same()),
        TensorMap("final_norm/bias", ("transformer.ln_f.bias",), same()),
    ]


def _decoder(cfg: Decoder.Config) -> List[TensorMap]:
    maps = [TensorMap("token_emb/weight", ("model.embed_tokens.weight",),
                      padded_rows(_padded(cfg), cfg.vocab_size))]
    if not cfg.tie_embeddings:
        maps.append(TensorMap("lm_head/weight", ("lm_head.weight",),
                              padded_rows(_padded(cfg), cfg.vocab_size)))
    pattern, first = cfg.layer_pattern, cfg.first_dense_layers
    for index in range(first):  # (DeepSeek-V3's dense layers, unstacked before the stack.)
        maps += _decoder_layers(cfg, prefix=f"decoder_head/{index}/", layers=0, offset=index,
                                dense=True)
    if pattern is None:
        maps += _decoder_layers(cfg, prefix="decoder/layer/", layers=cfg.num_layers - first,
                                offset=first)
    else:  # Member m of the group holds layers m, K + m, 2K + m, ... (layer_group.py).
        repetitions, tail = divmod(cfg.num_layers, len(pattern))
        for member, kind in enumerate(pattern):
            maps += _decoder_layers(cfg, prefix=f"decoder/layer/{member}/", layers=repetitions,
                                    stride=len(pattern), offset=member, kind=kind)
        for member, kind in enumerate(pattern[:tail]):  # (The unstacked layers after those.)
            maps += _decoder_layers(cfg, prefix=f"decoder_tail/{member}/", layers=0,
                                    offset=repetitions * len(pattern) + member, kind=kind)
    maps.append(TensorMap("final_norm/scale", ("model.norm.weight",), same()))
    for depth in range(cfg.mtp_depths):
        maps += _prediction_depth(cfg, depth)
    return maps


def _prediction_depth(cfg: Decoder.Config, depth: int) -> List[TensorMap]:
    """A multi-token-prediction depth's maps in DeepSeek-V3's names: HF layer ``num_layers +
    depth`` holds its norms (``enorm``, ``hnorm``, ``shared_head.norm``), its projection
    (``eh_proj``, embedding features first) and a decoder layer's tensors (its block); the
    shared embedding and head's copies there are ``prediction_copies``'."""
    layer_index, prefix, d = cfg.num_layers + depth, f"prediction/{depth}/", cfg.model_dim
    pre = f"model.layers.{layer_index}."
    return _decoder_layers(cfg, prefix=prefix + "block/", layers=0, offset=layer_index) + [
        TensorMap(prefix + "embedding_norm/scale", (pre + "enorm.weight",), same()),
        TensorMap(prefix + "hidden_norm/scale", (pre + "hnorm.weight",), same()),
        TensorMap(prefix + "project/weight", (pre + "eh_proj.weight",), transposed((2 * d, d))),
        TensorMap(prefix + "output_norm/scale", (pre + "shared_head.norm.weight",), same())]


# The tensors of an HF multi-token-prediction layer that copy the model's shared embedding and
# head (DeepSeek-V3's checkpoints hold them per depth; Titanax shares one of each).
PREDICTION_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def prediction_copies(cfg: ConfigBase) -> List[TensorMap]:
    """The export-only maps of each depth's copies of the embedding and the LM head (an import
    reads the model's own tensors and leaves these)."""
    maps = []
    for depth in range(getattr(cfg, "mtp_depths", 0)):
        pre = f"model.layers.{cfg.num_layers + depth}."
        head = "token_emb/weight" if cfg.tie_embeddings else "lm_head/weight"
        maps += [TensorMap(path, (pre + name,), padded_rows(_padded(cfg), cfg.vocab_size))
                 for path, name in zip(("token_emb/weight", head), PREDICTION_COPIES)]
    return maps


def _decoder_layers(cfg: Decoder.Config, *, prefix: str, layers: int, stride: int = 1,
                    offset: int = 0, kind: str = "full", dense: bool = False
                    ) -> List[TensorMap]:
    """The maps of one stacked block's params (``prefix``: its path), ``layers`` deep; ``kind``:
    the block's layer-pattern kind (its mixer's names); ``dense``: a dense MLP where the model
    has experts (``first_dense_layers``)."""
    d, heads = cfg.model_dim, cfg.num_heads
    kv = cfg.num_kv_heads or heads
    head_dim = cfg.head_dim or d // heads
    pre = "model.layers.{i}."

    def layer(path, names, form):
        names = (names,) if isinstance(names, str) else names
        return TensorMap(prefix + path, tuple(pre + n for n in names), form, layers=layers,
                         layer_stride=stride, layer_offset=offset)

    maps = [layer("input_norm/scale", "input_layernorm.weight", same())]
    if cfg.branch_output_norms:  # Gemma's four: the MLP's input norm is its "pre_feedforward".
        maps += [layer("attention_output_norm/scale", "post_attention_layernorm.weight", same()),
                 layer("post_attention_norm/scale", "pre_feedforward_layernorm.weight", same()),
                 layer("mlp_output_norm/scale", "post_feedforward_layernorm.weight", same())]
    else:
        maps.append(layer("post_attention_norm/scale", "post_attention_layernorm.weight",
                          same()))
    if kind == "linear":
        return maps + _linear_attention(cfg, layer) + _mlp(cfg, layer, dense=dense)
    if cfg.latent_attention is not None:
        return maps + _latent_attention(cfg, layer) + _mlp(cfg, layer, dense=dense)
    if cfg.attention_output_gate:  # Each head's query, then its gate, in one q_proj.
        maps += [layer("attn/q_weight", "self_attn.q_proj.weight",
                       head_part_transposed(heads, 2, 0, head_dim, d)),
                 layer("attn/gate_weight", "self_attn.q_proj.weight",
                       head_part_transposed(heads, 2, 1, head_dim, d))]
    else:
        maps.append(layer("attn/q_weight", "self_attn.q_proj.weight",
                          transposed((d, heads, head_dim))))
    maps += [
        layer("attn/k_weight", "self_attn.k_proj.weight", transposed((d, kv, head_dim))),
        layer("attn/v_weight", "self_attn.v_proj.weight", transposed((d, kv, head_dim))),
        layer("attn/o/weight", "self_attn.o_proj.weight", transposed((heads * head_dim, d))),
    ]
    maps += _mlp(cfg, layer, dense=dense)
    if cfg.qkv_bias:
        maps += [layer("attn/q_bias", "self_attn.q_proj.bias",
                       reshaped((heads, head_dim), (heads * head_dim,))),
                 layer("attn/k_bias", "self_attn.k_proj.bias",
                       reshaped((kv, head_dim), (kv * head_dim,))),
                 layer("attn/v_bias", "self_attn.v_proj.bias",
                       reshaped((kv, head_dim), (kv * head_dim,)))]
    if cfg.attention_output_bias:
        maps.append(layer("attn/o/bias", "self_attn.o_proj.bias", same()))
    if cfg.qk_norm:
        maps += [layer("attn/q_norm/scale", "self_attn.q_norm.weight", same()),
                 layer("attn/k_norm/scale", "self_attn.k_norm.weight", same())]
    if cfg.attention_sinks:
        maps.append(layer("attn/sinks", "self_attn.sinks", same()))
    return maps


def _mlp(cfg: Decoder.Config, layer, *, dense: bool = False) -> List[TensorMap]:
    """The feed-forward block's maps: dense (with its biases) or experts (``dense``: a dense
    layer of a model with experts)."""
    if cfg.moe is not None and not dense:
        return _experts(cfg, layer)
    d, hidden = cfg.model_dim, cfg.hidden_dim or 4 * cfg.model_dim
    maps = [layer("mlp/gate_up_weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                  stacked_transposed(2, (d, 2, hidden))),
            layer("mlp/down/weight", "mlp.down_proj.weight", transposed((hidden, d)))]
    if cfg.mlp_bias:
        maps += [layer("mlp/gate_up_bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), stacked(2)),
                 layer("mlp/down/bias", "mlp.down_proj.bias", same())]
    return maps


def _linear_attention(cfg: Decoder.Config, layer) -> List[TensorMap]:
    """A Gated DeltaNet's maps in Qwen 3.5's names (``linear_attn.*``): q, k and v one after
    the other in ``in_proj_qkv`` and ``conv1d``."""
    gdn, d = cfg.linear_attention, cfg.model_dim
    keys, values = gdn.num_key_heads, gdn.num_value_heads
    d_k, d_v, taps = gdn.key_head_dim, gdn.value_head_dim, gdn.conv_kernel_size
    kd, vd = keys * d_k, values * d_v
    rows = 2 * kd + vd
    pre = "linear_attn."
    maps = []
    for name, (start, stop), heads, width in (("q", (0, kd), keys, d_k),
                                              ("k", (kd, 2 * kd), keys, d_k),
                                              ("v", (2 * kd, rows), values, d_v)):
        maps += [layer(f"attn/{name}_weight", pre + "in_proj_qkv.weight",
                       rows_transposed((rows, d), start, stop, (d, heads, width))),
                 layer(f"attn/{name}_conv", pre + "conv1d.weight",
                       taps_rows((rows, 1, taps), start, stop, (taps, heads, width)))]
    return maps + [
        layer("attn/z_weight", pre + "in_proj_z.weight", transposed((d, values, d_v))),
        layer("attn/a_weight", pre + "in_proj_a.weight", transposed((d, values))),
        layer("attn/b_weight", pre + "in_proj_b.weight", transposed((d, values))),
        layer("attn/dt_bias", pre + "dt_bias", same()),
        layer("attn/a_log", pre + "A_log", same()),
        layer("attn/norm_scale", pre + "norm.weight", same()),
        layer("attn/o/weight", pre + "out_proj.weight", transposed((vd, d))),
    ]


def rope_pairs_transposed(groups: int, plain: int, rope: int, shape: Tuple[int, ...]) -> Form:
    """An HF ``[out, in]`` weight whose outputs are ``groups`` runs of ``plain`` features then
    ``rope`` RoPE features in interleaved pairs (DeepSeek-V3's ``rope_interleave``: pair k is
    features 2k, 2k+1) <-> Titanax ``[in, *out]`` with each run's RoPE features in rotate-half
    order (the even ones, then the odd ones: pair k is k, rope/2 + k)."""
    order = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    back = np.argsort(order)

    def to_titanax(ts):
        t = ts[0].reshape(groups, plain + rope, -1)
        t = np.concatenate([t[:, :plain], t[:, plain:][:, order]], axis=1)
        return t.reshape(groups * (plain + rope), -1).T.reshape(shape)

    def to_hf(a):
        t = a.reshape(a.shape[0], groups, plain + rope)
        t = np.concatenate([t[..., :plain], t[..., plain:][..., back]], axis=-1)
        return [t.reshape(a.shape[0], -1).T]
    return Form(to_titanax, to_hf)


def _latent_attention(cfg: Decoder.Config, layer) -> List[TensorMap]:
    """Multi-head latent attention's maps in DeepSeek-V3's names: low-rank queries (or one
    ``q_proj``), the latent with its shared RoPE key (``kv_a_proj_with_mqa``), its expansion to
    every head's keys and values (``kv_b_proj``)."""
    mla, d = cfg.latent_attention, cfg.model_dim
    heads, nope, rope = mla.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim
    latent, values, pre = mla.kv_lora_rank, mla.v_head_dim, "self_attn."
    queries = rope_pairs_transposed(heads, nope, rope, (mla.q_lora_rank or d, heads, nope + rope))
    if mla.q_lora_rank is None:
        maps = [layer("attn/q_weight", pre + "q_proj.weight", queries)]
    else:
        maps = [layer("attn/q_a_weight", pre + "q_a_proj.weight",
                      transposed((d, mla.q_lora_rank))),
                layer("attn/q_norm/scale", pre + "q_a_layernorm.weight", same()),
                layer("attn/q_b_weight", pre + "q_b_proj.weight", queries)]
    return maps + [
        layer("attn/kv_a_weight", pre + "kv_a_proj_with_mqa.weight",
              rope_pairs_transposed(1, latent, rope, (d, latent + rope))),
        layer("attn/kv_norm/scale", pre + "kv_a_layernorm.weight", same()),
        layer("attn/kv_b_weight", pre + "kv_b_proj.weight",
              transposed((latent, heads, nope + values))),
        layer("attn/o/weight", pre + "o_proj.weight", transposed((heads * values, d))),
    ]


def interleaved() -> Form:
    """gpt-oss's gate and up columns interleaved on the last axis (``[..., 2F]``: gate at even
    places, up at odd) <-> Titanax's ``[..., 2, F]``."""
    def to_titanax(ts):
        t = ts[0]
        return np.swapaxes(t.reshape(t.shape[:-1] + (t.shape[-1] // 2, 2)), -1, -2)

    def to_hf(a):
        return [np.swapaxes(a, -1, -2).reshape(a.shape[:-2] + (-1,))]
    return Form(to_titanax, to_hf)


def _gpt_oss_experts(cfg: Decoder.Config, layer) -> List[TensorMap]:
    """gpt-oss's router (with a bias) and experts, all experts in one tensor each, stored
    ``[in, out]`` with biases (``mlp.experts.gate_up_proj`` interleaving gate and up)."""
    moe = cfg.moe
    d, experts, hidden = cfg.model_dim, moe.num_experts, moe.hidden_dim
    pre = "mlp.experts."
    return [
        layer("mlp/router/weight", "mlp.router.weight", transposed((d, experts))),
        layer("mlp/router/bias", "mlp.router.bias", same()),
        layer("mlp/gate_up_weight", pre + "gate_up_proj", interleaved()),
        layer("mlp/gate_up_bias", pre + "gate_up_proj_bias", interleaved()),
        layer("mlp/down_weight", pre + "down_proj", same()),
        layer("mlp/down_bias", pre + "down_proj_bias", same()),
    ]


def _experts(cfg: Decoder.Config, layer) -> List[TensorMap]:
    """A mixture of experts' router and experts, in Qwen 3 MoE's names (``mlp.gate``,
    ``mlp.experts.{e}.gate_proj``...) or Mixtral's (``block_sparse_moe.gate``,
    ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down))."""
    moe = cfg.moe
    d, experts, hidden = cfg.model_dim, moe.num_experts, moe.hidden_dim
    if moe.expert_bias:
        return _gpt_oss_experts(cfg, layer)
    if cfg.qk_norm or cfg.latent_attention is not None:  # (qwen3_moe's names; DeepSeek-V3's.)
        block, gate, up, down = "mlp", "gate_proj", "up_proj", "down_proj"
    else:
        block, gate, up, down = "block_sparse_moe", "w1", "w3", "w2"
    both = tuple(f"{block}.experts.{e}.{name}.weight" for e in range(experts)
                 for name in (gate, up))
    maps = [
        layer("mlp/router/weight", f"{block}.gate.weight", transposed((d, experts))),
        layer("mlp/gate_up_weight", both, experts_transposed(experts, 2, (experts, d, 2, hidden))),
        layer("mlp/down_weight", tuple(f"{block}.experts.{e}.{down}.weight"
                                       for e in range(experts)),
              experts_transposed(experts, 1, (experts, hidden, d))),
    ]
    if moe.router.choosing_bias or moe.router.balance_rate:  # (DeepSeek-V3's.)
        maps.append(layer("mlp/router/expert_bias", f"{block}.gate.e_score_correction_bias",
                          same()))
    if moe.shared_hidden_dim:  # (DeepSeek-V3's shared_experts; Qwen 3.5's gated one.)
        shared = moe.shared_hidden_dim
        names = f"{block}.shared_expert{'' if moe.shared_gate else 's'}."
        maps += [layer("mlp/shared_gate_up_weight", (names + "gate_proj.weight",
                                                     names + "up_proj.weight"),
                       stacked_transposed(2, (d, 2, shared))),
                 layer("mlp/shared_down_weight", names + "down_proj.weight",
                       transposed((shared, d)))]
    if moe.shared_gate:
        maps.append(layer("mlp/shared_gate_weight", f"{block}.shared_expert_gate.weight",
                          reshaped((d,), (1, d))))
    return maps
