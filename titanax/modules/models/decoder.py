"""The decoder family -- GPT-2, Llama 2/3, Qwen 2/3, Mistral, and the MoE Mixtral / Qwen 3 MoE --
top to bottom.

One model covers the family, as Hugging Face's modeling files differ only in switches:

    token embedding (+ a learned position table: GPT-2; RoPE models rotate q and k instead)
    -> num_layers x DecoderBlock: x + attn(norm(x)); x + mlp(norm(x))
         norms: RMSNorm, or LayerNorm with a bias (GPT-2)
         attention: fused q/k/v (GPT-2) or per projection with grouped-query kv heads,
         RoPE (theta, Llama 3 scaling) or none, q/k/v and output biases (GPT-2, Qwen 2),
         QK-norm (Qwen 3), sliding window (Mistral), attention dropout (GPT-2)
         mlp: SwiGLU (gated) or GPT-2's GELU MLP, or routed experts (modules/layers/moe.py)
         dropout on the embeddings and each residual branch (GPT-2)
    -> final norm -> LM head (tied to the embedding, or its own table)

Tensor parallelism splits the vocabulary (embedding rows and head rows), the query heads (and
the kv heads when their count divides the TP size; otherwise each rank keeps them whole), and the
MLP's hidden features (the axis binding puts those logical dimensions on the TP axis); the loss
never gathers the logits. Sequence parallelism (``plan.tensor_parallel.sequence_parallel``)
splits the residual stream over the sequence between blocks. Pipelines cut the ``decoder`` stack
(``CausalLanguageModel.pipeline_parts``); FSDP and ZeRO come from the plan's layout.

``titanax.hf`` maps a Hugging Face ``config.json`` onto ``Decoder.Config`` and the weights onto
its params, both ways (``gpt2_config`` / ``llama_config`` / ``qwen3_config`` here give the
published sizes).
"""

from __future__ import annotations

import math
from typing import Dict, Literal, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp

from titanax.modules import sampling
from titanax import errors
from titanax.parallel.axis_binding import HEADS, MLP as MLP_DIM, RESIDUAL_SEQUENCE, SEQUENCE
from titanax.modules.initializers import Normal
from titanax.modules.layers.attention import (Attention, check_implementation,
                                               refuse_ignored_implementation,
                                               refuse_kernel_off_its_device,
                                               refuse_split_attention_dropout)
from titanax.modules.layers.decoder_block import DecoderBlock
from titanax.modules.layers.dropout import Dropout
from titanax.modules.layers.embedding import Embedding, VocabParallelEmbedding
from titanax.modules.layers.gated_deltanet import GatedDeltaNet
from titanax.modules.layers.latent_attention import MultiHeadLatentAttention
from titanax.modules.layers.layer_group import LayerGroup
from titanax.modules.layers.mlp import MLP
from titanax.modules.layers.moe import MoE, check_moe_binding
from titanax.modules.layers.norm import LayerNorm, RMSNorm
from titanax.modules.layers.repeat import UNROLL_UP_TO, Repeat
from titanax.modules.layers.rotary import (Llama3RopeScaling, LinearRopeScaling,
                                            YarnRopeScaling)
from titanax.modules.layers.token_prediction import (ExtraHeads, TokenPrediction,
                                                     TokenPredictions, prediction_heads)
from titanax.modules.models.language_model import UNSET_VOCABULARY, CausalLanguageModel
from titanax.modules.module import nowrap
from titanax.parallel import collectives

# Param paths of GPT checkpoints written before GPT-2 became a configuration of this model
# (``titanax.modules.models.gpt.GPT``): old -> new. A restore maps them (io/checkpointer.py).
GPT_CHECKPOINT_RENAMES = {
    "decoder/layer/ln1": "decoder/layer/input_norm",
    "decoder/layer/ln2": "decoder/layer/post_attention_norm",
    "decoder/layer/attn/out": "decoder/layer/attn/o",
    "decoder/layer/mlp/wi": "decoder/layer/mlp/up",
    "decoder/layer/mlp/wo": "decoder/layer/mlp/down",
}


