"""Blockwise attention for training, scoring and prefill: no [T, S] score matrix is ever materialized.

One entry, `attention(q, k, v, q_pos, k_pos, window, segments=None, impl="auto")`, with the masks of
`lrmq.model.decoder.attend` (the dense reference): a query sees key j when k_pos[j] >= 0 (-1 is padding),
k_pos[j] <= q_pos (causality by *position*), q_pos - k_pos[j] < window (sliding layers), and, with packed
`segments` [B, T], only keys of its own segment; GQA by H = KVH * G (query head h reads KV head h // G).
A fully masked query row (padding: q_pos < 0) gets what `attend` gives it, the uniform average of all S
values, so values and gradients equal the dense path's whatever the cotangent at padding rows.

Paths (`impl`; "auto" follows the compile target of `pallas_kernels.current_target()`, not the host):

* "xla" (CPU, and every fallback): flash-style online softmax in plain XLA, `block_q` queries x `block_k`
  keys at a time (`lax.map` over query blocks, `lax.scan` over key blocks; tiles nothing can see are
  skipped with `lax.cond`), with a `custom_vjp` whose backward recomputes each tile from the saved
  log-sum-exp: live memory O(T * block) plus O(T * H * D). Exact for any positions.
* "splash" (TPU): the splash-attention Mosaic kernel JAX ships
  (`jax.experimental.pallas.ops.tpu.splash_attention`): a causal (or local-window) mask by *index*,
  segment ids for packed rows, with padding given its own segment id; forward and fused backward kernels
  with `SPLASH_BLOCK`-sized tiles; wrapped in `shard_map` under a multi-device mesh (batch over the data
  axes, heads over the tensor axis). Off-TPU it runs in Pallas interpret mode (tests).
* "cudnn" (GPU): `jax.nn.dot_product_attention(implementation="cudnn")`, causal + sliding window by index,
  padding as per-row lengths after rotating each row's real tokens to its front; only without `segments`,
  for 16-bit q/k/v and head_dim <= 128 (a multiple of 8); anything else takes "xla".

The index-based kernels ("splash", "cudnn") are used for self-attention only (`k_pos` None or the same
array as `q_pos`) and assume the layouts lrmq builds: within a segment, the real tokens are contiguous and
their positions consecutive (left-padded prompts, right-padded completions, packed rows of
`lrmq.rl.batch.packed_batch`, left-padded prefill). Then index order and distance equal position order
and distance, and their masks equal the positional ones. For anything else pass impl="xla".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from lrmq.sharding import RULES, dividing_axes, entry_axes, is_manual, spec_entry

IMPLS = ("auto", "xla", "splash", "cudnn")
# Tiles of the XLA path (CPU): queries x keys per step. A sequence up to a block long is one tile.
BLOCK_Q = 512
BLOCK_K = 512
# Splash tiles (forward and fused backward) on TPU; shorter sequences use one tile rounded up to 128.
SPLASH_BLOCK = 512
_NEG = float(np.finfo(np.float32).min)
_PAD_SEGMENT = int(np.iinfo(np.int32).min)  # splash / cudnn: the segment id of padding tokens


# ------------------------------------------------------------------------------------------ entry
def attention(q, k, v, q_pos, k_pos=None, window: int | None = None, segments=None, impl: str = "auto", *,
              block_q: int | None = None, block_k: int | None = None):
    """Grouped-query attention over q [B, T, H, D], k / v [B, S, KVH, D] -> [B, T, H, D] (q's dtype).

    q_pos [B, T], k_pos [B, S] (None: self-attention, k_pos = q_pos); -1 marks padding. window: the sliding
    window (q_pos - k_pos < window) or None. segments [B, T]: ids of sequences packed in one row
    (self-attention only). impl: "auto" | "xla" | "splash" | "cudnn" (module docstring); block_q / block_k:
    tiles of the "xla" path (default BLOCK_Q / BLOCK_K)."""
    self_attn = k_pos is None or k_pos is q_pos
    k_pos = q_pos if k_pos is None else k_pos
    b, t, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} are not [B,T,H,D], [B,S,KVH,D] "
                         f"with H a multiple of KVH")
    if segments is not None and k.shape[1] != t:
        raise ValueError("attention: segments need self-attention (as many keys as queries)")
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    path, interpret = choose_impl(impl, q.shape, k.shape, q.dtype, self_attn=self_attn,
                                  segments=segments is not None)
    if path == "splash":
        return _splash(q, k, v, q_pos, segments, window, interpret)
    if path == "cudnn":
        return _rolled_dot_product_attention(q, k, v, q_pos, window, "cudnn")
    return _blockwise(q, k, v, q_pos, k_pos, segments, window, block_q or BLOCK_Q, block_k or BLOCK_K)


def choose_impl(impl: str, q_shape, k_shape, dtype, *, self_attn: bool, segments: bool) -> tuple[str, bool]:
    """(path, interpret) that `attention` takes for these shapes on the current compile target: "auto" picks
    "splash" on TPU, "cudnn" on GPU where it can take the call, else "xla"; a forced kernel the shapes do not
    allow raises. Splash off-TPU runs interpreted."""
    if impl not in IMPLS:
        raise ValueError(f"attention: impl must be one of {IMPLS}, got {impl!r}")
    platform = pk.current_target().platform
    if impl == "auto":
        impl = {"tpu": "splash", "gpu": "cudnn"}.get(platform, "xla")
        if impl == "splash" and not (self_attn and _splash_module() is not None):
            impl = "xla"
        if impl == "cudnn" and cudnn_unsupported(q_shape, k_shape, dtype, self_attn=self_attn, segments=segments):
            impl = "xla"
        return impl, False
    if impl == "splash":
        if not self_attn or _splash_module() is None:
            raise ValueError("attention: impl='splash' needs self-attention and jax's splash_attention module")
        return "splash", platform != "tpu"
    if impl == "cudnn":
        why = cudnn_unsupported(q_shape, k_shape, dtype, self_attn=self_attn, segments=segments)
        if why:
            raise ValueError(f"attention: impl='cudnn' cannot take this call: {why}")
    return impl, False


def cudnn_unsupported(q_shape, k_shape, dtype, *, self_attn: bool, segments: bool) -> str | None:
    """Why cuDNN's fused attention cannot take the call (None: it can)."""
    d = q_shape[-1]
    if segments:
        return "packed segments"
    if not self_attn or q_shape[1] != k_shape[1]:
        return "not self-attention"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"{jnp.dtype(dtype).name} q/k/v (cuDNN takes bf16 / f16)"
    if d % 8 or d > 128:
        return f"head_dim {d} (a multiple of 8, at most 128)"
    if not cudnn_loaded():
        return "cuDNN is not loaded in this process (an ahead-of-time compile for a GPU on a machine without it)"
    return None


@functools.lru_cache(maxsize=None)
def cudnn_loaded() -> bool:
    """Whether JAX finds cuDNN here: its fused attention asks for the library's version when traced, and XLA
    builds the cuDNN graph when it compiles, so a compile-only GPU target on a machine without cuDNN (a CPU
    host: `lrmq.targets.gpu_topology_devices`) takes XLA's blockwise attention instead."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        check_cudnn_version()
    except Exception:  # jax's private helper moved, no CUDA plugin, or no libcudnn
        return False
    return True


def allowed_mask(qp, kp, qs=None, ks=None, window: int | None = None):
    """[B, Tq, Tk] booleans: which keys each query sees (the masks of `decoder.attend`)."""
    qp, kp = qp[:, :, None], kp[:, None, :]
    ok = (kp >= 0) & (kp <= qp)
    if qs is not None:
        ok &= qs[:, :, None] == ks[:, None, :]
    if window is not None:
        ok &= (qp - kp) < window
    return ok


def _uniform_rows(out, v, empty):
    """`out` with the rows in `empty` [B, T, H] replaced by the mean of all S values (what the dense softmax
    gives a row whose every score is masked): values and gradients then match `decoder.attend`."""
    b, t, h, d = out.shape
    kvh = v.shape[2]
    mean = jnp.mean(v.astype(jnp.float32), axis=1).astype(out.dtype)  # [B, KVH, D]
    mean = jnp.broadcast_to(mean[:, None, :, None, :], (b, t, kvh, h // kvh, d)).reshape(b, t, h, d)
    return jnp.where(empty[..., None], mean, out)


# ------------------------------------------------------------------------------- XLA (blockwise)
def _split(n: int, block: int) -> tuple[int, int]:
    """(tile, padded length): n in ceil(n / block) equal tiles (multiples of 8); one tile when n <= block."""
    if n <= block:
        return n, n
    count = -(-n // block)
    tile = -(-(-(-n // count)) // 8) * 8
    return tile, tile * count


def _pad(x, length: int, value):
    if x is None or x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths, constant_values=value)


def _blockwise(q, k, v, q_pos, k_pos, segments, window, block_q, block_k):
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    bq, tp = _split(t, block_q)
    bk, sp = _split(s, block_k)
    qs = ks = None
    if segments is not None:
        qs, ks = _pad(segments, tp, 0), _pad(segments, sp, 0)
    out, lse = _flash(_pad(q, tp, 0), _pad(k, sp, 0), _pad(v, sp, 0), _pad(q_pos, tp, -1), _pad(k_pos, sp, -1),
                      qs, ks, window, bq, bk)
    out = out[:, :t]
    empty = _unblock_rows(lse, b, h)[:, :t] == -jnp.inf  # rows that saw no key
    return _uniform_rows(out, v, jax.lax.stop_gradient(empty))


def _q_blocks(x, bq):  # [B, T, H, D] -> [nq, B, KVH, G, bq, D]   (H split as KVH x G given by x's shape)
    b, t, kvh, g, d = x.shape
    return x.reshape(b, t // bq, bq, kvh, g, d).transpose(1, 0, 3, 4, 2, 5)


def _kv_blocks(x, bk):  # [B, S, KVH, D] -> [nk, B, KVH, bk, D]
    b, s, kvh, d = x.shape
    return x.reshape(b, s // bk, bk, kvh, d).transpose(1, 0, 3, 2, 4)


def _seq_blocks(x, n):  # [B, T] -> [T / n, B, n]
    return None if x is None else x.reshape(x.shape[0], -1, n).swapaxes(0, 1)


def _unblock_rows(x, b, h):  # [nq, B, KVH, G, bq] -> [B, T, H]
    nq, _, kvh, g, bq = x.shape
    return x.transpose(1, 0, 4, 2, 3).reshape(b, nq * bq, h)


def _grouped(q, kvh):
    b, t, h, d = q.shape
    return q.reshape(b, t, kvh, h // kvh, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _flash(q, k, v, q_pos, k_pos, seg_q, seg_k, window, bq, bk):
    """(out [B, T, H, D], log-sum-exp [nq, B, KVH, G, bq], -inf where a row saw no key); T, S padded to
    multiples of bq, bk. Rows that saw no key are 0 here (the caller replaces them)."""
    return _flash_fwd(q, k, v, q_pos, k_pos, seg_q, seg_k, window, bq, bk)[0]


def _flash_fwd(q, k, v, q_pos, k_pos, seg_q, seg_k, window, bq, bk):
    b, t, h, d = q.shape
    kvh = k.shape[2]
    scale = d ** -0.5
    f32 = jnp.float32
    kb, vb, kpb, ksb = _kv_blocks(k, bk), _kv_blocks(v, bk), _seq_blocks(k_pos, bk), _seq_blocks(seg_k, bk)

    def q_block(xs):
        qt, qp, qs = xs  # [B, KVH, G, bq, D], [B, bq], [B, bq]

        def step(carry, ys):
            kt, vt, kp, ks = ys
            ok = allowed_mask(qp, kp, qs, ks, window)[:, None, None]  # [B, 1, 1, bq, bk]

            def tile(carry):
                m, l, acc = carry
                sc = jnp.einsum("bkgqd,bkcd->bkgqc", qt, kt, preferred_element_type=f32) * scale
                sc = jnp.where(ok, sc, _NEG)
                m_new = jnp.maximum(m, sc.max(-1))
                p = jnp.where(ok, jnp.exp(sc - m_new[..., None]), 0.0)
                alpha = jnp.exp(m - m_new)
                acc = alpha[..., None] * acc + jnp.einsum("bkgqc,bkcd->bkgqd", p.astype(vt.dtype), vt,
                                                          preferred_element_type=f32)
                return m_new, alpha * l + p.sum(-1), acc

            return jax.lax.cond(jnp.any(ok), tile, lambda c: c, carry), None

        shape = qt.shape[:-1]
        init = (jnp.full(shape, _NEG, f32), jnp.zeros(shape, f32), jnp.zeros(qt.shape, f32))
        (m, l, acc), _ = jax.lax.scan(step, init, (kb, vb, kpb, ksb))
        empty = l == 0
        safe = jnp.where(empty, 1.0, l)
        return (acc / safe[..., None]).astype(q.dtype), jnp.where(empty, -jnp.inf, m + jnp.log(safe))

    qb = _q_blocks(_grouped(q, kvh), bq)
    out, lse = jax.lax.map(q_block, (qb, _seq_blocks(q_pos, bq), _seq_blocks(seg_q, bq)))
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, t, h, d)
    return (out, lse), (q, k, v, q_pos, k_pos, seg_q, seg_k, out, lse)


def _flash_bwd(window, bq, bk, res, cts):
    q, k, v, q_pos, k_pos, seg_q, seg_k, out, lse = res
    dout, dlse = cts
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    scale = d ** -0.5
    f32 = jnp.float32
    # D_i = sum_d dO * O (FlashAttention-2), minus the log-sum-exp's own cotangent (d lse / d s = p).
    delta = _q_blocks(_grouped((dout.astype(f32) * out.astype(f32)).sum(-1)[..., None], kvh), bq)[..., 0]
    delta = delta - dlse
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that saw no key: every p is masked to 0 anyway
    qb, dob = _q_blocks(_grouped(q, kvh), bq), _q_blocks(_grouped(dout, kvh), bq)
    qpb, qsb = _seq_blocks(q_pos, bq), _seq_blocks(seg_q, bq)

    def k_block(dq, ys):
        kt, vt, kp, ks = ys  # [B, KVH, bk, D] x2, [B, bk] x2

        def q_step(carry, xs):
            qt, dot, lse_t, delta_t, qp, qs = xs
            ok = allowed_mask(qp, kp, qs, ks, window)[:, None, None]

            def tile(carry):
                dk, dv = carry
                sc = jnp.einsum("bkgqd,bkcd->bkgqc", qt, kt, preferred_element_type=f32) * scale
                p = jnp.where(ok, jnp.exp(sc - lse_t[..., None]), 0.0)
                dv = dv + jnp.einsum("bkgqc,bkgqd->bkcd", p.astype(dot.dtype), dot, preferred_element_type=f32)
                dp = jnp.einsum("bkgqd,bkcd->bkgqc", dot, vt, preferred_element_type=f32)
                ds = p * (dp - delta_t[..., None]) * scale
                dq_t = jnp.einsum("bkgqc,bkcd->bkgqd", ds, kt.astype(f32))
                dk = dk + jnp.einsum("bkgqc,bkgqd->bkcd", ds, qt.astype(f32))
                return (dk, dv), dq_t

            def skip(carry):
                return carry, jnp.zeros(qt.shape, f32)

            return jax.lax.cond(jnp.any(ok), tile, skip, carry)

        zeros = jnp.zeros(kt.shape, f32)
        (dk, dv), dq_tiles = jax.lax.scan(q_step, (zeros, zeros), (qb, dob, lse, delta, qpb, qsb))
        return dq + dq_tiles, (dk, dv)

    kb, vb = _kv_blocks(k, bk), _kv_blocks(v, bk)
    dq, (dk, dv) = jax.lax.scan(k_block, jnp.zeros(qb.shape, f32),
                                (kb, vb, _seq_blocks(k_pos, bk), _seq_blocks(seg_k, bk)))
    dq = dq.transpose(1, 0, 4, 2, 3, 5).reshape(b, t, h, d).astype(q.dtype)
    unkv = lambda x, like: x.transpose(1, 0, 3, 2, 4).reshape(b, s, kvh, d).astype(like.dtype)  # noqa: E731
    return dq, unkv(dk, k), unkv(dv, v), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------------- splash (TPU)
@functools.lru_cache(maxsize=None)
def _splash_module():
    """jax's splash-attention package, or None where this jax does not ship it (then "auto" takes "xla")."""
    try:
        from jax.experimental.pallas.ops.tpu import splash_attention
    except ImportError:  # pragma: no cover - moved or dropped in a later jax
        return None
    return splash_attention


def splash_block(t: int) -> int:
    """The splash tile for a sequence of t tokens (the sequence is padded to a multiple of it)."""
    return min(SPLASH_BLOCK, -(-t // 128) * 128)


def _splash_kernel(t: int, heads: int, window: int | None, interpret: bool):
    sa = _splash_module()
    block = splash_block(t)
    mask = sa.CausalMask((t, t)) if window is None else sa.LocalMask((t, t), (window - 1, 0), 0)
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True)
    return sa.make_splash_mha(sa.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=interpret)


def _splash_local(q, k, v, q_pos, segments, window, interpret):
    """Splash on one device's share: q [B, T, H, D], k / v [B, T, KVH, D]."""
    sa = _splash_module()
    b, t, h, d = q.shape
    tp = -(-t // splash_block(t)) * splash_block(t)
    seg = jnp.zeros_like(q_pos) if segments is None else segments.astype(jnp.int32)
    seg = _pad(jnp.where(q_pos >= 0, seg, _PAD_SEGMENT), tp, _PAD_SEGMENT)  # padding: its own segment
    heads_major = lambda x: _pad(x, tp, 0).transpose(0, 2, 1, 3)  # noqa: E731  [B, heads, Tp, D]
    kernel = _splash_kernel(tp, h, window, interpret)
    run = lambda qq, kk, vv, ss: kernel(qq, kk, vv, segment_ids=sa.SegmentIds(ss, ss))  # noqa: E731
    out = jax.vmap(run)(heads_major(q * d ** -0.5), heads_major(k), heads_major(v), seg)
    out = out[:, :, :t].transpose(0, 2, 1, 3).astype(q.dtype)
    return _uniform_rows(out, v, jnp.broadcast_to((q_pos < 0)[..., None], out.shape[:3]))


def splash_specs(mesh, q_shape, k_shape) -> tuple[P, P, P]:
    """shard_map specs (q / out, k / v, positions / segments) of a splash call on `mesh`: the batch over the
    mesh's batch axes, heads over the tensor axis when it divides both H and KVH; the sequence whole."""
    batch = spec_entry(dividing_axes(mesh, entry_axes(RULES.get("batch")), q_shape[0]))
    heads = spec_entry(dividing_axes(mesh, entry_axes(RULES.get("heads")), math.gcd(q_shape[2], k_shape[2])))
    return P(batch, None, heads, None), P(batch, None, heads, None), P(batch, None)


def _splash(q, k, v, q_pos, segments, window, interpret):
    mesh = pk.mesh_in_effect()
    if mesh is None or mesh.size == 1 or is_manual(mesh):
        return _splash_local(q, k, v, q_pos, segments, window, interpret)
    qs, kvs, rows = splash_specs(mesh, q.shape, k.shape)
    body = functools.partial(_splash_local, window=window, interpret=interpret)
    if segments is None:
        fn = jax.shard_map(lambda q, k, v, p: body(q, k, v, p, None), mesh=mesh, in_specs=(qs, kvs, kvs, rows),
                           out_specs=qs, check_vma=False)
        return fn(q, k, v, q_pos)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(qs, kvs, kvs, rows, rows), out_specs=qs, check_vma=False)
    return fn(q, k, v, q_pos, segments)


# ------------------------------------------------------------------------------------ cuDNN (GPU)
def _rolled_dot_product_attention(q, k, v, q_pos, window, implementation: str):
    """Self-attention through `jax.nn.dot_product_attention` (causal and window by index, padding as
    lengths): each row is rotated so its real tokens (contiguous) come first, then rotated back.
    `implementation` "cudnn" on GPU; "xla" lets the tests check the arithmetic on CPU."""
    b, t, h, d = q.shape
    real = q_pos >= 0
    first = jnp.argmax(real, axis=1).astype(jnp.int32)  # index of each row's first real token
    lengths = jnp.maximum(real.sum(axis=1).astype(jnp.int32), 1)  # an all-padding row: length 1, replaced below
    ar = jnp.arange(t, dtype=jnp.int32)[None]
    fwd, back = (ar + first[:, None]) % t, (ar - first[:, None]) % t
    take = lambda x, idx: jnp.take_along_axis(x, idx[:, :, None, None], axis=1)  # noqa: E731
    out = jax.nn.dot_product_attention(
        take(q, fwd), take(k, fwd), take(v, fwd), is_causal=True, query_seq_lengths=lengths,
        key_value_seq_lengths=lengths, local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation)
    out = take(out, back).astype(q.dtype)
    return _uniform_rows(out, v, jnp.broadcast_to((~real)[..., None], out.shape[:3]))
