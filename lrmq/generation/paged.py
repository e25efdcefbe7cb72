"""A paged KV cache: fixed-size pages in one pool, a page table per decode slot.

The pool holds every layer's keys and values as `[layers, pages, page_size, 2 * kv_heads, head_dim]`,
K and V heads interleaved (K of head h at 2h, V at 2h + 1): the layout of the ragged paged attention
kernel JAX ships for TPU, so the TPU path reads the pool in place. Page 0 is never handed out: rows
that are not live write there, so a static-shaped step needs no branch.

The model sees one object per forward (`PagedCache`): `write(k, v, q_pos)` stores this forward's keys and
values in the pages; in prefill mode a prompt then attends to itself with the model's own (blockwise)
attention; in decode mode `attend(q, q_pos, window)` has each slot's one new token attend to its pages,
read a block of pages at a time with an online softmax, so a step costs what the longest live
row holds, not what was allocated.

Decode attention implementations (`DECODE_ATTENTION`, chosen by `PagedCache.impl`; "auto" follows the compile
target of `pallas_kernels.current_target()`, so ahead-of-time TPU compiles from a CPU host get the kernel):

* "xla" (CPU, GPU, and every fallback): `decode_attention_xla`, a gather of each slot's pages a block at a
  time with an online softmax.
* "tpu": JAX's ragged paged attention Mosaic kernel (`decode_attention_tpu`), reading the pool in place
  (viewed as `[layers * pages, ...]`, page indices offset by `layer * pages`: no per-layer copy).

On a mesh (`pool_sharding`) the pool's KV heads are split like the KV projections of the decode layout
(tensor parallel over tensor x fsdp, `sharding.DECODE_RULES`; `kv_head_axes`), so each chip holds its share
of the pool instead of all of it; `write` and `attend` run under `shard_map` on each chip's heads for every
slot (rows split over the remaining data axes), and every slot's pages stay where they are.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels.tpu_tiles import generation

from lrmq.sharding import DECODE_RULES, logical_to_spec

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


def tpu_unsupported(q_heads: int, pool_shape, dtype) -> str | None:
    """Why the TPU kernel cannot take a pool / queries of these shapes (None: it can)."""
    rpa = _rpa_module()
    if rpa is None:
        return "this jax has no ragged_paged_attention"
    d, combined = pool_shape[-1], pool_shape[-2]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"{jnp.dtype(dtype).name} KV pages (the kernel takes bf16 / f32)"
    if d % 128:
        return f"head_dim {d} (a multiple of 128)"
    try:
        rpa.get_min_heads_per_blk(q_heads, combined, dtype, dtype)
    except ValueError as e:
        return str(e)
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
    n_layers, pages = pool.shape[:2]
    kv_blk, q_blk, vmem = tpu_block_sizes(pk.current_target().device_kind, q_heads=h, pool_shape=pool.shape,
                                          dtype=pool.dtype, width=page_table.shape[1], slots=s)
    flat = pool.reshape(n_layers * pages, *pool.shape[2:])
    table = (page_table + layer * pages).astype(jnp.int32)
    out = _tpu_kernel()(
        q.astype(pool.dtype), flat, jnp.maximum(lengths, 1).astype(jnp.int32), table,
        jnp.arange(s + 1, dtype=jnp.int32), jnp.array([s], jnp.int32), sm_scale=d ** -0.5, sliding_window=window,
        num_kv_pages_per_block=kv_blk, num_queries_per_block=q_blk, vmem_limit_bytes=vmem)
    return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)


# Decode-attention implementations by name; "xla" runs everywhere, "tpu" on TPU (or in Pallas's TPU
# interpret mode); "auto" (resolve_impl) picks by the compile target.
DECODE_ATTENTION: dict[str, Callable] = {"xla": decode_attention_xla, "tpu": decode_attention_tpu}


def resolve_impl(impl: str, q_heads: int, pool_shape, dtype) -> str:
    """The DECODE_ATTENTION entry a call takes: "auto" -> "tpu" when the compile target is a TPU and the kernel
    takes these shapes, else "xla" (GPU included: JAX's GPU paged attention wants separate K and V pages,
    heads first, and no sliding window; docs/tpu.md); any other name as given."""
    if impl != "auto":
        if impl not in DECODE_ATTENTION:
            raise ValueError(f"decode attention impl must be 'auto' or one of {sorted(DECODE_ATTENTION)}, "
                             f"got {impl!r}")
        return impl
    if pk.current_target().platform == "tpu" and tpu_unsupported(q_heads, pool_shape, dtype) is None:
        return "tpu"
    return "xla"


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
        return (entry,) if isinstance(entry, str) else tuple(entry)
    axes = [a for a in _HEAD_AXES if a in mesh.shape and mesh.shape[a] > 1]
    best = ()
    for n in range(len(axes), 0, -1):
        for combo in itertools.combinations(axes, n):
            size = math.prod(mesh.shape[a] for a in combo)
            if kv_heads % size == 0 and size > math.prod(mesh.shape[a] for a in best):
                best = combo
    return best


def _entry(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def pool_spec(mesh, kv_heads: int) -> P:
    """PartitionSpec of the pool [L, P, page_size, 2*KVH, D]: heads over `kv_head_axes`, the rest whole. A
    contiguous share of the interleaved heads is whole (K, V) pairs, so each chip's share is itself a pool."""
    return P(None, None, None, _entry(kv_head_axes(mesh, kv_heads)), None)


