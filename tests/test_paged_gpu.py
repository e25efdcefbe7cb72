"""The paged KV cache on GPU, without a GPU (lrmq.generation.paged, the "gpu" decode attention).

* JAX's GPU paged attention kernel (Triton), run in Pallas's interpret mode on CPU and called the way the
  engine calls it, equals the "xla" path on an interleaved pool holding the same keys and values: uneven
  lengths, an idle slot (zeros, no NaN), GQA, the page offset of a later layer, f32 and bf16; with a sliding
  window the call takes the XLA path on the same "split" pool.
* The XLA path reads both layouts alike; page copies (copy on write) and writes land on the same entries.
* "auto" takes the kernel for a GPU target where it takes the shapes (power-of-two head_dim / page_size).
* The engine with impl="gpu" gives the tokens and log-probs of impl="xla" (olmo3: a sliding layer on the XLA
  fallback; shared prompts; a pool small enough to preempt).
* The kernel is traced at "highest" precision (Triton would take TF32 for f32 dots otherwise).
* Lowered for a CUDA target from this CPU host, the engine's decode program holds the Triton kernel call (one
  per full-attention layer run): the kernel lowers to Triton IR for the engine's shapes. The kernel compiled to
  PTX for an H200 (JAX's CUDA plugin, no GPU): tests/test_gpu_aot_kernels.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from lrmq.checkpoint.hf import load_hf_model
from lrmq.generation import attention, kv_pool, paged
from lrmq.generation.attention import gpu as attn_gpu
from lrmq.generation.attention import xla as attn_xla
from lrmq.generation.engine import Engine, EngineConfig
from lrmq.generation.sampling import SamplingConfig


def _pools(rng, layers, pages, ps, kvh, d):
    k = rng.normal(size=(layers, pages, ps, kvh, d)).astype(np.float32)
    v = rng.normal(size=(layers, pages, ps, kvh, d)).astype(np.float32)
    inter = np.asarray(kv_pool.interleave(jnp.asarray(k), jnp.asarray(v)))
    split = (np.moveaxis(k, 3, 0), np.moveaxis(v, 3, 0))  # [KVH, L, P, ps, D]
    return inter, split


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_decode_attention_equals_xla(window, dtype):
    rng = np.random.default_rng(0)
    s, h, kvh, d, ps, width, layers, pages = 4, 8, 2, 16, 16, 8, 2, 40
    inter, split = _pools(rng, layers, pages, ps, kvh, d)
    table = rng.permutation(np.arange(1, pages))[: s * width].reshape(s, width).astype(np.int32)
    lengths = np.array([1, 37, 128, 0], np.int32)
    q = rng.normal(size=(s, h, d)).astype(np.float32)
    for layer in (0, 1):
        args = (jnp.asarray(table), jnp.asarray(lengths))
        want = attn_xla.decode_attention_xla(jnp.asarray(q, dtype), jnp.asarray(inter, dtype), layer, *args, window,
                                          block_pages=2)
        got = attn_gpu.decode_attention_gpu(jnp.asarray(q, dtype), tuple(jnp.asarray(x, dtype) for x in split), layer,
                                         *args, window)
        assert got.dtype == dtype and got.shape == (s, h, d)
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.isfinite(got).all() and np.all(got[3] == 0)
        np.testing.assert_allclose(got, want, atol=2e-2 if dtype == jnp.bfloat16 else 2e-5)


def test_xla_path_reads_both_layouts_and_copies_pages():
    rng = np.random.default_rng(1)
    inter, split = _pools(rng, 2, 12, 4, 2, 8)
    table = np.array([[3, 5, 7, 9], [2, 4, 6, 8]], np.int32)
    k1, v1 = kv_pool.read_pages(jnp.asarray(inter), 1, jnp.asarray(table))
    k2, v2 = kv_pool.read_pages(tuple(map(jnp.asarray, split)), 1, jnp.asarray(table))
    np.testing.assert_array_equal(k1, k2)
    np.testing.assert_array_equal(v1, v2)
    src, dst = jnp.asarray([3, 0]), jnp.asarray([10, 0])
    a = kv_pool.copy_pages(jnp.asarray(inter), src, dst)
    b = kv_pool.copy_pages(tuple(map(jnp.asarray, split)), src, dst)
    ka, _ = kv_pool.read_pages(a, 0, jnp.asarray([[10]]))
    kb, _ = kv_pool.read_pages(b, 0, jnp.asarray([[10]]))
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_array_equal(ka[0], inter[0, 3][:, 0::2])


def test_auto_takes_the_gpu_kernel_for_a_gpu_target():
    shape = (2, 9, 16, 4, 64)  # [L, P, page_size, 2*KVH, D]
    assert attention.resolve_impl("auto", 8, shape, jnp.bfloat16) == "xla"  # this CPU host
    with pk.target("gpu"):
        assert attention.resolve_impl("auto", 8, shape, jnp.bfloat16) == "gpu"
        assert attention.resolve_impl("auto", 8, shape[:-1] + (24,), jnp.float32) == "xla"  # head_dim 24
        assert attention.resolve_impl("auto", 8, (2, 9, 8, 4, 64), jnp.float32) == "xla"  # page_size 8
        assert attention.resolve_impl("auto", 8, shape, jnp.int8) == "xla"
    assert attn_gpu.gpu_unsupported(8, (2, 9, 8, 4, 64), jnp.float32) == "page_size 8 (a power of two >= 16)"
    for width, block in ((8, 8), (24, 8), (12, 8), (7, 8), (256, 8), (6, 1)):
        per_block, splits = attn_gpu.gpu_blocks(width, block)
        assert per_block <= block and width % (per_block * splits) == 0 and splits <= attn_gpu.GPU_MAX_K_SPLITS
    assert attn_gpu.gpu_blocks(256, 8) == (8, 16) and attn_gpu.gpu_blocks(24, 8) == (8, 3)


def test_a_pool_of_the_wrong_layout_is_refused():
    cfg = type("Cfg", (), dict(num_layers=1, num_kv_heads=1, head_dim=16, dtype="float32"))()
    cache = paged.PagedCache(kv_pool.new_pool(cfg, 4, 16), jnp.zeros((1, 1), jnp.int32), jnp.ones(1, bool), impl="gpu")
    with pytest.raises(ValueError, match="reads a 'split' pool"):
        cache.attend(jnp.zeros((1, 1, 2, 16)), jnp.zeros((1, 1), jnp.int32), None)


@pytest.mark.slow(reason="the engine compiled three times: XLA, and the GPU kernel at two engine configs")
def test_engine_on_the_gpu_kernel_equals_xla(hf_checkpoint):
    """The GPU kernel (interpreted) gives the XLA path's tokens, at the default pool (shared prompt pages) and at a
    pool that preempts (the XLA path's own independence of the pool: test_generation's scheduling test)."""
    model = load_hf_model(hf_checkpoint("olmo3")[0])  # a full-attention layer on the kernel, a sliding one not
    prompts = [[9, 10, 11, 12, 13, 14, 15], [5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [3], list(range(4, 25))]
    budgets = [30, 9, 22, 5, 26]
    keys = np.asarray(jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(jax.random.key(7), i)))(
        jnp.arange(len(prompts))))
    s = SamplingConfig(temperature=1.3)
    configs = [EngineConfig(page_size=16, block_pages=2),  # the repeated prompt prefilled once, pages shared
               EngineConfig(slots=3, page_size=16, pages=7, sync_steps=8, block_pages=2)]  # a pool that preempts
    runs = {}
    for impl, config in [("xla", configs[0]), ("gpu", configs[0]), ("gpu", configs[1])]:
        eng = Engine(model, eos_ids=[127], pad_id=0, config=dataclasses.replace(config, attention=impl))
        assert eng.resolved_impl() == impl
        res = runs[impl, config.pages] = eng.generate(model, prompts, max_new_tokens=budgets, sampling=s, keys=keys)
        assert res.stats["preempted"] > 0 if config.pages else res.stats["prefilled_prompts"] == 3
    ref = runs["xla", 0]
    assert len(set(ref.lengths.tolist())) > 2
    for res in (runs["gpu", 0], runs["gpu", 7]):
        np.testing.assert_array_equal(res.tokens, ref.tokens)
        np.testing.assert_array_equal(res.lengths, ref.lengths)
        np.testing.assert_allclose(res.logprobs, ref.logprobs, atol=2e-5)


@pytest.mark.parametrize("kv_cache", ["auto", "fp8_e4m3", "int8"])
def test_decode_lowers_to_the_triton_kernel_for_a_gpu_target(hf_checkpoint, kv_cache):
    """The engine's decode program lowered for CUDA (not compiled: no GPU here) reads the split pool through JAX's
    Triton paged attention; a quantized KV cache's pages go to the same kernel with their per-token scale pages
    (fp8 / int8 pages in their own dtype, float32 scales)."""
    from flax import nnx

    from lrmq.generation.kv_format import QUANT_DTYPES
    from lrmq.generation.kv_pool import QuantPool

    model = load_hf_model(hf_checkpoint("olmo3")[0])  # layers: sliding (XLA), full (the kernel)
    eng = Engine(model, eos_ids=[127], pad_id=0, config=EngineConfig(slots=4, page_size=16, kv_cache=kv_cache))
    with pk.target("gpu"):
        assert eng.resolved_impl() == "gpu"
        calls = eng.abstract_calls(nnx.state(model), n_requests=4, prompt_len=16, max_new=64,
                                   sampling=SamplingConfig())
        fn, args = calls["decode"]
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    pool = args[1]
    pages = pool.pages if isinstance(pool, QuantPool) else pool
    assert isinstance(pages, tuple) and pages[0].shape == (2, 2, pages[0].shape[2], 16, 16)  # [KVH, L, P, ps, D]
    assert text.count("__gpu$xla.gpu.triton") == 1 and "paged_attention" in text
    if kv_cache != "auto":
        assert pages[0].dtype == QUANT_DTYPES[kv_cache] and pool.k_token is not None
        assert pool.k_token.shape == pages[0].shape[:-1]  # one scale per token and KV head


def _dot_precisions(jaxpr, out):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(eqn.params["precision"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _dot_precisions(inner, out)
    return out


def test_gpu_kernel_dots_are_full_precision():
    """Triton would take TF32 for f32 dots at the default precision (~1e-3 off): the kernel is traced at
    "highest", so an f32 pool gets IEEE dots as on the XLA path."""
    q, k = jnp.zeros((2, 8, 16)), jnp.zeros((2, 2, 10, 16, 16))
    table, lengths = jnp.zeros((2, 8), jnp.int32), jnp.ones(2, jnp.int32)
    with pk.target("gpu"):
        jaxpr = jax.make_jaxpr(lambda q, pool: attn_gpu.decode_attention_gpu(q, pool, 1, table, lengths, None))(q, (k, k))
    precisions = _dot_precisions(jaxpr.jaxpr, [])
    assert len(precisions) == 2 and all(p == (jax.lax.Precision.HIGHEST,) * 2 for p in precisions)
