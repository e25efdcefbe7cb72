"""The quantized KV cache (lrmq.generation.kv_pool.QuantPool; docs/generation.md, "Quantized KV cache").

* `kv_cache=auto` is the model's dtype: the pool is the plain array it always was and the engine's tokens,
  log-probs and stats are exactly the default's.
* Pages round-trip within the format's error: fp8_e4m3 / fp8_e5m2 per KV head (calibrated by the first write,
  clipped and counted after), int8 per token and KV head; in both pool layouts.
* Copy on write of a shared prompt's last page carries its scale pages: a prompt shared by two samples decodes
  as it does alone.
* Preemption and recompute give the same tokens with a quantized cache.
* The XLA path, the TPU kernel (its reference: neither interpret mode runs it on CPU in jax 0.10.2) with the
  per-KV-head scales folded into q and the output, and the GPU kernel (Pallas interpret mode) with scale pages
  agree on a quantized pool.
* libtpu compiles the engine with fp8 pages in the TPU kernel for v5e / v5p / v6e, the pool argument half the
  bf16 pool's bytes; int8 compiles on the XLA path (tests/test_paged_tpu.py, which compiles the bf16 engine).
* On 8 CPU devices the quantized pool split over KV heads gives the one-device tokens and clip count.
* Kept fp8 scales (rollout.kv_scale_refresh): a call given scales writes under them and returns them
  bit-identical, a call given its own is reproduced bit for bit, `KVCalibration` recalibrates after k updates;
  int8 / auto / bf16 refuse them.
* Per-token log-prob error and greedy agreement against the float cache (printed: `pytest -s`; at 2k positions per
  family: benchmarks/kv_cache_error.py).
* Config: rollout.kv_cache / generation.kv_cache / --kv-cache, unknown values refused naming the key;
  algo.rollout_correction=auto turns the correction on with a quantized cache; rollout.kv_cache=fp8_e4m3
  trains a step of the tiny recipe.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL_DIR, tiny_train_config
from lrmq.checkpoint.hf import load_hf_model
from lrmq.generation import attention, kv_format, kv_pool
from lrmq.generation.attention import gpu as attn_gpu
from lrmq.generation.attention import tpu as attn_tpu
from lrmq.generation.attention import xla as attn_xla
from lrmq.generation.kv_format import KVFormat
from lrmq.generation import paged
from lrmq.generation.engine import Engine, EngineConfig, engine_format
from lrmq.generation.sampling import SamplingConfig

QUANT = ("fp8_e4m3", "fp8_e5m2", "int8")


@pytest.fixture(scope="module")
def tiny():
    return load_hf_model(TINY_MODEL_DIR)


def _cfg(layers=2, kvh=2, d=32, dtype="float32", heads=4):
    return type("Cfg", (), dict(num_layers=layers, num_kv_heads=kvh, head_dim=d, dtype=dtype, num_heads=heads))()


def _keys(n, seed=7):
    return np.asarray(jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(jax.random.key(seed), i)))(
        jnp.arange(n)))


def _write(pool, k, v, table, q_pos, layer, mode="prefill"):
    cache = paged.PagedCache(pool, table, jnp.ones(table.shape[0], bool), layer=layer, mode=mode)
    return cache.write(k, v, q_pos).pool


# The engine tests share one engine per KV format (and pool size), its programs sized by CAPACITY: every
# call takes the same pool and page table, so each row bucket's prefill and decode compile once per format for
# all of them.
ENGINE = dict(slots=3, page_size=8, sync_steps=8)
CAPACITY = dict(prompt_capacity=128, new_capacity=64)
SAMPLING = SamplingConfig(temperature=1.2)
EOS = 319


@pytest.fixture(scope="module")
def engine(tiny):
    made = {}

    def get(fmt, pages=0):
        if (fmt, pages) not in made:
            made[fmt, pages] = Engine(tiny, eos_ids=[EOS], pad_id=0,
                                      config=EngineConfig(**ENGINE, pages=pages, kv_cache=fmt))
        return made[fmt, pages]

    return get


def _gen(eng, tiny, prompts, max_new, keys, kv_scales=None, sampling=SAMPLING):
    return eng.generate(tiny, prompts, max_new_tokens=max_new, sampling=sampling, keys=keys, kv_scales=kv_scales,
                        **CAPACITY)


# ------------------------------------------------------------------------------------------ the pool
def test_auto_is_the_plain_pool_and_the_default_engine(tiny, engine):
    cfg = tiny.cfg
    auto = kv_pool.new_pool(cfg, 5, 8, fmt=KVFormat("auto"))
    plain = kv_pool.new_pool(cfg, 5, 8)
    assert not isinstance(auto, kv_pool.QuantPool) and auto.dtype == plain.dtype == jnp.dtype(cfg.dtype)
    assert kv_pool.page_bytes(cfg, 8, fmt=KVFormat("auto")) == kv_pool.page_bytes(cfg, 8)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3, 4]]
    default = Engine(tiny, eos_ids=[EOS], pad_id=0, config=EngineConfig(**ENGINE))  # the engine before kv_cache
    runs = [_gen(e, tiny, prompts, 10, _keys(3)) for e in (default, engine("auto"))]
    np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
    np.testing.assert_array_equal(runs[0].logprobs, runs[1].logprobs)  # bit-identical
    assert runs[0].stats == runs[1].stats and "kv_saturated" not in runs[1].stats


def _bound(fmt, x, scale):
    """The largest round-trip error of entries x at `scale` (broadcast to x): half a step of the format."""
    if fmt == "int8":
        return scale / 2
    mant, sub = {"fp8_e4m3": (3, -9), "fp8_e5m2": (2, -16)}[fmt]
    return np.abs(x) * 2.0 ** -(mant + 1) + scale * 2.0 ** (sub - 1)


@pytest.mark.parametrize("layout", ["interleaved", "split"])
@pytest.mark.parametrize("fmt", QUANT)
def test_quantized_pages_round_trip_within_the_format(fmt, layout):
    """Pages written through PagedCache.write read back within half a step of the format (fp8: per-head scales
    calibrated by the first write; int8: per token); copy on write of a page carries its scale pages; a later write
    past the calibrated range clips at the format's max and is counted."""
    rng = np.random.default_rng(0)
    cfg, ps, pages, t = _cfg(), 4, 9, 8
    pool = kv_pool.new_pool(cfg, pages, ps, fmt=KVFormat(fmt, layout))
    assert isinstance(pool, kv_pool.QuantPool) and kv_pool.pool_dtype(pool) == KVFormat(fmt).dtype(cfg)
    assert (pool.k_token is not None) == KVFormat(fmt, layout).token_scales
    table = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    q_pos = jnp.broadcast_to(jnp.arange(t), (2, t))
    k = rng.normal(size=(2, t, 2, 32)).astype(np.float32) * np.array([1.0, 30.0])[:, None]  # heads' ranges differ
    v = rng.normal(size=(2, t, 2, 32)).astype(np.float32)
    for layer in (0, 1):
        pool = _write(pool, jnp.asarray(k), jnp.asarray(v) * (layer + 1), table, q_pos, layer)
    for layer in (0, 1):
        gk, gv = (np.asarray(x) for x in kv_pool.read_pages(pool, layer, table))
        for got, want, head_scale, token in ((gk, k, pool.k_scale, pool.k_token),
                                             (gv, v * (layer + 1), pool.v_scale, pool.v_token)):
            if fmt == "int8":  # per token: absmax / 127
                scale = np.abs(want).max(-1, keepdims=True) / 127
            else:  # per head: FP8_HEADROOM x the absmax of what the first write saw, on the format's max
                scale = kv_pool.FP8_HEADROOM * np.abs(want).max((0, 1, 3)) / KVFormat(fmt).fmax
                np.testing.assert_allclose(np.asarray(head_scale)[:, layer], scale, rtol=1e-6)
                scale = scale[:, None]
            assert np.all(np.abs(got - want) <= _bound(fmt, want, scale) * (1 + 1e-5) + 1e-12)
            assert np.abs(got - want).max() > 0  # really quantized
            if token is not None and fmt != "int8":  # the GPU kernel's scale pages: the head's scale per token
                np.testing.assert_allclose(np.asarray(token)[:, layer, 1:5].reshape(2, -1),
                                           np.broadcast_to(np.asarray(head_scale)[:, layer, None], (2, 4 * ps)))
    assert int(np.sum(pool.saturated)) == 0
    # copy on write of a page (a shared prompt's partly filled last page) carries its scale pages: page 6 then reads
    # as page 2 (per-head scales are pool-global); without them it would read as zeros
    copied = kv_pool.copy_pages(pool, jnp.asarray([2, 0]), jnp.asarray([6, 0]))
    for layer in (0, 1):
        src, dst = (kv_pool.read_pages(copied, layer, jnp.asarray([[p]])) for p in (2, 6))
        for a, b in zip(src, dst):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert np.abs(np.asarray(b)).max() > 0
    if pool.k_token is not None:
        np.testing.assert_array_equal(np.asarray(copied.k_token[:, :, 6]), np.asarray(pool.k_token[:, :, 2]))
        np.testing.assert_array_equal(np.asarray(copied.v_token[:, :, 6]), np.asarray(pool.v_token[:, :, 2]))
    # a later write beyond the calibrated range is clipped at the format's max and counted (fp8; int8 never clips)
    pool = _write(pool, jnp.asarray(k) * 10, jnp.asarray(v), table, q_pos, 0)
    gk, _ = kv_pool.read_pages(pool, 0, table)
    if fmt == "int8":
        assert int(np.sum(pool.saturated)) == 0
    else:
        limit = np.asarray(pool.k_scale)[:, 0] * KVFormat(fmt).fmax
        over = np.abs(k * 10) > limit[:, None] * (1 + 2.0 ** -3)
        assert over.any() and int(np.sum(pool.saturated)) >= over.sum()
        np.testing.assert_allclose(np.abs(np.asarray(gk))[over], np.broadcast_to(limit[:, None], over.shape)[over],
                                   rtol=1e-6)


