"""A paged KV cache: fixed-size pages in one pool, a page table per decode slot.

The pool holds every layer's keys and values in the layout its decode kernel reads in place (`LAYOUTS`):

* "interleaved" (the "xla" and "tpu" implementations): one array `[layers, pages, page_size, 2 * kv_heads,
  head_dim]`, K and V heads interleaved (K of head h at 2h, V at 2h + 1), the layout of the ragged paged
  attention kernel JAX ships for TPU;
* "split" (the "gpu" implementation): a (K, V) pair of `[kv_heads, layers, pages, page_size, head_dim]`, heads
  first and K apart from V, the layout of JAX's GPU paged attention kernel (`[kv_heads, pages, ...]` per
  array: the layer and page axes merge for free, so the kernel reads every layer's pages in place).

Page 0 is never handed out: rows that are not live write there, so a static-shaped step needs no branch.

The model sees one object per forward (`PagedCache`): `write(k, v, q_pos)` stores this forward's keys and
values in the pages; in prefill mode a prompt then attends to itself with the model's own (blockwise)
attention; in decode mode `attend(q, q_pos, window)` has each slot's one new token attend to its pages,
read a block of pages at a time with an online softmax, so a step costs what the longest live
row holds, not what was allocated.

Decode attention implementations (`DECODE_ATTENTION`, chosen by `PagedCache.impl`; "auto" follows the compile
target of `pallas_kernels.current_target()`, so ahead-of-time TPU compiles from a CPU host get the kernel):

* "xla" (CPU, and every fallback): `decode_attention_xla`, a gather of each slot's pages a block at a
  time with an online softmax.
* "tpu": JAX's ragged paged attention Mosaic kernel (`decode_attention_tpu`), reading the pool in place
  (viewed as `[layers * pages, ...]`, page indices offset by `layer * pages`: no per-layer copy).
* "gpu": JAX's GPU paged attention Triton kernel (`decode_attention_gpu`, the "split" layout, read in place
  the same way). It has no sliding window: sliding-window layers take the XLA path on the same pool.

On a mesh (`pool_sharding`) the pool's KV heads are split like the KV projections of the decode layout
(tensor parallel over tensor x fsdp, `sharding.DECODE_RULES`; `kv_head_axes`), and its pages over the data
axes that do not split heads (`kv_page_axes`): each data group holds only the pages of its own rows, with page
ids local to the group (page 0 of each is its null page; the scheduler allocates per group:
`Scheduler(groups=)`). So each chip holds its heads of its group's pages, not the whole pool; `write`, `attend`
and `copy_pages` run under `shard_map` on each chip's heads for its group's rows, and every slot's pages stay
where they are.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels.target import target_gpu
from pallas_kernels.tpu_tiles import generation

from lrmq.sharding import (DECODE_RULES, axes_size, dividing_axes, entry_axes, host_array, is_manual, logical_to_spec,
                           spec_entry)

NULL_PAGE = 0  # the page rows that are not live write to; never allocated
_NEG = -1e30  # finite: a block with nothing visible must not turn the running max into NaN


# The pool layout each decode implementation reads in place (see the module docstring).
LAYOUTS = {"xla": "interleaved", "tpu": "interleaved", "gpu": "split"}

# ------------------------------------------------------------------------ the KV cache's storage format
# "auto": the model's dtype (the pool is a plain array / pair, as it always was); "bf16": bfloat16 pages;
# "fp8_e4m3" / "fp8_e5m2" / "int8": quantized pages in a `QuantPool` with their scales (module docstring of
# `QuantPool`).
KV_CACHE_FORMATS = ("auto", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")
QUANT_DTYPES = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2, "int8": jnp.int8}


def check_kv_cache(kv_cache: str, key: str = "kv_cache") -> str:
    if kv_cache not in KV_CACHE_FORMATS:
        raise ValueError(f"{key} must be one of {', '.join(KV_CACHE_FORMATS)} (got {kv_cache!r})")
    return kv_cache


def is_quantized(kv_cache: str) -> bool:
    return kv_cache in QUANT_DTYPES


def storage_dtype(cfg, kv_cache: str = "auto"):
    """dtype of the pool's pages: the model's ("auto"), bfloat16 ("bf16") or the quantized format's."""
    check_kv_cache(kv_cache)
    if kv_cache == "auto":
        return jnp.dtype(cfg.dtype)
    return jnp.dtype(jnp.bfloat16 if kv_cache == "bf16" else QUANT_DTYPES[kv_cache])


def format_max(kv_cache: str) -> float:
    """The largest magnitude a quantized format stores (a scale maps a head's absmax onto it)."""
    return 127.0 if kv_cache == "int8" else float(jnp.finfo(QUANT_DTYPES[kv_cache]).max)


def per_token_scales(kv_cache: str, layout: str) -> bool:
    """Whether a quantized pool keeps scale pages (one scale per token and KV head, for K and V): int8 (a
    per-token absmax, nothing saturates) and every "split" pool (JAX's GPU kernel reads its scales from pages;
    fp8 there writes the head's scale for each token)."""
    return kv_cache == "int8" or layout == "split"


