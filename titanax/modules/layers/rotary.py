"""Rotary position embeddings (RoPE), in Hugging Face's rotate-half pairing.

A head vector of width ``d`` is rotated as ``d/2`` planes: with the *rotate-half* pairing used by
every Hugging Face Llama / Qwen / Mistral checkpoint, plane ``i`` holds features ``i`` and
``i + d/2`` (``x * cos + rotate_half(x) * sin``, ``rotate_half(x) = [-x2, x1]``). Meta's original
Llama code pairs *adjacent* features (``2i``, ``2i + 1``) instead, and HF's conversion script
permutes the q/k projection rows to move between the two. A converter that copies weights between
the two pairings without that permutation produces a model that runs and is wrong (MaxText's Llama 3
export did); Titanax uses HF's pairing, so HF weights are copied as they are.

Frequencies: ``theta ** (-2i / d)``, optionally rescaled for long context with Llama 3.1's
"llama3" rule (wavelengths above ``original_max_position_embeddings / low_freq_factor`` divided by
``factor``, below ``/ high_freq_factor`` kept, a smooth blend between), or every frequency divided
by one factor (HF's "linear" rope type: positions interpolated; Gemma 3's global layers), or
YaRN's (HF "yarn": gpt-oss, DeepSeek-V3, long-context Qwen): fast-rotating planes kept, slow
ones interpolated by ``factor``, a linear ramp between, and cos / sin multiplied by an attention
factor (``0.1 ln(factor) + 1`` by default) -- so every score by its square.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from titanax.config import Configurable


class Llama3RopeScaling(Configurable):
    """Llama 3.1's frequency rescaling (HF ``rope_type: "llama3"``)."""

    class Config(Configurable.Config):
        # Divides the frequencies of long wavelengths (Llama 3.1: 8; 3.2: 32).
        factor: float = 8.0
        # Wavelengths above original_max_position_embeddings / low_freq_factor are rescaled.
        low_freq_factor: float = 1.0
        # Wavelengths below original_max_position_embeddings / high_freq_factor are kept.
        high_freq_factor: float = 4.0
        # The context length the model was pretrained with (Llama 3: 8192).
        original_max_position_embeddings: int = 8192

        def _validate_values(self):
            if self.factor <= 0:
                yield "factor", f"must be > 0, got {self.factor}"
            if self.low_freq_factor <= 0:
                yield "low_freq_factor", f"must be > 0, got {self.low_freq_factor}"
            elif self.high_freq_factor <= self.low_freq_factor:  # (Either may be the one off.)
                yield "low_freq_factor", (f"must be below high_freq_factor="
                                          f"{self.high_freq_factor}, got {self.low_freq_factor}")
                yield "high_freq_factor", (f"must exceed low_freq_factor={self.low_freq_factor}, "
                                           f"got {self.high_freq_factor}")
            if self.original_max_position_embeddings < 1:
                yield "original_max_position_embeddings", "must be >= 1"

    def rescale(self, inv_freq: np.ndarray, *, theta: float, dim: int) -> np.ndarray:
        del theta, dim
        cfg = self.config
        context = cfg.original_max_position_embeddings
        low_wavelength = context / cfg.low_freq_factor
        high_wavelength = context / cfg.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        scaled = np.where(wavelength > low_wavelength, inv_freq / cfg.factor, inv_freq)
        smooth = (context / wavelength - cfg.low_freq_factor) / (
            cfg.high_freq_factor - cfg.low_freq_factor)
        blended = (1 - smooth) * scaled / cfg.factor + smooth * scaled
        medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
        return np.where(medium, blended, scaled).astype(np.float32)


class LinearRopeScaling(Configurable):
    """Every frequency divided by ``factor`` (HF ``rope_type: "linear"``: position ``p`` rotates
    as ``p / factor`` would; Gemma 3's global layers at 4B and up: 8)."""

    class Config(Configurable.Config):
        # What the frequencies are divided by.
        factor: float = 8.0

        def _validate_values(self):
            if not self.factor > 0:
                yield "factor", f"must be > 0, got {self.factor}"

    def rescale(self, inv_freq: np.ndarray, *, theta: float, dim: int) -> np.ndarray:
        del theta, dim
        return (inv_freq / np.float32(self.config.factor)).astype(np.float32)


