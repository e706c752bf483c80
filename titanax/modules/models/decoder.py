"""Today's decoders -- Llama 2/3, Qwen 2/3, Mistral, and the MoE Mixtral / Qwen 3 MoE -- top to
bottom.

One model covers the family, as Hugging Face's modeling files differ only in switches:

    token embedding (no position table: RoPE rotates q and k inside attention)
    -> num_layers x DecoderBlock: x + attn(rmsnorm(x)); x + swiglu_mlp(rmsnorm(x))
         (or x + moe(rmsnorm(x)): routed SwiGLU experts, modules/layers/moe.py)
         attention: grouped-query (num_kv_heads), RoPE (theta, Llama 3 scaling), optional
         q/k/v biases (Qwen 2), QK-norm (Qwen 3), sliding window (Mistral)
    -> final RMSNorm -> LM head (tied to the embedding, or its own table)

Tensor parallelism splits the vocabulary (embedding rows and head rows), the query heads (and
the kv heads when their count divides the TP size; otherwise each rank keeps them whole), and the
MLP's hidden features (the axis binding puts those logical dimensions on the TP axis); the loss
never gathers the logits. Sequence parallelism (``plan.tensor_parallel.sequence_parallel``)
splits the residual stream over the sequence between blocks. Pipelines cut the ``decoder`` stack like
GPT's (``CausalLanguageModel.pipeline_parts``); FSDP and ZeRO come from the plan's layout.

``titanax.hf`` maps a Hugging Face ``config.json`` onto ``Decoder.Config`` and the weights onto
its params, both ways (``llama_config`` / ``qwen3_config`` here give the published sizes).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from titanax.modules import sampling
from titanax.modules.axis_binding import HEADS, MLP
from titanax.modules.initializers import Normal
from titanax.modules.layers.decoder_block import DecoderBlock
from titanax.modules.layers.embedding import VocabParallelEmbedding
from titanax.modules.layers.gated_mlp import GatedMLP
from titanax.modules.layers.grouped_query_attention import GroupedQueryAttention
from titanax.modules.layers.moe import MoE, check_moe_binding
from titanax.modules.layers.norm import RMSNorm
from titanax.modules.layers.repeat import Repeat
from titanax.modules.layers.rotary import Llama3RopeScaling
from titanax.modules.models.language_model import UNSET_VOCABULARY, CausalLanguageModel
from titanax.parallel import collectives
from titanax.modules.module import nowrap


class Decoder(CausalLanguageModel):
    """A Llama / Qwen / Mistral language model. ``forward(batch)`` returns ``(loss, aux)``."""

    class Config(CausalLanguageModel.Config):
        # Real vocabulary size (Llama 3: 128256; Qwen 3: 151936; bytes: 256). None: the size
        # the run's train input declares (its tokenizer's), set when the run starts.
        vocab_size: Optional[int] = 32000
        # The embedding / head tables are padded to a multiple of this (fast matmuls; the
        # table must be divisible by the TP size to be split). Padding ids never get probability.
        vocab_pad_multiple: int = 1
        # Longest sequence the model is meant for (HF max_position_embeddings): inputs longer
        # than this are refused before the first step.
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
        # MLP hidden width (HF intermediate_size; a mixture of experts' own width is moe's).
        hidden_dim: int = 11008
        # Every block's MLP a mixture of experts (Mixtral, Qwen 3 MoE): its model_dim follows
        # the model's; None: dense SwiGLU MLPs of hidden_dim.
        moe: Optional[MoE.Config] = None
        # RMSNorm epsilon (HF rms_norm_eps).
        norm_eps: float = 1e-6
        # Rotary base (HF rope_theta).
        rope_theta: float = 10000.0
        # Llama 3.1 frequency rescaling (HF rope_type "llama3"); None: plain RoPE.
        rope_scaling: Optional[Llama3RopeScaling.Config] = None
        # Biases on q, k, v (Qwen 2; Llama's attention_bias sets this and output_bias).
        qkv_bias: bool = False
        # Bias on the attention output projection.
        attention_output_bias: bool = False
        # Biases on the MLP projections (HF mlp_bias).
        mlp_bias: bool = False
        # RMSNorm of every q and k head before RoPE (Qwen 3).
        qk_norm: bool = False
        # Mistral's sliding-window attention (positions attended, itself included); None: full.
        sliding_window: Optional[int] = None
        # The LM head is the token embedding (HF tie_word_embeddings).
        tie_embeddings: bool = False
        # jax.checkpoint policy per block in training (None: keep activations).
        layer_remat_policy: Optional[str] = None
        # Trace the blocks one after another instead of a lax.scan over them; None: unrolled up
        # to 12 layers, scanned beyond (see Repeat.Config.unroll).
        unroll_layers: Optional[bool] = None

        def _validate_values(self):
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
            if self.head_dim is None and heads >= 1 and self.model_dim % heads:
                yield "num_heads", (f"must divide model_dim={self.model_dim}, or set head_dim")
            width = self.head_dim or (self.model_dim // heads if heads >= 1 else 0)
            if width % 2:
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

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        table = VocabParallelEmbedding.default_config().set(
            num_embeddings=self.padded_vocab_size, dim=cfg.model_dim)
        self._add_child("token_emb", table)
        if not cfg.tie_embeddings:
            self._add_child("lm_head", table.clone())
        output_init = Normal.default_config().set(stddev=0.02 / math.sqrt(2 * cfg.num_layers))
        attention = GroupedQueryAttention.default_config().set(
            model_dim=cfg.model_dim, num_heads=cfg.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, qkv_bias=cfg.qkv_bias,
            output_bias=cfg.attention_output_bias, qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps,
            sliding_window=cfg.sliding_window, output_param_init=output_init)
        if cfg.moe is not None:
            mlp = cfg.moe.clone(model_dim=cfg.model_dim, output_param_init=output_init)
        else:
            mlp = GatedMLP.default_config().set(model_dim=cfg.model_dim, hidden_dim=cfg.hidden_dim,
                                                bias=cfg.mlp_bias, output_param_init=output_init)
        block = DecoderBlock.default_config().set(model_dim=cfg.model_dim, attention=attention,
                                                  mlp=mlp, norm_eps=cfg.norm_eps)
        self._add_child("decoder", Repeat.default_config().set(
            layer=block, num_layers=cfg.num_layers, layer_remat_policy=cfg.layer_remat_policy,
            unroll=cfg.unroll_layers))
        self._add_child("final_norm", RMSNorm.default_config().set(input_dim=cfg.model_dim,
                                                                   eps=cfg.norm_eps))

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_kv_heads or self.config.num_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim or self.config.model_dim // self.config.num_heads

    @nowrap
    def check_axis_binding(self, binding, *, path):
        if self.config.moe is not None:  # Under the path the user sets it by.
            check_moe_binding(self.config.moe, binding, path=f"{path}.moe")
        super().check_axis_binding(binding, path=path)

    @nowrap
    def head(self) -> VocabParallelEmbedding:
        return self.token_emb if self.config.tie_embeddings else self.lm_head

    @nowrap
    def attention_width(self) -> int:
        return self.config.num_heads * self.head_dim

    def embed(self, input_ids: jax.Array, positions: Optional[jax.Array] = None) -> jax.Array:
        """The token embeddings ``[batch, seq, model_dim]`` (this rank's part of the sequence
        under sequence parallelism); the positions are RoPE's, read in attention."""
        del positions
        x = self.token_emb(input_ids)
        cfg = self.config
        binding = self.axis_binding
        biased = ([binding.active(HEADS)] if cfg.attention_output_bias else []) + \
            ([binding.active(MLP)] if cfg.mlp_bias else [])
        for axis in sorted({a for a in biased if a is not None}):
            # A bias added after a row-parallel psum varies over the TP axis as the params do,
            # so the residual stream does from the first block on; the layer loop's carry must
            # have one type, so it starts so (the first block would cast it anyway).
            x = collectives.cast_varying(x, axis)
        return x


    # --- Generation: a key/value cache, one token at a time --------------------------------------

    def generate(self, prompt_ids: jax.Array, key: Optional[jax.Array], *, max_new_tokens: int,
                 temperature: Optional[float] = None, top_p: float = 1.0) -> jax.Array:
        """``[batch, max_new_tokens]`` tokens following ``prompt_ids`` ``[batch, prompt]`` (all
        prompts of one length): the prompt runs once through the stack (prefill), filling a
        key/value cache of ``prompt + max_new_tokens`` positions; then each new token runs
        alone over the cache. Greedy without a temperature (``sampling.next_token``). Runs in
        local view like ``forward``: heads split over TP, rows over the batch axes."""
        if self._split_sequence():
            raise NotImplementedError("decoding has no sequence to split: generate under a "
                                      "binding without residual_sequence")
        batch, prompt = prompt_ids.shape
        total = prompt + max_new_tokens
        k_weight = self.parameters["decoder"]["layer"]["attn"]["k_weight"]
        table = self.parameters["token_emb"]["weight"]
        cache_shape = (self.config.num_layers, batch, total) + tuple(k_weight.shape[-2:])
        cache = (jnp.zeros(cache_shape, table.dtype), jnp.zeros(cache_shape, table.dtype))

        def choose(x, cache_out, step):
            logits = self.full_logits(self._logits_of(self.final_norm(x[:, -1:])))[:, -1]
            step_key = None if key is None else jax.random.fold_in(key, step)
            return sampling.next_token(logits, step_key, temperature=temperature,
                                       top_p=top_p), cache_out

        x, cache = self.decoder.decode(self.embed(prompt_ids), cache, start=0)
        first, cache = choose(x, cache, 0)

        def step(carry, index):
            token, cache_in = carry
            x, cache_out = self.decoder.decode(self.embed(token[:, None]), cache_in,
                                               start=prompt + index)
            return choose(x, cache_out, index + 1), token

        (last, _), tokens = jax.lax.scan(step, (first, cache), jnp.arange(max_new_tokens - 1))
        return jnp.concatenate([tokens.T, last[:, None]], axis=1)


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
