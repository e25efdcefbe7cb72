import os
import tracemalloc

import numpy as np
import pytest

from lrmq.ptq import importance as imp
from lrmq.ptq.importance_files import plot_importance, save_importance_npz
from lrmq.ptq.median import Stats, positive_stats


def _stream_of(chunks):
    return lambda: iter(chunks)


# ------------------------------------------------------------------ median.py


def _check(chunks, **kw):
    allv = np.concatenate([np.asarray(c, np.float32).ravel() for c in chunks])
    pos = allv[allv > 0]
    s = positive_stats(_stream_of(chunks), **kw)
    assert s.count == pos.size
    assert s.min == float(pos.min()) and s.max == float(pos.max())
    assert s.median == float(np.median(pos)), (s.median, np.median(pos))
    return s


@pytest.mark.parametrize("n", [1, 2, 1001, 1000])
@pytest.mark.parametrize("bracket", [0, 2, 32])
def test_median_random_odd_even(n, bracket):
    rng = np.random.default_rng(n)
    # exactly n positives (odd / even), plus negatives and zeros that must be ignored
    x = np.concatenate([rng.random(n) + 1e-3, -rng.random(n), np.zeros(n // 3 + 1)]).astype(np.float32)
    rng.shuffle(x)
    chunks = np.array_split(x, 5)
    assert _check(chunks, bracket=bracket).count == n


@pytest.mark.parametrize("bracket", [0, 32])
def test_median_ties_duplicates_magnitudes(bracket):
    rng = np.random.default_rng(1)
    ties = np.repeat(np.float32([0.5, 0.25, 3.0]), [500, 499, 2])
    _check([ties[:300], ties[300:]], bracket=bracket)
    mags = (10.0 ** rng.uniform(-30, 30, 4001)).astype(np.float32)
    _check(np.array_split(mags, 3), bracket=bracket)
    # all values inside one top-16-bit bucket: 1.0 .. 1.0 + 2^-8 share sign/exponent/7 mantissa bits
    one_bucket = (np.float32(1) + rng.integers(0, 2**16, 2000) * np.float32(2.0**-23)).astype(np.float32)
    assert len(np.unique(one_bucket.view(np.uint32) >> 16)) == 1
    _check([one_bucket, -one_bucket, np.zeros(5)], bracket=bracket)
    # even count whose two middle values differ (float32 mean)
    _check([np.float32([1.0, 2.0, 3.0, 1e-3])], bracket=bracket)


def test_median_no_positive_raises():
    with pytest.raises(ValueError, match="no strictly positive"):
        positive_stats(_stream_of([np.zeros(4), -np.ones(3)]))


def test_median_memory_bound():
    # peak traced memory does not grow with the stream: 20 vs 80 chunks of 1 MB, same bound
    chunk = 250_000

    def run(n_chunks):
        def stream():
            for s in range(n_chunks):
                yield np.random.default_rng(s).random(chunk, dtype=np.float32)

        tracemalloc.start()
        st = positive_stats(stream, workers=2)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        allv = np.concatenate(list(stream()))
        assert st.median == float(np.median(allv[allv > 0]))
        return peak

    small, big = run(20), run(80)
    # per worker: the top histograms (2 MiB) + 65 low histograms (33 MiB) + a few chunks in flight
    bound = 3 * (2 + 33) * 2**20 + 8 * chunk * 4
    assert big < bound and big < 1.2 * small + 2 * chunk * 4, (small, big, bound)


def test_median_guess_miss_reads_again():
    # the first item sits far below the bulk: the guessed bracket misses, a second read is exact
    rng = np.random.default_rng(3)
    first = rng.random(1000).astype(np.float32) * 1e-6
    bulk = [rng.random(5000).astype(np.float32) + 1 for _ in range(4)]
    info = {}
    s = _check([first, *bulk], bracket=4, info=info)
    assert info["reads"] == 2 and info["guess_bucket"] != info["median_bucket"]
    info = {}
    _check([bulk[0], first, *bulk[1:]], info=info)
    assert info["reads"] == 1
    # even count whose two middle values sit in far-apart buckets: one read per bucket
    info = {}
    _check([np.float32([1e-6, 1e6])], info=info)
    assert info["reads"] == 3
    # a stream that changes between reads is detected, not silently wrong
    calls = []

    def unstable():
        calls.append(1)
        return iter([first, *bulk] if len(calls) == 1 else [first, *bulk[:2]])

    with pytest.raises(RuntimeError, match="changed between reads"):
        positive_stats(unstable, bracket=4)
    del s


# ------------------------------------------------------------------ abs_delta / zero test


def test_abs_delta_and_shape_error():
    a = np.float32([[1.0, 2.0], [3.0, 4.0]])
    b = np.float32([[1.5, 2.0], [2.0, 4.25]])
    np.testing.assert_array_equal(imp.abs_delta(a, b), [[0.5, 0.0], [1.0, 0.25]])
    with pytest.raises(ValueError, match=r"layers\.0\.q_proj.*\(2, 2\).*\(2, 3\)"):
        imp.abs_delta(a, np.zeros((2, 3)), name="layers.0.q_proj")


def test_zero_mask_matches_fp16_cast():
    x = np.float32([0.0, 2.0**-26, 2.0**-25, np.nextafter(np.float32(2.0**-25), np.float32(1)),
                    2.0**-24, 1e-3, 1e-9])
    np.testing.assert_array_equal(imp.zero_mask(x, "fp16"), x.astype(np.float16) == 0)
    np.testing.assert_array_equal(imp.zero_mask(x, "fp32"), x == 0)
    rng = np.random.default_rng(3)
    y = (10.0 ** rng.uniform(-12, 0, 10000)).astype(np.float32)
    np.testing.assert_array_equal(imp.zero_mask(y, "fp16"), y.astype(np.float16) == 0)


# ------------------------------------------------------------------ mappings

STATS = Stats(min=0.01, median=0.1, max=1.0, count=3)


def test_u_shape_endpoints_and_formula():
    x = np.float32([0.0, 0.01, 0.1, 1.0, 0.055, 0.55, 2.0, 0.005])
    q = imp.MAPPINGS.get("u_shape")(x, STATS, 10.0)
    np.testing.assert_allclose(q[:4], [1.0, 10.0, 1.0, 10.0], rtol=1e-6)
    np.testing.assert_allclose(q[4], 1 + 9 * 0.25, rtol=1e-5)  # halfway on the left
    np.testing.assert_allclose(q[5], 1 + 9 * 0.25, rtol=1e-5)  # halfway on the right
    assert q[6] == pytest.approx(10.0) and q[7] == pytest.approx(10.0)  # clipped outside [min, max]
    assert q.dtype == np.float32


@pytest.mark.parametrize("name,at_min,at_mid,at_max", [
    ("u_shape", 10, 1, 10), ("inverted_u", 1, 10, 1), ("increasing", 1, 5.5, 10),
    ("decreasing", 10, 5.5, 1), ("constant", 1, 1, 1)])
def test_mapping_family(name, at_min, at_mid, at_max):
    x = np.float32([0.0, 0.01, 0.1, 1.0])
    q = imp.MAPPINGS.get(name)(x, STATS, 10.0)
    np.testing.assert_allclose(q, [1.0, at_min, at_mid, at_max], rtol=1e-6)
    grid = np.geomspace(0.01, 1.0, 101).astype(np.float32)
    qg = imp.MAPPINGS.get(name)(grid, STATS, 10.0)
    assert qg.min() >= 1 - 1e-6 and qg.max() <= 10 + 1e-5


def test_degenerate_denominators_floored():
    s = Stats(min=0.5, median=0.5, max=0.5, count=4)
    q = imp.MAPPINGS.get("u_shape")(np.float32([0.5, 0.0]), s, 10.0)
    np.testing.assert_array_equal(q, [1.0, 1.0])


# ------------------------------------------------------------------ channel importance


def test_channel_importance_by_hand_and_orientation():
    # lrmq orientation [K=3 in, N=4 out]; importance per row (input channel)
    dw = np.float32([[0.0, 0.0, 0.01, 1.0],
                     [0.1, 0.1, 0.1, 0.1],
                     [0.0, 0.055, 0.55, 0.0]])
    stats = positive_stats(_stream_of([dw]))
    # positives: 0.01, 1.0, 0.1 x4, 0.055, 0.55 -> 8 values, middle two 0.1, 0.1
    assert stats.count == 8 and stats.median == pytest.approx(0.1) and stats.min == pytest.approx(0.01)
    I = imp.channel_importance(dw, stats)
    # row 0: q = [1, 1, 10, 10], mean 5.5, two zeros -> count 3
    # row 1: all at the median -> q = 1, no zeros -> 1
    # row 2: q = [1, 1 + 9 * 0.5^2, 1 + 9 * 0.5^2, 1] (halfway on each side), mean 2.125, count 3
    np.testing.assert_array_equal(I, np.float32([16.5, 1.0, 6.375]))
    # transposed input (torch orientation) gives per-output-row values instead -> must differ
    assert not np.allclose(imp.channel_importance(dw.T.copy(), stats)[:3], I)
    assert I.shape == (3,)


def test_even_odd_median_in_importance():
    odd = np.float32([[0.1, 0.2, 0.3]])
    even = np.float32([[0.1, 0.2, 0.3, 0.4]])
    assert positive_stats(_stream_of([odd])).median == pytest.approx(0.2)
    assert positive_stats(_stream_of([even])).median == float((np.float32(0.2) + np.float32(0.3)) / 2)


def test_chunked_count():
    dw = np.zeros((2, 10), np.float32)
    dw[0, :3] = 0.5
    dw[1, :] = 0.5  # no zeros
    stats = Stats(min=0.5, median=0.5, max=0.5, count=13)
    I5 = imp.channel_importance(dw, stats, zero_chunks=5)
    # row 0: 7 zeros -> (1/5) sum over 5 chunks of (1 + Z_c) = (7 + 5) / 5 = 2.4; mean q = 1
    exp0 = np.float16(np.float16(1.0) * np.float16(np.float32(12) / np.float32(5)))
    np.testing.assert_array_equal(I5, np.float32([exp0, 1.0]))
    # explicit chunking over the output dim as the reference (tensor_split into 5) agrees
    counts = sum((c == 0).sum(axis=1) + 1 for c in np.array_split(dw, 5, axis=1)) / 5
    assert np.float16(counts[0]) == np.float16(12 / 5)
    np.testing.assert_array_equal(imp.channel_importance(dw, stats), [8.0, 1.0])


def test_fp16_overflow_visible():
    dw = np.zeros((1, 70000), np.float32)
    dw[0, 0] = 1.0
    stats = Stats(min=1.0, median=1.0, max=1.0, count=1)
    assert np.isinf(imp.channel_importance(dw, stats)[0])
    assert np.isfinite(imp.channel_importance(dw, stats, zero_chunks=5)[0])
    assert imp.channel_importance(dw, stats, precision="fp32")[0] == pytest.approx(70000.0)


def test_against_torch_reference_replica():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    K, N = 48, 3000
    base = (rng.standard_normal((K, N)) * 0.02).astype(np.float32)
    ft = base + (rng.standard_normal((K, N)) * 10.0 ** rng.uniform(-7, -2, (K, N))).astype(np.float32)
    keep = rng.random((K, N)) < 0.3
    ft[keep] = base[keep]  # ~30% exact zero updates
    # bf16 checkpoints, as the reference's inputs
    tb = torch.from_numpy(base).to(torch.bfloat16)
    tf = torch.from_numpy(ft).to(torch.bfloat16)
    wb, wf = tb.float().numpy(), tf.float().numpy()  # exact bf16 values
    stats = positive_stats(_stream_of([imp.abs_delta(wf, wb)]))
    ours = imp.channel_importance(imp.abs_delta(wf, wb), stats)

    # reference, in torch orientation [out, in] = our transpose
    diff = torch.abs(tf.T.float() - tb.T.float())
    pos = diff[diff > 0].numpy()
    x_mid = float(np.median(pos))
    assert x_mid == stats.median
    R, eps = 10, 1e-30
    lden = max(x_mid - float(pos.min()), eps)
    rden = max(float(pos.max()) - x_mid, eps)
    xm, ld, rd = (torch.tensor(v, dtype=torch.float32) for v in (x_mid, lden, rden))
    y = torch.empty_like(diff)
    zm = diff == 0
    left = ~zm & (diff <= xm)
    right = ~zm & ~left
    y[zm] = 1.0
    y[left] = 1 + (R - 1.0) * ((xm - diff[left]) / ld).clamp(-1, 1) ** 2
    y[right] = 1 + (R - 1.0) * ((diff[right] - xm) / rd).clamp(-1, 1) ** 2
    minus, quad = diff.half(), y.half()
    count = (minus == 0).sum(dim=0) + 1
    ref = (quad.mean(dim=0) * count).float().numpy()
    np.testing.assert_array_equal(ours, ref)


# ------------------------------------------------------------------ model-level driver


def _pairs(seed=0, layers=2, K=16):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(layers):
        for p, shape in [("q_proj", (K, K)), ("k_proj", (K, 8)), ("o_proj", (K, K)),
                         ("gate_proj", (K, 24)), ("down_proj", (24, K))]:
            b = rng.standard_normal(shape).astype(np.float32)
            f = b + rng.standard_normal(shape).astype(np.float32) * 1e-3 * (rng.random(shape) < 0.7)
            out.append((f"layers.{i}.{p}", f, b))
    return out


def test_importance_for_model_matches_direct(tmp_path):
    pairs = _pairs()
    stats_all = positive_stats(_stream_of([imp.abs_delta(f, b) for _, f, b in pairs]))
    res = imp.importance_for_model(pairs)
    assert sorted(res) == sorted(n for n, _, _ in pairs if "k_proj" not in n)
    for n, f, b in pairs:
        if n in res:
            np.testing.assert_array_equal(res[n], imp.channel_importance(imp.abs_delta(f, b), stats_all))
            assert res[n].shape == (f.shape[0],)
    # lazy weights and a callable stream; stats only over the importance targets (OLMo-style)
    lazy = lambda: ((n, (lambda f=f: f), (lambda b=b: b)) for n, f, b in pairs)  # noqa: E731
    res2 = imp.importance_for_model(lazy, ("o_proj", "down_proj"), stats_targets=None)
    st2 = positive_stats(_stream_of([imp.abs_delta(f, b) for n, f, b in pairs
                                     if "o_proj" in n or "down_proj" in n]))
    assert sorted(res2) == ["layers.0.down_proj", "layers.0.o_proj", "layers.1.down_proj", "layers.1.o_proj"]
    np.testing.assert_array_equal(res2["layers.1.o_proj"],
                                  imp.channel_importance(imp.abs_delta(pairs[7][1], pairs[7][2]), st2))
    path = tmp_path / "imp" / "x.npz"
    save_importance_npz(str(path), res)
    with np.load(path) as z:
        assert sorted(z.files) == sorted(res)
        np.testing.assert_array_equal(z["layers.1.gate_proj"], res["layers.1.gate_proj"])
    assert [p for p in os.listdir(path.parent) if p.endswith(".tmp")] == []
    png = tmp_path / "imp.png"
    plot_importance(str(png), imp.abs_delta(pairs[0][1], pairs[0][2]), stats_all, res)
    assert png.stat().st_size > 1000


def test_importance_errors():
    pairs = _pairs()
    same = [(n, b, b) for n, _, b in pairs]
    with pytest.raises(ValueError, match="identical to the base"):
        imp.importance_for_model(same)
    bad = list(pairs)
    bad[2] = (bad[2][0], bad[2][1], bad[2][2][:, :-1])
    with pytest.raises(ValueError, match=r"layers\.0\.o_proj"):
        imp.importance_for_model(bad)
    with pytest.raises(TypeError, match="re-iterable"):
        imp.importance_for_model(iter(pairs))
    with pytest.raises(ValueError, match="no tensor matched"):
        imp.importance_for_model(pairs, ("x_proj",), stats_targets=None)


def test_round_to_fp16_matches_numpy_cast():
    rng = np.random.default_rng(11)
    q = np.concatenate([rng.uniform(1, 10, 100000),
                        # exact float16 ties (half-way between neighbours) and values next to them
                        (np.arange(1024, 2048) + 0.5) / 1024.0, (np.arange(1024, 2048) + 0.5) / 128.0,
                        rng.uniform(2.0**-14, 65504, 1000)]).astype(np.float32)
    q = np.concatenate([q, np.nextafter(q, np.float32(0)), np.nextafter(q, np.float32(1e9))])
    q = q[(q >= 2.0**-14) & (q <= 65504)]
    np.testing.assert_array_equal(imp.round_to_fp16(q), q.astype(np.float16).astype(np.float32))
    small = np.float32([1e-9, 3.0])
    np.testing.assert_array_equal(imp.round_to_fp16(small), small.astype(np.float16).astype(np.float32))


def test_median_fast_path_zeros_subnormals_nan():
    tiny = np.float32([1e-45, 2e-45, 0.0, 0.0])  # subnormals share bucket 0 with exact zeros
    big = np.float32([np.inf, 3.0, 0.0])
    _check([tiny, big, np.zeros(7, np.float32)])
    _check([tiny, big], bracket=0)
    # NaN is not positive: ignored like the reference's `flat > 0`
    s = positive_stats(_stream_of([np.float32([np.nan, 1.0, 2.0, 0.0])]))
    assert (s.count, s.median) == (2, 1.5)
    # Fortran-ordered (transposed) chunks are read in memory order, same stats
    a = np.random.default_rng(0).random((30, 40), dtype=np.float32)
    _check([a.T, a[:, ::3]])


def test_pair_importance_fused_matches_whole_matrix():
    # the driver's fused kernel == channel_importance(abs_delta(...)) bit for bit: bf16 in both
    # memory orders, float32, mixed, every built-in mapping, fp32 precision, chunked counts, R edge
    # cases (R outside [1, 65504] takes the numpy fallback)
    import ml_dtypes

    rng = np.random.default_rng(5)
    b = rng.standard_normal((300, 700), dtype=np.float32) * 0.02
    d = rng.standard_normal(b.shape, dtype=np.float32) * 10.0 ** rng.uniform(-7, -2, b.shape).astype(np.float32)
    d[rng.random(b.shape) < 0.3] = 0
    d.flat[::97] = 2.0**-25
    d.flat[::89] = 2.0**-24
    bf = lambda x: x.astype(ml_dtypes.bfloat16)  # noqa: E731
    cases = [(b + d, b), (bf(b + d), bf(b)), (bf(b + d), b),
             (np.ascontiguousarray(bf(b + d).T).T, np.ascontiguousarray(bf(b).T).T)]
    st = positive_stats(_stream_of([imp.abs_delta(f, g) for f, g in cases]))
    for f, g in cases:
        dw = imp.abs_delta(f, g)
        for kw in [{}, {"precision": "fp32"}, {"mapping": "inverted_u", "zero_chunks": 5},
                   {"mapping": "increasing", "R": 3.0}, {"mapping": "decreasing"},
                   {"mapping": "constant"}, {"R": 1e4}, {"R": 1.0}, {"R": 0.5}, {"R": 1e5}]:
            got = imp.pair_importance(f, g, st, **kw)
            want = imp.channel_importance(dw, st, **kw)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), kw
    # stats from the pair kernel (global_stats) == stats of the materialised |dW|
    pairs = [(f"layers.{i}.q_proj", f, g) for i, (f, g) in enumerate(cases)]
    assert imp.global_stats(pairs) == st
    # stream items may be callables returning iterables of blocks; workers do not change the stats
    chunks = [imp.abs_delta(f, g) for f, g in cases]
    items = [lambda c=c: iter(np.array_split(c, 3)) for c in chunks]
    for w in (1, 2, 3):
        assert positive_stats(lambda: iter(items), workers=w) == st
