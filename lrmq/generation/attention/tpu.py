"""Decode attention through JAX's TPU ragged paged attention Mosaic kernel, reading an "interleaved" pool in place
(viewed as `[layers * pages, ...]`, page indices offset by `layer * pages`: no per-layer copy)."""

from __future__ import annotations

import functools

import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels.tpu_tiles import generation

from lrmq.generation.kv_format import FP8
from lrmq.generation.kv_pool import QuantPool, kv_heads_of

# Block sizes of the TPU kernel. JAX's tuned table (tuned_block_sizes.py, v5 and v6 alike) reads a whole
# sequence per block up to 16 pages and takes 32 queries per block; it is looked up by
# jax.devices()[0].device_kind, the CPU's when compiling ahead of time, so lrmq passes its own choice:
# at most TPU_MAX_KV_PAGES pages per block (one DMA per page, unrolled: more pages spill scalar registers),
# fewer when the double-buffered block would take more than a quarter of the generation's VMEM limit
# (large pages x many KV heads, tightest on v5p / TPU7x with 64 MiB of VMEM per core).
TPU_MAX_KV_PAGES = 16
TPU_QUERIES_PER_BLOCK = 32


@functools.lru_cache(maxsize=None)
def _rpa_module():
    """jax's ragged paged attention package, or None where this jax does not ship it ("auto" takes "xla")."""
    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel
    except ImportError:  # pragma: no cover - moved or dropped in a later jax
        return None
    return kernel


def tpu_unsupported(q_heads: int, pool_shape, dtype, scaled: bool = False) -> str | None:
    """Why the TPU kernel cannot take a pool / queries of these shapes (None: it can). scaled: the pages are a
    QuantPool's (fp8 pages are taken with their per-head scales; unscaled they are not)."""
    rpa = _rpa_module()
    if rpa is None:
        return "this jax has no ragged_paged_attention"
    d, combined = pool_shape[-1], pool_shape[-2]
    if jnp.dtype(dtype) in FP8 and not scaled:
        return f"{jnp.dtype(dtype).name} KV pages without scales"
    if jnp.dtype(dtype) == jnp.dtype(jnp.int8):
        return ("int8 KV pages (the kernel's int8 path is not implemented in jax, and per-token scales need a "
                "kernel that reads scale pages: the XLA path reads them)")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e4m3fn),
                                jnp.dtype(jnp.float8_e5m2)):
        return f"{jnp.dtype(dtype).name} KV pages (the kernel takes bf16 / f32 / fp8)"
    if d % 128:
        return f"head_dim {d} (a multiple of 128)"
    return _tpu_heads_refusal(q_heads, combined, dtype)


def _tpu_heads_refusal(q_heads: int, combined: int, dtype) -> str | None:
    """The kernel wrapper's refusal of `combined` interleaved K/V heads (and `q_heads` queries) per call, None if
    it takes them: it needs whole 32-bit sublanes of heads (bf16 packs 2 rows to one, fp8 4, so fp8 pages need
    an even number of KV heads per chip)."""
    try:
        _rpa_module().get_min_heads_per_blk(q_heads, combined, dtype, dtype)
    except (ValueError, AssertionError) as e:
        return str(e) or f"{q_heads} query heads over {combined} interleaved K/V heads"
    return None


def tpu_block_sizes(device_kind: str | None, *, q_heads: int, pool_shape, dtype, width: int,
                    slots: int) -> tuple[int, int, int]:
    """(KV pages per block, queries per block, VMEM limit bytes) of a TPU decode call (see TPU_MAX_KV_PAGES)."""
    gen = generation(device_kind)
    page_size, combined, d = pool_shape[-3:]
    heads_per_block = _rpa_module().get_min_heads_per_blk(q_heads, combined, dtype, dtype)[1]
    page_bytes = page_size * heads_per_block * d * jnp.dtype(dtype).itemsize
    fit = max(1, gen.vmem_limit // 4 // (2 * page_bytes))
    return max(1, min(width, TPU_MAX_KV_PAGES, fit)), min(slots, TPU_QUERIES_PER_BLOCK), gen.vmem_limit


def _tpu_kernel():
    """The kernel `decode_attention_tpu` calls (tests swap in the kernel's own reference: neither of Pallas's
    interpret modes runs it on CPU in jax 0.10.2)."""
    return _rpa_module().ragged_paged_attention


def decode_attention_tpu(q, pool, layer, page_table, lengths, window, *, block_pages: int = 0):
    """`decode_attention_xla` through JAX's TPU ragged paged attention kernel (one query per slot).

    The pool is read in place as [layers * pages, page_size, 2*KVH, D] (a free reshape; slicing pool[layer]
    inside the layer scan would copy the layer's pool every step), with the page table offset by
    layer * pages. Idle slots (length 0) are given length 1 (their table row points at the null page) and
    zeros out, as the XLA path gives them. block_pages: unused (`tpu_block_sizes` picks the kernel's blocks).
    """
    del block_pages
    s, h, d = q.shape
    quant = isinstance(pool, QuantPool)
    if quant:  # fp8 pages, per-KV-head scales folded into q (s_k) and the output (s_v): the kernel at scale 1.0
        if pool.k_token is not None:
            raise ValueError("the TPU kernel reads per-head scales only; this pool has per-token scale pages")
        kvh = kv_heads_of(pool)
        heads = lambda sc: jnp.repeat(sc[:, layer], h // kvh)[None, :, None]  # noqa: E731  [1, H, 1]
        q_in, s_v, pool = (q.astype(jnp.float32) * heads(pool.k_scale)).astype(q.dtype), heads(pool.v_scale), pool.pages
    else:
        q_in = q.astype(pool.dtype)
    n_layers, pages = pool.shape[:2]
    kv_blk, q_blk, vmem = tpu_block_sizes(pk.current_target().device_kind, q_heads=h, pool_shape=pool.shape,
                                          dtype=pool.dtype, width=page_table.shape[1], slots=s)
    flat = pool.reshape(n_layers * pages, *pool.shape[2:])
    table = (page_table + layer * pages).astype(jnp.int32)
    scales = {"k_scale": 1.0, "v_scale": 1.0} if quant else {}  # static: the kernel dequantizes fp8 to q's dtype
    out = _tpu_kernel()(
        q_in, flat, jnp.maximum(lengths, 1).astype(jnp.int32), table,
        jnp.arange(s + 1, dtype=jnp.int32), jnp.array([s], jnp.int32), sm_scale=d ** -0.5, sliding_window=window,
        num_kv_pages_per_block=kv_blk, num_queries_per_block=q_blk, vmem_limit_bytes=vmem, **scales)
    if quant:
        out = out.astype(jnp.float32) * s_v
    return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)

