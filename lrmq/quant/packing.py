"""Bit packing of unsigned integer codes into uint8 (layouts in docs/DESIGN.md, "Packed formats").

Int formats pack along K (axis 0) as a little-endian bit stream per column:
  * bits 2, 3, 4: a chunk of `values_per_chunk` codes forms one little-endian word of `bytes_per_chunk`
    bytes; code j of the chunk sits at bits [bits*j, bits*j + bits). int4: 2 codes/byte (even k in the
    low nibble); int2: 4 codes/byte; int3: 8 codes in 3 bytes.
  * bits 5..8: one code per byte (no packing; sub-byte straddling is not worth the unpack cost).
NF4 (bitsandbytes) instead pairs neighbours along the last axis with the *even* element in the high
nibble: `pack_nibbles_high_first`.

All functions accept numpy or jax arrays: numpy in -> numpy out (host-side export code), anything
else -> jnp (works under jit; shapes are static).
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

# bits -> (codes per chunk, bytes per chunk); chunk = lcm(bits, 8) bits.
_CHUNK = {2: (4, 1), 3: (8, 3), 4: (2, 1)}


def _xp(x):
    return np if isinstance(x, np.ndarray) else jnp


def _check_bits(bits) -> int:
    if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an int in 2..8, got {bits!r}")
    return int(bits)


def packed_rows(K: int, bits: int) -> int:
    """Number of packed uint8 rows holding K codes of `bits` bits."""
    bits = _check_bits(bits)
    if bits not in _CHUNK:
        return K
    per, nbytes = _CHUNK[bits]
    if K % per:
        raise ValueError(f"K={K} must be a multiple of {per} to pack {bits}-bit codes along K")
    return K // per * nbytes


def _check_2d_int(name: str, a) -> None:
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D [K, N], got shape {tuple(a.shape)}")
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must have an integer dtype, got {a.dtype}")


def pack(codes, bits: int):
    """Pack unsigned codes [K, N] (values in [0, 2^bits-1]) along K into uint8 [K*bits/8, N].

    Bits above `bits` are masked off so an out-of-range code cannot corrupt its neighbours.
    """
    bits = _check_bits(bits)
    xp = _xp(codes)
    _check_2d_int("codes", codes)
    K, N = codes.shape
    rows = packed_rows(K, bits)
    mask = (1 << bits) - 1
    if bits not in _CHUNK:
        return (codes.astype(xp.uint32) & mask).astype(xp.uint8)
    per, nbytes = _CHUNK[bits]
    c = (codes.astype(xp.uint32) & mask).reshape(K // per, per, N)
    word = xp.zeros((K // per, N), dtype=xp.uint32)
    for j in range(per):  # static unroll; at most 8 terms
        word = word | (c[:, j, :] << (bits * j))
    out = xp.stack([(word >> (8 * i)) & 0xFF for i in range(nbytes)], axis=1)
    return out.reshape(rows, N).astype(xp.uint8)


def unpack(packed, bits: int, K: int):
    """Inverse of `pack`: uint8 [K*bits/8, N] -> uint8 codes [K, N]."""
    bits = _check_bits(bits)
    xp = _xp(packed)
    _check_2d_int("packed", packed)
    rows = packed_rows(K, bits)
    if packed.shape[0] != rows:
        raise ValueError(
            f"packed has {packed.shape[0]} rows but K={K} at {bits} bits needs {rows} rows"
        )
    N = packed.shape[1]
    if bits not in _CHUNK:
        return packed.astype(xp.uint8)
    per, nbytes = _CHUNK[bits]
    b = packed.astype(xp.uint32).reshape(K // per, nbytes, N)
    word = xp.zeros((K // per, N), dtype=xp.uint32)
    for i in range(nbytes):
        word = word | (b[:, i, :] << (8 * i))
    mask = (1 << bits) - 1
    out = xp.stack([(word >> (bits * j)) & mask for j in range(per)], axis=1)
    return out.reshape(K, N).astype(xp.uint8)


def pack_nibbles_high_first(codes):
    """bitsandbytes 4-bit packing along the last axis: byte i = (c[2i] << 4) | c[2i+1]."""
    xp = _xp(codes)
    if codes.shape[-1] % 2:
        raise ValueError(f"codes last axis must be even to pack nibbles, got shape {tuple(codes.shape)}")
    c = codes.astype(xp.uint8) & 0xF
    return ((c[..., 0::2] << 4) | c[..., 1::2]).astype(xp.uint8)


def unpack_nibbles_high_first(packed):
    """Inverse of `pack_nibbles_high_first`: last axis doubles."""
    xp = _xp(packed)
    p = packed.astype(xp.uint8)
    hi, lo = p >> 4, p & 0xF
    out = xp.stack([hi, lo], axis=-1)
    return out.reshape(*p.shape[:-1], p.shape[-1] * 2).astype(xp.uint8)
