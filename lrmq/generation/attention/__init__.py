"""Decode attention backends over the paged KV pool, one module each, and the one place a call's backend and pool
format are decided.

* "xla" (`xla.py`, CPU and every fallback): a gather of each slot's pages a block at a time with an online
  softmax.
* "tpu" (`tpu.py`): JAX's ragged paged attention Mosaic kernel, reading the "interleaved" pool in place.
* "gpu" (`gpu.py`): JAX's GPU paged attention Triton kernel, reading the "split" pool in place (sliding-window
  layers take the XLA path on the same pool).

`resolve_impl` turns "auto" into the compile target's kernel where it takes the call (the target of
`pallas_kernels.current_target()`, so ahead-of-time TPU compiles from a CPU host get the kernel), else "xla";
`kv_format` then resolves the user's kv_cache name into the `KVFormat` the backend reads (`LAYOUTS`,
`int8_bits`). Every backend has the signature `(q [S, H, D], pool, layer, page_table, lengths, window, *,
block_pages) -> [S, H, D]`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

import pallas_kernels as pk

from lrmq.generation.attention.gpu import decode_attention_gpu, gpu_unsupported
from lrmq.generation.attention.tpu import _tpu_heads_refusal, decode_attention_tpu, tpu_unsupported
from lrmq.generation.attention.xla import decode_attention_xla
from lrmq.generation.kv_format import FP8, KVFormat
from lrmq.generation.kv_pool import kv_head_axes
from lrmq.sharding import axes_size, is_manual

# The pool layout each decode implementation reads in place (`KVFormat.layout`).
LAYOUTS = {"xla": "interleaved", "tpu": "interleaved", "gpu": "split"}

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
    if (platform == "tpu" and scaled and jnp.dtype(dtype) in FP8
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


def int8_bits(kv_cache: str, impl: str) -> bool:
    """Whether a pool of `kv_cache` pages read by decode attention `impl` holds fp8 pages as int8 (their bits, the
    same bytes): the XLA path's. On TPU an f8 pool read by XLA's gather is laid out apart from the layout its
    scatter writes, so XLA copied the chip's whole pool in every layer of every decode step (docs/tpu.md, "fp8 /
    int8 KV pages on a slice"); an int8 pool is not (int8 KV never was), and only the gathered pages and the new
    tokens are reinterpreted. The kernels read f8 pages in place."""
    return kv_cache in ("fp8_e4m3", "fp8_e5m2") and impl == "xla"



def kv_format(kv_cache: str, impl: str) -> KVFormat:
    """The resolved format of a pool of `kv_cache` pages read by decode attention `impl` (a resolved name, not
    "auto"): its layout (`LAYOUTS`) and whether fp8 pages are held as int8 bits (`int8_bits`)."""
    return KVFormat(kv_cache, LAYOUTS[impl], int8_bits(kv_cache, impl))
