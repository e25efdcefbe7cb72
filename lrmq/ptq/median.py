"""Exact min / median / max of the strictly positive values of a stream of arrays, in bounded memory.

QuantLRM needs the exact median of |dW| over every targeted matrix of a model (hundreds of millions to
billions of values); the reference writes them all to a memmap and runs ``np.partition``. Here the
values are streamed twice and never held at once:

* pass 1: count, min, max and a histogram of the top 16 bits of each value's float32 bit pattern.
  Positive float32 values order exactly like their uint32 bit patterns, so the histogram is ordered
  and the bucket holding any rank is found by a cumulative sum.
* pass 2 (one pass for both middle ranks): a bucket holding a middle rank is either small
  (``<= max_bucket`` values: collect them, ``np.partition``) or large (histogram the low 16 bits of that
  bucket's values: the rank then falls on one exact 32-bit pattern, i.e. one exact value).

Memory: two 65536-bin int64 histograms plus at most ``max_bucket`` uint32 per middle bucket (at most
2 buckets), plus whatever one chunk of the stream costs.  Values are compared in float32 (the
reference's dtype).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy as np

_NBINS = 1 << 16
# values per block: whole-matrix temporaries (tens of MB, page-faulted on every allocation) are
# replaced by cache-sized blocks; also bounds np.bincount's int64 copy of its input
BLOCK = 1 << 16


class NoPositiveValues(ValueError):
    """The stream holds no strictly positive value."""


class Stats(NamedTuple):
    min: float
    median: float
    max: float
    count: int


def _as_f32_1d(chunk) -> np.ndarray:
    # order="K": no transposing copy for Fortran-ordered views (e.g. a transposed checkpoint tensor)
    return np.ascontiguousarray(np.asarray(chunk, dtype=np.float32).ravel(order="K"))


def positive_bits(chunk) -> np.ndarray:
    """uint32 bit patterns of the strictly positive float32 values of one chunk (NaN dropped)."""
    x = _as_f32_1d(chunk)
    return x[x > 0].view(np.uint32)


def _high16(bits: np.ndarray) -> np.ndarray:
    # the top half-word as a strided uint16 view is cheaper to histogram than `bits >> 16`
    if np.little_endian:
        return bits.view(np.uint16)[1::2]
    return bits.view(np.uint16)[0::2]


def _chunk_hist(x: np.ndarray) -> tuple[np.ndarray, int, int] | None:
    """(histogram, min bits, max bits) of the positives of ``x`` float32 1-D; None if none.
    The histogram may be shorter than 65536 bins (trailing empty bins omitted)."""
    b = x.view(np.uint32)
    if b.size == 0:
        return None
    # unpadded (length max+1): small blocks would otherwise pay a 65536-bin array each
    h = np.bincount(_high16(b))
    if h[0x8000:].any() or (h[0x7F80:0x8000].any() and np.isnan(x).any()):
        # negatives or NaN present: filter explicitly (slower, rare for |dW|)
        p = b[x > 0]
        if p.size == 0:
            return None
        return np.bincount(p >> 16, minlength=_NBINS), int(p.min()), int(p.max())
    zeros = int(np.count_nonzero(b == 0))
    h[0] -= zeros  # exact zeros share bucket 0 with the tiniest subnormals
    if zeros == b.size:
        return None
    # zeros wrap to 0xFFFFFFFF, so the smallest (bits - 1) belongs to the smallest positive
    return h, int((b - np.uint32(1)).min()) + 1, int(b.max())


def default_workers() -> int:
    """Threads for the per-matrix work (numpy releases the GIL in its array loops)."""
    return max(1, min(4, os.cpu_count() or 1))


def pmap(fn: Callable, items: Iterable, workers: int | None = None) -> Iterator:
    """``map(fn, items)`` in order on ``workers`` threads with at most ``workers`` items in flight
    (bounded memory). ``items`` is consumed on the calling thread, so lazy loaders run where the
    sequential code would run them."""
    workers = default_workers() if workers is None else workers
    if workers <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(workers) as ex:
        pending: deque = deque()
        try:
            for it in items:
                pending.append(ex.submit(fn, it))
                if len(pending) >= workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


def blocks(item) -> Iterator[np.ndarray]:
    """float32 1-D blocks (<= ``BLOCK`` values, memory order) of one stream item: an array, or a
    zero-argument callable returning an array or an iterable of arrays (each split further)."""
    if callable(item):
        item = item()
    parts = [item] if isinstance(item, np.ndarray) or not hasattr(item, "__iter__") else item
    for part in parts:
        x = _as_f32_1d(part)
        for i in range(0, max(x.size, 1), BLOCK):
            yield x[i : i + BLOCK]


def _item_hist(item):
    hist, bmin, bmax = None, None, None
    for x in blocks(item):
        r = _chunk_hist(x)
        if r is None:
            continue
        if hist is None:
            hist = np.zeros(_NBINS, np.int64)
        hist[: r[0].size] += r[0]
        bmin = r[1] if bmin is None else min(bmin, r[1])
        bmax = r[2] if bmax is None else max(bmax, r[2])
    return hist, bmin, bmax


def _pass1(make_stream, workers=None) -> tuple[np.ndarray, float, float]:
    hist = np.zeros(_NBINS, np.int64)
    bmin, bmax = None, None
    for h, lo, hi in pmap(_item_hist, make_stream(), workers):
        if h is None:
            continue
        hist += h
        bmin = lo if bmin is None else min(bmin, lo)
        bmax = hi if bmax is None else max(bmax, hi)
    if bmin is None:
        return hist, np.nan, np.nan
    return hist, float(np.uint32(bmin).view(np.float32)), float(np.uint32(bmax).view(np.float32))


def _bucket_values(x: np.ndarray, bucket: int) -> np.ndarray:
    """Bit patterns of the positive values of ``x`` whose top 16 bits equal ``bucket``."""
    b = x.view(np.uint32)
    sel = b[_high16(b) == bucket]
    if bucket == 0 or bucket >= 0x7F80:  # zeros / NaN share these buckets with positives
        sel = sel[sel.view(np.float32) > 0]
    return sel


def _pass2(make_stream, wanted: dict[int, list[int]], hist: np.ndarray, max_bucket: int,
           workers=None) -> dict:
    """Exact values at within-bucket ranks: ``wanted`` maps bucket -> ranks inside that bucket."""
    small = {b: np.empty(int(hist[b]), np.uint32) for b in wanted if hist[b] <= max_bucket}
    filled = dict.fromkeys(small, 0)
    large = {b: np.zeros(_NBINS, np.int64) for b in wanted if hist[b] > max_bucket}

    def select(item):  # per item: {bucket: [bit patterns per block] (small) or [low-16 histogram]}
        out = {b: [] for b in wanted}
        for x in blocks(item):
            for b in wanted:
                sel = _bucket_values(x, b)
                if not sel.size:
                    continue
                if b in small:
                    out[b].append(sel)
                elif out[b]:
                    out[b][0] += np.bincount(sel & 0xFFFF, minlength=_NBINS)
                else:
                    out[b].append(np.bincount(sel & 0xFFFF, minlength=_NBINS))
        return out

    for got in pmap(select, make_stream(), workers):
        for b, sels in got.items():
            for sel in sels:
                if b in small:
                    n = filled[b]
                    if n + sel.size > small[b].size:
                        raise RuntimeError("the stream changed between passes (bucket count grew)")
                    small[b][n : n + sel.size] = sel
                    filled[b] = n + sel.size
                else:
                    large[b] += sel
    out = {}
    for b, ranks in wanted.items():
        if b in small:
            if filled[b] != hist[b]:
                raise RuntimeError("the stream changed between passes (bucket count differs)")
            part = np.partition(small[b], ranks)  # uint32 order == float order for positives
            for r in ranks:
                out[(b, r)] = part[r].view(np.float32)
        else:
            if large[b].sum() != hist[b]:
                raise RuntimeError("the stream changed between passes (bucket count differs)")
            cum = np.cumsum(large[b])
            for r in ranks:
                low = int(np.searchsorted(cum, r, side="right"))
                out[(b, r)] = np.uint32((b << 16) | low).view(np.float32)
    return out


def positive_stats(
    make_stream: Callable[[], Iterable[np.ndarray]], *, max_bucket: int = 1 << 22,
    workers: int | None = None,
) -> Stats:
    """Exact (min, median, max, count) over all strictly positive float32 values of ``make_stream()``.

    ``make_stream`` is called twice (one call per pass) and must yield the same values each time.
    An item may be an array, or a zero-argument callable returning an array or an iterable of arrays
    (evaluated on a worker thread: ``workers`` threads, default :func:`default_workers`, at most
    ``workers`` items in flight; each item is processed in blocks of ``BLOCK`` values).
    An even count's median is the mean of the two middle values computed in float32, exactly as the
    reference (``(mm[k1] + mm[k2]) / 2.0`` on float32 scalars) and ``np.median`` on float32 do.
    Raises NoPositiveValues (a ValueError) if there is no positive value.
    """
    hist, vmin, vmax = _pass1(make_stream, workers)
    n = int(hist.sum())
    if n == 0:
        raise NoPositiveValues("no strictly positive values in the stream")
    cum = np.cumsum(hist)
    ranks = sorted({(n - 1) // 2, n // 2})
    where = {}
    wanted: dict[int, list[int]] = {}
    for r in ranks:
        b = int(np.searchsorted(cum, r, side="right"))
        within = r - (int(cum[b - 1]) if b else 0)
        where[r] = (b, within)
        wanted.setdefault(b, []).append(within)
    vals = _pass2(make_stream, wanted, hist, max_bucket, workers)
    lo, hi = vals[where[(n - 1) // 2]], vals[where[n // 2]]
    med = float((lo + hi) / np.float32(2)) if lo != hi else float(lo)
    return Stats(min=vmin, median=med, max=vmax, count=n)