@pytest.mark.parametrize("layout", ["interleaved", "split"])
def test_fp8_pages_held_as_int8_bits_read_and_write_the_same(layout):
    """The XLA path's fp8 pool holds its pages as int8 (`attention.int8_bits`: on TPU an f8 pool was relaid whole per
    layer and step): the same writes store the same bits and read back the same keys and values and attention as
    the f8 pool; a kernel is refused on it; the engine makes it for "xla" only."""
    rng = np.random.default_rng(1)
    cfg, ps, pages, t = _cfg(), 4, 9, 8
    table, q_pos = jnp.asarray([[1, 2], [3, 4]], jnp.int32), jnp.broadcast_to(jnp.arange(t), (2, t))
    k, v = (jnp.asarray(rng.normal(size=(2, t, 2, 32)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(2, 4, 32)), jnp.float32)
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        f8, bits = (kv_pool.new_pool(cfg, pages, ps, fmt=KVFormat(fmt, layout, b)) for b in (False, True))
        assert kv_pool.pool_dtype(bits) == jnp.int8 and kv_pool.pool_dtype(f8) == kv_format.QUANT_DTYPES[fmt]
        f8, bits = (_write(p, k, v, table, q_pos, 1) for p in (f8, bits))
        for a, b in zip(jax.tree.leaves(f8.pages), jax.tree.leaves(bits.pages)):
            np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(a, jnp.int8)), np.asarray(b))
        for a, b in zip(kv_pool.read_pages(f8, 1, table), kv_pool.read_pages(bits, 1, table)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        lengths = jnp.asarray([t, t - 3])
        np.testing.assert_array_equal(
            *(np.asarray(attn_xla.decode_attention_xla(q, p, 1, table, lengths, None, block_pages=2)) for p in (f8, bits)))
        kernel = "gpu" if layout == "split" else "tpu"
        with pytest.raises(ValueError, match="as int8 bits"):
            paged.PagedCache(bits, table, jnp.ones(2, bool), layer=1, impl=kernel).attend(q[:, None], q_pos[:, -1:],
                                                                                          None)
        assert attention.int8_bits(fmt, "xla") and not attention.int8_bits(fmt, "tpu")
        assert not attention.int8_bits(fmt, "gpu")
    assert not attention.int8_bits("int8", "xla") and not attention.int8_bits("bf16", "xla")


# ------------------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_a_shared_prompt_decodes_as_it_does_alone(tiny, engine, fmt):
    """The prompt (11 tokens: 10 prefilled, its last page partly full at page_size 8) is prefilled once for both
    samples and its last page copied into each (copy on write, scale pages included)."""
    prompt, keys, eng = list(range(5, 16)), _keys(2), engine(fmt)
    shared = _gen(eng, tiny, [prompt, prompt], 12, keys)
    assert shared.stats["prefilled_prompts"] == 1
    for i in range(2):
        alone = _gen(eng, tiny, [prompt], 12, keys[i:i + 1])
        np.testing.assert_array_equal(shared.tokens[i], alone.tokens[0])
        np.testing.assert_allclose(shared.logprobs[i], alone.logprobs[0], atol=2e-5)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_preemption_and_recompute_give_the_same_tokens(tiny, engine, fmt):
    prompts = [[9, 10, 11, 12, 13, 14, 15], [5, 6, 7], [3], list(range(4, 25)), [8, 8, 9]]
    budgets, keys = [30, 9, 22, 26, 5], _keys(5)
    runs = [_gen(engine(fmt, pages), tiny, prompts, budgets, keys) for pages in (0, 9)]
    assert runs[0].stats["preempted"] == 0 and runs[1].stats["preempted"] > 0
    np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
    np.testing.assert_array_equal(runs[0].lengths, runs[1].lengths)
    np.testing.assert_allclose(runs[0].logprobs, runs[1].logprobs, atol=2e-5)


# ------------------------------------------------------------------------------------------ kept scales
def test_kept_kv_scales_are_reused_until_the_refresh(tiny, engine):
    """rollout.kv_scale_refresh=2 (`KVCalibration` around `Engine.generate(kv_scales=)`, as the sampler runs it,
    an update after each rollout: rollout k samples from version k): rollout 0 calibrates on its prompts; rollout 1 writes under those scales
    (returned bit-identical, not its own prompts' calibration, and its log-probs differ from its own); after 2
    updates rollout 2 recalibrates on its prompts; rollout 3 reuses that, which reproduces a call that calibrated
    itself bit for bit. refresh 0 (the default) calibrates every call, as the engine always did."""
    from lrmq.rl.kv_scales import KVCalibration

    eng = engine("fp8_e4m3")
    first, later = [list(range(5, 16)), list(range(20, 31))], [list(range(200, 211)), list(range(150, 161))]

    def gen(prompts, kv_scales=None):
        return _gen(eng, tiny, prompts, 8, _keys(2), kv_scales)

    own = gen(later)  # the later prompts, calibrated on themselves
    assert own.kv_scales.fmt == "fp8_e4m3" and own.kv_scales.k.shape == (tiny.cfg.num_kv_heads, tiny.cfg.num_layers)
    assert np.all(own.kv_scales.k > 0) and np.all(own.kv_scales.v > 0)
    cal, runs = KVCalibration(refresh=2), []
    for step in range(4):  # rollout `step` samples from policy version `step` (one update after each rollout)
        given = cal.for_rollout(step)
        res = gen(first if step == 0 else later, given)
        runs.append((given, res, cal.after_rollout(given, res, step)))
    assert [st["rollout/kv_calibrated"] for _, _, st in runs] == [1.0, 0.0, 1.0, 0.0]
    assert all(st["rollout/kv_saturated"] == res.stats["kv_saturated"] for _, res, st in runs)
    kept = runs[0][1].kv_scales
    assert runs[0][0] is None and runs[1][0] == kept and runs[1][1].kv_scales == kept  # bit-identical
    assert kept != own.kv_scales and not np.array_equal(runs[1][1].logprobs, own.logprobs)
    assert runs[2][0] is None and runs[2][1].kv_scales == own.kv_scales  # recalibrated on its own prompts
    np.testing.assert_array_equal(runs[2][1].logprobs, own.logprobs)
    assert runs[3][0] == own.kv_scales  # a call's own scales given back: the same call, bit for bit
    np.testing.assert_array_equal(runs[3][1].tokens, own.tokens)
    np.testing.assert_array_equal(runs[3][1].logprobs, own.logprobs)
    cal = KVCalibration(refresh=0)
    for step in range(2):
        given = cal.for_rollout(step)
        res = gen(later, given)
        assert given is None and "rollout/kv_calibrated" not in cal.after_rollout(given, res, step)
        assert res.kv_scales == own.kv_scales and cal.scales is None


def test_kv_scales_are_refused_where_they_do_not_apply(tiny, tmp_path):
    """Kept scales are fp8's: int8 (a scale per token), auto and bf16 have none, refused naming why (the engine's
    kv_scales before any compile; the config's rollout.kv_scale_refresh when it is read)."""
    from lrmq.configlib import ConfigError

    kvh, layers = tiny.cfg.num_kv_heads, tiny.cfg.num_layers
    ones = np.ones((kvh, layers), np.float32)
    with pytest.raises(ValueError, match="int8 scales each token"):
        kv_pool.KVScales("int8", ones, ones)
    with pytest.raises(ValueError, match="finite"):
        kv_pool.KVScales("fp8_e4m3", ones * np.nan, ones)
    scales = kv_pool.KVScales("fp8_e4m3", ones, ones)
    for kv_cache, match in (("int8", "int8 scales each token"), ("auto", "no scales"), ("fp8_e5m2", "calibrated for")):
        with pytest.raises(ValueError, match=match):
            Engine(tiny, eos_ids=[127], pad_id=0, config=EngineConfig(kv_cache=kv_cache)).generate(
                tiny, [[5, 6]], max_new_tokens=2, kv_scales=scales)
    with pytest.raises(ValueError, match="kv_heads, layers"):
        Engine(tiny, eos_ids=[127], pad_id=0, config=EngineConfig(kv_cache="fp8_e4m3")).generate(
            tiny, [[5, 6]], max_new_tokens=2, kv_scales=kv_pool.KVScales("fp8_e4m3", ones[:, :1], ones[:, :1]))
    assert tiny_train_config(str(tmp_path)).rollout.kv_scale_refresh == 0
    assert tiny_train_config(str(tmp_path), rollout={"kv_cache": "fp8_e5m2", "kv_scale_refresh": 3}
                             ).rollout.kv_scale_refresh == 3
    for kv_cache, match in (("int8", "int8 scales each token"), ("auto", "no scales"), ("bf16", "no scales")):
        with pytest.raises(ConfigError, match=f"rollout.kv_scale_refresh=2 .*{match}"):
            tiny_train_config(str(tmp_path), rollout={"kv_cache": kv_cache, "kv_scale_refresh": 2})
    with pytest.raises(ConfigError, match="rollout.kv_scale_refresh"):
        tiny_train_config(str(tmp_path), rollout={"kv_cache": "fp8_e4m3", "kv_scale_refresh": -1})


# ------------------------------------------------------------------------------------------ the kernels
def _reference_tpu_kernel(q, pages, kv_lens, table, cu_q_lens, num_seqs, *, num_kv_pages_per_block,
                          num_queries_per_block, vmem_limit_bytes, **kw):
    """The TPU kernel's own reference, after its static and dynamic validators (as tests/test_paged_tpu.py)."""
    rpa = attn_tpu._rpa_module()
    assert kw["k_scale"] == 1.0 and kw["v_scale"] == 1.0 and pages.dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2)
    rpa.static_validate_inputs(q, pages, kv_lens, table, cu_q_lens, num_seqs, **kw,
                               num_kv_pages_per_block=num_kv_pages_per_block,
                               num_queries_per_block=num_queries_per_block, vmem_limit_bytes=vmem_limit_bytes)
    rpa.dynamic_validate_inputs(q, pages, kv_lens, table, cu_q_lens, num_seqs, **kw)
    return rpa.ref_ragged_paged_attention(q, pages, kv_lens, table, cu_q_lens, num_seqs, **kw)


