"""Decode attention through JAX's GPU paged attention Triton kernel, reading a "split" pool in place (K and V as
`[kv_heads, layers * pages, ...]`). It has no sliding window: sliding-window layers take the XLA path on the same
pool."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels.target import target_gpu

from lrmq.generation.attention.xla import decode_attention_xla
from lrmq.generation.kv_format import FP8
from lrmq.generation.kv_pool import QuantPool

GPU_BLOCK_H = 16  # query heads per kernel block (the kernel's minimum; a KV head's fewer queries are padded)
GPU_MAX_K_SPLITS = 16  # the kernel's default: partitions of a sequence's pages decoded in parallel
# What one program of the kernel reads per step (pages_per_compute_block x page_size tokens x head_dim), at most
# (benchmarks/gpu_aot_kernels.py, head_dim 128 on H200 / A100 / B200): 16-bit pages 128 tokens (no spill); f32
# pages 16 (at 128 tokens Triton asked 264 KiB of shared memory, past every GPU's; ptxas spilled 250-360 B per
# thread at 64 and 152 B at 32); int8 / fp8 pages, dequantized with their scale pages, 32 (spills of 3.7 KB per
# thread at 128 tokens, 200 B at 64). A page past GPU_PAGE_BYTES is refused (`gpu_unsupported`): one page would not fit shared memory.
GPU_BLOCK_ELEMENTS = {"16-bit": 128 * 128, "float32": 16 * 128, "scaled": 32 * 128}
GPU_PAGE_BYTES = 32 * 1024


@functools.lru_cache(maxsize=None)
def _gpu_module():
    """jax's GPU paged attention module, or None where this jax does not ship it ("auto" takes "xla")."""
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention
    except ImportError:  # pragma: no cover - moved or dropped in a later jax
        return None
    return paged_attention