class YarnRopeScaling(Configurable):
    """YaRN (HF ``rope_type: "yarn"``; see the module docstring), computed as transformers'
    ``_compute_yarn_parameters`` does, in float32."""

    class Config(Configurable.Config):
        # How much longer than the pretraining context the model reads (gpt-oss: 32).
        factor: float = 32.0
        # The context length the model was pretrained with (gpt-oss: 4096).
        original_max_position_embeddings: int = 4096
        # Planes turning more than this many times over the original context keep their
        # frequency (extrapolated)...
        beta_fast: float = 32.0
        # ... and those turning fewer than this are interpolated by factor; a ramp between.
        beta_slow: float = 1.0
        # What cos and sin are multiplied by; None: 0.1 ln(factor) + 1, or with mscale and
        # mscale_all_dim (DeepSeek-V3) the ratio of 0.1 m ln(factor) + 1 for the two.
        attention_factor: Optional[float] = None
        mscale: Optional[float] = None
        mscale_all_dim: Optional[float] = None
        # Round the ramp's ends to whole planes (HF's default; gpt-oss: False).
        truncate: bool = True

        def _validate_values(self):
            if not self.factor > 0:
                yield "factor", f"must be > 0, got {self.factor}"
            if self.original_max_position_embeddings < 1:
                yield "original_max_position_embeddings", "must be >= 1"
            for name in ("beta_fast", "beta_slow"):
                if not getattr(self, name) > 0:
                    yield name, f"must be > 0 (rotations over the context), got {getattr(self, name)}"
            if self.attention_factor is not None and not self.attention_factor > 0:
                yield "attention_factor", f"must be > 0 (or None), got {self.attention_factor}"

    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by."""
        cfg = self.config
        if cfg.attention_factor is not None:
            return float(cfg.attention_factor)

        def magnitude(scale):
            return 1.0 if cfg.factor <= 1 else 0.1 * scale * math.log(cfg.factor) + 1.0

        if cfg.mscale and cfg.mscale_all_dim:
            return float(magnitude(cfg.mscale) / magnitude(cfg.mscale_all_dim))
        return magnitude(1.0)

    def rescale(self, inv_freq: np.ndarray, *, theta: float, dim: int) -> np.ndarray:
        cfg = self.config
        context = cfg.original_max_position_embeddings

        def plane(rotations):  # The plane that turns `rotations` times over the context.
            return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = plane(cfg.beta_fast), plane(cfg.beta_slow)
        if cfg.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                       / np.float32(high - low), 0, 1).astype(np.float32)
        kept = (1 - ramp).astype(np.float32)  # 1: extrapolated (the fast planes)
        exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
        interpolated = (1.0 / (np.float32(cfg.factor) * np.float32(theta) ** exponents)
                        ).astype(np.float32)
        return (interpolated * (1 - kept) + inv_freq * kept).astype(np.float32)


def inverse_frequencies(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """``[head_dim / 2]`` float32 inverse frequencies (computed as HF does, in float32), rescaled
    by ``scaling`` (one of the scalings above, instantiated) if given."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    return scaling.rescale(inv_freq, theta=theta, dim=head_dim)


def attention_scaling(scaling) -> float:
    """What a scaling multiplies cos and sin by (YaRN's attention factor; 1 for the others)."""
    return scaling.attention_scaling() if hasattr(scaling, "attention_scaling") else 1.0


def rotate(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
           magnitude: float = 1.0) -> jax.Array:
    """``x`` ``[batch, seq, heads, head_dim]`` rotated by ``positions`` (``[seq]`` or
    ``[batch, seq]``), angles and cos/sin in float32, the result in ``x``'s dtype. Fewer
    frequencies than ``head_dim / 2`` rotate only the first ``2 * len(inv_freq)`` features (partial
    RoPE: Qwen 3.5's quarter of each head), the rest pass unrotated. ``magnitude`` multiplies
    cos and sin (YaRN's attention factor)."""
    width = 2 * len(inv_freq)
    if width < x.shape[-1]:
        return jnp.concatenate([rotate(x[..., :width], positions, inv_freq, magnitude),
                                x[..., width:]], axis=-1)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [.., seq, d/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    if angles.ndim == 2:
        angles = angles[None]
    cos = (jnp.cos(angles) * magnitude)[:, :, None, :].astype(x.dtype)
    sin = (jnp.sin(angles) * magnitude)[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