def _quant_pools(fmt, layouts, d, kvh=2, layers=2, ps=16, width=4, slots=4, seed=3):
    """Pools of each layout holding the same keys / values (written through PagedCache.write), their table, the
    float keys / values, and the same pools unquantized."""
    rng = np.random.default_rng(seed)
    cfg = _cfg(layers, kvh, d)
    pages = 1 + slots * width
    table = jnp.asarray(rng.permutation(np.arange(1, pages)).reshape(slots, width).astype(np.int32))
    t = width * ps
    k = jnp.asarray(rng.normal(size=(slots, t, kvh, d)).astype(np.float32) * np.linspace(0.5, 4, kvh)[:, None])
    v = jnp.asarray(rng.normal(size=(slots, t, kvh, d)).astype(np.float32))
    q_pos = jnp.broadcast_to(jnp.arange(t), (slots, t))
    out = {}
    for layout in layouts:
        for name, kv_cache in (("quant", fmt), ("float", "auto")):
            pool = kv_pool.new_pool(cfg, pages, ps, fmt=KVFormat(kv_cache, layout))
            for layer in range(layers):
                pool = _write(pool, k * (layer + 1), v, table, q_pos, layer)
            out[name, layout] = pool
    return out, table


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_tpu_kernel_with_folded_scales_equals_xla(monkeypatch, fmt):
    pools, table = _quant_pools(fmt, ["interleaved"], d=128)
    monkeypatch.setattr(attn_tpu, "_tpu_kernel", lambda: _reference_tpu_kernel)
    rng = np.random.default_rng(4)
    s, h = table.shape[0], 8  # GQA: 4 query heads per KV head
    q = jnp.asarray(rng.normal(size=(s, h, 128)).astype(np.float32))
    lengths = jnp.asarray([1, 37, 64, 0], jnp.int32)
    pool = pools["quant", "interleaved"]
    assert attn_tpu.tpu_unsupported(h, kv_pool.interleaved_shape(pool), kv_pool.pool_dtype(pool), scaled=True) is None
    # the XLA path as one compiled program (per pool type and layer), not op by op; the kernel's reference reads
    # its lengths on the host, so it runs eagerly
    xla = jax.jit(attn_xla.decode_attention_xla, static_argnums=(2,), static_argnames=("block_pages",))
    for layer in (0, 1):
        want = np.asarray(xla(q, pool, layer, table, lengths, None, block_pages=2))
        got = np.asarray(attn_tpu.decode_attention_tpu(q, pool, layer, table, lengths, None))
        flt = np.asarray(xla(q, pools["float", "interleaved"], layer, table, lengths, None, block_pages=2))
        assert np.isfinite(got).all() and np.all(got[3] == 0)
        np.testing.assert_allclose(got, want, atol=2e-5)  # the scales fold exactly
        rel = np.linalg.norm(got - flt) / np.linalg.norm(flt)  # against the float pool: the format's error
        assert 0 < rel < (0.05 if fmt == "fp8_e4m3" else 0.1), rel