@struct.dataclass
class QuantPool:
    """A quantized pool: `pages` (the plain pool's array or (K, V) pair, in the quantized dtype) and its scales.

    * k_scale / v_scale [KVH, L] float32: per layer and KV head, pool-global (fp8). 0 = not yet calibrated: the
      first write that sees a layer's keys (the call's first prefill) sets absmax / format max, unless the pool
      was made holding a caller's `KVScales` (`with_scales`); later writes keep it, clip at the format's max and
      count what they clipped in `saturated` [KVH] (int32).
    * k_token / v_token [KVH, L, P, page_size] float32 scale pages (`per_token_scales`; None otherwise): int8's
      per-token absmax / 127, or the head's fp8 scale repeated for the GPU kernel. Copy on write copies them
      with the pages.
    The value of a stored entry is page x scale. Every leaf has the KV heads first (heads split on a mesh).
    """

    pages: jax.Array | tuple
    k_scale: jax.Array
    v_scale: jax.Array
    saturated: jax.Array
    k_token: jax.Array | None = None
    v_token: jax.Array | None = None
    fmt: str = struct.field(pytree_node=False, default="fp8_e4m3")


@dataclasses.dataclass(frozen=True)
class KVScales:
    """The fp8 per-layer / KV-head scales of a `QuantPool` (host arrays), as a call calibrated them: what crosses
    the engine's boundary both ways (`GenerationResult.kv_scales` out, `Engine.generate(kv_scales=...)` in), so a
    caller can keep one calibration across calls (`rollout.kv_scale_refresh`). k / v: [kv_heads, layers] float32,
    the value of a stored entry being page x scale. fp8 only: int8 keeps a scale per token (nothing to reuse)."""

    fmt: str
    k: np.ndarray
    v: np.ndarray

    def __post_init__(self):
        if self.fmt not in KEPT_SCALE_FORMATS:
            raise ValueError(f"KV scales are kept for {' / '.join(KEPT_SCALE_FORMATS)} only (got {self.fmt!r}: "
                             f"{_no_kept_scales(self.fmt)})")
        for name in ("k", "v"):
            x = np.asarray(getattr(self, name))
            if x.ndim != 2 or x.dtype != np.float32 or not np.all(np.isfinite(x)) or np.any(x < 0):
                raise ValueError(f"KVScales.{name} must be finite, >= 0 float32 [kv_heads, layers] "
                                 f"(got {x.dtype} {x.shape})")
        if np.shape(self.k) != np.shape(self.v):
            raise ValueError(f"KVScales: k {np.shape(self.k)} and v {np.shape(self.v)} differ in shape")

    def __eq__(self, other):
        return (isinstance(other, KVScales) and self.fmt == other.fmt and np.array_equal(self.k, other.k)
                and np.array_equal(self.v, other.v))

    __hash__ = None


# The formats whose scales are per layer and KV head (pool-global), so a calibration can be kept across calls.
KEPT_SCALE_FORMATS = ("fp8_e4m3", "fp8_e5m2")


def _no_kept_scales(fmt: str) -> str:
    if fmt == "int8":
        return "int8 scales each token by its own absmax when it is written: there is no calibration to keep"
    return "an unquantized cache has no scales"


def pool_scales(pool) -> KVScales | None:
    """The per-head scales a pool holds (a 0 entry: a head never written, calibrated by its next write), on the
    host; None for a pool without them (plain, int8)."""
    if not isinstance(pool, QuantPool) or pool.fmt not in KEPT_SCALE_FORMATS:
        return None
    return KVScales(pool.fmt, host_array(pool.k_scale).astype(np.float32), host_array(pool.v_scale).astype(np.float32))


def check_kv_scales(scales: KVScales, kv_cache: str, cfg) -> KVScales:
    """`scales` if a cache of format `kv_cache` for a model of `cfg` can write under them, else a ValueError."""
    if kv_cache not in KEPT_SCALE_FORMATS:
        raise ValueError(f"kv_scales are for an fp8 KV cache; this engine's is {kv_cache!r} "
                         f"({_no_kept_scales(kv_cache)})")
    if scales.fmt != kv_cache:
        raise ValueError(f"kv_scales were calibrated for {scales.fmt}, this engine's KV cache is {kv_cache}")
    want = (cfg.num_kv_heads, cfg.num_layers)
    if np.shape(scales.k) != want:
        raise ValueError(f"kv_scales are [kv_heads, layers] = {np.shape(scales.k)}, this model's are {want}")
    return scales


def with_scales(pool: QuantPool, scales: KVScales) -> QuantPool:
    """`pool` (a fresh one: nothing written yet) holding `scales` (`check_kv_scales`): its writes keep them instead
    of calibrating (a 0 entry is still calibrated by its first write), laid out as the pool's own scales."""
    def put(x, like):  # each device (each process's) takes its share of the host array
        x = np.asarray(x, np.float32)
        return jax.make_array_from_callback(x.shape, like.sharding, lambda index: x[index])

    return pool.replace(k_scale=put(scales.k, pool.k_scale), v_scale=put(scales.v, pool.v_scale))


def _data(pool):
    """The pages of a pool (a QuantPool's `pages`; a plain pool itself)."""
    return pool.pages if isinstance(pool, QuantPool) else pool


