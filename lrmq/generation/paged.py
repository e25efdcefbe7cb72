"""The paged KV cache a forward writes to and decode attends through (`PagedCache`): fixed-size pages in one pool
(`lrmq.generation.kv_pool`), a page table per decode slot.

The model sees one object per forward: `write(k, v, q_pos)` stores this forward's keys and values in the pages;
in prefill mode a prompt then attends to itself with the model's own (blockwise) attention; in decode mode
`attend(q, q_pos, window)` has each slot's one new token attend to its pages through the decode attention
backend `PagedCache.impl` names (`lrmq.generation.attention`: "xla", "tpu", "gpu"; "auto" by the compile target),
read a block of pages at a time, so a step costs what the longest live row holds, not what was allocated.

The pool's format (`lrmq.generation.kv_format.KVFormat`: pages' dtype, layout, scales) is resolved once when
the pool is made; a `QuantPool` carries it. On a mesh, `write` and `attend` run under `shard_map` on each chip's
KV heads for its data group's rows (`kv_pool.kv_head_axes` / `kv_page_axes`), and every slot's pages stay where
they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from lrmq.generation.attention import DECODE_ATTENTION, LAYOUTS, resolve_impl
from lrmq.generation.kv_format import QUANT_DTYPES
from lrmq.generation.kv_pool import (BATCH_AXES, NULL_PAGE, QuantPool, check_rows, interleave, interleaved_shape,
                                     is_split, layout_of, mesh_for, pool_dtype, quant_scales, quantize, spec_of)
from lrmq.sharding import dividing_axes, spec_entry


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
        return spec_of(self.pool, mesh)

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

        mesh, heads, groups = mesh_for(self.pool)

        def store(pool, k, v, page, offset, layer, live):
            if isinstance(pool, QuantPool):
                return store_quant(pool, k, v, page, offset, layer, live)
            if is_split(pool):  # [KVH, L, P, page_size, D] at [:, layer, page, offset] is [KVH, R, T, D]
                return tuple(x.at[:, layer, page, offset].set(jnp.moveaxis(y, 2, 0).astype(x.dtype))
                             for x, y in ((pool[0], k), (pool[1], v)))
            return pool.at[layer, page, offset].set(interleave(k, v).astype(pool.dtype))

        def store_quant(qp, k, v, page, offset, layer, live):
            fmax, dtype, token = qp.fmt.fmax, QUANT_DTYPES[qp.fmt.name], {}
            k_scale, v_scale, saturated = qp.k_scale, qp.v_scale, qp.saturated
            if qp.fmt.name == "int8":  # per token and head: absmax / 127, nothing clips
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
            if qp.fmt.int8_bits:  # fp8 bits in an int8 pool
                kq, vq = (jax.lax.bitcast_convert_type(x, pool_dtype(qp)) for x in (kq, vq))
            return qp.replace(pages=store(qp.pages, kq, vq, page, offset, layer, live), k_scale=k_scale,
                              v_scale=v_scale, saturated=saturated, **token)

        if not heads and not groups:  # one device, or a pool whole on every chip: XLA partitions the scatter
            return self.replace(pool=store(self.pool, k, v, page, offset, self.layer, live))
        # each chip stores its KV heads of its data group's rows (the rest of the rows gathered: activation-sized)
        check_rows(k.shape[0], mesh, groups)
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
        if impl != "xla" and isinstance(self.pool, QuantPool) and self.pool.fmt.int8_bits:
            raise ValueError(f"decode attention {impl!r} reads {self.pool.fmt.name} pages in their dtype; this pool "
                             f"holds them as {pool_dtype(self.pool).name} bits (made for the XLA path: "
                             f"`attention.int8_bits`)")
        if impl != "xla" and LAYOUTS[impl] != layout:
            raise ValueError(f"decode attention {impl!r} reads a {LAYOUTS[impl]!r} pool; this one is not "
                             f"(make it with kv_pool.new_pool(..., fmt=attention.kv_format(kv_cache, {impl!r})))")
        fn = functools.partial(DECODE_ATTENTION[impl], window=window, block_pages=self.block_pages)
        mesh, heads, groups = mesh_for(self.pool)
        if mesh is None or (impl == "xla" and not heads and not groups):  # XLA partitions the plain path itself
            return fn(q[:, 0], self.pool, self.layer, self.page_table, lengths)[:, None]
        # Mosaic kernels are not partitioned automatically, and a split pool must be read where it lies: each chip
        # attends with its heads for its data group's rows (group-local page tables); with the pages whole, the
        # rows of the data axes not splitting heads, trailing ones dropped until they divide the rows
        check_rows(q.shape[0], mesh, groups)
        rows = spec_entry(groups or dividing_axes(mesh, BATCH_AXES, q.shape[0], exclude=heads))
        qs = P(rows, spec_entry(heads), None)
        run = jax.shard_map(lambda q, pool, layer, table, lengths: fn(q, pool, layer, table, lengths), mesh=mesh,
                            in_specs=(qs, self._spec(mesh), P(), P(rows, None), P(rows)),
                            out_specs=qs, check_vma=False)
        return run(q[:, 0], self.pool, jnp.asarray(self.layer, jnp.int32), self.page_table, lengths)[:, None]