def test_page_bytes_count_the_scale_pages():
    import pallas_kernels as pk

    cfg = _cfg(layers=2, kvh=2, d=32)
    entries = 2 * 16 * 2 * 2  # layers x page_size x (K, V) x KV heads
    assert kv_pool.page_bytes(cfg, 16) == entries * 32 * 4  # f32, as before
    assert kv_pool.page_bytes(cfg, 16, fmt=KVFormat("bf16")) == entries * 32 * 2
    assert kv_pool.page_bytes(cfg, 16, fmt=KVFormat("fp8_e4m3")) == entries * 32  # per-head scales: pool-global
    assert kv_pool.page_bytes(cfg, 16, fmt=KVFormat("int8")) == entries * (32 + 4)  # a float32 scale per token and head
    with pk.target("gpu"):  # the GPU kernel's pool keeps fp8 scale pages too
        assert kv_pool.page_bytes(cfg, 16, fmt=KVFormat("fp8_e5m2", "split")) == entries * (32 + 4)
        # the engine resolves its format once, from the attention the target takes: the GPU kernel's split pool
        fmt = engine_format(EngineConfig(kv_cache="fp8_e5m2", page_size=16), cfg)
        assert fmt == KVFormat("fp8_e5m2", "split") and fmt.token_scales
    assert engine_format(EngineConfig(kv_cache="fp8_e5m2"), cfg) == KVFormat("fp8_e5m2", "interleaved", True)