def pool_dtype(pool):
    return jax.tree.leaves(_data(pool))[0].dtype


# fp8 per-head scales map FP8_HEADROOM x the calibration's absmax onto the format's max: decode-time keys and
# values beyond the prompts' range are then still stored, not clipped. An fp8 value's relative precision is the
# same across its normal range (2^-6 .. 448 for e4m3), so the headroom costs only the smallest entries (which
# fall 2 binades deeper into the subnormals).
FP8_HEADROOM = 4.0


def quant_scales(x, live, scale, fmax, axes: tuple[str, ...] = ()):
    """(scale [KVH], clipped [KVH]) of a per-head write: x [R, T, KVH, D] at live [R, T]; `scale` 0 is
    calibrated here (FP8_HEADROOM x absmax of the live entries / fmax). axes: the mesh axes the rows are split
    over inside a shard_map (the pool's data groups): the absmax and the count are taken over all of them, so
    every group keeps the same pool-global scale."""
    amax = jnp.max(jnp.where(live[:, :, None, None], jnp.abs(x.astype(jnp.float32)), 0.0), axis=(0, 1, 3))
    if axes:
        amax = jax.lax.pmax(amax, axes)
    scale = jnp.where(scale > 0, scale, FP8_HEADROOM * amax / fmax)
    safe = jnp.where(scale > 0, scale, 1.0)
    over = (jnp.abs(x.astype(jnp.float32)) / safe[:, None]) > fmax
    clipped = jnp.sum(over & live[:, :, None, None], axis=(0, 1, 3)).astype(jnp.int32)
    return scale, jax.lax.psum(clipped, axes) if axes else clipped


def quantize(x, scale, dtype, fmax):
    """x [..., KVH, D] / scale (broadcast over D) in `dtype`, clipped at +-fmax (rounded for int8)."""
    y = x.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0)[..., None]
    y = jnp.clip(y, -fmax, fmax)
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.round(y)
    return y.astype(dtype)


def pool_shape(cfg, pages: int, page_size: int, layout: str = "interleaved"):
    """The pool's array shape ("interleaved"), or the shape of each of its K and V arrays ("split")."""
    if layout == "split":
        return (cfg.num_kv_heads, cfg.num_layers, pages, page_size, cfg.head_dim)
    return (cfg.num_layers, pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim)


def is_split(pool) -> bool:
    return isinstance(_data(pool), tuple)


def layout_of(pool) -> str:
    return "split" if is_split(pool) else "interleaved"


def interleaved_shape(pool) -> tuple[int, ...]:
    """[L, P, page_size, 2*KVH, D] of a pool in either layout."""
    pool = _data(pool)
    if is_split(pool):
        kvh, n_layers, pages, page_size, d = pool[0].shape
        return (n_layers, pages, page_size, 2 * kvh, d)
    return tuple(pool.shape)


def kv_heads_of(pool) -> int:
    pool = _data(pool)
    return pool[0].shape[0] if is_split(pool) else pool.shape[3] // 2


def interleave(k: jax.Array, v: jax.Array) -> jax.Array:
    """[..., KVH, D] keys and values -> [..., 2 * KVH, D] with K at even and V at odd heads."""
    return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def read_pages(pool, layer, pages, fmt_dtype=None):
    """Keys and values [S, n * page_size, KVH, D] (f32) of `layer` at pages [S, n], from either layout.
    fmt_dtype: the pages' format where the pool holds its bits in another dtype (`int8_bits`): the gathered pages
    are reinterpreted, never the pool."""
    s, n = pages.shape
    bits = lambda x: x if fmt_dtype is None or x.dtype == fmt_dtype else jax.lax.bitcast_convert_type(  # noqa: E731
        x, fmt_dtype)
    if isinstance(pool, QuantPool):  # dequantized: the pages times their scales (per token, else per head)
        k, v = read_pages(pool.pages, layer, pages, QUANT_DTYPES[pool.fmt])

        def scaled(x, token, head):
            if token is None:
                return x * head[:, layer][None, None, :, None]
            t = token[:, layer, pages]  # [KVH, S, n, page_size]
            return x * jnp.moveaxis(t, 0, -1).reshape(s, n * t.shape[-1], t.shape[0])[..., None]
        return scaled(k, pool.k_token, pool.k_scale), scaled(v, pool.v_token, pool.v_scale)
    if is_split(pool):
        def one(x):  # [KVH, S, n, page_size, D] -> [S, n * page_size, KVH, D]
            x = bits(x[:, layer, pages])
            return jnp.moveaxis(x, 0, -2).reshape(s, n * x.shape[3], x.shape[0], x.shape[-1]).astype(jnp.float32)
        return one(pool[0]), one(pool[1])
    kv = bits(pool[layer, pages])
    kv = kv.reshape(s, n * kv.shape[2], *kv.shape[3:]).astype(jnp.float32)
    return kv[:, :, 0::2], kv[:, :, 1::2]


