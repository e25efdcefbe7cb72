"""The KV pool: fixed-size pages holding every layer's keys and values, laid out for a mesh, sized to a device.

The pool holds the pages in the layout its decode attention reads in place (`KVFormat.layout`):

* "interleaved" (the "xla" and "tpu" implementations): one array `[layers, pages, page_size, 2 * kv_heads,
  head_dim]`, K and V heads interleaved (K of head h at 2h, V at 2h + 1), the layout of the ragged paged
  attention kernel JAX ships for TPU;
* "split" (the "gpu" implementation): a (K, V) pair of `[kv_heads, layers, pages, page_size, head_dim]`, heads
  first and K apart from V, the layout of JAX's GPU paged attention kernel (`[kv_heads, pages, ...]` per
  array: the layer and page axes merge for free, so the kernel reads every layer's pages in place).

A quantized format's pool is a `QuantPool` (the pages and their scales). Page 0 is never handed out: rows that
are not live write there, so a static-shaped step needs no branch.

On a mesh (`pool_sharding`) the pool's KV heads are split like the KV projections of the decode layout
(tensor parallel over tensor x fsdp, `sharding.DECODE_RULES`; `kv_head_axes`), and its pages over the data
axes that do not split heads (`kv_page_axes`): each data group holds only the pages of its own rows, with page
ids local to the group (page 0 of each is its null page; the scheduler allocates per group:
`Scheduler(groups=)`). So each chip holds its heads of its group's pages, not the whole pool.

The pool is made in one place per caller: `new_pool` / `abstract_pool` (the engine's `Engine.pool`), sized by
`page_bytes`, `pool_budget` and `fitted_pages`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels as pk

from lrmq.generation.kv_format import KEPT_SCALE_FORMATS, QUANT_DTYPES, KVFormat, no_kept_scales
from lrmq.sharding import DECODE_RULES, axes_size, entry_axes, host_array, is_manual, logical_to_spec, spec_entry

NULL_PAGE = 0  # the page rows that are not live write to; never allocated


@struct.dataclass
class QuantPool:
    """A quantized pool: `pages` (the plain pool's array or (K, V) pair, in the quantized dtype) and its scales.

    * k_scale / v_scale [KVH, L] float32: per layer and KV head, pool-global (fp8). 0 = not yet calibrated: the
      first write that sees a layer's keys (the call's first prefill) sets absmax / format max, unless the pool
      was made holding a caller's `KVScales` (`with_scales`); later writes keep it, clip at the format's max and
      count what they clipped in `saturated` [KVH] (int32).
    * k_token / v_token [KVH, L, P, page_size] float32 scale pages (`KVFormat.token_scales`; None otherwise):
      int8's per-token absmax / 127, or the head's fp8 scale repeated for the GPU kernel. Copy on write copies
      them with the pages.
    The value of a stored entry is page x scale. Every leaf has the KV heads first (heads split on a mesh).
    fmt: the pool's resolved format (static).
    """

    pages: jax.Array | tuple
    k_scale: jax.Array
    v_scale: jax.Array
    saturated: jax.Array
    k_token: jax.Array | None = None
    v_token: jax.Array | None = None
    fmt: KVFormat = struct.field(pytree_node=False, default=KVFormat("fp8_e4m3"))


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
                             f"{no_kept_scales(self.fmt)})")
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


def pool_scales(pool) -> KVScales | None:
    """The per-head scales a pool holds (a 0 entry: a head never written, calibrated by its next write), on the
    host; None for a pool without them (plain, int8)."""
    if not isinstance(pool, QuantPool) or not pool.fmt.kept_scales:
        return None
    return KVScales(pool.fmt.name, host_array(pool.k_scale).astype(np.float32), host_array(pool.v_scale).astype(np.float32))


def check_kv_scales(scales: KVScales, fmt: KVFormat, cfg) -> KVScales:
    """`scales` if a cache of format `fmt` for a model of `cfg` can write under them, else a ValueError."""
    if not fmt.kept_scales:
        raise ValueError(f"kv_scales are for an fp8 KV cache; this engine's is {fmt.name!r} "
                         f"({no_kept_scales(fmt.name)})")
    if scales.fmt != fmt.name:
        raise ValueError(f"kv_scales were calibrated for {scales.fmt}, this engine's KV cache is {fmt.name}")
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
    fmt_dtype: the pages' format where the pool holds its bits in another dtype (`KVFormat.int8_bits`): the gathered pages
    are reinterpreted, never the pool."""
    s, n = pages.shape
    bits = lambda x: x if fmt_dtype is None or x.dtype == fmt_dtype else jax.lax.bitcast_convert_type(  # noqa: E731
        x, fmt_dtype)
    if isinstance(pool, QuantPool):  # dequantized: the pages times their scales (per token, else per head)
        k, v = read_pages(pool.pages, layer, pages, QUANT_DTYPES[pool.fmt.name])

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
    mesh, heads, groups = mesh_for(pool)
    if not groups:
        return _copy_local(pool, src, dst)
    rows = P(spec_entry(groups))
    return jax.shard_map(_copy_local, mesh=mesh, in_specs=(spec_of(pool, mesh), rows, rows),
                         out_specs=spec_of(pool, mesh), check_vma=False)(pool, src, dst)