class Decoder(CausalLanguageModel):
    """A GPT-2 / Llama / Qwen / Mistral language model. ``forward(batch)`` returns
    ``(loss, aux)``."""

    class Config(CausalLanguageModel.Config):
        # Real vocabulary size (GPT-2: 50257; Llama 3: 128256; Qwen 3: 151936; bytes: 256).
        # None: the size the run's train input declares (its tokenizer's), set when the run
        # starts.
        vocab_size: Optional[int] = 32000
        # The embedding / head tables are padded to a multiple of this (fast matmuls; the
        # table must be divisible by the TP size to be split). Padding ids never get probability.
        vocab_pad_multiple: int = 1
        # Longest sequence the model is meant for (HF max_position_embeddings; with learned
        # positions, the rows of the position table): longer inputs are refused before the
        # first step.
        max_seq_len: int = 4096
        # Decoder layers.
        num_layers: int = 32
        # Residual-stream width (HF hidden_size).
        model_dim: int = 4096
        # Query heads.
        num_heads: int = 32
        # Key/value heads (grouped-query attention); None: num_heads.
        num_kv_heads: Optional[int] = None
        # Width of each head; None: model_dim / num_heads.
        head_dim: Optional[int] = None
        # MLP hidden width (HF intermediate_size; a mixture of experts' own width is moe's);
        # None: 4 x model_dim (GPT-2).
        hidden_dim: Optional[int] = 11008
        # A gated MLP (SwiGLU: Llama, Qwen, Mistral); False: GPT-2's up -> GELU -> down.
        gated_mlp: bool = True
        # The MLP's activation: "silu" (SwiGLU), "gelu_tanh" (GPT-2), "gelu", "relu".
        mlp_activation: Literal["silu", "gelu_tanh", "gelu", "relu"] = "silu"
        # Every block's MLP a mixture of experts (Mixtral, Qwen 3 MoE): its model_dim follows
        # the model's; None: dense MLPs of hidden_dim.
        moe: Optional[MoE.Config] = None
        # "rms": RMSNorm (Llama, Qwen, Mistral); "layer": LayerNorm with a bias (GPT-2).
        norm: Literal["rms", "layer"] = "rms"
        # The norms' epsilon (HF rms_norm_eps / layer_norm_epsilon).
        norm_eps: float = 1e-6
        # "rotary": RoPE in every attention; "learned": a table of max_seq_len positions added
        # to the token embeddings (GPT-2).
        position_embedding: Literal["rotary", "learned"] = "rotary"
        # Rotary base (HF rope_theta).
        rope_theta: float = 10000.0
        # Frequency rescaling: Llama 3.1's (HF rope_type "llama3"), linear (HF "linear":
        # Gemma 3's global layers) or YaRN (HF "yarn": gpt-oss, DeepSeek-V3, long-context
        # Qwen); None: plain RoPE.
        rope_scaling: Optional[Union[Llama3RopeScaling.Config, LinearRopeScaling.Config,
                                     YarnRopeScaling.Config]] = None
        # One q/k/v projection (GPT-2's c_attn; needs num_kv_heads None).
        fused_qkv: bool = False
        # Biases on q, k, v (GPT-2, Qwen 2; Llama's attention_bias sets this and output_bias).
        qkv_bias: bool = False
        # Bias on the attention output projection.
        attention_output_bias: bool = False
        # Biases on the MLP projections (GPT-2; HF mlp_bias).
        mlp_bias: bool = False
        # RMSNorm of every q and k head before RoPE (Qwen 3, Gemma 3).
        qk_norm: bool = False
        # What the attention scores are multiplied by; None: 1 / sqrt(head_dim) (Gemma 3:
        # query_pre_attn_scalar ** -0.5).
        attention_scale: Optional[float] = None
        # The token embeddings are multiplied by this before the first block (Gemma:
        # sqrt(model_dim), rounded to the embedding's dtype as Gemma's code does; the tied LM
        # head reads the table unscaled).
        embedding_multiplier: float = 1.0
        # A norm of each residual branch's output before it joins the stream (Gemma 2/3's
        # post-attention and post-feedforward norms: DecoderBlock.Config.output_norms).
        branch_output_norms: bool = False
        # The blocks', QK and final RMSNorms scale by 1 + their params, which start at 0 (Qwen
        # 3.5, Gemma: "zero-centered"; a Gated DeltaNet's gated norm keeps its plain scale, as
        # Qwen's); False: the param is the scale (Llama, Qwen 3).
        norm_zero_centered: bool = False
        # A sigmoid gate per attention head on its output, from a second query-sized
        # projection (Qwen 3.5's gated attention).
        attention_output_gate: bool = False
        # A learned logit per attention head in every query's softmax, a key without a value
        # (gpt-oss's sinks: Attention.Config.sinks).
        attention_sinks: bool = False
        # The part of each head RoPE rotates (Qwen 3.5: 0.25, HF partial_rotary_factor).
        rotary_fraction: float = 1.0
        # Mistral's sliding-window attention (positions attended, itself included); None: full.
        sliding_window: Optional[int] = None
        # The LM head is the token embedding (HF tie_word_embeddings; GPT-2: always).
        tie_embeddings: bool = False
        # Dropout on the embeddings and each residual branch (GPT-2: 0.1; training only).
        dropout_rate: float = 0.0
        # Dropout on the attention probabilities (training only).
        attention_dropout_rate: float = 0.0
        # How attention runs (Attention.Config.implementation): "auto", "dense", "blockwise"
        # (O(S) memory), "fused" (jax.nn.dot_product_attention: cuDNN on a GPU) or "pallas"
        # (jax's Pallas flash kernel: packed documents, any float dtype, no sliding window).
        attention_implementation: str = "auto"
        # Query / key block length of blockwise attention.
        attention_block_size: int = 512
        # jax.checkpoint policy per block in training (None: keep activations).
        layer_remat_policy: Optional[str] = None
        # Trace the blocks one after another instead of a lax.scan over them; None: unrolled up
        # to 12 layers, scanned beyond (see Repeat.Config.unroll).
        unroll_layers: Optional[bool] = None
        # The kinds of one repeating group of layers, in order: "full" (attention over every
        # earlier position), "sliding" (attention within sliding_window) or "linear" (Gated
        # DeltaNet, linear_attention). Gemma 3: 5 x "sliding" then "full"; gpt-oss: "sliding",
        # "full"; Qwen 3.5: 3 x "linear" then "full". The stack repeats the group num_layers //
        # len(pattern) times (layer g * len + i is member i of repetition g: param path
        # decoder/layer/{i}/..., modules/layers/layer_group.py); a depth the pattern does not
        # divide ends in the pattern's first num_layers % len(pattern) kinds, unrolled after
        # the stack (Gemma 3 27B: 62 layers = 10 x 6 + 2; param path decoder_tail/{i}/...).
        # None: every layer alike (full, or sliding where sliding_window is set), param path
        # decoder/layer/...
        layer_pattern: Optional[Sequence[Literal["full", "sliding", "linear"]]] = None
        # RoPE base of the pattern's "sliding" layers, which then rotate by plain RoPE, without
        # rope_scaling (Gemma 3: 10000; its full layers 1000000, scaled linearly by 8 at 4B and
        # up); None: the sliding layers rotate as the full ones (rope_theta, rope_scaling).
        sliding_rope_theta: Optional[float] = None
        # The Gated DeltaNet of the pattern's "linear" layers (its model_dim follows the
        # model's).
        linear_attention: Optional[GatedDeltaNet.Config] = None
        # The first this many layers have a dense MLP of hidden_dim where the others have moe's
        # experts (DeepSeek-V3: 3, HF first_k_dense_replace); they run before the stack,
        # unstacked (param path decoder_head/{i}/...; under a pipeline, on the first stage with
        # the embedding).
        first_dense_layers: int = 0
        # Multi-head latent attention in place of every attention layer (DeepSeek-V2/V3, Kimi
        # K2; its model_dim, sliding window, RoPE base and scaling follow the model's; num_heads,
        # num_kv_heads, head_dim, the biases and QK-norm are not read). None: Attention.
        latent_attention: Optional[MultiHeadLatentAttention.Config] = None
        # Multi-token prediction: this many extra depths, each predicting one token further
        # ahead through a decoder block of the stack's kind and the shared embedding and head,
        # trained beside the next-token loss (DeepSeek-V3: 1, HF num_nextn_predict_layers;
        # modules/layers/token_prediction.py; param path prediction/{k-1}/...). Each depth's
        # loss is the metric mtp_loss/<k>. 0: none.
        mtp_depths: int = 0
        # The weight of the depths' mean loss in the gradient (DeepSeek-V3: 0.3 for its first
        # 10T tokens, then 0.1); the reported loss stays the next-token one.
        mtp_loss_weight: float = 0.3

        def _validate_values(self):
            yield from super()._validate_values()
            if self.vocab_size is None:
                yield "vocab_size", UNSET_VOCABULARY
            for name in ("vocab_size", "max_seq_len", "num_layers", "model_dim", "num_heads",
                         "hidden_dim", "vocab_pad_multiple"):
                value = getattr(self, name)
                if isinstance(value, int) and value < 1:
                    yield name, f"must be >= 1, got {value}"
            for name in ("num_kv_heads", "head_dim"):
                value = getattr(self, name)
                if value is not None and value < 1:
                    yield name, f"must be >= 1 (or None), got {value}"
            heads, kv = self.num_heads, self.num_kv_heads
            if kv is not None and heads >= 1 and kv >= 1 and heads % kv:
                yield "num_kv_heads", f"must divide num_heads={heads}"
            if self.fused_qkv and kv is not None and kv != heads:
                yield "fused_qkv", "one q/k/v projection has as many kv heads as query heads"
            if self.head_dim is None and heads >= 1 and self.model_dim % heads:
                yield "num_heads", (f"must divide model_dim={self.model_dim}, or set head_dim")
            width = self.head_dim or (self.model_dim // heads if heads >= 1 else 0)
            if width % 2 and self.position_embedding == "rotary":
                yield ("head_dim" if self.head_dim else "model_dim",
                       f"gives heads of width {width}: RoPE rotates pairs, the width must be even")
            if self.norm_eps <= 0:
                yield "norm_eps", f"must be > 0, got {self.norm_eps}"
            if self.rope_theta <= 0:
                yield "rope_theta", f"must be > 0, got {self.rope_theta}"
            if self.sliding_window is not None and self.sliding_window < 1:
                yield "sliding_window", f"must be >= 1 (or None), got {self.sliding_window}"
            if self.moe is not None and self.mlp_bias:
                yield "mlp_bias", "a mixture of experts has no MLP biases: set it False with moe"
            for name in ("dropout_rate", "attention_dropout_rate"):
                value = getattr(self, name)
                if not 0.0 <= value < 1.0:
                    yield name, f"must be in [0, 1), got {value}"
            for _, message in check_implementation(self.attention_implementation,
                                                   self.attention_dropout_rate,
                                                   sliding_window=self.sliding_window):
                yield "attention_implementation", message
            if self.attention_block_size < 1:
                yield "attention_block_size", f"must be >= 1, got {self.attention_block_size}"
            yield from _pattern_problems(self)
            if self.mtp_depths < 0:
                yield "mtp_depths", f"must be >= 0, got {self.mtp_depths}"
            if self.mtp_loss_weight < 0:
                yield "mtp_loss_weight", f"must be >= 0, got {self.mtp_loss_weight}"

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        table = VocabParallelEmbedding.default_config().set(
            num_embeddings=self.padded_vocab_size, dim=cfg.model_dim)
        self._add_child("token_emb", table)
        if cfg.position_embedding == "learned":
            self._add_child("pos_emb", Embedding.default_config().set(
                num_embeddings=cfg.max_seq_len, dim=cfg.model_dim))
        self._add_child("emb_dropout", Dropout.default_config().set(
            rate=cfg.dropout_rate, split_dims=(RESIDUAL_SEQUENCE,)))
        if not cfg.tie_embeddings:
            self._add_child("lm_head", table.clone())
        # The projections that write into the residual stream start smaller, by
        # 1 / sqrt(2 x layers) (GPT-2's scheme).
        output_init = Normal.default_config().set(stddev=0.02 / math.sqrt(2 * cfg.num_layers))
        block = _block_config(cfg, output_init)
        if cfg.first_dense_layers:  # (Unstacked, before the stack: dense MLPs.)
            dense = block.clone(mlp=_dense_mlp(cfg, output_init),
                                remat_policy=cfg.layer_remat_policy)
            self._add_child("decoder_head", LayerGroup.default_config().set(
                layers=[dense] * cfg.first_dense_layers))
        layer, repetitions = block, cfg.num_layers - cfg.first_dense_layers
        if cfg.layer_pattern is not None:
            members = [_block_of_kind(cfg, block, kind, output_init) for kind in cfg.layer_pattern]
            if cfg.layer_remat_policy is not None:
                # Each member its own checkpoint too: a group's backward then holds one layer's
                # activations, not the whole group's (and the tail's layers are rematerialised).
                members = [m.clone(remat_policy=m.remat_policy or cfg.layer_remat_policy)
                           for m in members]
            layer = LayerGroup.default_config().set(layers=members)
            repetitions, tail = divmod(cfg.num_layers, len(cfg.layer_pattern))
            if tail:  # (Unstacked, after the stack: the pattern's first `tail` kinds.)
                self._add_child("decoder_tail",
                                LayerGroup.default_config().set(layers=members[:tail]))
        # (None unrolls by the model's depth in layers, not in repetitions of a pattern.)
        unroll = cfg.unroll_layers if cfg.unroll_layers is not None else \
            cfg.num_layers <= UNROLL_UP_TO
        self._add_child("decoder", Repeat.default_config().set(
            layer=layer, num_layers=repetitions, layer_remat_policy=cfg.layer_remat_policy,
            unroll=unroll))
        norm = LayerNorm if cfg.norm == "layer" else RMSNorm
        final_norm = norm.default_config().set(input_dim=cfg.model_dim, eps=cfg.norm_eps)
        if cfg.norm_zero_centered:
            final_norm.zero_centered = True
        self._add_child("final_norm", final_norm)
        if cfg.mtp_depths:  # (A full-attention block of the stack's MLP: DeepSeek-V3's MoE.)
            depth_block = _block_of_kind(cfg, block, "full", output_init)
            self._add_child("prediction", TokenPredictions.default_config().set(
                num_depths=cfg.mtp_depths, depth=TokenPrediction.default_config().set(
                    model_dim=cfg.model_dim, norm=final_norm,
                    block=depth_block.clone(remat_policy=cfg.layer_remat_policy))))
        # (A checkpoint of the former GPT class restores with its param paths mapped.)
        self.checkpoint_renames = (GPT_CHECKPOINT_RENAMES
                                   if cfg.position_embedding == "learned" else {})

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_kv_heads or self.config.num_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim or self.config.model_dim // self.config.num_heads

    @nowrap
    def check_axis_binding(self, binding, *, path):
        # Options set on the model, refused under the path the user sets them by.
        refuse_split_attention_dropout(self.config.attention_dropout_rate, binding, path=path)
        refuse_ignored_implementation(self.config.attention_implementation, binding,
                                      path=f"{path}.attention_implementation")
        refuse_kernel_off_its_device(self.config.attention_implementation,
                                     path=f"{path}.attention_implementation")
        if self.config.moe is not None:
            check_moe_binding(self.config.moe, binding, path=f"{path}.moe")
        split = binding.active(RESIDUAL_SEQUENCE) or binding.axis(SEQUENCE)
        if self.config.mtp_depths and split is not None:
            raise errors.PlanError(
                f"the multi-token-prediction depths read tokens further along the sequence, "
                f"which mesh axis {split!r} splits (sequence or context parallelism): not "
                f"implemented yet", path=f"{path}.mtp_depths",
                suggestion="set it to 0, or train without sequence / context parallelism")
        super().check_axis_binding(binding, path=path)

    @nowrap
    def head(self) -> VocabParallelEmbedding:
        return self.token_emb if self.config.tie_embeddings else self.lm_head

    def extra_heads(self, hidden: jax.Array, batch: Dict[str, jax.Array], *,
                    weights: jax.Array) -> Optional[ExtraHeads]:
        """The multi-token-prediction depths' head inputs in training, their loss sum
        ``mtp_loss_weight / D x (L_1 + ... + L_D)`` (layers/token_prediction.py; one embedding
        lookup for every depth); none in evaluation or without depths."""
        if "prediction" not in self.children or not self.is_training:
            return None
        return prediction_heads(
            self, hidden, batch, weights=weights,
            token_embeddings=self.embed(batch["input_ids"], batch.get("positions")),
            loss_weight=self.config.mtp_loss_weight)

    @nowrap
    def flops_per_token(self, seq_len: int) -> float:
        """The stack's count (``CausalLanguageModel.flops_per_token``: the depths' params are
        among the model's) plus each multi-token-prediction depth's own pass through the LM
        head and its attention over the sequence."""
        cfg = self.config
        depths = cfg.mtp_depths * (6.0 * self.padded_vocab_size * cfg.model_dim
                                   + 12.0 * self.attention_width() * seq_len)
        return super().flops_per_token(seq_len) + depths

    @nowrap
    def attention_width(self) -> int:
        return self.config.num_heads * self.head_dim

    def stack_head(self, embedded: jax.Array, **layer_inputs) -> jax.Array:
        """The layers before the stack (``decoder_head``: dense first layers), if any."""
        if "decoder_head" not in self.children:
            return embedded
        return self.decoder_head(embedded, **layer_inputs)

    def stack_tail(self, decoded: jax.Array, **layer_inputs) -> jax.Array:
        """The layers after the stack (``decoder_tail``: a depth the layer pattern does not
        divide), if any."""
        if "decoder_tail" not in self.children:
            return decoded
        return self.decoder_tail(decoded, **layer_inputs)

    def embed(self, input_ids: jax.Array, positions: Optional[jax.Array] = None) -> jax.Array:
        """The token embeddings ``[batch, seq, model_dim]`` (this rank's part of the sequence
        under sequence parallelism; times ``embedding_multiplier``), plus the learned
        positions' (GPT-2: ``positions`` --
        packed rows: each token's place in its document -- pick the rows, by default
        ``0 .. seq-1``); rotary models read the positions in attention."""
        x = self.token_emb(input_ids)
        cfg = self.config
        if cfg.embedding_multiplier != 1.0:  # (In the embedding's dtype, as Gemma's code.)
            x = x * jnp.asarray(cfg.embedding_multiplier, x.dtype)
        if cfg.position_embedding == "learned":
            length = x.shape[1]
            start = self.axis_binding.rank(RESIDUAL_SEQUENCE) * length
            if positions is None:
                positions = (start if self._split_sequence() else 0) + jnp.arange(length)
            elif self._split_sequence():  # This rank's part of the sequence.
                positions = jax.lax.dynamic_slice_in_dim(positions, start, length, axis=1)
            return self.emb_dropout(x + self.pos_emb(positions))
        binding = self.axis_binding
        biased = ([binding.active(HEADS)] if cfg.attention_output_bias
                  or cfg.branch_output_norms else []) + \
            ([binding.active(MLP_DIM)] if cfg.mlp_bias or cfg.branch_output_norms else [])
        for axis in sorted({a for a in biased if a is not None}):
            # A bias added -- or a norm's scale multiplied (Gemma's branch output norms) --
            # after a row-parallel psum varies over the TP axis as the params do, so the
            # residual stream does from the first block on; the layer loop's carry must have
            # one type, so it starts so (the first block would cast it anyway). (A learned
            # position table, replicated over TP, makes it vary from the start.)
            x = collectives.cast_varying(x, axis)
        return self.emb_dropout(x)

    # --- Generation: a key/value cache, one token at a time --------------------------------------

    def generate(self, prompt_ids: jax.Array, key: Optional[jax.Array], *, max_new_tokens: int,
                 temperature: Optional[float] = None, top_p: float = 1.0,
                 prompt_lengths: Optional[jax.Array] = None) -> jax.Array:
        """``[batch, max_new_tokens]`` tokens following ``prompt_ids`` (``sample``'s
        ``tokens``)."""
        return self.sample(prompt_ids, key, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_p=top_p,
                           prompt_lengths=prompt_lengths)["tokens"]

    def sample(self, prompt_ids: jax.Array, key: Optional[jax.Array], *, max_new_tokens: int,
               temperature: Optional[float] = None, top_p: float = 1.0,
               prompt_lengths: Optional[jax.Array] = None, end_ids: Sequence[int] = (),
               agree_over: Sequence[str] = ()) -> Dict[str, jax.Array]:
        """``max_new_tokens`` tokens after each prompt of ``prompt_ids`` ``[batch, prompt]``:
        the prompts run once through the stack (prefill), filling a key/value cache of ``prompt
        + max_new_tokens`` positions; then each new token runs alone over the cache. Greedy
        without a temperature (``sampling.next_token``). ``prompt_lengths`` ``[batch]``: the
        prompts are left-padded to one length, row ``i``'s real tokens its last
        ``prompt_lengths[i]`` (None: all real) -- padding is seen by no token and shifts no
        position, so a row samples as it would alone.

        Returns ``tokens`` ``[batch, max_new_tokens]`` and, per token, ``logps`` -- its
        log-probability under the distribution it was drawn from before top-p (the logits
        divided by the temperature, as an RL trainer scores it) -- and ``entropy`` of that
        distribution, both float32. Runs in local view like ``forward``: heads split over TP,
        rows over the batch axes.

        ``end_ids``: decoding stops once every row has drawn one of them -- agreed over the
        mesh axes ``agree_over`` (the batch axes: every device runs as many steps); the places
        after that hold ``end_ids[0]``, log-prob and entropy 0 (a row that ended earlier keeps
        what it drew until then: its end token marks where it stops)."""
        if self._split_sequence():
            raise NotImplementedError("decoding has no sequence to split: generate under a "
                                      "binding without residual_sequence")
        batch, prompt = prompt_ids.shape
        cache = self._empty_cache(batch=batch, length=prompt + max_new_tokens)
        offsets = None if prompt_lengths is None else prompt - prompt_lengths.astype(jnp.int32)

        def positions(first, length):
            places = jnp.broadcast_to(first + jnp.arange(length), (batch, length))
            return places if offsets is None else jnp.maximum(places - offsets[:, None], 0)

        def choose(x, cache_out, step):
            logits = self.full_logits(self._logits_of(self.final_norm(x[:, -1:])))[:, -1]
            step_key = None if key is None else jax.random.fold_in(key, step)
            token = sampling.next_token(logits, step_key, temperature=temperature, top_p=top_p)
            logp, entropy = sampling.token_logp_and_entropy(logits, token,
                                                            temperature=temperature)
            return (token, logp, entropy), cache_out

        x, cache = self._decode_layers(self.embed(prompt_ids, positions(0, prompt)), cache,
                                       start=0, offsets=offsets)
        first, cache = choose(x, cache, 0)

        def step(carry, index):
            chosen, cache_in = carry
            x, cache_out = self._decode_layers(
                self.embed(chosen[0][:, None], positions(prompt + index, 1)), cache_in,
                start=prompt + index, offsets=offsets)
            return choose(x, cache_out, index + 1), chosen

        if not end_ids:
            (last, _), chosen = jax.lax.scan(step, (first, cache),
                                             jnp.arange(max_new_tokens - 1))
            return {name: jnp.concatenate([values.T, final[:, None]], axis=1)
                    for name, values, final in zip(("tokens", "logps", "entropy"), chosen, last)}
        return self._sample_until_ended(step, first, cache, max_new_tokens=max_new_tokens,
                                        end_ids=end_ids, agree_over=agree_over)

    def _decode_layers(self, x, cache, *, start, offsets):
        """Every layer's ``decode`` over ``cache`` (``_empty_cache``'s): the head's, the
        stack's, then the tail's."""
        if not isinstance(cache, dict):
            return self.decoder.decode(x, cache, start=start, offsets=offsets)
        out = {}
        for part, module in (("head", "decoder_head"), ("stack", "decoder"),
                             ("tail", "decoder_tail")):
            if part in cache:
                x, out[part] = getattr(self, module).decode(x, cache[part], start=start,
                                                            offsets=offsets)
        return x, out

    def _empty_cache(self, *, batch: int, length: int):
        """Every layer's cache, zeros: ``(k, v)`` of ``length`` positions stacked over the layers,
        or with a layer pattern one cache per member of the group, stacked over its repetitions
        (a Gated DeltaNet's: its convolution window and state, ``GatedDeltaNet.empty_cache``);
        with a ``decoder_head`` or ``decoder_tail``, ``{"head": one per head layer, "stack": the
        stack's, "tail": one per tail layer}``."""
        dtype = self.parameters["token_emb"]["weight"].dtype

        def cache(block, block_params, layers):
            if isinstance(block.attn, GatedDeltaNet):  # (A convolution window and a state.)
                return block.attn.empty_cache(block_params["attn"], layers=layers,
                                              batch=batch, dtype=dtype)
            shape = block.attn.cache_shape(block_params["attn"], layers=layers,
                                           batch=batch, length=length)
            if isinstance(block.attn, MultiHeadLatentAttention):  # (The latent and rope key.)
                return tuple(jnp.zeros(part, dtype) for part in shape)
            return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

        return self._per_block(cache)

    def _per_block(self, cache):
        """``cache(block, its params stacked over layers, layers)`` for the stack (one per
        member of a pattern's group, stacked over its repetitions) and, with a ``decoder_head``
        or ``decoder_tail``, ``{"head": one per head layer, "stack": the stack's, "tail": one per
        tail layer}`` -- the structure ``_decode_layers`` walks."""
        params = self.parameters["decoder"]["layer"]
        repetitions = self.decoder.config.num_layers
        if not isinstance(self.decoder.layer, LayerGroup):
            stack = cache(self.decoder.layer, params, repetitions)
        else:
            stack = tuple(cache(member, params[str(i)], repetitions)
                          for i, member in enumerate(self.decoder.layer.members))
        unstacked = {part: module for part, module in (("head", "decoder_head"),
                                                       ("tail", "decoder_tail"))
                     if module in self.children}
        if not unstacked:
            return stack
        out = {"stack": stack}
        for part, module in unstacked.items():
            # (Unstacked params: each cache as one layer's, its layer axis dropped.)
            group_params = {name: jax.tree_util.tree_map(lambda p: p[None], value)
                            for name, value in self.parameters[module].items()}
            out[part] = tuple(
                jax.tree_util.tree_map(lambda a: a[0], cache(member, group_params[str(i)], 1))
                for i, member in enumerate(getattr(self, module).members))
        return out

    # --- Generation over a paged cache (titanax/decoding) ------------------------------------

    def empty_paged_cache(self, *, num_blocks: int, block_size: int, slots: int):
        """Every layer's pool for the decode engine, zeros, in ``_empty_cache``'s structure
        (``_per_block``): an attention's ``(k, v)`` ``[layers, num_blocks, block_size, local kv
        heads, head_dim]``, a latent attention's latents and RoPE keys in blocks alike (one head
        wide), a Gated DeltaNet's windows and state per decode slot, ``slots`` of them (the
        state with heads and d_k swapped: ``decoding/slot_states.py``)."""
        dtype = self.parameters["token_emb"]["weight"].dtype
        for block in self._blocks():
            if isinstance(block.mlp, MoE) and block.mlp.config.dispatch != "dropless":
                raise errors.DecodingError(
                    "experts of a fixed capacity would be shared with the batch's idle and "
                    "padding rows, so a sequence's tokens would depend on what ran beside it",
                    path="model.moe.dispatch", suggestion="decode with dispatch='dropless'")

        def pools(block, block_params, layers):
            attn, attn_params = block.attn, block_params["attn"]
            if isinstance(attn, GatedDeltaNet):
                return attn.empty_slot_states(attn_params, layers=layers, slots=slots,
                                              dtype=dtype)
            if isinstance(attn, MultiHeadLatentAttention):
                return tuple(jnp.zeros(shape, dtype) for shape in attn.paged_cache_shape(
                    attn_params, layers=layers, num_blocks=num_blocks, block_size=block_size))
            shape = attn.cache_shape(attn_params, layers=layers, batch=num_blocks,
                                     length=block_size)
            return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

        return self._per_block(pools)

    def paged_logits(self, token_ids: jax.Array, pools, paging) -> Tuple[jax.Array, object]:
        """The logits after each row's last token of ``token_ids`` ``[b, t]`` -- the tokens at
        ``paging.positions`` (-1 after a row's last: a shorter prompt), their keys and values
        written into ``pools`` (``empty_paged_cache``'s) through ``paging.tables`` -- and the
        pools. A prompt's prefill is all its tokens at once; decoding is one token per row."""
        x = self.embed(token_ids, jnp.maximum(paging.positions, 0))
        x, pools = self._decode_layers(x, pools, start=paging, offsets=None)
        last = jnp.argmax(paging.positions, axis=1)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)
        return self.full_logits(self._logits_of(self.final_norm(x)))[:, -1], pools

    def _blocks(self):
        """Each kind of block the model decodes through: the stack's (each member of a
        pattern's) and the unstacked head and tail layers."""
        layer = self.decoder.layer
        blocks = list(layer.members) if isinstance(layer, LayerGroup) else [layer]
        for module in ("decoder_head", "decoder_tail"):
            if module in self.children:
                blocks += list(getattr(self, module).members)
        return blocks

    def _sample_until_ended(self, step, first, cache, *, max_new_tokens: int,
                            end_ids: Sequence[int], agree_over: Sequence[str]):
        """``sample``'s loop that stops once every row (on every device of ``agree_over``) has
        drawn an end token; ``step(carry, index)`` as ``sample``'s."""
        ends = jnp.asarray(list(end_ids), jnp.int32)
        batch = first[0].shape[0]
        buffers = tuple(jnp.zeros((batch, max_new_tokens), v.dtype).at[:, 0].set(v)
                        for v in first)
        ended = jnp.isin(first[0], ends)

        def unfinished(ended):
            count = jnp.sum(~ended).astype(jnp.int32)
            return collectives.psum(count, tuple(agree_over)) if agree_over else count

        def cond(carry):
            index, _, _, _, _, waiting = carry
            return (index < max_new_tokens) & (waiting > 0)

        def body(carry):
            index, chosen, cache_in, buffers, ended, _ = carry
            now, cache_out = step((chosen, cache_in), index - 1)[0]
            buffers = tuple(jax.lax.dynamic_update_slice_in_dim(b, v[:, None].astype(b.dtype),
                                                                index, 1)
                            for b, v in zip(buffers, now))
            ended = ended | jnp.isin(now[0], ends)
            return index + 1, now, cache_out, buffers, ended, unfinished(ended)

        index, _, _, buffers, _, _ = jax.lax.while_loop(
            cond, body, (jnp.asarray(1, jnp.int32), first, cache, buffers, ended,
                         unfinished(ended)))
        unused = jnp.arange(max_new_tokens)[None, :] >= index
        tokens, logps, entropy = buffers
        return {"tokens": jnp.where(unused, ends[0], tokens),
                "logps": jnp.where(unused, 0.0, logps),
                "entropy": jnp.where(unused, 0.0, entropy)}