def test_tpu_refuses_int8_and_takes_fp8_with_scales():
    shape = (2, 9, 16, 4, 128)
    assert "int8" in attn_tpu.tpu_unsupported(8, shape, jnp.int8, scaled=True)
    assert attn_tpu.tpu_unsupported(8, shape, jnp.float8_e4m3fn, scaled=True) is None
    assert attn_tpu.tpu_unsupported(8, shape, jnp.float8_e4m3fn) is not None  # fp8 pages without scales
    import pallas_kernels as pk
    with pk.target("tpu", "TPU v5 lite"):
        assert attention.resolve_impl("auto", 8, shape, jnp.float8_e5m2, scaled=True) == "tpu"
        assert attention.resolve_impl("auto", 8, shape, jnp.int8, scaled=True) == "xla"
    with pk.target("gpu"):
        assert attention.resolve_impl("auto", 8, shape, jnp.int8, scaled=True) == "gpu"
        assert attention.resolve_impl("auto", 8, shape, jnp.int8) == "xla"  # int8 pages without scale pages


def test_fp8_pages_at_one_kv_head_per_tpu_chip_are_refused_up_front():
    """The TPU kernel is asked about a chip's share of the KV heads: 8 KV heads over fsdp=8 (Qwen3 on v5e:2x4, the
    paper recipes' mesh) leave 1 per chip, which JAX's kernel refuses for fp8 pages (4 rows to a sublane). "auto"
    then refuses with the setting, the mesh and what works (the XLA path on an fp8 pool copies the pool per layer
    and step on TPU), before any compile (the Engine's constructor); 2 per chip (data=2 x fsdp=4) takes the
    kernel, bf16 at 1 per chip still does, int8 and an explicit impl="xla" take XLA. No compile: libtpu's devices."""
    import os

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from test_paged_tpu import TINY, _require_libtpu

    from lrmq import aot
    from lrmq.model.config import ModelConfig
    from lrmq.sharding import MeshConfig, make_mesh

    _require_libtpu()
    devices = list(aot.topology_devices("v5e:2x4"))
    one, two = make_mesh(MeshConfig(1, 8, 1), devices=devices), make_mesh(MeshConfig(2, 4, 1), devices=devices)
    shape = (28, 9, 16, 16, 128)  # [L, P, page_size, 2 x 8 KV heads, D], 16 query heads
    for dtype, fmt in ((jnp.float8_e4m3fn, "fp8_e4m3"), (jnp.float8_e5m2, "fp8_e5m2")):
        assert attn_tpu.tpu_unsupported(16, shape, dtype, scaled=True) is None  # the whole pool's 8 heads: fine
        with pytest.raises(ValueError, match=f"kv_cache={fmt} .*generation.kv_cache.* data=1 x fsdp=8 x tensor=1 "
                                             "splits the 8 KV heads 8 ways, 1 per chip") as e:
            attention.resolve_impl("auto", 16, shape, dtype, mesh=one, scaled=True)
        for works in ("data=2 x fsdp=4, 2 per chip", "kv_cache=int8", "kv_cache=bf16", "impl='xla'"):
            assert works in str(e.value)
        assert attention.resolve_impl("auto", 16, shape, dtype, mesh=two, scaled=True) == "tpu"
        assert attention.resolve_impl("xla", 16, shape, dtype, mesh=one, scaled=True) == "xla"
    assert attention.resolve_impl("auto", 16, shape, jnp.bfloat16, mesh=one) == "tpu"  # bf16 packs 2: 1 head is fine
    assert attention.resolve_impl("auto", 16, shape, jnp.int8, mesh=one, scaled=True) == "xla"
    cfg = ModelConfig.from_hf_dict(dict(TINY), dtype="bfloat16", param_dtype="bfloat16")  # 8 KV heads, head_dim 128
    graphdef, _ = aot.abstract_model(cfg, one)
    make = lambda mesh, kv, impl="auto": Engine(None, eos_ids=(0,), pad_id=0, graphdef=graphdef,  # noqa: E731
                                                model_cfg=cfg, config=EngineConfig(kv_cache=kv, attention=impl), mesh=mesh)
    with pytest.raises(ValueError, match="kv_cache=fp8_e4m3 .* 1 per chip"):
        make(one, "fp8_e4m3")
    assert make(two, "fp8_e4m3").resolved_impl() == "tpu"
    assert make(one, "bf16").resolved_impl() == "tpu"
    assert make(one, "fp8_e4m3", impl="xla").resolved_impl() == "xla"


