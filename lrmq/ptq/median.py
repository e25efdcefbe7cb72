"""Exact min / median / max of the strictly positive values of a stream, in bounded memory, in one read.

QuantLRM needs the exact median of |dW| over every targeted matrix of a model (hundreds of millions to
billions of values); the reference writes them all to a memmap and runs ``np.partition``.  Here the
values are histogrammed by their float32 bit pattern, which for positive floats orders exactly like
the value, so a rank is found by a cumulative sum:

* every value counts in a 65536-bin histogram of its top 16 bits (sign, exponent, 7 mantissa bits);
* values whose top 16 bits fall in a *bracket* of ``2 * bracket + 1`` buckets around a guessed median
  bucket also count in a histogram of their low 16 bits, which pins a rank to one exact 32-bit
  pattern, i.e. one exact value.  The guess is the median bucket of the first item with positive
  values (that item is summarised twice);
* if a middle rank falls outside the bracket (the first item was not representative), one more read
  with the bracket set to the bucket(s) holding the middle ranks gives the exact value (two reads
  if the two middle values of an even count sit in far-apart buckets with only empty ones between).

Memory per worker thread: the top histogram (8 interleaved copies, 4 MiB) and ``2 * bracket + 1``
low histograms (512 KiB each; 33 MiB at the default ``bracket = 32``), plus the items in flight;
nothing grows with the stream.  The counting runs in the numba kernel :func:`lrmq.ptq.fused.hist_positive`.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy as np

from lrmq.ptq import fused

_NBINS = fused.NBINS
DEFAULT_BRACKET = 32  # half-width in top-16 buckets (128 per octave): +-1/4 octave around the guess


class NoPositiveValues(ValueError):
    """The stream holds no strictly positive value."""


class Stats(NamedTuple):
    min: float
    median: float
    max: float
    count: int


def default_workers() -> int:
    """Threads for the per-matrix work (the kernels and numpy release the GIL): the cores this process
    may run on, at most ``OMP_NUM_THREADS`` when that is set (the thread budget the user gave), at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        cores = min(cores, int(omp))
    return max(1, min(4, cores))


def pmap(fn: Callable, items: Iterable, workers: int | None = None, ahead: int | None = None) -> Iterator:
    """``map(fn, items)`` in order on ``workers`` threads with at most ``ahead`` items in flight
    (default ``2 * workers``: a long item does not leave the other threads idle, memory stays
    bounded). ``items`` is consumed on the calling thread, so lazy loaders run where the sequential
    code would run them."""
    workers = default_workers() if workers is None else workers
    if workers <= 1:
        yield from map(fn, items)
        return
    ahead = max(workers, ahead or 2 * workers)
    with ThreadPoolExecutor(workers) as ex:
        pending: deque = deque()
        try:
            for it in items:
                pending.append(ex.submit(fn, it))
                if len(pending) >= ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


class Histogram:
    """Counts of positive float32 values by bit pattern: top 16 bits for all, low 16 bits for the top
    buckets ``lo .. lo + n_low - 1``.  One per worker thread (the kernel is not atomic)."""

    def __init__(self, lo: int = 0, n_low: int = 0):
        self.lo, self.n_low = lo, n_low
        self.top = np.zeros(fused.N_COPIES * _NBINS, np.int64)
        self.low = np.zeros(max(n_low, 1) * _NBINS, np.int64)
        self.mm = np.array([0xFFFFFFFF, 0], np.uint32)
        self.non_positive = 0

    def add(self, a: np.ndarray, b: np.ndarray | None = None) -> None:
        """Count the positive values of ``a`` (1-D float32), or of ``|f32(a) - f32(b)|`` for two
        same-length 1-D arrays of float32 or bfloat16 bit patterns (uint16)."""
        self.non_positive += fused.hist_positive(a, b, self.top, self.low, self.lo, self.n_low, self.mm)

    def add_values(self, chunk) -> None:
        self.add(np.ascontiguousarray(np.asarray(chunk, dtype=np.float32).ravel(order="K")))

    def totals(self) -> tuple[np.ndarray, np.ndarray]:
        """(top[65536], low[n_low, 65536]) with the non-positive values taken out of bucket 0."""
        top = self.top.reshape(fused.N_COPIES, _NBINS).sum(axis=0)
        top[0] -= self.non_positive
        low = self.low[: self.n_low * _NBINS].reshape(self.n_low, _NBINS)
        if self.lo == 0 and self.n_low:
            low = low.copy()  # do not change the counts themselves
            low[0, 0] -= self.non_positive
        return top, low


def _merge(hists: list[Histogram]) -> tuple[np.ndarray, np.ndarray, int | None, int | None]:
    top, low = hists[0].totals()
    top, low = top.copy(), low.copy()
    for h in hists[1:]:
        t, lw = h.totals()
        top += t
        low += lw
    mins = [int(h.mm[0]) for h in hists if h.mm[0] <= h.mm[1]]
    maxs = [int(h.mm[1]) for h in hists if h.mm[0] <= h.mm[1]]
    return top, low, (min(mins) if mins else None), (max(maxs) if maxs else None)