def _pattern_problems(cfg):
    """The newer families' switches (Qwen 3.5, Gemma) against the fields they read, and
    ``layer_pattern``'s agreement with the fields its kinds read (Config validation)."""
    if cfg.norm_zero_centered and cfg.norm != "rms":
        yield "norm_zero_centered", "centres RMSNorm's scale: set norm='rms'"
    for name in ("attention_scale", "embedding_multiplier"):
        value = getattr(cfg, name)
        if value is not None and not value > 0:
            yield name, f"must be > 0, got {value}"
    if not 0.0 < cfg.rotary_fraction <= 1.0:
        yield "rotary_fraction", f"must be in (0, 1], got {cfg.rotary_fraction}"
    if cfg.sliding_rope_theta is not None and not cfg.sliding_rope_theta > 0:
        yield "sliding_rope_theta", f"must be > 0, got {cfg.sliding_rope_theta}"
    if cfg.sliding_rope_theta is not None and "sliding" not in (cfg.layer_pattern or ()):
        yield "sliding_rope_theta", ("is the RoPE base of a layer pattern's 'sliding' layers, "
                                     "and there are none: leave it None")
    if cfg.rotary_fraction != 1.0 and cfg.position_embedding != "rotary":
        yield "rotary_fraction", "is the part of each head RoPE rotates: set it with rotary positions"
    if cfg.first_dense_layers:
        if not 0 < cfg.first_dense_layers < cfg.num_layers:
            yield "first_dense_layers", (f"must be in [0, num_layers={cfg.num_layers}), got "
                                         f"{cfg.first_dense_layers}")
        if cfg.moe is None:
            yield "first_dense_layers", "are dense where the rest have experts: set moe"
        if cfg.layer_pattern is not None:
            yield "first_dense_layers", "with a layer pattern is not implemented yet"
    if cfg.latent_attention is not None:
        if cfg.position_embedding != "rotary":
            yield "latent_attention", "rotates its shared key: set position_embedding='rotary'"
        attention_only = [name for name in ("attention_sinks", "attention_output_gate",
                                            "qk_norm", "qkv_bias", "attention_output_bias",
                                            "fused_qkv") if getattr(cfg, name)]
        if attention_only:
            yield "latent_attention", (f"replaces Attention, so {', '.join(attention_only)} "
                                       "would be ignored: unset them (MLA's own biases: "
                                       "latent_attention.bias)")
    if cfg.linear_attention is not None and "linear" not in (cfg.layer_pattern or ()):
        yield "linear_attention", ("configures the layer pattern's 'linear' layers, and there "
                                   "are none: leave it None")
    pattern = cfg.layer_pattern
    if pattern is None:
        return
    if not pattern:
        yield "layer_pattern", "needs at least one kind (or None: every layer alike)"
        return
    unknown = sorted(set(pattern) - set(LAYER_KINDS))
    if unknown:
        yield "layer_pattern", f"unknown kind(s) {unknown}; each one of {list(LAYER_KINDS)}"
    if 1 <= cfg.num_layers < len(pattern):
        yield "num_layers", (f"must be at least the layer pattern's length {len(pattern)} (the "
                             f"stack repeats the pattern), got {cfg.num_layers}")
    if "sliding" in pattern and cfg.sliding_window is None:
        yield "sliding_window", "the layer pattern has sliding layers: give their window"
    if cfg.sliding_window is not None and "sliding" not in pattern:
        yield "sliding_window", ("with a layer pattern it is the window of its 'sliding' "
                                 "layers, and the pattern has none")
    if "linear" in pattern and cfg.linear_attention is None:
        yield "linear_attention", "the layer pattern has linear layers: configure their Gated DeltaNet"