def pool_sharding(mesh, cfg) -> NamedSharding | None:
    return None if mesh is None else NamedSharding(mesh, pool_spec(mesh, cfg.num_kv_heads))


def new_pool(cfg, pages: int, page_size: int, mesh=None) -> jax.Array:
    """A zeroed pool, laid out for `mesh` (`pool_sharding`): no chip ever holds more than its share."""
    shape, dtype = pool_shape(cfg, pages, page_size), jnp.dtype(cfg.dtype)
    if mesh is None:
        return jnp.zeros(shape, dtype)
    # created sharded (each chip allocates its share); an eager op: compiled once per shape and layout
    return jnp.zeros(shape, dtype, device=pool_sharding(mesh, cfg))


def _mesh_for(pool) -> tuple[object, tuple[str, ...]] | tuple[None, tuple]:
    """(mesh, KV-head axes) when the program being traced is partitioned over a multi-device mesh (not
    already inside a shard_map), else (None, ())."""
    mesh = pk.mesh_in_effect()
    if mesh is None or mesh.size == 1:
        return None, ()
    manual = getattr(jax.sharding.AxisType, "Manual", None)
    if any(t == manual for t in (getattr(mesh, "axis_types", ()) or ())):
        return None, ()
    return mesh, kv_head_axes(mesh, pool.shape[3] // 2)


def _batch_axes(mesh, heads: tuple[str, ...], rows: int) -> tuple[str, ...]:
    """The data axes not splitting heads whose product divides `rows` (trailing ones dropped until it does)."""
    axes = tuple(a for a in _BATCH_AXES if a not in heads and a in mesh.shape and mesh.shape[a] > 1)
    while axes and rows % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    return axes


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
    impl: str = struct.field(pytree_node=False, default="auto")

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

        def store(pool, k, v, page, offset, layer):
            return pool.at[layer, page, offset].set(interleave(k, v).astype(pool.dtype))

        mesh, heads = _mesh_for(self.pool)
        if not heads:  # one device, or a pool whole on every chip: XLA partitions the scatter
            return self.replace(pool=store(self.pool, k, v, page, offset, self.layer))
        # each chip stores its KV heads of every row (rows gathered over the data axes: activation-sized)
        kv, pool = P(None, None, _entry(heads), None), pool_spec(mesh, self.pool.shape[3] // 2)
        fn = jax.shard_map(store, mesh=mesh, in_specs=(pool, kv, kv, P(), P(), P()), out_specs=pool,
                           check_vma=False)
        return self.replace(pool=fn(self.pool, k, v, page, offset, jnp.asarray(self.layer, jnp.int32)))

    def attend(self, q, q_pos, window):
        """Decode: q [S, 1, H, D] at q_pos [S, 1] against each slot's pages -> [S, 1, H, D]."""
        lengths = jnp.where(self.live, q_pos[:, 0] + 1, 0)
        impl = resolve_impl(self.impl, q.shape[2], self.pool.shape, self.pool.dtype)
        fn = functools.partial(DECODE_ATTENTION[impl], window=window, block_pages=self.block_pages)
        mesh, heads = _mesh_for(self.pool)
        if mesh is None or (impl == "xla" and not heads):  # XLA partitions the plain path itself
            return fn(q[:, 0], self.pool, self.layer, self.page_table, lengths)[:, None]
        # Mosaic kernels are not partitioned automatically, and a head-split pool must be read where it lies:
        # each chip attends with its heads for the rows of its remaining data axes
        rows = _entry(_batch_axes(mesh, heads, q.shape[0]))
        qs = P(rows, _entry(heads), None)
        run = jax.shard_map(lambda q, pool, layer, table, lengths: fn(q, pool, layer, table, lengths), mesh=mesh,
                            in_specs=(qs, pool_spec(mesh, self.pool.shape[3] // 2), P(), P(rows, None), P(rows)),
                            out_specs=qs, check_vma=False)
        return run(q[:, 0], self.pool, jnp.asarray(self.layer, jnp.int32), self.page_table, lengths)[:, None]


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)