def _copy_local(pool, src, dst):
    if isinstance(pool, QuantPool):
        token = {name: getattr(pool, name).at[:, :, dst].set(getattr(pool, name)[:, :, src])
                 for name in ("k_token", "v_token") if getattr(pool, name) is not None}
        return pool.replace(pages=_copy_local(pool.pages, src, dst), **token)
    if is_split(pool):
        return tuple(x.at[:, :, dst].set(x[:, :, src]) for x in pool)
    return pool.at[:, dst].set(pool[:, src])


# --------------------------------------------------------------------------------- the pool on a mesh
_HEAD_AXES = ("tensor", "data", "fsdp")  # tensor first: the KV projections already split heads over it
BATCH_AXES = ("data", "fsdp")


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
    if mesh is None:
        return ()
    heads = kv_head_axes(mesh, kv_heads)
    return tuple(a for a in BATCH_AXES if a in mesh.shape and mesh.shape[a] > 1 and a not in heads)


def kv_groups(mesh, kv_heads: int) -> int:
    """How many data groups split the pool's pages (`kv_page_axes`): 1 without a mesh."""
    return axes_size(mesh, kv_page_axes(mesh, kv_heads)) if mesh is not None else 1


def least_kv_heads(kv_cache: str, platform: str) -> int:
    """The fewest KV heads per chip a pool of `kv_cache` pages (the format's name: a mesh is chosen before the
    format is resolved) decodes with on `platform`: 2 for fp8 pages on TPU (JAX's ragged paged attention packs
    fp8 rows in pairs of heads; `attention.fp8_heads_message`), else 1."""
    return 2 if platform == "tpu" and kv_cache in KEPT_SCALE_FORMATS else 1


def decode_fsdp(chips: int, kv_heads: int, kv_cache: str, platform: str) -> int:
    """The fsdp axis of a decode mesh of `chips` chips (data the rest) that the KV format runs on: the largest that
    splits the `kv_heads` KV heads into whole shares of at least what the format's kernel takes (>= 2 per chip for
    fp8 pages on TPU: JAX's ragged paged attention packs fp8 rows in pairs of heads; docs/tpu.md), else >= 1. The
    data axis left then splits the pool's pages (`kv_page_axes`)."""
    least = least_kv_heads(kv_cache, platform)
    fits = [d for d in range(1, chips + 1) if chips % d == 0 and kv_heads % d == 0 and kv_heads // d >= least]
    return max(fits, default=1)


def pool_spec(mesh, kv_heads: int, fmt: KVFormat = KVFormat()):
    """PartitionSpec of the pool (a pair of them, "split"; a QuantPool of them, quantized): heads over
    `kv_head_axes`, pages over `kv_page_axes`, the rest whole. A contiguous share of the interleaved heads is
    whole (K, V) pairs, so each chip's share is itself a pool; a QuantPool's scales have the heads first, split
    the same way (its scale pages split over the groups like the pages; its per-head scales whole: pool-global)."""
    heads = spec_entry(kv_head_axes(mesh, kv_heads))
    groups = spec_entry(kv_page_axes(mesh, kv_heads))
    if fmt.layout == "split":
        pages = (P(heads, None, groups, None, None),) * 2
    else:
        pages = P(None, groups, None, heads, None)
    if not fmt.quantized:
        return pages
    token = P(heads, None, groups, None) if fmt.token_scales else None
    return QuantPool(pages, P(heads, None), P(heads, None), P(heads), token, token, fmt=fmt)


def format_of(pool) -> KVFormat:
    """The format of an existing pool: a QuantPool's own, else its layout's plain format."""
    return pool.fmt if isinstance(pool, QuantPool) else KVFormat(layout=layout_of(pool))


def spec_of(pool, mesh):
    """`pool_spec` of an existing pool (its layout and format)."""
    return pool_spec(mesh, kv_heads_of(pool), format_of(pool))


def pool_sharding(mesh, cfg, fmt: KVFormat = KVFormat()):
    if mesh is None:
        return None
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), pool_spec(mesh, cfg.num_kv_heads, fmt))