def _dense_mlp(cfg, output_init) -> MLP.Config:
    """The dense feed-forward block of a Decoder config (hidden_dim wide)."""
    return MLP.default_config().set(
        model_dim=cfg.model_dim, hidden_dim=cfg.hidden_dim or 4 * cfg.model_dim,
        gated=cfg.gated_mlp, activation=cfg.mlp_activation, bias=cfg.mlp_bias,
        output_param_init=output_init)


def _block_config(cfg, output_init) -> DecoderBlock.Config:
    """The decoder block a Decoder config describes (a layer pattern's kinds change its mixer:
    ``_block_of_kind``)."""
    attention = Attention.default_config().set(
        model_dim=cfg.model_dim, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, fused_qkv=cfg.fused_qkv,
        rotary=cfg.position_embedding == "rotary", rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling, qkv_bias=cfg.qkv_bias,
        output_bias=cfg.attention_output_bias, qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps,
        scale=cfg.attention_scale, norm_zero_centered=cfg.norm_zero_centered,
        output_gate=cfg.attention_output_gate, rotary_fraction=cfg.rotary_fraction,
        sinks=cfg.attention_sinks,
        sliding_window=cfg.sliding_window, attention_dropout_rate=cfg.attention_dropout_rate,
        implementation=cfg.attention_implementation, block_size=cfg.attention_block_size,
        output_param_init=output_init)
    if cfg.moe is not None:
        mlp = cfg.moe.clone(model_dim=cfg.model_dim, output_param_init=output_init)
    else:
        mlp = _dense_mlp(cfg, output_init)
    if cfg.latent_attention is not None:  # (DeepSeek's attention in every attention layer.)
        attention = cfg.latent_attention.clone(
            model_dim=cfg.model_dim, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
            sliding_window=cfg.sliding_window, norm_eps=cfg.norm_eps, output_param_init=output_init,
            implementation=cfg.attention_implementation, block_size=cfg.attention_block_size)
    return DecoderBlock.default_config().set(
        model_dim=cfg.model_dim, attention=attention, mlp=mlp, norm=cfg.norm,
        norm_eps=cfg.norm_eps, norm_zero_centered=cfg.norm_zero_centered,
        dropout_rate=cfg.dropout_rate, output_norms=cfg.branch_output_norms)