@pytest.mark.parametrize("fmt", QUANT)
def test_gpu_kernel_with_scale_pages_equals_xla(fmt):
    pools, table = _quant_pools(fmt, ["interleaved", "split"], d=16)
    rng = np.random.default_rng(5)
    s, h = table.shape[0], 4
    q = jnp.asarray(rng.normal(size=(s, h, 16)).astype(np.float32))
    lengths = jnp.asarray([1, 37, 64, 0], jnp.int32)
    split = pools["quant", "split"]
    assert split.k_token is not None and attn_gpu.gpu_unsupported(h, kv_pool.interleaved_shape(split), kv_pool.pool_dtype(
        split), scaled=True) is None
    # each path one compiled program (per pool layout and layer), not op by op
    gpu, xla = (jax.jit(f, static_argnums=(2,), static_argnames=("block_pages",))
                for f in (attn_gpu.decode_attention_gpu, attn_xla.decode_attention_xla))
    for layer in (0, 1):
        got = np.asarray(gpu(q, split, layer, table, lengths, None, block_pages=2))
        want = np.asarray(xla(q, split, layer, table, lengths, None, block_pages=2))
        inter = np.asarray(xla(q, pools["quant", "interleaved"], layer, table, lengths, None, block_pages=2))
        assert np.isfinite(got).all() and np.all(got[3] == 0)
        np.testing.assert_allclose(got, want, atol=2e-5)
        if fmt == "int8":  # per-token scales in both layouts: the same stored values
            np.testing.assert_allclose(inter, want, atol=2e-6)