def gpu_unsupported(q_heads: int, pool_shape, dtype, scaled: bool = False) -> str | None:
    """Why the GPU kernel cannot take queries / a pool of these shapes (None: it can). pool_shape: the
    interleaved shape [L, P, page_size, 2*KVH, D] (`pool_shape(cfg, ...)`); scaled: the pages are a QuantPool's
    (int8 / fp8 pages are taken with their scale pages only)."""
    if _gpu_module() is None:
        return "this jax has no GPU paged_attention"
    page_size, d = pool_shape[2], pool_shape[-1]
    quant = (jnp.dtype(jnp.int8), *FP8) if scaled else ()
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32), *quant):
        return f"{jnp.dtype(dtype).name} KV pages (the kernel takes f32 / bf16 / f16, int8 / fp8 with scale pages)"
    why = gpu_fp8_unsupported(dtype)
    if why:
        return why
    for name, n in (("head_dim", d), ("page_size", page_size)):
        if n < 16 or n & (n - 1):  # Triton blocks: powers of two, at least 16 for its dots
            return f"{name} {n} (a power of two >= 16)"
    if page_size * d * jnp.dtype(dtype).itemsize > GPU_PAGE_BYTES:
        return (f"a page of {page_size} x {d} {jnp.dtype(dtype).name} (past {GPU_PAGE_BYTES // 1024} KiB: the "
                f"kernel's blocks would not fit shared memory)")
    if q_heads % (pool_shape[3] // 2):
        return f"{q_heads} query heads over {pool_shape[3] // 2} KV heads"
    return None


def gpu_fp8_unsupported(dtype) -> str | None:
    """Why fp8 pages cannot go to the GPU kernel of the compile target (None: they can): Triton converts fp8 only
    on compute capability >= 8.9, and on an A100 (8.0) XLA's Triton compiler aborts the process ("LLVM Fatal Error
    ... Conversion from/to f8e4m3nv is only supported on compute capability >= 89")."""
    if jnp.dtype(dtype) not in FP8 or pk.current_target().platform != "gpu":
        return None
    gpu = target_gpu()
    if gpu.capability < (8, 9):
        return (f"{jnp.dtype(dtype).name} KV pages on the {gpu.name} (compute capability "
                f"{'.'.join(map(str, gpu.capability))}: Triton converts fp8 from 8.9 on)")
    return None


def gpu_blocks(width: int, block_pages: int) -> tuple[int, int]:
    """(pages per compute block, k_splits) of a GPU decode call over a page table `width` pages wide: blocks of
    the largest power of two <= block_pages dividing the width, and as many partitions (<= GPU_MAX_K_SPLITS)
    as divide the blocks; partitions past a row's length are skipped, so a step costs its live pages."""
    per_block = 1
    while per_block * 2 <= block_pages and width % (per_block * 2) == 0:
        per_block *= 2
    blocks = width // per_block
    splits = max(k for k in range(1, min(blocks, GPU_MAX_K_SPLITS) + 1) if blocks % k == 0)
    return per_block, splits


def _gpu_kernel():
    """The kernel `decode_attention_gpu` calls, in Pallas's interpret mode unless compiled for a GPU (a CPU host
    lowering for a GPU target gets the Triton call)."""
    interpret = pk.current_target().platform != "gpu"
    return functools.partial(_gpu_module().paged_attention, interpret=interpret)


def decode_attention_gpu(q, pool, layer, page_table, lengths, window, *, block_pages: int = 8):
    """`decode_attention_xla` through JAX's GPU paged attention kernel, on a "split" pool (one query per slot).

    The K and V arrays are read in place as [KVH, layers * pages, page_size, D] (a free reshape), with the page
    table offset by layer * pages. The kernel has no sliding window and no softmax scale: windowed layers take
    the XLA path on the same pool, and the queries are scaled before the call. Idle slots (length 0) get zeros.
    """
    if window is not None:
        return decode_attention_xla(q, pool, layer, page_table, lengths, window, block_pages=block_pages)
    scales = {}
    if isinstance(pool, QuantPool):  # quantized pages: the kernel scales per token from the scale pages
        kvh, n_layers, pages = pool.k_token.shape[:3]
        scales = {"k_scales_pages": pool.k_token.reshape(kvh, n_layers * pages, -1),
                  "v_scales_pages": pool.v_token.reshape(kvh, n_layers * pages, -1)}
        q_dtype, (k, v) = q.dtype, pool.pages
    else:
        (k, v), q_dtype = pool, pool[0].dtype
    kvh, n_layers, pages = k.shape[:3]
    if pk.current_target().platform == "gpu":  # compiled, not interpreted: refused here rather than by the compiler
        # (which fails on shared memory, or for fp8 on an A100 aborts the process)
        why = gpu_unsupported(q.shape[1], (n_layers, pages, k.shape[3], 2 * kvh, k.shape[4]), k.dtype,
                              scaled=bool(scales))
        if why:
            raise ValueError(f"decode attention 'gpu' cannot take {why}; take impl 'xla'")
    flat = lambda x: x.reshape(kvh, n_layers * pages, *x.shape[3:])  # noqa: E731
    page_size, d = k.shape[3], k.shape[4]
    kind = "scaled" if scales else "float32" if k.dtype.itemsize == 4 else "16-bit"
    tokens = GPU_BLOCK_ELEMENTS[kind] // d
    per_block, splits = gpu_blocks(page_table.shape[1], max(1, min(block_pages, tokens // page_size)))
    with jax.default_matmul_precision("highest"):  # f32 pages: IEEE dots in Triton, not TF32 (the kernel's
        out = _gpu_kernel()(  # dots take the default precision; 16-bit pages are unaffected)
            (q.astype(jnp.float32) * q.shape[-1] ** -0.5).astype(q_dtype), flat(k), flat(v),
            (page_table + layer * pages).astype(jnp.int32), lengths.astype(jnp.int32), block_h=GPU_BLOCK_H,
            pages_per_compute_block=per_block, k_splits=splits, **scales)
    return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)