def copy_pages(pool, src, dst):
    """Every layer's page src[i] copied to page dst[i] (copy on write of a shared prompt's last page); a
    QuantPool's scale pages with them (its per-head scales are pool-global: nothing to copy). On a mesh whose data
    groups split the pages (`kv_page_axes`), src / dst [rows] are group-local ids and each group copies its rows'."""
    mesh, heads, groups = _mesh_for(pool)
    if not groups:
        return _copy_local(pool, src, dst)
    rows = P(spec_entry(groups))
    return jax.shard_map(_copy_local, mesh=mesh, in_specs=(_spec_of(pool, mesh), rows, rows),
                         out_specs=_spec_of(pool, mesh), check_vma=False)(pool, src, dst)


def _copy_local(pool, src, dst):
    if isinstance(pool, QuantPool):
        token = {name: getattr(pool, name).at[:, :, dst].set(getattr(pool, name)[:, :, src])
                 for name in ("k_token", "v_token") if getattr(pool, name) is not None}
        return pool.replace(pages=_copy_local(pool.pages, src, dst), **token)
    if is_split(pool):
        return tuple(x.at[:, :, dst].set(x[:, :, src]) for x in pool)
    return pool.at[:, dst].set(pool[:, src])


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


# ------------------------------------------------------------------------ TPU: ragged paged attention
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


_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def tpu_unsupported(q_heads: int, pool_shape, dtype, scaled: bool = False) -> str | None:
    """Why the TPU kernel cannot take a pool / queries of these shapes (None: it can). scaled: the pages are a
    QuantPool's (fp8 pages are taken with their per-head scales; unscaled they are not)."""
    rpa = _rpa_module()
    if rpa is None:
        return "this jax has no ragged_paged_attention"
    d, combined = pool_shape[-1], pool_shape[-2]
    if jnp.dtype(dtype) in _FP8 and not scaled:
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


# ------------------------------------------------------------------------ GPU: paged attention (Triton)
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
    quant = (jnp.dtype(jnp.int8), *_FP8) if scaled else ()
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
    if jnp.dtype(dtype) not in _FP8 or pk.current_target().platform != "gpu":
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


# Decode-attention implementations by name; "xla" runs everywhere, "tpu" on TPU and "gpu" on GPU (or in
# Pallas's interpret mode); "auto" (resolve_impl) picks by the compile target.
DECODE_ATTENTION: dict[str, Callable] = {"xla": decode_attention_xla, "tpu": decode_attention_tpu,
                                         "gpu": decode_attention_gpu}


