"""Pure-jnp dequantization and dequantize-then-dot references.

These are the numerical ground truth for the Pallas kernels and double as the XLA fallback path
(``impl="xla"``). Layouts follow docs/DESIGN.md; weights are lrmq orientation ``[K, N]`` except
NF4, which keeps the bitsandbytes torch orientation ``[N, K]``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# bitsandbytes get_4bit_type("nf4"), index 0..15 (quantization-anchors.md §4).
NF4_TABLE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)

_HI = jax.lax.Precision.HIGHEST


def _groups(k: int, rows: int, what: str) -> int:
    """Group size implied by `rows` scale rows over `k` weight rows (checks divisibility)."""
    if rows <= 0 or k % rows:
        raise ValueError(f"{what}: {rows} scale rows do not divide K={k}")
    return k // rows


def unpack_int4(codes: jax.Array) -> jax.Array:
    """uint8 [K/2, N] -> uint8 [K, N]; element 2i is the low nibble, 2i+1 the high nibble."""
    kh, n = codes.shape
    return jnp.stack([codes & 0xF, codes >> 4], axis=1).reshape(2 * kh, n)


def pack_int4(q) -> np.ndarray:
    """Inverse of unpack_int4 (numpy; used by tests and the benchmark to build inputs)."""
    q = np.asarray(q, dtype=np.uint8)
    return (q[0::2] & 0xF) | ((q[1::2] & 0xF) << 4)


def unpack_nf4(codes: jax.Array) -> jax.Array:
    """uint8 [N, K/2] (bitsandbytes: even element in the HIGH nibble) -> uint8 [N, K]."""
    n, kh = codes.shape
    return jnp.stack([codes >> 4, codes & 0xF], axis=-1).reshape(n, 2 * kh)


def pack_nf4(q) -> np.ndarray:
    """Inverse of unpack_nf4: [N, K] codes -> [N, K/2] bytes, (q[even] << 4) | q[odd]."""
    q = np.asarray(q, dtype=np.uint8)
    return ((q[:, 0::2] & 0xF) << 4) | (q[:, 1::2] & 0xF)


def _affine(q: jax.Array, scales: jax.Array, zeros: jax.Array, what: str) -> jax.Array:
    k, n = q.shape
    ng = scales.shape[0]
    if scales.shape != (ng, n) or zeros.shape != (ng, n):
        raise ValueError(f"{what}: scales {scales.shape} / zeros {zeros.shape} must be [K/g, {n}]")
    g = _groups(k, ng, what)
    q = q.astype(jnp.float32).reshape(ng, g, n)
    w = (q - zeros.astype(jnp.float32)[:, None]) * scales.astype(jnp.float32)[:, None]
    return w.reshape(k, n)


def dequantize_int4(codes, scales, zeros, group_size=None, dtype=jnp.float32) -> jax.Array:
    """w[K, N] = (q - z) * s in float32, then cast to `dtype`."""
    q = unpack_int4(codes)
    if group_size is not None and q.shape[0] // group_size != scales.shape[0]:
        raise ValueError(f"int4: group_size={group_size} but scales has {scales.shape[0]} rows "
                         f"for K={q.shape[0]}")
    return _affine(q, scales, zeros, "int4").astype(dtype)


def dequantize_int8(codes, scales, zeros, dtype=jnp.float32) -> jax.Array:
    """codes uint8 [K, N]; scales/zeros [1, N] (per channel) or [K/g, N]."""
    return _affine(codes, scales, zeros, "int8").astype(dtype)


def dequantize_nf4(codes, absmax, block_size: int = 64, dtype=jnp.float32) -> jax.Array:
    """Torch-orientation w_t[N, K] = table[code] * absmax[n, k // block_size].

    `absmax` may be [N, K/bs] or the flat [N*K/bs] of DESIGN.md (K must be a multiple of bs so
    no block straddles two rows)."""
    q = unpack_nf4(codes)
    n, k = q.shape
    if k % block_size:
        raise ValueError(f"nf4: K={k} is not a multiple of block_size={block_size}")
    nb = k // block_size
    absmax = absmax.reshape(n, nb).astype(jnp.float32)
    vals = jnp.asarray(NF4_TABLE, jnp.float32)[q.astype(jnp.int32)]
    return (vals.reshape(n, nb, block_size) * absmax[..., None]).reshape(n, k).astype(dtype)


def _dot(x, w, compute_dtype, transpose_w=False):
    """x[..., K] @ w[K, N] (or w[N, K].T) with f32 accumulation; output in x.dtype."""
    cd = jnp.float32 if compute_dtype is None else compute_dtype
    dims = (((x.ndim - 1,), (1 if transpose_w else 0,)), ((), ()))
    y = jax.lax.dot_general(x.astype(cd), w.astype(cd), dims, precision=_HI,
                            preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


# compute_dtype=None is the exact reference (f32 weights, f32 dot). The XLA fallback passes the
# 16-bit activation dtype so the dot runs on bf16 tensor cores / MXU, as the kernels do.
def int4_matmul_reference(x, codes, scales, zeros, group_size=None, *, compute_dtype=None):
    return _dot(x, dequantize_int4(codes, scales, zeros, group_size), compute_dtype)


def int8_matmul_reference(x, codes, scales, zeros, *, compute_dtype=None):
    return _dot(x, dequantize_int8(codes, scales, zeros), compute_dtype)


def nf4_matmul_reference(x, codes, absmax, block_size: int = 64, *, compute_dtype=None):
    return _dot(x, dequantize_nf4(codes, absmax, block_size), compute_dtype, transpose_w=True)


# Grouped (mixture-of-experts) forms: stacked expert weights [E, ...], rows of x sorted by expert, `group_sizes`
# [E] rows each (`jax.lax.ragged_dot`; rows past their sum give 0).
def _ragged(x, w, group_sizes, compute_dtype):
    cd = jnp.float32 if compute_dtype is None else compute_dtype
    y = jax.lax.ragged_dot(x.astype(cd), w.astype(cd), group_sizes, precision=_HI,
                           preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def dequantize_grouped_int4(codes, scales, zeros, group_size=None, dtype=jnp.float32) -> jax.Array:
    """Stacked int4 experts: codes [E, K/2, N], scales / zeros [E, K/g, N] -> [E, K, N]."""
    return jax.vmap(lambda c, s, z: dequantize_int4(c, s, z, group_size, dtype))(codes, scales, zeros)


def dequantize_grouped_int8(codes, scales, zeros, dtype=jnp.float32) -> jax.Array:
    """Stacked int8 experts: codes [E, K, N], scales / zeros [E, 1 or K/g, N] -> [E, K, N]."""
    return jax.vmap(lambda c, s, z: dequantize_int8(c, s, z, dtype))(codes, scales, zeros)


def grouped_int4_matmul_reference(x, group_sizes, codes, scales, zeros, group_size=None, *, compute_dtype=None):
    return _ragged(x, dequantize_grouped_int4(codes, scales, zeros, group_size), group_sizes, compute_dtype)


def grouped_int8_matmul_reference(x, group_sizes, codes, scales, zeros, *, compute_dtype=None):
    return _ragged(x, dequantize_grouped_int8(codes, scales, zeros), group_sizes, compute_dtype)
