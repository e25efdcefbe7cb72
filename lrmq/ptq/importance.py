"""QuantLRM channel importance from fine-tuning updates (papers.md, Paper 2, "Channel importance").

Reference pipeline (psunlpgroup/QuantLRM) and what is replicated here:

1. ``compare_weight_matrix.py``: both checkpoints are loaded with ``from_pretrained`` and no dtype
   (transformers 4.57 -> float32 upcast of the bf16 weights), ``|W_ft - W_base|`` is taken in float32
   and saved.  Here: :func:`abs_delta` (float32 difference of float32-upcast weights; exact for bf16
   inputs of similar magnitude, as in the reference).
2. ``quadratic_mapping.py``: global (all targeted matrices, all layers) min / exact median / max of the
   strictly positive |dW| in float32, then the mapping ``q`` elementwise in float32.  Here:
   :func:`global_stats` (streamed, exact, :mod:`lrmq.ptq.median`) and :data:`MAPPINGS`.
3. ``pre_quant.run_awq``: ``minus = dW.half(); quadratic = q.half()``;
   ``count = (minus == 0).sum(0) + 1``; ``imp = quadratic.mean(0) * count`` -- all float16 and along
   torch dim 0 = the output dim, giving one value per input channel.  So the zero test is on the
   float16 cast of the float32 difference (|dW| <= 2^-25 counts as zero although it is positive in the
   float32 stats and its q came from the quadratic), the mean is of float16-rounded q, and the product
   is float16 (the int count is first cast to float16).  Here: :func:`channel_importance`.

Orientation: lrmq weights are ``[K, N] = [in, out]``; the reference's column j of the torch
``[out, in]`` weight is our row k, so every reduction below is over axis 1 (the output dim).
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from lrmq.ptq import fused
from lrmq.ptq.median import DEFAULT_BRACKET, Histogram, NoPositiveValues, Stats, pmap, positive_stats
from lrmq.registry import Registry

ALL_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IMPORTANCE_PROJ = ("q_proj", "o_proj", "gate_proj", "down_proj")
_EPS = 1e-30
# largest float32 that rounds to 0 in float16: half of the smallest subnormal, ties go to even (0)
_FP16_ZERO_MAX = np.float32(2.0**-25)

MAPPINGS: Registry = Registry("importance mapping")


def abs_delta(w_ft, w_base, *, name: str = "weight") -> np.ndarray:
    """|W_ft - W_base| in float32 (the reference's fp32 upcast of bf16 weights, then subtract).

    The exact-zero test is *not* applied here: the reference computes the mapping on these float32
    values and zero-tests their float16 cast separately (see :func:`zero_mask`).
    """
    a, b = _pair_arrays(w_ft, w_base, name)
    return _absdiff(a, b)


def _pair_arrays(w_ft, w_base, name: str) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(w_ft)
    b = np.asarray(w_base)
    if a.shape != b.shape:
        raise ValueError(f"{name}: fine-tuned shape {a.shape} != base shape {b.shape}")
    return a, b


def _absdiff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    fa = to_float32(a)
    # subtract in place when the widened copy is fresh (never into the caller's float32 array)
    d = np.subtract(fa, to_float32(b), out=fa if a.dtype != np.float32 else None)
    return np.abs(d, out=d)


def to_float32(a: np.ndarray) -> np.ndarray:
    """float32 copy/view of an array; bfloat16 (ml_dtypes) widened by a 16-bit shift (exact, fast)."""
    if a.dtype.name == "bfloat16":
        u = a.view(np.uint16).astype(np.uint32)
        u <<= np.uint32(16)
        return u.view(np.float32)
    return a.astype(np.float32, copy=False)


def _rows(w: np.ndarray) -> np.ndarray:
    """``[out, in]`` C-contiguous kernel array of an lrmq ``[K, N]`` weight (for a checkpoint tensor
    loaded ``[out, in]`` and transposed, ``w.T`` is already C-contiguous: no copy)."""
    return fused.as_kernel_array(w.T)


def zero_mask(dw_abs: np.ndarray, precision: str = "fp16") -> np.ndarray:
    """Exact-zero test of |dW|: after a float16 cast (reference) or in float32 (``"fp32"``)."""
    if precision == "fp16":
        # |x| cast to fp16 is 0 iff |x| <= 2^-25 (round-half-even at half the smallest subnormal)
        return dw_abs <= _FP16_ZERO_MAX
    if precision == "fp32":
        return dw_abs == 0
    raise ValueError(f"precision must be 'fp16' or 'fp32', got {precision!r}")


def _dens(stats: Stats) -> tuple[np.float32, np.float32, np.float32]:
    # as the reference: python-float denominators floored at 1e-30, then made float32 tensors
    mid = np.float32(stats.median)
    left = np.float32(max(stats.median - stats.min, _EPS))
    right = np.float32(max(stats.max - stats.median, _EPS))
    return mid, left, right


def _signed_position(x: np.ndarray, stats: Stats) -> np.ndarray:
    """u in [-1, 1]: -1 at x_min, 0 at the median, +1 at x_max (two linear halves, clipped).

    ``min(d, 0)/left + max(d, 0)/right`` (d = x - mid) is exactly the reference's branch value (the
    other term is +-0), and -((mid - x)/left) on the left, so u^2 equals the reference's z^2 bit for bit.
    """
    mid, left, right = _dens(stats)
    d = x - mid
    u = np.minimum(d, 0) / left
    u += np.maximum(d, 0, out=d) / right
    return np.clip(u, -1, 1, out=u)


def _finish(t: np.ndarray, x: np.ndarray) -> np.ndarray:
    """1 + t, with zero updates mapped to 1 (t * 0 == 0 exactly, cheaper than masked assignment)."""
    t *= x != 0
    t += np.float32(1)
    return t


@MAPPINGS.register("u_shape")
def u_shape(x: np.ndarray, stats: Stats, R: float = 10.0) -> np.ndarray:
    """Reference "restricted quadratic": 1 + (R-1) z^2, z = clipped distance to the median.

    R at x_min and x_max, 1 at the median.  float32 throughout as the reference.
    """
    x = np.asarray(x, np.float32)
    u = _signed_position(x, stats)
    u *= u
    u *= np.float32(R - 1)
    return _finish(u, x)


@MAPPINGS.register("inverted_u")
def inverted_u(x: np.ndarray, stats: Stats, R: float = 10.0) -> np.ndarray:
    """Ablation: 1 + (R-1)(1 - z^2): R at the median, 1 at both ends (protects the middle)."""
    x = np.asarray(x, np.float32)
    u = _signed_position(x, stats)
    return _finish(np.float32(R - 1) * (np.float32(1) - u * u), x)


@MAPPINGS.register("increasing")
def increasing(x: np.ndarray, stats: Stats, R: float = 10.0) -> np.ndarray:
    """Ablation: 1 + (R-1)(u+1)/2: 1 at x_min, (1+R)/2 at the median, R at x_max (protects big updates)."""
    x = np.asarray(x, np.float32)
    u = _signed_position(x, stats)
    return _finish(np.float32((R - 1) / 2) * (u + np.float32(1)), x)


@MAPPINGS.register("decreasing")
def decreasing(x: np.ndarray, stats: Stats, R: float = 10.0) -> np.ndarray:
    """Ablation: 1 + (R-1)(1-u)/2: R at x_min, (1+R)/2 at the median, 1 at x_max (protects small updates)."""
    x = np.asarray(x, np.float32)
    u = _signed_position(x, stats)
    return _finish(np.float32((R - 1) / 2) * (np.float32(1) - u), x)


@MAPPINGS.register("constant")
def constant(x: np.ndarray, stats: Stats, R: float = 10.0) -> np.ndarray:
    """Ablation: q == 1, so the importance is the zero-update count term alone."""
    return np.ones(np.shape(x), np.float32)


def channel_importance(
    dw_abs: np.ndarray,
    stats: Stats,
    *,
    mapping: str = "u_shape",
    R: float = 10.0,
    zero_chunks: int = 1,
    precision: str = "fp16",
) -> np.ndarray:
    """Per-input-channel importance of one ``[K, N]`` (lrmq orientation) |dW|: ``[K]`` float32.

    ``I_k = mean_n q(|dW[k, n]|) * C_k`` with ``C_k = 1 + #zeros in row k`` (``zero_chunks == 1``) or
    ``C_k = (1/K_c) sum_c (1 + Z_k^(c))`` over ``K_c`` chunks of the output dim (the reference's 32B/70B
    variant; the sum does not depend on the split, so ``C_k = (Z_k + K_c) / K_c``, computed in float32).

    ``precision="fp16"`` replicates the reference: q is cast to float16 before the mean, the mean is
    rounded to float16 (accumulated here in float64; torch accumulates in float32 -- identical unless
    a mean sits within float32 rounding error of a float16 rounding boundary), the count is cast to
    float16 (integers above 2048 round), the product is rounded to float16 (may be inf above 65504,
    which is why the reference chunks the count for wide matrices).  The result holds those float16
    values as float32.  ``precision="fp32"`` keeps everything float32 (mean in float64) and tests
    exact float32 zeros.
    """
    x = np.asarray(dw_abs, np.float32)
    if x.ndim != 2:
        raise ValueError(f"dw_abs must be 2-D [K, N], got shape {x.shape}")
    if zero_chunks < 1:
        raise ValueError(f"zero_chunks must be >= 1, got {zero_chunks}")
    fn = MAPPINGS.get(mapping)
    q = fn(x, stats, R)
    z = zero_mask(x, precision).sum(axis=1)
    if precision == "fp16":
        return _combine(round_to_fp16(q).sum(axis=1, dtype=np.float64), z, x.shape[1], zero_chunks, precision)
    return _combine(q.sum(axis=1, dtype=np.float64), z, x.shape[1], zero_chunks, precision)


def _combine(qsum: np.ndarray, z: np.ndarray, n: int, zero_chunks: int, precision: str) -> np.ndarray:
    """Importance from the float64 sums of the (float16-rounded) q and the zero counts per channel."""
    if zero_chunks == 1:
        count = (z + 1).astype(np.float32)
    else:
        count = (z + zero_chunks).astype(np.float32) / np.float32(zero_chunks)
    if precision == "fp16":
        mean = (qsum / n).astype(np.float16)
        with np.errstate(over="ignore"):
            prod = mean.astype(np.float32) * count.astype(np.float16).astype(np.float32)
            return prod.astype(np.float16).astype(np.float32)
    # np.mean(dtype=float64) is the float64 sum divided by n
    return ((qsum / n) * count).astype(np.float32)


def pair_importance(
    w_ft,
    w_base,
    stats: Stats,
    *,
    name: str = "weight",
    mapping: str = "u_shape",
    R: float = 10.0,
    zero_chunks: int = 1,
    precision: str = "fp16",
) -> np.ndarray:
    """``channel_importance(abs_delta(w_ft, w_base), ...)`` bit for bit, in one fused pass over the pair (a stacked
    experts pair [E, K, N]: each expert's slice alone, [E, K])
    (:func:`lrmq.ptq.fused.importance_sums`) without materialising |dW| (the model driver's kernel).

    The kernel covers the built-in mappings with ``1 <= R <= 65504`` and ``N * R < 2^29``: q is then in
    [1, R], its float16 rounding is in float16's normal range, and the per-channel float64 sums of
    multiples of 2^-10 (fp16) or 2^-23 (fp32) are exact in any order.  Other cases (registered custom
    mappings, extreme R) fall back to the whole-matrix numpy computation.
    """
    a, b = _pair_arrays(w_ft, w_base, name)
    if a.ndim == 3:  # a mixture-of-experts layer's stacked experts [E, K, N]: each expert's own slice, [E, K]
        return np.stack([pair_importance(a[e], b[e], stats, name=f"{name}[{e}]", mapping=mapping, R=R,
                                         zero_chunks=zero_chunks, precision=precision) for e in range(a.shape[0])])
    if zero_chunks < 1:
        raise ValueError(f"zero_chunks must be >= 1, got {zero_chunks}")
    if precision not in ("fp16", "fp32"):
        raise ValueError(f"precision must be 'fp16' or 'fp32', got {precision!r}")
    fn = MAPPINGS.get(mapping)
    fused_ok = (a.ndim == 2 and a.size > 0 and _BUILTIN_MAPPINGS.get(mapping) is fn
                and 1.0 <= R <= 65504.0 and a.shape[1] * R < 2.0**29)
    if not fused_ok:
        return channel_importance(_absdiff(a, b), stats, mapping=mapping, R=R, zero_chunks=zero_chunks,
                                  precision=precision)
    k, n = a.shape
    mid, left, right = _dens(stats)
    acc = np.zeros(k, np.float64)
    z = np.zeros(k, np.int64)
    # fp16: q16 in [1, round16(R)], multiples of 2^-10: float32 row-block sums exact below 2^14
    r16 = float(np.float32(R).astype(np.float16))
    block_rows = int(2.0**14 // r16) if precision == "fp16" else 0
    fused.importance_sums(_rows(a), _rows(b), fused.MAPPING_IDS[mapping], mid, left, right,
                          np.float32(R - 1), np.float32((R - 1) / 2), precision == "fp16",
                          _FP16_ZERO_MAX if precision == "fp16" else np.float32(0), block_rows, acc, z)
    return _combine(acc, z, n, zero_chunks, precision)


# mappings with values in [1, R] (R >= 1), for which pair_importance's blocked sums are exact
_BUILTIN_MAPPINGS = {"u_shape": u_shape, "inverted_u": inverted_u, "increasing": increasing,
                     "decreasing": decreasing, "constant": constant}


def round_to_fp16(q: np.ndarray) -> np.ndarray:
    """float32 -> nearest float16 value (half to even), kept as float32; for values in float16's
    normal range [2^-14, 65504] (all mappings give [1, R]).  Same values as ``astype(float16)``,
    ~6x faster than numpy's conversion.  Out-of-range input falls back to the numpy cast."""
    q = np.asarray(q, np.float32)
    if q.size and not (q.min() >= 2.0**-14 and q.max() <= 65504.0):
        with np.errstate(over="ignore"):  # above 65504 -> inf, as the reference's .half()
            return q.astype(np.float16).astype(np.float32)
    b = q.view(np.uint32)
    r = b + (np.uint32(0x0FFF) + ((b >> 13) & np.uint32(1)))
    r &= np.uint32(0xFFFFE000)
    return r.view(np.float32)


# ----------------------------------------------------------------------------------------------
# model-level two-pass driver

Pair = tuple  # (name, w_ft, w_base); each weight an array or a zero-argument callable returning one


def matrix_type(name: str, targets: Sequence[str]) -> str | None:
    """The target a tensor name belongs to, by dotted component (``layers.3.attn.q_proj`` -> q_proj)."""
    parts = name.split(".")
    for t in targets:
        if t in parts:
            return t
    return None


def _reiterable(pairs) -> Callable[[], Iterable[Pair]]:
    if callable(pairs):
        return pairs
    if iter(pairs) is pairs:
        raise TypeError("pairs must be re-iterable (a sequence or a callable returning an iterable); "
                        "the importance pass reads the weights more than once")
    return lambda: pairs


def _load(w):
    return w() if callable(w) else w


def _loaded(make_pairs, targets) -> Iterable[tuple[str, str, object, object]]:
    """(name, target, w_ft, w_base) with the weights loaded, on the calling thread (lazy loaders may
    hold file handles that are only valid while their iterator is at that item)."""
    for name, w_ft, w_base in make_pairs():
        t = matrix_type(name, targets)
        if t is not None:
            yield name, t, _load(w_ft), _load(w_base)


def _flat_pair(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """1-D kernel arrays of a pair in one common memory order (no copy for C- or Fortran-ordered
    pairs, e.g. transposed checkpoint tensors: the histogram does not care about the order)."""
    if a.flags.f_contiguous and b.flags.f_contiguous and not (a.flags.c_contiguous and b.flags.c_contiguous):
        a, b = a.T, b.T
    return fused.as_kernel_array(a).reshape(-1), fused.as_kernel_array(b).reshape(-1)


def _summarize_pair(item, hist: Histogram) -> None:
    hist.add(*item)


# values per stats work item: big matrices are split so the worker threads stay balanced
_STATS_CHUNK = 1 << 22


def global_stats(pairs, *, stats_targets: Sequence[str] = ALL_PROJ, bracket: int = DEFAULT_BRACKET,
                 workers: int | None = None, info: dict | None = None) -> Stats:
    """Global positive-only (min, exact median, max, count) of |dW| over every ``stats_targets`` matrix.

    One read of the weights (two if the median falls outside the bracket guessed from the first
    matrix, see :func:`lrmq.ptq.median.positive_stats`): loaded on the calling thread, |dW| histogrammed
    by the fused kernel on ``workers`` threads (default :func:`lrmq.ptq.median.default_workers`), a
    few matrices in flight."""
    make_pairs = _reiterable(pairs)
    seen = []

    def stream():
        seen.clear()
        for name, _, w_ft, w_base in _loaded(make_pairs, stats_targets):
            seen.append(name)
            a, b = _flat_pair(*_pair_arrays(w_ft, w_base, name))
            for i in range(0, max(a.size, 1), _STATS_CHUNK):
                yield a[i : i + _STATS_CHUNK], b[i : i + _STATS_CHUNK]

    try:
        return positive_stats(stream, summarize=_summarize_pair, bracket=bracket, workers=workers, info=info)
    except NoPositiveValues:
        if not seen:
            raise ValueError(f"no tensor matched the targets {tuple(stats_targets)}") from None
        raise ValueError(
            f"|dW| is zero everywhere in the {len(seen)} targeted matrices: the fine-tuned weights are "
            "identical to the base weights, so there is no fine-tuning signal for QuantLRM importance"
        ) from None


def importance_for_model(
    pairs,
    targets: Sequence[str] = IMPORTANCE_PROJ,
    *,
    stats_targets: Sequence[str] | None = ALL_PROJ,
    stats: Stats | None = None,
    mapping: str = "u_shape",
    R: float = 10.0,
    zero_chunks: int | Mapping[str, int] = 1,
    precision: str = "fp16",
    bracket: int = DEFAULT_BRACKET,
    workers: int | None = None,
) -> dict[str, np.ndarray]:
    """Importance vectors ``{name: [K]}`` for every tensor whose name has a ``targets`` component.

    ``pairs``: a sequence of ``(name, w_ft, w_base)`` or a callable returning a fresh iterable of
    them, in lrmq orientation ``[K, N]``; a weight may be a zero-argument callable (lazy load).
    Pass 1 (one streamed read, :func:`global_stats`) takes the global stats over ``stats_targets``
    (default: all seven projections, as the reference's Qwen3-8B run; ``None`` = ``targets``, as its
    OLMo-3 run); pass 2 reads the ``targets`` matrices once more.  ``zero_chunks`` may be a dict
    ``{target: chunks}`` (the 32B reference chunks gate/down by 5).  Weights are loaded on the calling
    thread and processed by :func:`pair_importance` on ``workers`` threads, a few matrices in flight.
    """
    make_pairs = _reiterable(pairs)
    if stats is None:
        stats = global_stats(make_pairs, stats_targets=stats_targets or targets, bracket=bracket,
                             workers=workers)

    def one(item):
        name, t, w_ft, w_base = item
        chunks = zero_chunks.get(t, 1) if isinstance(zero_chunks, Mapping) else zero_chunks
        return name, pair_importance(w_ft, w_base, stats, name=name, mapping=mapping, R=R,
                                     zero_chunks=chunks, precision=precision)

    out = dict(pmap(one, _loaded(make_pairs, targets), workers))
    if not out:
        raise ValueError(f"no tensor matched the targets {tuple(targets)}")
    return out
