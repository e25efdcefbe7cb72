"""Helpers shared by the TPU and GPU kernels (shape checks, padding, x de-interleave, NF4 lookup)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import NF4_TABLE


def affine_geometry(fmt: str, x, codes, scales, group_size=None) -> tuple[int, int, int, int, bool]:
    """(M, K, N, group size, per_channel) of an int4 / int8 matmul ``x [M, K] @ dequant(codes)``,
    with ``codes`` [K/2, N] (int4, two codes per byte) or [K, N] (int8) and scales [1 or K/g, N];
    ValueError naming the format on a mismatch."""
    m, k = x.shape
    n = codes.shape[1]
    ng = scales.shape[0]
    rows = k // 2 if fmt == "int4" else k
    if codes.shape[0] != rows or (fmt == "int4" and k % 2) or k % ng:
        raise ValueError(f"{fmt}: codes {codes.shape} / scales {scales.shape} do not match K={k}")
    g = k // ng
    if group_size is not None and group_size != g:
        raise ValueError(f"{fmt}: group_size={group_size} but scales imply {g}")
    return m, k, n, g, ng == 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def pad_to(a: jax.Array, shape) -> jax.Array:
    """Zero-pad trailing edges up to `shape` (no-op, hence no copy, when already that shape)."""
    pads = [(0, t - s) for s, t in zip(a.shape, shape)]
    if all(p == (0, 0) for p in pads):
        return a
    return jnp.pad(a, pads)


def split_even_odd(x: jax.Array):
    """x[M, K] -> (x[:, 0::2], x[:, 1::2]).

    Packed 4-bit codes hold k=2i and k=2i+1 in one byte. Instead of interleaving the two nibble
    planes back into [K, N] inside the kernel (a sublane/lane shuffle Mosaic handles badly), we
    de-interleave the small activation once in XLA and do two half-K dots:
    y = x_even @ W_even + x_odd @ W_odd."""
    m, k = x.shape
    xr = x.reshape(m, k // 2, 2)
    return xr[..., 0], xr[..., 1]


def nf4_lookup(q: jax.Array) -> jax.Array:
    """NF4 table lookup for int32 codes in [0, 16) as a 15-select binary tree on the code bits.

    Neither Mosaic nor Triton has a cheap in-register 16-entry gather; selects are plain VPU /
    ALU ops on both."""
    level = [jnp.float32(v) for v in NF4_TABLE]
    for bit in range(4):
        b = ((q >> bit) & 1) == 1
        level = [jnp.where(b, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
    return level[0]