# The kinds a layer pattern names (Decoder.Config.layer_pattern).
LAYER_KINDS = ("full", "sliding", "linear")


def layer_kinds(cfg) -> Tuple[str, ...]:
    """Every layer's kind, first to last: the pattern repeated through the depth (a tail
    included), or one kind for every layer ("sliding" where sliding_window is set)."""
    if cfg.layer_pattern is None:
        return ("sliding" if cfg.sliding_window is not None else "full",) * cfg.num_layers
    pattern = tuple(cfg.layer_pattern)
    return (pattern * -(-cfg.num_layers // len(pattern)))[:cfg.num_layers]


def _block_of_kind(cfg, block, kind, output_init):
    """The decoder block of one ``layer_pattern`` kind: ``block`` with its mixer changed."""
    attention = block.attention
    if kind == "full":
        return block.clone(attention=attention.clone(sliding_window=None))
    if kind == "sliding" and cfg.sliding_rope_theta is not None:  # (Plain RoPE: Gemma 3.)
        return block.clone(attention=attention.clone(
            sliding_window=cfg.sliding_window, rope_theta=cfg.sliding_rope_theta,
            rope_scaling=None))
    if kind == "sliding":
        return block.clone(attention=attention.clone(sliding_window=cfg.sliding_window))
    linear = cfg.linear_attention
    if linear.output_param_init is None:  # (The model's residual-branch init, unless set.)
        linear = linear.clone(output_param_init=output_init)
    return block.clone(attention=linear)


def gpt_config(**overrides) -> Decoder.Config:
    """GPT-2's switches of the family (learned positions, LayerNorm, fused q/k/v with biases,
    GELU MLP with biases, tied head) at GPT-2 small's size, then ``overrides``."""
    return Decoder.default_config().set(
        name="gpt", vocab_size=50257, max_seq_len=1024, num_layers=12, model_dim=768,
        num_heads=12, hidden_dim=None, gated_mlp=False, mlp_activation="gelu_tanh",
        norm="layer", norm_eps=1e-5, position_embedding="learned", fused_qkv=True,
        qkv_bias=True, attention_output_bias=True, mlp_bias=True,
        tie_embeddings=True).set(**overrides)


def is_gpt2(cfg) -> bool:
    """Whether a model config is GPT-2's configuration of the family (its HF names)."""
    return getattr(cfg, "position_embedding", None) == "learned"


def gpt2_config(size: str, **overrides) -> Decoder.Config:
    """Standard GPT-2 sizes: "small" (124M), "medium" (350M), "large" (774M), "xl" (1.5B)."""
    shapes = {"small": (12, 768, 12), "medium": (24, 1024, 16), "large": (36, 1280, 20),
              "xl": (48, 1600, 25)}
    if size not in shapes:
        raise ValueError(f"unknown GPT-2 size {size!r}; one of {', '.join(shapes)}")
    num_layers, model_dim, num_heads = shapes[size]
    return gpt_config(num_layers=num_layers, model_dim=model_dim, num_heads=num_heads,
                      **overrides)


def llama_config(size: str, **overrides) -> Decoder.Config:
    """Published Llama 3 sizes: "3.2-1b", "3.2-3b", "3.1-8b", "3.1-70b"."""
    scaling = Llama3RopeScaling.default_config()
    shapes = {
        # layers, width, heads, kv heads, hidden, tied, rope factor
        "3.2-1b": (16, 2048, 32, 8, 8192, True, 32.0),
        "3.2-3b": (28, 3072, 24, 8, 8192, True, 32.0),
        "3.1-8b": (32, 4096, 32, 8, 14336, False, 8.0),
        "3.1-70b": (80, 8192, 64, 8, 28672, False, 8.0),
    }
    if size not in shapes:
        raise ValueError(f"unknown Llama size {size!r}; one of {', '.join(shapes)}")
    layers, width, heads, kv, hidden, tied, factor = shapes[size]
    return Decoder.default_config().set(
        name="llama", vocab_size=128256, max_seq_len=131072, num_layers=layers, model_dim=width,
        num_heads=heads, num_kv_heads=kv, hidden_dim=hidden, norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=scaling.set(factor=factor), tie_embeddings=tied).set(**overrides)


def qwen3_config(size: str, **overrides) -> Decoder.Config:
    """Published Qwen 3 dense sizes: "0.6b", "1.7b", "4b", "8b"."""
    shapes = {
        # layers, width, heads, kv heads, hidden, tied
        "0.6b": (28, 1024, 16, 8, 3072, True),
        "1.7b": (28, 2048, 16, 8, 6144, True),
        "4b": (36, 2560, 32, 8, 9728, True),
        "8b": (36, 4096, 32, 8, 12288, False),
    }
    if size not in shapes:
        raise ValueError(f"unknown Qwen 3 size {size!r}; one of {', '.join(shapes)}")
    layers, width, heads, kv, hidden, tied = shapes[size]
    return Decoder.default_config().set(
        name="qwen3", vocab_size=151936, max_seq_len=40960, num_layers=layers, model_dim=width,
        num_heads=heads, num_kv_heads=kv, head_dim=128, hidden_dim=hidden, norm_eps=1e-6,
        rope_theta=1000000.0, qk_norm=True, tie_embeddings=tied).set(**overrides)


def qwen3_moe_config(size: str, **overrides) -> Decoder.Config:
    """Published Qwen 3 MoE sizes: "30b-a3b" (128 experts, 8 per token), "235b-a22b"."""
    shapes = {
        # layers, width, heads, kv heads, dense hidden, expert hidden, experts
        "30b-a3b": (48, 2048, 32, 4, 6144, 768, 128),
        "235b-a22b": (94, 4096, 64, 4, 12288, 1536, 128),
    }
    if size not in shapes:
        raise ValueError(f"unknown Qwen 3 MoE size {size!r}; one of {', '.join(shapes)}")
    layers, width, heads, kv, hidden, expert_hidden, experts = shapes[size]
    moe = MoE.default_config().set(hidden_dim=expert_hidden, num_experts=experts, top_k=8)
    moe.router.normalize_top_k = True
    return Decoder.default_config().set(
        name="qwen3_moe", vocab_size=151936, max_seq_len=40960, num_layers=layers,
        model_dim=width, num_heads=heads, num_kv_heads=kv, head_dim=128, hidden_dim=hidden,
        norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True, tie_embeddings=False,
        moe=moe).set(**overrides)


def mixtral_config(size: str, **overrides) -> Decoder.Config:
    """Published Mixtral sizes: "8x7b", "8x22b" (8 experts, 2 per token)."""
    shapes = {
        # layers, width, heads, kv heads, expert hidden, vocabulary
        "8x7b": (32, 4096, 32, 8, 14336, 32000),
        "8x22b": (56, 6144, 48, 8, 16384, 32768),
    }
    if size not in shapes:
        raise ValueError(f"unknown Mixtral size {size!r}; one of {', '.join(shapes)}")
    layers, width, heads, kv, expert_hidden, vocab = shapes[size]
    moe = MoE.default_config().set(hidden_dim=expert_hidden, num_experts=8, top_k=2)
    return Decoder.default_config().set(
        name="mixtral", vocab_size=vocab, max_seq_len=65536 if size == "8x22b" else 32768,
        num_layers=layers, model_dim=width, num_heads=heads, num_kv_heads=kv,
        hidden_dim=expert_hidden, norm_eps=1e-5, rope_theta=1000000.0, tie_embeddings=False,
        moe=moe).set(**overrides)