def resolve_impl(impl: str, q_heads: int, pool_shape, dtype, *, layout: str | None = None, mesh=None,
                 scaled: bool = False) -> str:
    """The DECODE_ATTENTION entry a call takes (the one place "auto" is decided): "auto" -> the compile target's
    kernel ("tpu" / "gpu") when it takes these shapes (`tpu_unsupported`, `gpu_unsupported`) and reads a pool of
    `layout` (None: any, the pool is made for the choice), else "xla"; any other name as given. pool_shape: the
    interleaved shape (`pool_shape(cfg, pages, page_size)`); mesh: decide for its devices (`jax.set_mesh`), not
    the target in effect; scaled: a quantized pool (`QuantPool`) of `dtype` pages. The kernels are asked about
    a chip's share of the heads (`kv_head_axes` of the mesh in effect), as they run per chip. fp8 pages the TPU
    kernel refuses only for that share (one KV head per chip) raise a ValueError (`fp8_heads_message`) instead
    of taking "xla" unasked (docs/tpu.md, "fp8 / int8 KV pages on a slice")."""
    if impl != "auto":
        if impl not in DECODE_ATTENTION:
            raise ValueError(f"decode attention impl must be 'auto' or one of {sorted(DECODE_ATTENTION)}, "
                             f"got {impl!r}")
        return impl
    if mesh is not None:
        with jax.set_mesh(mesh):
            return resolve_impl(impl, q_heads, pool_shape, dtype, layout=layout, scaled=scaled)
    platform = pk.current_target().platform
    unsupported = {"tpu": tpu_unsupported, "gpu": gpu_unsupported}.get(platform)
    if unsupported is None or layout not in (None, LAYOUTS[platform]):
        return "xla"
    # the kernel runs per chip (in a shard_map) on the chip's share of the KV heads and of the query heads
    mesh, share = _head_share(pool_shape[-2] // 2)
    chip_shape = (*pool_shape[:-2], pool_shape[-2] // share, pool_shape[-1])
    why = unsupported(q_heads // share, chip_shape, dtype, scaled)
    if why is None:
        return platform
    # fp8 pages refused only for the heads a chip holds (the last check): the XLA path is taken only when asked
    if (platform == "tpu" and scaled and jnp.dtype(dtype) in _FP8
            and why == _tpu_heads_refusal(q_heads // share, chip_shape[-2], dtype)):
        raise ValueError(fp8_heads_message(dtype, pool_shape[-2] // 2, mesh, share))
    return "xla"


def _head_share(kv_heads: int) -> tuple[object, int]:
    """(mesh, how many ways the pool's KV heads are split over it: `kv_head_axes`) for the mesh in effect
    ((None, 1) without one, or inside a shard_map, where the shapes are already a chip's)."""
    mesh = pk.mesh_in_effect()
    if mesh is None or mesh.size == 1 or is_manual(mesh):
        return mesh, 1
    return mesh, axes_size(mesh, kv_head_axes(mesh, kv_heads))


def fp8_heads_message(dtype, kv_heads: int, mesh, share: int) -> str:
    """Why `resolve_impl` refuses fp8 pages on TPU at one KV head per chip (see docs/tpu.md, "fp8 / int8 KV pages
    on a slice"), naming the setting, the mesh and what works instead."""
    fmt = {jnp.dtype(jnp.float8_e4m3fn): "fp8_e4m3", jnp.dtype(jnp.float8_e5m2): "fp8_e5m2"}[jnp.dtype(dtype)]
    per_chip = kv_heads // share
    n = mesh.size if mesh is not None else 1
    where = (f"the mesh {' x '.join(f'{a}={s}' for a, s in mesh.shape.items())} splits the {kv_heads} KV heads "
             f"{share} ways, {per_chip} per chip" if mesh is not None and share > 1
             else f"one chip holds all {kv_heads} KV heads")
    splits = [s for s in range(1, n + 1) if n % s == 0 and kv_heads % s == 0 and kv_heads // s >= 2]
    if splits:
        s = max(splits)
        mesh_hint = f"a mesh with >= 2 KV heads per chip (here: data={n // s} x fsdp={s}, {kv_heads // s} per chip)"
    else:
        mesh_hint = f"no mesh (the model has {kv_heads} KV head{'s' * (kv_heads != 1)})"
    return (f"kv_cache={fmt} (rollout.kv_cache / generation.kv_cache / EngineConfig.kv_cache) on TPU: {where}. "
            f"JAX's ragged paged attention kernel takes fp8 pages only at >= 2 KV heads per chip (fp8 packs 4 rows "
            f"to a 32-bit sublane; {per_chip} KV head = {2 * per_chip} interleaved K/V rows), and decode attention "
            f"'auto' does not silently swap the kernel for the XLA path (it gathers pages instead of the kernel's "
            f"DMA, and XLA relays the whole pool before and after each device call: two pool-sized temporaries, "
            f"so the program is larger than bf16's; docs/tpu.md). What works: {mesh_hint}; kv_cache=int8 (the XLA "
            f"path, the same relayouts); kv_cache=bf16 / auto; or the XLA path for fp8 pages, given explicitly: "
            f"rollout.decode_attention=xla (lrmq.train), generation.decode_attention=xla (lrmq.evaluate), "
            f"--decode-attention xla (lrmq.generate) or Engine(impl='xla').")


# --------------------------------------------------------------------------------- the pool on a mesh
_HEAD_AXES = ("tensor", "data", "fsdp")  # tensor first: the KV projections already split heads over it
_BATCH_AXES = ("data", "fsdp")


def kv_head_axes(mesh, kv_heads: int) -> tuple[str, ...]:
    """Mesh axes (>1 device) the pool's KV heads are split over: those of the KV projections in the decode
    layout (`sharding.DECODE_RULES`, tensor x fsdp), so each chip's new keys and values and its query heads
    are already its share of the pool; when those axes do not divide kv_heads, the subset of (tensor, data,
    fsdp) with the largest product that does (ties: the one listed first; queries are then resharded for the
    attention). () without a mesh."""
    if mesh is None:
        return ()
    entry = logical_to_spec(("kv_heads",), (kv_heads,), mesh, DECODE_RULES)[0]
    if entry is not None:
        return entry_axes(entry)
    axes = [a for a in _HEAD_AXES if a in mesh.shape and mesh.shape[a] > 1]
    best = ()
    for n in range(len(axes), 0, -1):
        for combo in itertools.combinations(axes, n):
            size = axes_size(mesh, combo)
            if kv_heads % size == 0 and size > axes_size(mesh, best):
                best = combo
    return best


def kv_page_axes(mesh, kv_heads: int) -> tuple[str, ...]:
    """Mesh axes (>1 device) the pool's pages are split over: the data axes (data, fsdp) that do not split its KV
    heads (`kv_head_axes`), the axes a decode batch's rows are split over in `attend`. Each data group (a chip's
    coordinates on them) holds only its own rows' pages, with group-local page ids (`Scheduler(groups=)`): the
    pool per chip is its share of the heads of its group's pages. () without a mesh."""
    if mesh is None or jax.process_count() > 1:
        # a multi-process run keeps the pages whole over data (as before): the two-process colocated launch hung
        # with the pages split across processes (tests/test_pod_path.py), not yet diagnosed
        return ()
    heads = kv_head_axes(mesh, kv_heads)
    return tuple(a for a in _BATCH_AXES if a in mesh.shape and mesh.shape[a] > 1 and a not in heads)


def kv_groups(mesh, kv_heads: int) -> int:
    """How many data groups split the pool's pages (`kv_page_axes`): 1 without a mesh."""
    return axes_size(mesh, kv_page_axes(mesh, kv_heads)) if mesh is not None else 1


def least_kv_heads(kv_cache: str, platform: str) -> int:
    """The fewest KV heads per chip a pool of `kv_cache` pages decodes with on `platform`: 2 for fp8 pages on TPU
    (JAX's ragged paged attention packs fp8 rows in pairs of heads; `fp8_heads_message`), else 1."""
    return 2 if platform == "tpu" and kv_cache in KEPT_SCALE_FORMATS else 1


def decode_fsdp(chips: int, kv_heads: int, kv_cache: str, platform: str) -> int:
    """The fsdp axis of a decode mesh of `chips` chips (data the rest) that the KV format runs on: the largest that
    splits the `kv_heads` KV heads into whole shares of at least what the format's kernel takes (>= 2 per chip for
    fp8 pages on TPU: JAX's ragged paged attention packs fp8 rows in pairs of heads; docs/tpu.md), else >= 1. The
    data axis left then splits the pool's pages (`kv_page_axes`)."""
    least = least_kv_heads(kv_cache, platform)
    fits = [d for d in range(1, chips + 1) if chips % d == 0 and kv_heads % d == 0 and kv_heads // d >= least]
    return max(fits, default=1)


def pool_spec(mesh, kv_heads: int, layout: str = "interleaved", kv_cache: str = "auto"):
    """PartitionSpec of the pool (a pair of them, "split"; a QuantPool of them, quantized): heads over
    `kv_head_axes`, pages over `kv_page_axes`, the rest whole. A contiguous share of the interleaved heads is
    whole (K, V) pairs, so each chip's share is itself a pool; a QuantPool's scales have the heads first, split
    the same way (its scale pages split over the groups like the pages; its per-head scales whole: pool-global)."""
    heads = spec_entry(kv_head_axes(mesh, kv_heads))
    groups = spec_entry(kv_page_axes(mesh, kv_heads))
    if layout == "split":
        pages = (P(heads, None, groups, None, None),) * 2
    else:
        pages = P(None, groups, None, heads, None)
    if not is_quantized(kv_cache):
        return pages
    token = P(heads, None, groups, None) if per_token_scales(kv_cache, layout) else None
    return QuantPool(pages, P(heads, None), P(heads, None), P(heads), token, token, fmt=kv_cache)


def _spec_of(pool, mesh):
    """`pool_spec` of an existing pool (its layout and format)."""
    fmt = pool.fmt if isinstance(pool, QuantPool) else "auto"
    return pool_spec(mesh, kv_heads_of(pool), layout_of(pool), fmt)


def pool_sharding(mesh, cfg, layout: str = "interleaved", kv_cache: str = "auto"):
    if mesh is None:
        return None
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), pool_spec(mesh, cfg.num_kv_heads, layout, kv_cache))


def int8_bits(kv_cache: str, impl: str) -> bool:
    """Whether a pool of `kv_cache` pages read by decode attention `impl` holds fp8 pages as int8 (their bits, the
    same bytes): the XLA path's. On TPU an f8 pool read by XLA's gather is laid out apart from the layout its
    scatter writes, so XLA copied the chip's whole pool in every layer of every decode step (docs/tpu.md, "fp8 /
    int8 KV pages on a slice"); an int8 pool is not (int8 KV never was), and only the gathered pages and the new
    tokens are reinterpreted. The kernels read f8 pages in place."""
    return kv_cache in ("fp8_e4m3", "fp8_e5m2") and impl == "xla"


def abstract_pool(cfg, pages: int, page_size: int, mesh=None, layout: str = "interleaved", kv_cache: str = "auto",
                  fp8_as_int8: bool = False):
    """The pool's ShapeDtypeStruct(s), laid out for `mesh`: what `new_pool` returns, for ahead-of-time compiles.
    kv_cache: the pages' format (`KV_CACHE_FORMATS`; a quantized one: a QuantPool with its scales); fp8_as_int8:
    fp8 pages held as int8 bits (`int8_bits`)."""
    shape, dtype = pool_shape(cfg, pages, page_size, layout), storage_dtype(cfg, kv_cache)
    if fp8_as_int8 and dtype in _FP8:
        dtype = jnp.dtype(jnp.int8)
    sharding = pool_sharding(mesh, cfg, layout, kv_cache)
    sh = lambda name: getattr(sharding, name) if sharding is not None else None  # noqa: E731
    pages_sharding = sharding.pages if isinstance(sharding, QuantPool) else sharding
    if layout == "split":
        data = tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=s) for s in (pages_sharding or (None, None)))
    else:
        data = jax.ShapeDtypeStruct(shape, dtype, sharding=pages_sharding)
    if not is_quantized(kv_cache):
        return data
    kvh, n_layers = cfg.num_kv_heads, cfg.num_layers
    head = lambda name: jax.ShapeDtypeStruct((kvh, n_layers), jnp.float32, sharding=sh(name))  # noqa: E731
    token = lambda name: jax.ShapeDtypeStruct((kvh, n_layers, pages, page_size), jnp.float32,  # noqa: E731
                                              sharding=sh(name)) if per_token_scales(kv_cache, layout) else None
    return QuantPool(data, head("k_scale"), head("v_scale"), jax.ShapeDtypeStruct((kvh,), jnp.int32,
                     sharding=sh("saturated")), token("k_token"), token("v_token"), fmt=kv_cache)


def new_pool(cfg, pages: int, page_size: int, mesh=None, layout: str = "interleaved", kv_cache: str = "auto",
             fp8_as_int8: bool = False):
    """A zeroed pool, laid out for `mesh` (`pool_sharding`): no chip ever holds more than its share (scales 0:
    not calibrated yet)."""
    # created sharded (each chip allocates its share); an eager op: compiled once per shape and layout
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding),
                        abstract_pool(cfg, pages, page_size, mesh, layout, kv_cache, fp8_as_int8))


def _mesh_for(pool) -> tuple[object, tuple[str, ...], tuple[str, ...]]:
    """(mesh, KV-head axes, page axes: `kv_page_axes`) when the program being traced is partitioned over a
    multi-device mesh (not already inside a shard_map), else (None, (), ())."""
    mesh = pk.mesh_in_effect()
    if mesh is None or mesh.size == 1 or is_manual(mesh):
        return None, (), ()
    kvh = kv_heads_of(pool)
    return mesh, kv_head_axes(mesh, kvh), kv_page_axes(mesh, kvh)


@struct.dataclass
class PagedCache:
    """The cache a forward writes to (see the module docstring).

    prefill: tokens [R, T] at positions 0..T-1 per row (padding at -1) write to page_table[r, pos // page_size].
    decode: tokens [S, 1] at position `lengths - 1` of each slot; `live` slots only (others write to NULL_PAGE).
    """

    pool: jax.Array | tuple  # [L, P, page_size, 2*KVH, D], or a "split" (K, V) pair (see the module docstring)
    page_table: jax.Array  # [rows, max_pages] int32
    live: jax.Array  # [rows] bool
    layer: jax.Array | int = 0
    mode: str = struct.field(pytree_node=False, default="decode")
    block_pages: int = struct.field(pytree_node=False, default=8)
    impl: str = struct.field(pytree_node=False, default="auto")

    @property
    def page_size(self) -> int:
        return interleaved_shape(self.pool)[2]

    def _spec(self, mesh):
        return _spec_of(self.pool, mesh)

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

        mesh, heads, groups = _mesh_for(self.pool)

        def store(pool, k, v, page, offset, layer, live):
            if isinstance(pool, QuantPool):
                return store_quant(pool, k, v, page, offset, layer, live)
            if is_split(pool):  # [KVH, L, P, page_size, D] at [:, layer, page, offset] is [KVH, R, T, D]
                return tuple(x.at[:, layer, page, offset].set(jnp.moveaxis(y, 2, 0).astype(x.dtype))
                             for x, y in ((pool[0], k), (pool[1], v)))
            return pool.at[layer, page, offset].set(interleave(k, v).astype(pool.dtype))

        def store_quant(qp, k, v, page, offset, layer, live):
            fmax, dtype, token = format_max(qp.fmt), QUANT_DTYPES[qp.fmt], {}
            k_scale, v_scale, saturated = qp.k_scale, qp.v_scale, qp.saturated
            if qp.fmt == "int8":  # per token and head: absmax / 127, nothing clips
                ks, vs = (jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1) / fmax for x in (k, v))  # [R, T, KVH]
            else:  # per head, pool-global: calibrated by the first write that sees the layer, then clipped
                (ks, k_sat), (vs, v_sat) = (quant_scales(x, live, sc[:, layer], fmax, groups)
                                            for x, sc in ((k, k_scale), (v, v_scale)))
                k_scale, v_scale = k_scale.at[:, layer].set(ks), v_scale.at[:, layer].set(vs)
                saturated = saturated + k_sat + v_sat
                ks, vs = (jnp.broadcast_to(x, k.shape[:-1]) for x in (ks, vs))
            if qp.k_token is not None:  # [KVH, L, P, page_size] at [:, layer, page, offset] is [KVH, R, T]
                token = {name: getattr(qp, name).at[:, layer, page, offset].set(jnp.moveaxis(x, 2, 0))
                         for name, x in (("k_token", ks), ("v_token", vs))}
            kq, vq = quantize(k, ks, dtype, fmax), quantize(v, vs, dtype, fmax)
            if pool_dtype(qp) != dtype:  # fp8 bits in an int8 pool (`int8_bits`)
                kq, vq = (jax.lax.bitcast_convert_type(x, pool_dtype(qp)) for x in (kq, vq))
            return qp.replace(pages=store(qp.pages, kq, vq, page, offset, layer, live), k_scale=k_scale,
                              v_scale=v_scale, saturated=saturated, **token)

        if not heads and not groups:  # one device, or a pool whole on every chip: XLA partitions the scatter
            return self.replace(pool=store(self.pool, k, v, page, offset, self.layer, live))
        # each chip stores its KV heads of its data group's rows (the rest of the rows gathered: activation-sized)
        _check_rows(k.shape[0], mesh, groups)
        rows = spec_entry(groups)
        kv, pool, idx = P(rows, None, spec_entry(heads), None), self._spec(mesh), P(rows, None)
        fn = jax.shard_map(store, mesh=mesh, in_specs=(pool, kv, kv, idx, idx, P(), idx), out_specs=pool,
                           check_vma=False)
        return self.replace(pool=fn(self.pool, k, v, page, offset, jnp.asarray(self.layer, jnp.int32), live))

    def attend(self, q, q_pos, window):
        """Decode: q [S, 1, H, D] at q_pos [S, 1] against each slot's pages -> [S, 1, H, D]."""
        lengths = jnp.where(self.live, q_pos[:, 0] + 1, 0)
        layout = layout_of(self.pool)  # "auto" (the Engine passes its choice): a kernel that reads this pool
        impl = resolve_impl(self.impl, q.shape[2], interleaved_shape(self.pool), pool_dtype(self.pool), layout=layout,
                            scaled=isinstance(self.pool, QuantPool))
        if impl != "xla" and isinstance(self.pool, QuantPool) and pool_dtype(self.pool) != QUANT_DTYPES[self.pool.fmt]:
            raise ValueError(f"decode attention {impl!r} reads {self.pool.fmt} pages in their dtype; this pool holds "
                             f"them as {pool_dtype(self.pool).name} bits (made for the XLA path: `int8_bits`)")
        if impl != "xla" and LAYOUTS[impl] != layout:
            raise ValueError(f"decode attention {impl!r} reads a {LAYOUTS[impl]!r} pool; this one is not "
                             f"(make it with new_pool(..., layout=LAYOUTS[{impl!r}]))")
        fn = functools.partial(DECODE_ATTENTION[impl], window=window, block_pages=self.block_pages)
        mesh, heads, groups = _mesh_for(self.pool)
        if mesh is None or (impl == "xla" and not heads and not groups):  # XLA partitions the plain path itself
            return fn(q[:, 0], self.pool, self.layer, self.page_table, lengths)[:, None]
        # Mosaic kernels are not partitioned automatically, and a split pool must be read where it lies: each chip
        # attends with its heads for its data group's rows (group-local page tables); with the pages whole, the
        # rows of the data axes not splitting heads, trailing ones dropped until they divide the rows
        _check_rows(q.shape[0], mesh, groups)
        rows = spec_entry(groups or dividing_axes(mesh, _BATCH_AXES, q.shape[0], exclude=heads))
        qs = P(rows, spec_entry(heads), None)
        run = jax.shard_map(lambda q, pool, layer, table, lengths: fn(q, pool, layer, table, lengths), mesh=mesh,
                            in_specs=(qs, self._spec(mesh), P(), P(rows, None), P(rows)),
                            out_specs=qs, check_vma=False)
        return run(q[:, 0], self.pool, jnp.asarray(self.layer, jnp.int32), self.page_table, lengths)[:, None]


def _check_rows(rows: int, mesh, groups: tuple[str, ...]) -> None:
    if groups and rows % axes_size(mesh, groups):
        raise ValueError(f"{rows} rows do not split over the pool's {axes_size(mesh, groups)} data groups "
                         f"({' x '.join(groups)}): a batch on this mesh needs a multiple of them")


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


# ----------------------------------------------------------------------------- sizing the pool to the device
def page_bytes(cfg, page_size: int, mesh=None, kv_cache: str = "auto", layout: str | None = None) -> int:
    """Bytes one page of the pool takes on each device of the data group holding it (a pool of P pages takes
    P / `kv_groups` of them per device): K and V of every layer for `page_size` tokens, the
    device's share of the KV heads (`kv_head_axes`), in the cache's format (with its scale pages, when it keeps
    them: `per_token_scales`; layout None: "split" when compiling for a GPU (the mesh's devices, else the
    target in effect), where "auto" takes the GPU kernel's pool, else "interleaved")."""
    share = axes_size(mesh, kv_head_axes(mesh, cfg.num_kv_heads)) if mesh is not None else 1
    entries = cfg.num_layers * page_size * 2 * cfg.num_kv_heads
    per_page = entries * cfg.head_dim * storage_dtype(cfg, kv_cache).itemsize
    if is_quantized(kv_cache) and layout is None:
        if mesh is not None:
            with jax.set_mesh(mesh):
                platform = pk.current_target().platform
        else:
            platform = pk.current_target().platform
        layout = "split" if platform == "gpu" else "interleaved"
    if is_quantized(kv_cache) and per_token_scales(kv_cache, layout):
        per_page += entries * 4
    return per_page // share


def pool_budget(hbm: int | None, reserved: int, fraction: float) -> int:
    """Bytes per device the KV pool may take, as vLLM's gpu_memory_utilization: `fraction` of the device's
    memory `hbm` less the `reserved` bytes of what else lives there (the weights, the optimizer state and the
    update's peak when training; the weights when serving). 0 (no limit: the worst-case pool) when the device's
    memory is unknown (a CPU)."""
    if not hbm:
        return 0
    return max(1, int(fraction * hbm) - int(reserved))


def fitted_pages(budget: int, page_bytes: int, cap: int, minimum: int) -> int:
    """Pages of a pool of at most `budget` bytes per device (`pool_budget`; 0 = no limit), `page_bytes` each,
    never more than `cap` (the worst case: every slot at full length, nothing ever preempted; preemption covers
    a smaller pool) nor fewer than `minimum` (the null page and one whole sequence: the engine cannot run
    with less, and the program's memory check then says it does not fit)."""
    if budget <= 0:
        return cap
    return max(min(minimum, cap), min(cap, budget // page_bytes))
