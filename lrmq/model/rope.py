"""Rotary position embeddings: default, linear, llama3 and yarn, as transformers computes them."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from lrmq.model.config import RopeConfig


def inv_frequencies(r: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim/2] (float32) and the cos/sin scaling factor."""
    dim = head_dim
    inv = 1.0 / (r.theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    inv = inv.astype(np.float32)
    if r.type == "default":
        return inv, 1.0
    if r.type == "linear":
        return (inv / np.float32(r.factor)).astype(np.float32), 1.0
    if r.type == "llama3":
        low_wavelen = r.original_max_position_embeddings / r.low_freq_factor
        high_wavelen = r.original_max_position_embeddings / r.high_freq_factor
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > low_wavelen, inv / r.factor, inv)
        smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (
            r.high_freq_factor - r.low_freq_factor)
        smoothed = (1 - smooth) * out / r.factor + smooth * out
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, out).astype(np.float32), 1.0
    if r.type == "yarn":
        return _yarn(r, dim)
    raise ValueError(f"rope type {r.type!r} is not supported")


def _yarn(r: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    factor, base = r.factor, r.theta

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = r.attention_factor
    if attn is None:
        if r.mscale and r.mscale_all_dim:
            attn = float(get_mscale(factor, r.mscale) / get_mscale(factor, r.mscale_all_dim))
        else:
            attn = get_mscale(factor)

    def corr_dim(rot):
        return (dim * math.log(r.original_max_position_embeddings / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(r.beta_fast), corr_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (np.arange(0, dim, 2).astype(np.float32) / dim)
    extra = 1.0 / pos_freqs
    inter = 1.0 / (factor * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    inv = inter * (1 - extra_factor) + extra * extra_factor
    return inv.astype(np.float32), float(attn)


def rope_cos_sin(positions: jnp.ndarray, inv_freq: np.ndarray, scale: float, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin [B, T, head_dim] for integer positions [B, T] (HF's concatenated-halves layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x [B, T, H, D]; rotate_half convention (first half / second half), as transformers."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rot * sin[:, :, None, :]
