"""A paged KV cache: fixed-size pages in one pool, a page table per decode slot.

The pool holds every layer's keys and values as `[layers, pages, page_size, 2 * kv_heads, head_dim]`,
K and V heads interleaved (K of head h at 2h, V at 2h + 1): the layout of the ragged paged attention
kernel JAX ships for TPU, so the TPU path reads the pool in place. Page 0 is never handed out: rows
that are not live write there, so a static-shaped step needs no branch.

The model sees one object per forward (`PagedCache`): `write(k, v, q_pos)` stores this forward's keys and
values in the pages; in prefill mode a prompt then attends to itself with the model's own (blockwise)
attention; in decode mode `attend(q, q_pos, window)` has each slot's one new token attend to its pages, read a block of pages at a time with an online softmax, so a step costs what the longest live
row holds, not what was allocated.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

NULL_PAGE = 0  # the page rows that are not live write to; never allocated
_NEG = -1e30  # finite: a block with nothing visible must not turn the running max into NaN


def pool_shape(cfg, pages: int, page_size: int) -> tuple[int, ...]:
    return (cfg.num_layers, pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim)


def interleave(k: jax.Array, v: jax.Array) -> jax.Array:
    """[..., KVH, D] keys and values -> [..., 2 * KVH, D] with K at even and V at odd heads."""
    return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def decode_attention_xla(q, pool, layer, page_table, lengths, window, *, block_pages: int):
    """One query token per slot against its pages, a block of pages at a time (online softmax).

    q [S, H, D]; pool [L, P, page_size, 2*KVH, D], read at `layer` only; page_table [S, max_pages] (a multiple of
    block_pages); lengths [S]: tokens visible to each slot (its query's position + 1; 0 = idle slot).
    The loop runs over the blocks the longest slot needs: cost follows the live length.
    """
    s, h, d = q.shape
    page_size, kvh = pool.shape[2], pool.shape[3] // 2
    g = h // kvh
    span = block_pages * page_size
    qg = q.reshape(s, kvh, g, d).astype(jnp.float32) * (d ** -0.5)
    q_pos = (lengths - 1)[:, None]
    n_blocks = (jnp.max(lengths) + span - 1) // span

    def body(j, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(page_table, j * block_pages, block_pages, axis=1)
        kv = pool[layer, pages].reshape(s, span, 2 * kvh, d).astype(jnp.float32)
        k, v = kv[:, :, 0::2], kv[:, :, 1::2]
        k_pos = j * span + jnp.arange(span, dtype=jnp.int32)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= (q_pos - k_pos) < window
        scores = jnp.einsum("skgd,stkd->skgt", qg, k)
        scores = jnp.where(visible[:, None, None, :], scores, _NEG)
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.where(visible[:, None, None, :], jnp.exp(scores - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("skgt,stkd->skgd", p, v)
        return m_new, l, acc

    init = (jnp.full((s, kvh, g), _NEG, jnp.float32), jnp.zeros((s, kvh, g), jnp.float32),
            jnp.zeros((s, kvh, g, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # idle slots (l = 0) get zeros, not NaN
    return out.reshape(s, h, d).astype(q.dtype)


# Decode-attention implementations by name; "xla" runs everywhere. Accelerator kernels register here.
DECODE_ATTENTION: dict[str, Callable] = {"xla": decode_attention_xla}


@struct.dataclass
class PagedCache:
    """The cache a forward writes to (see the module docstring).

    prefill: tokens [R, T] at positions 0..T-1 per row (padding at -1) write to page_table[r, pos // page_size].
    decode: tokens [S, 1] at position `lengths - 1` of each slot; `live` slots only (others write to NULL_PAGE).
    """

    pool: jax.Array  # [L, P, page_size, 2*KVH, D]
    page_table: jax.Array  # [rows, max_pages] int32
    live: jax.Array  # [rows] bool
    layer: jax.Array | int = 0
    mode: str = struct.field(pytree_node=False, default="decode")
    block_pages: int = struct.field(pytree_node=False, default=8)
    impl: str = struct.field(pytree_node=False, default="xla")

    @property
    def page_size(self) -> int:
        return self.pool.shape[2]

    def at_layer(self, layer) -> "PagedCache":
        return self.replace(layer=layer)

    @property
    def decoding(self) -> bool:
        return self.mode == "decode"

    def write(self, k, v, q_pos) -> "PagedCache":
        """Store this forward's roped keys/values k, v [R, T, KVH, D] at positions q_pos [R, T]."""
        live = self.live[:, None] & (q_pos >= 0)
        index = jnp.minimum(jnp.clip(q_pos, 0) // self.page_size, self.page_table.shape[1] - 1)
        page = jnp.where(live, jnp.take_along_axis(self.page_table, index, axis=1), NULL_PAGE)
        offset = jnp.where(live, q_pos % self.page_size, 0)
        return self.replace(pool=self.pool.at[self.layer, page, offset].set(interleave(k, v).astype(self.pool.dtype)))

    def attend(self, q, q_pos, window):
        """Decode: q [S, 1, H, D] at q_pos [S, 1] against each slot's pages -> [S, 1, H, D]."""
        lengths = jnp.where(self.live, q_pos[:, 0] + 1, 0)
        out = DECODE_ATTENTION[self.impl](q[:, 0], self.pool, self.layer, self.page_table, lengths, window,
                                          block_pages=self.block_pages)
        return out[:, None]


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)