def abstract_pool(cfg, pages: int, page_size: int, mesh=None, fmt: KVFormat = KVFormat()):
    """The pool's ShapeDtypeStruct(s), laid out for `mesh`: what `new_pool` returns, for ahead-of-time compiles.
    fmt: the pages' resolved format (a quantized one: a QuantPool with its scales)."""
    shape, dtype = pool_shape(cfg, pages, page_size, fmt.layout), fmt.pool_dtype(cfg)
    sharding = pool_sharding(mesh, cfg, fmt)
    sh = lambda name: getattr(sharding, name) if sharding is not None else None  # noqa: E731
    pages_sharding = sharding.pages if isinstance(sharding, QuantPool) else sharding
    if fmt.layout == "split":
        data = tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=s) for s in (pages_sharding or (None, None)))
    else:
        data = jax.ShapeDtypeStruct(shape, dtype, sharding=pages_sharding)
    if not fmt.quantized:
        return data
    kvh, n_layers = cfg.num_kv_heads, cfg.num_layers
    head = lambda name: jax.ShapeDtypeStruct((kvh, n_layers), jnp.float32, sharding=sh(name))  # noqa: E731
    token = lambda name: jax.ShapeDtypeStruct((kvh, n_layers, pages, page_size), jnp.float32,  # noqa: E731
                                              sharding=sh(name)) if fmt.token_scales else None
    return QuantPool(data, head("k_scale"), head("v_scale"), jax.ShapeDtypeStruct((kvh,), jnp.int32,
                     sharding=sh("saturated")), token("k_token"), token("v_token"), fmt=fmt)


def new_pool(cfg, pages: int, page_size: int, mesh=None, fmt: KVFormat = KVFormat()):
    """A zeroed pool, laid out for `mesh` (`pool_sharding`): no chip ever holds more than its share (scales 0:
    not calibrated yet)."""
    # created sharded (each chip allocates its share); an eager op: compiled once per shape and layout
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding),
                        abstract_pool(cfg, pages, page_size, mesh, fmt))


def mesh_for(pool) -> tuple[object, tuple[str, ...], tuple[str, ...]]:
    """(mesh, KV-head axes, page axes: `kv_page_axes`) when the program being traced is partitioned over a
    multi-device mesh (not already inside a shard_map), else (None, (), ())."""
    mesh = pk.mesh_in_effect()
    if mesh is None or mesh.size == 1 or is_manual(mesh):
        return None, (), ()
    kvh = kv_heads_of(pool)
    return mesh, kv_head_axes(mesh, kvh), kv_page_axes(mesh, kvh)




def check_rows(rows: int, mesh, groups: tuple[str, ...]) -> None:
    if groups and rows % axes_size(mesh, groups):
        raise ValueError(f"{rows} rows do not split over the pool's {axes_size(mesh, groups)} data groups "
                         f"({' x '.join(groups)}): a batch on this mesh needs a multiple of them")


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


# ----------------------------------------------------------------------------- sizing the pool to the device
def page_bytes(cfg, page_size: int, mesh=None, fmt: KVFormat = KVFormat()) -> int:
    """Bytes one page of the pool takes on each device of the data group holding it (a pool of P pages takes
    P / `kv_groups` of them per device): K and V of every layer for `page_size` tokens, the device's share of the
    KV heads (`kv_head_axes`), in the resolved format `fmt` (with its scale pages, when it keeps them:
    `KVFormat.token_scales`)."""
    share = axes_size(mesh, kv_head_axes(mesh, cfg.num_kv_heads)) if mesh is not None else 1
    entries = cfg.num_layers * page_size * 2 * cfg.num_kv_heads
    per_page = entries * cfg.head_dim * fmt.pool_dtype(cfg).itemsize
    if fmt.token_scales:
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
