"""Decode attention through XLA: a gather of each slot's pages a block at a time with an online softmax. Runs
everywhere (CPU, and every fallback of the kernels), on a pool of either layout and format."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lrmq.generation.kv_pool import interleaved_shape, kv_heads_of, read_pages

_NEG = -1e30  # finite: a block with nothing visible must not turn the running max into NaN


def decode_attention_xla(q, pool, layer, page_table, lengths, window, *, block_pages: int):
    """One query token per slot against its pages, a block of pages at a time (online softmax).

    q [S, H, D]; pool in either layout, read at `layer` only; page_table [S, max_pages] (a multiple of
    block_pages); lengths [S]: tokens visible to each slot (its query's position + 1; 0 = idle slot).
    The loop runs over the blocks the longest slot needs: cost follows the live length.
    """
    s, h, d = q.shape
    kvh, page_size = kv_heads_of(pool), interleaved_shape(pool)[2]
    g = h // kvh
    span = block_pages * page_size
    qg = q.reshape(s, kvh, g, d).astype(jnp.float32) * (d ** -0.5)
    q_pos = (lengths - 1)[:, None]
    n_blocks = (jnp.max(lengths) + span - 1) // span

    def body(j, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(page_table, j * block_pages, block_pages, axis=1)
        k, v = read_pages(pool, layer, pages)
        k_pos = j * span + jnp.arange(span, dtype=jnp.int32)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= (q_pos - k_pos) < window
        scores = jnp.where(visible[:, None, None, :], jnp.einsum("skgd,stkd->skgt", qg, k), _NEG)
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