def summarize_values(item, hist: Histogram) -> None:
    """Default item summariser: an array, or a zero-argument callable returning an array or an
    iterable of arrays; every value is counted (any float dtype, any memory order)."""
    if callable(item):
        item = item()
    parts = [item] if isinstance(item, np.ndarray) or not hasattr(item, "__iter__") else item
    for part in parts:
        hist.add_values(part)


def _histogram_pass(items: Iterable, summarize, lo: int, n_low: int, workers) -> tuple:
    """One read of ``items`` into per-thread histograms; (top, low, min bits, max bits)."""
    per_thread: dict[int, Histogram] = {}
    lock = threading.Lock()

    def one(item):
        tid = threading.get_ident()
        h = per_thread.get(tid)
        if h is None:
            with lock:
                h = per_thread.setdefault(tid, Histogram(lo, n_low))
        summarize(item, h)

    for _ in pmap(one, items, workers):
        pass
    if not per_thread:
        return np.zeros(_NBINS, np.int64), np.zeros((n_low, _NBINS), np.int64), None, None
    return _merge(list(per_thread.values()))


def _rank_bucket(cum: np.ndarray, r: int) -> tuple[int, int]:
    """(top bucket holding 0-based rank r, rank within that bucket)."""
    b = int(np.searchsorted(cum, r, side="right"))
    return b, r - (int(cum[b - 1]) if b else 0)


def _value_at(low_row: np.ndarray, bucket: int, within: int) -> np.float32:
    low = int(np.searchsorted(np.cumsum(low_row), within, side="right"))
    return np.uint32((bucket << 16) | low).view(np.float32)


def positive_stats(
    make_stream: Callable[[], Iterable],
    *,
    summarize: Callable = summarize_values,
    bracket: int = DEFAULT_BRACKET,
    workers: int | None = None,
    info: dict | None = None,
) -> Stats:
    """Exact (min, median, max, count) over all strictly positive float32 values of ``make_stream()``.

    ``summarize(item, hist)`` counts one stream item into a :class:`Histogram` (default
    :func:`summarize_values`); it runs on ``workers`` threads (default :func:`default_workers`), at
    most ``2 * workers`` items in flight, and is called twice for the first item with positive values.
    ``make_stream`` is called once, or again (once, or twice for two far-apart middle buckets) if the
    median falls outside the guessed bracket; ``info["reads"]`` says how many times (each call must
    yield the same values).
    An even count's median is the mean of the two middle values computed in float32, exactly as the
    reference (``(mm[k1] + mm[k2]) / 2.0`` on float32 scalars) and ``np.median`` on float32 do.
    Raises NoPositiveValues (a ValueError) if there is no positive value.
    """
    if bracket < 0:
        raise ValueError(f"bracket must be >= 0, got {bracket}")
    items = iter(make_stream())
    # guess: the median bucket of the first item with positives (items without any contribute nothing)
    first = None
    for item in items:
        probe = Histogram()
        summarize(item, probe)
        top0, _ = probe.totals()
        if top0.sum():
            first = item
            break
    if first is None:
        raise NoPositiveValues("no strictly positive values in the stream")
    guess, _ = _rank_bucket(np.cumsum(top0), (int(top0.sum()) - 1) // 2)
    lo = max(0, guess - bracket)
    n_low = min(_NBINS, guess + bracket + 1) - lo

    def rest():
        yield first
        yield from items

    top, low, bmin, bmax = _histogram_pass(rest(), summarize, lo, n_low, workers)
    n = int(top.sum())
    cum = np.cumsum(top)
    ranks = sorted({(n - 1) // 2, n // 2})
    where = {r: _rank_bucket(cum, r) for r in ranks}
    reads = 1
    if all(lo <= b < lo + n_low for b, _ in where.values()):
        vals = [_value_at(low[b - lo], b, w) for b, w in (where[r] for r in ranks)]
    else:
        # the guess missed: read again with the bracket on the middle bucket(s); two far-apart buckets
        # (empty buckets between the two middle values of an even count) get a read each
        buckets = sorted({b for b, _ in where.values()})
        span = buckets[-1] - buckets[0] + 1
        groups = [(buckets[0], span)] if span <= max(2, 2 * bracket + 1) else [(b, 1) for b in buckets]
        lows = {}
        for lo2, n2 in groups:
            top2, low2, _, _ = _histogram_pass(make_stream(), summarize, lo2, n2, workers)
            if not np.array_equal(top2, top):
                raise RuntimeError("the stream changed between reads (histograms differ)")
            lows.update({lo2 + i: low2[i] for i in range(n2)})
            reads += 1
        vals = [_value_at(lows[b], b, w) for b, w in (where[r] for r in ranks)]
    lo_v, hi_v = vals[0], vals[-1]
    med = float((lo_v + hi_v) / np.float32(2)) if lo_v != hi_v else float(lo_v)
    if info is not None:
        info.update(reads=reads, guess_bucket=guess, median_bucket=where[ranks[0]][0])
    as_f32 = lambda bits: float(np.uint32(bits).view(np.float32))  # noqa: E731
    return Stats(min=as_f32(bmin), median=med, max=as_f32(bmax), count=n)