# ------------------------------------------------------------------------------------------ the error
def test_logprob_error_against_the_float_cache(tiny, engine):
    """Greedy decoding of 64 tokens after 120-token prompts (up to 184 positions of the tiny model's 256): the
    per-token log-prob error against the float cache over the tokens before the first disagreement, and greedy
    agreement. The figures are printed (pytest -s) and reported in docs/generation.md."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, size=120).tolist() for _ in range(4)]
    s, keys = SamplingConfig(greedy=True), _keys(4)
    ref = _gen(engine("auto"), tiny, prompts, 64, keys, sampling=s)
    report = {}
    for fmt in ("bf16",) + QUANT:
        res = _gen(engine(fmt), tiny, prompts, 64, keys, sampling=s)
        errs, agree = [], []
        for i in range(len(prompts)):
            n = int(min(ref.lengths[i], res.lengths[i]))
            same = ref.tokens[i, :n] == res.tokens[i, :n]
            first = n if same.all() else int(np.argmin(same))
            agree.append(first / n)
            errs.append(np.abs(ref.logprobs[i, :first + (first < n)] - res.logprobs[i, :first + (first < n)]))
        err = np.concatenate(errs)
        report[fmt] = {"mean_abs_logprob_err": float(err.mean()), "max_abs_logprob_err": float(err.max()),
                       "greedy_agreement": float(np.mean(agree)), "kv_saturated": res.stats.get("kv_saturated", 0)}
    print("kv cache vs float cache, tiny model, 120 + 64 tokens:", json.dumps(report, indent=1))
    assert report["bf16"]["mean_abs_logprob_err"] < 1e-2
    for fmt in QUANT:
        assert report[fmt]["mean_abs_logprob_err"] < 0.1 and report[fmt]["greedy_agreement"] > 0.5
    assert report["int8"]["mean_abs_logprob_err"] < report["fp8_e5m2"]["mean_abs_logprob_err"]


# ------------------------------------------------------------------------------------------ config
def test_config_options_and_refusals(tmp_path):
    from lrmq.configlib import ConfigError
    from lrmq.evals.config import GenerationSection

    cfg = tiny_train_config(str(tmp_path), rollout={"kv_cache": "int8"})
    assert cfg.rollout.engine_config().kv_cache == "int8"
    assert tiny_train_config(str(tmp_path)).rollout.engine_config().kv_cache == "auto"
    with pytest.raises(ConfigError, match="rollout.kv_cache"):
        tiny_train_config(str(tmp_path), rollout={"kv_cache": "fp4"})
    assert GenerationSection(kv_cache="fp8_e5m2").engine_config().kv_cache == "fp8_e5m2"
    with pytest.raises(ValueError, match="engine.kv_cache"):
        EngineConfig(kv_cache="fp8")
    from lrmq.configlib import config_from_dict
    from lrmq.evals.config import EvalConfig
    with pytest.raises(ConfigError, match="generation.kv_cache"):
        config_from_dict(EvalConfig, {"suite": "synthetic", "generation": {"kv_cache": "fp4"}})


def test_auto_correction_turns_on_with_a_quantized_kv_cache(tmp_path):
    from lrmq.rl.step import old_logprob_sources, rollout_quant_warning

    correction = lambda **a: tiny_train_config(str(tmp_path), **a).loss_config().rollout_correction  # noqa: E731
    assert correction() == "none" and correction(rollout={"kv_cache": "bf16"}) == "none"
    for fmt in QUANT:
        assert correction(rollout={"kv_cache": fmt}) == "sequence_mask"
    assert correction(rollout={"kv_cache": "int8"}, algo={"rollout_correction": "token_truncate"}) == "token_truncate"
    cfg = tiny_train_config(str(tmp_path), rollout={"kv_cache": "fp8_e4m3"}, algo={"rollout_correction": "none"})
    assert old_logprob_sources(cfg)[0] == "behaviour_logp" and "kv_cache=fp8_e4m3" in rollout_quant_warning(cfg)


@pytest.mark.slow(reason="an in-process GRPO step of the tiny recipe (compiles the engine and the update)")
@pytest.mark.parametrize("kv_cache,quant,refresh", [("fp8_e4m3", "none", 2), ("int8", "int4", 0)])
def test_quantized_kv_cache_trains_a_step(tmp_path, kv_cache, quant, refresh):
    """fp8 KV alone, with rollout.kv_scale_refresh=2 (the step's rollout calibrates and the trainer keeps its
    scales; one update later the next rollout writes under them: rollout/kv_calibrated 1 then 0), and int8 KV
    with the packed int4 rollout copy (both in one decode program)."""
    from lrmq.rl.trainer import GRPOTrainer

    cfg = tiny_train_config(str(tmp_path), rollout={"kv_cache": kv_cache, "quant": quant, "kv_scale_refresh": refresh,
                                                    "max_new_tokens": 16},
                            run={"steps": 1, "eval_size": 0, "save_every": 1})
    assert cfg.loss_config().rollout_correction == "sequence_mask"
    trainer = GRPOTrainer(cfg)
    trainer.train()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    row = [r for r in rows if r["step"] == 1][-1]
    assert np.isfinite(row["train/loss"])
    assert row["train/mismatch/kl_k3"] > 0  # the fp8 cache's sampler differs from the float learner
    assert row["rollout/kv_saturated"] >= 0
    if not refresh:
        assert "rollout/kv_calibrated" not in row and trainer.sampler.kv_calibration.scales is None
        return
    kept = trainer.sampler.kv_calibration.scales
    assert row["rollout/kv_calibrated"] == 1.0 and kept is not None and trainer.sampler.kv_calibration.version == 0
    later = trainer.rollout(next(trainer.pipeline), jax.random.key(5))  # compiled already: no update needed
    assert later.stats["rollout/kv_calibrated"] == 0.0 and trainer.sampler.kv_calibration.scales == kept


# ------------------------------------------------------------------------------------------ TPU compiles (libtpu)
# (the kernel on fp8 pages and the fp8 pool's size on TPU compile in tests/test_paged_tpu.py, beside the bf16 engine)
@pytest.mark.slow(reason="a libtpu compile of the tiny engine's decode program on 8 v5e chips (about 10 s here)")
def test_the_xla_path_does_not_copy_an_fp8_pool_in_the_decode_loop_on_tpu():
    """The XLA decode path on fp8 pages at 1 KV head per chip (impl="xla" on data=1 x fsdp=8, the path the refusal
    above points away from): with an f8 pool libtpu copied the chip's whole pool in every layer of every decode
    step (the pool's write and its gathered read in two layouts); the pool held as int8 bits is copied only
    before and after the loop (as int8 KV's is)."""
    import os
    import re

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from test_paged_tpu import TINY, _require_libtpu

    from lrmq import aot
    from lrmq.model.config import ModelConfig
    from lrmq.sharding import MeshConfig, make_mesh

    _require_libtpu()
    cfg = ModelConfig.from_hf_dict(dict(TINY), dtype="bfloat16", param_dtype="bfloat16")  # 8 KV heads, head_dim 128
    mesh = make_mesh(MeshConfig(1, 8, 1), devices=list(aot.topology_devices("v5e:2x4")))
    graphdef, state = aot.abstract_model(cfg, mesh)
    eng = Engine(None, eos_ids=(0,), pad_id=0, graphdef=graphdef, model_cfg=cfg,
                 config=EngineConfig(slots=16, sync_steps=4, kv_cache="fp8_e4m3", attention="xla"), mesh=mesh)
    fn, args = eng.abstract_calls(state, n_requests=16, prompt_len=64, max_new=64, sampling=SamplingConfig(),
                                  mesh=mesh)["decode"]
    pages = args[1].pages
    assert pages.dtype == jnp.int8
    text = aot._compile(fn, *args, mesh=mesh)[0].as_text()
    chip = f"[{pages.shape[0]},{pages.shape[1]},{pages.shape[2]},2,{pages.shape[4]}]"  # 1 KV head: 2 K/V rows
    copies, comp = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" "):
            comp = line.split(" ")[0] if not line.startswith("ENTRY") else "ENTRY"
        elif chip in line and re.search(r"= \S+ copy(-start)?\(", line):
            copies.setdefault(comp, []).append(line.strip()[:120])
    assert "ENTRY" in copies  # the parser sees the copies (before / after the loop)
    assert not {c: v for c, v in copies.items() if c != "ENTRY"}, copies  # none inside a loop


# ------------------------------------------------------------------------------------------ on a mesh
@pytest.mark.slow(reason="an 8-CPU-device subprocess compiling the sharded engine and the single-device one per format")
def test_sharded_quantized_engine_matches_one_device(multi_device_run):
    out = multi_device_run("test_kv_cache_quant.py", "sharded-engine", n_devices=8, timeout=900)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def _sharded_engine() -> None:
    """The quantized pool's pages and scales split over the KV heads (the mesh specs of a QuantPool): the tokens,
    saturation count and (to a step of the format) log-probs of one device."""
    from lrmq.checkpoint.load import load_model
    from lrmq.sharding import make_mesh, shard_model

    assert len(jax.devices()) == 8
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [3], [5, 6, 7], [20, 21, 22, 23, 24]] * 2
    sampling = SamplingConfig(temperature=1.0)

    def run(mesh, fmt, impl="auto", kv_scales=None):
        model = load_model(TINY_MODEL_DIR)
        if mesh is not None:
            with jax.set_mesh(mesh):
                model = shard_model(model, mesh)
        eng = Engine(model, eos_ids=[271], pad_id=0, mesh=mesh,
                     config=EngineConfig(slots=8, page_size=4, sync_steps=8, kv_cache=fmt, attention=impl))
        return eng.generate(model, prompts, max_new_tokens=[6, 15, 4, 15, 10] * 2, sampling=sampling, seed=3,
                            kv_scales=kv_scales)

    for fmt in ("fp8_e4m3", "int8"):
        ref = run(None, fmt)
        # KV heads (2) over data; over tensor; the GPU kernel (interpret mode) on its split pool with scale pages
        for shape, impl in (((2, 4, 1), "auto"), ((2, 2, 2), "auto"), ((2, 2, 2), "gpu")):
            got = run(make_mesh(shape), fmt, impl)
            np.testing.assert_array_equal(got.tokens, ref.tokens, err_msg=f"{fmt} {shape} {impl}")
            # a key a float ulp apart (another reduction order on the mesh) can round to the next code: a step of
            # the format (int8: absmax / 127 of its token) instead of float noise
            np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=5e-3, err_msg=f"{fmt} {shape} {impl}")
            assert got.stats["kv_saturated"] == ref.stats["kv_saturated"], (fmt, shape, impl)
            if fmt != "int8":  # the heads' scales calibrated on the mesh are the one-device ones
                np.testing.assert_allclose(got.kv_scales.k, ref.kv_scales.k, rtol=1e-6)
                np.testing.assert_allclose(got.kv_scales.v, ref.kv_scales.v, rtol=1e-6)
            print(fmt, shape, impl, "OK")
        if fmt != "int8":  # the one-device scales given to the mesh's pool (split over the KV heads) are kept
            got = run(make_mesh((2, 4, 1)), fmt, kv_scales=ref.kv_scales)
            assert got.kv_scales == ref.kv_scales
            np.testing.assert_array_equal(got.tokens, ref.tokens)
    print("OK")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["sharded-engine"]:
        _sharded_engine()


def test_every_config_offers_the_engine_formats():
    """rollout.kv_cache's Literal (typed for --help-config) and generation.kv_cache's names are the engine's
    KV_CACHE_FORMATS, so a format added to the engine cannot be missing from a config."""
    import dataclasses
    import typing

    from lrmq.config_help import NAMES
    from lrmq.evals.config import GenerationSection
    from lrmq.generation.kv_format import KV_CACHE_FORMATS
    from lrmq.rl.config import RolloutSection

    hint = typing.get_type_hints(RolloutSection)["kv_cache"]
    assert typing.get_args(hint) == KV_CACHE_FORMATS
    field = {f.name: f for f in dataclasses.fields(GenerationSection)}["kv_cache"]
    assert tuple(field.metadata[NAMES]) == KV_CACHE_FORMATS
