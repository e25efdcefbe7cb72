"""The paged KV cache on TPU, without a TPU (libtpu compiles ahead of time; lrmq.generation.paged).

* "tpu" decode attention (JAX's ragged paged attention kernel) called the way the engine calls it equals the
  "xla" path on the same pool and page table: uneven lengths, an idle slot (zeros, no NaN), a sliding window,
  GQA, the page offset of a later layer, f32 and bf16. Neither of Pallas's interpret modes runs this kernel on
  CPU in jax 0.10.2, so the kernel is swapped for its own reference (`ref_ragged_paged_attention`), which
  also checks the arguments with the kernel's static and dynamic validators.
* "auto" follows the compile target; the block sizes follow the generation.
* The engine's prefill and decode programs compile for v5e, v5p and v6e with the kernel in them; with fp8 pages
  (kv_cache=fp8_e4m3) the kernel takes them on each generation, and on v5e the decode program's arguments shrink
  by half the bf16 pool (int8 pages compile on the XLA path).
* On an 8-chip v5e slice with FSDP-sharded weights the decode loop moves no weight per token (the stacked
  weights, embedding and lm head are relaid into the tensor-parallel decode layout once per call, before the
  loop), each chip holds 1/8 of the KV pool (KV heads split like the KV projections) and reads 1/8 of the
  weights; without the embedding / lm head layout the check fails.
* The same with packed int4 / NF4 weights (quantized rollouts): the Pallas matmul kernels' shard_map follows the
  decode layout, so no packed weight is gathered per token either.
* On 8 CPU devices the engine with the pool split over KV heads gives the single-device tokens and log-probs, also
  on the GPU kernel's split K/V pool (Pallas interpret mode).
"""

from __future__ import annotations

import dataclasses

import os
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from lrmq.generation import attention, kv_pool  # noqa: E402
from lrmq.generation.attention import tpu as attn_tpu  # noqa: E402
from lrmq.generation.attention import xla as attn_xla  # noqa: E402
from lrmq.generation.kv_format import KVFormat  # noqa: E402

# A tiny Qwen3 the kernel takes (head_dim 128) with 8 KV heads (one per chip of a v5e:2x4), weights far larger
# than any decode activation of 16 slots: a weight gathered per step cannot pass for an activation.
TINY = dict(model_type="qwen3", vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
            max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0)


def _require_libtpu():
    try:
        import libtpu  # noqa: F401
    except ImportError:
        if sys.version_info < (3, 12):
            raise
        pytest.skip("libtpu is not installed (the test extra pins it for Python < 3.12 only)")


# ----------------------------------------------------------------------------------- numerics (CPU)
def _reference_kernel(width):
    rpa = attn_tpu._rpa_module()

    def kernel(q, pages, kv_lens, table, cu_q_lens, num_seqs, *, num_kv_pages_per_block, num_queries_per_block,
               vmem_limit_bytes, **kw):
        blocks = dict(num_kv_pages_per_block=num_kv_pages_per_block, num_queries_per_block=num_queries_per_block,
                      vmem_limit_bytes=vmem_limit_bytes)
        rpa.static_validate_inputs(q, pages, kv_lens, table, cu_q_lens, num_seqs, **kw, **blocks)
        rpa.dynamic_validate_inputs(q, pages, kv_lens, table, cu_q_lens, num_seqs, **kw)
        assert num_kv_pages_per_block <= width and num_queries_per_block <= q.shape[0]
        return rpa.ref_ragged_paged_attention(q, pages, kv_lens, table, cu_q_lens, num_seqs, **kw)

    return kernel


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_decode_attention_equals_xla(monkeypatch, window, dtype):
    rng = np.random.default_rng(0)
    s, h, kvh, d, ps, width, layers = 5, 8, 2, 128, 4, 8, 2  # GQA: 4 query heads per KV head
    lengths = np.array([1, 7, 23, 0, 32], np.int32)  # slot 3 idle; slot 4 fills its table
    pages = 1 + s * width
    table = rng.permutation(np.arange(1, pages)).reshape(s, width).astype(np.int32)
    table[3] = kv_pool.NULL_PAGE
    pool = rng.normal(size=(layers, pages, ps, 2 * kvh, d)).astype(np.float32)
    q = rng.normal(size=(s, h, d)).astype(np.float32)
    monkeypatch.setattr(attn_tpu, "_tpu_kernel", lambda: _reference_kernel(width))
    for layer in range(layers):  # the later layer reads its pages through the offset table
        args = (jnp.asarray(q, dtype), jnp.asarray(pool, dtype), layer, jnp.asarray(table), jnp.asarray(lengths),
                window)
        want = np.asarray(attn_xla.decode_attention_xla(*args, block_pages=2), np.float32)
        got = np.asarray(attn_tpu.decode_attention_tpu(*args), np.float32)
        assert np.all(np.isfinite(got)) and np.all(got[3] == 0)
        np.testing.assert_allclose(got, want, atol=2e-6 if dtype == jnp.float32 else 2e-2)


def test_auto_follows_the_compile_target():
    shape = (2, 9, 16, 16, 128)  # [L, P, page_size, 2 * KVH, D]
    assert attention.resolve_impl("auto", 16, shape, jnp.bfloat16) == "xla"  # this CPU host
    with pk.target("tpu", "TPU v5 lite"):
        assert attention.resolve_impl("auto", 16, shape, jnp.bfloat16) == "tpu"
        assert attention.resolve_impl("auto", 16, shape[:-1] + (32,), jnp.bfloat16) == "xla"  # head_dim 32
        assert attention.resolve_impl("xla", 16, shape, jnp.bfloat16) == "xla"
    with pk.target("gpu"):  # JAX's GPU paged attention (tests/test_paged_gpu.py)
        assert attention.resolve_impl("auto", 16, shape, jnp.bfloat16) == "gpu"
    with pytest.raises(ValueError, match="splash"):
        attention.resolve_impl("splash", 16, shape, jnp.bfloat16)


def test_tpu_block_sizes_follow_the_generation():
    small = dict(q_heads=16, pool_shape=(28, 999, 16, 16, 128), dtype=jnp.bfloat16, width=72, slots=256)
    for kind, vmem in (("TPU v5 lite", 96), ("TPU v5", 48), ("TPU v6 lite", 96)):
        assert attn_tpu.tpu_block_sizes(kind, **small) == (16, 32, vmem << 20)  # 16 pages of 16 tokens
    assert attn_tpu.tpu_block_sizes("TPU v5 lite", **dict(small, width=8, slots=4))[:2] == (8, 4)
    big = dict(small, pool_shape=(28, 99, 256, 16, 128))  # 1 MiB pages: VMEM decides
    assert attn_tpu.tpu_block_sizes("TPU v5", **big)[0] == 6 and attn_tpu.tpu_block_sizes("TPU v6 lite", **big)[0] == 12


def test_pool_heads_split_like_the_kv_projections():
    from jax.sharding import AbstractMesh

    mesh = lambda d, f, t: AbstractMesh((d, f, t), ("data", "fsdp", "tensor"))  # noqa: E731
    assert kv_pool.kv_head_axes(mesh(1, 8, 1), 8) == ("fsdp",)
    assert kv_pool.kv_head_axes(mesh(4, 8, 1), 8) == ("fsdp",)  # v5p-64: 32 chips, 8 KV heads
    assert kv_pool.kv_head_axes(mesh(2, 2, 2), 8) == ("tensor", "fsdp")  # as the KV projections (DECODE_RULES)
    assert kv_pool.kv_head_axes(mesh(2, 4, 1), 2) == ("data",)  # they are whole (4 does not divide 2): data
    assert kv_pool.kv_head_axes(mesh(2, 2, 2), 2) == ("tensor",)
    assert kv_pool.kv_head_axes(mesh(1, 8, 1), 2) == ()  # no axis divides: the pool stays whole
    # the pages over the data axes left: each data group holds its own rows' pages
    assert kv_pool.pool_spec(mesh(2, 2, 2), 8) == jax.sharding.PartitionSpec(None, "data", None, ("tensor", "fsdp"), None)
    assert kv_pool.kv_page_axes(mesh(2, 4, 1), 8) == ("data",) and kv_pool.kv_groups(mesh(2, 4, 1), 8) == 2
    assert kv_pool.kv_page_axes(mesh(1, 8, 1), 2) == ("fsdp",)  # heads whole: 8 groups of pages
    assert kv_pool.kv_page_axes(mesh(1, 8, 1), 8) == () and kv_pool.kv_groups(None, 8) == 1
    assert [kv_pool.decode_fsdp(8, 8, kv, "tpu") for kv in ("auto", "fp8_e4m3", "int8")] == [8, 4, 8]
    assert kv_pool.decode_fsdp(8, 8, "fp8_e4m3", "gpu") == 8


# ----------------------------------------------------------------------------- TPU compiles (libtpu)
def _compile(topology, mesh_shape, *, slots=16, pack=None, kv_cache="auto", programs=("prefill", "decode")):
    from lrmq import aot
    from lrmq.generation.engine import EngineConfig
    from lrmq.generation.sampling import SamplingConfig
    from lrmq.model.config import ModelConfig
    from lrmq.sharding import MeshConfig, make_mesh

    cfg = ModelConfig.from_hf_dict(dict(TINY), dtype="bfloat16", param_dtype="bfloat16")
    devices = list(aot.topology_devices(topology))[:int(np.prod(mesh_shape))]
    mesh = make_mesh(MeshConfig(*mesh_shape), devices=devices)
    graphdef, state = aot.abstract_model(cfg, mesh, pack=pack)
    return aot.compile_generate(graphdef, state, mesh, model_cfg=cfg, requests=slots, prompt_len=64, max_new=64,
                                engine=EngineConfig(slots=slots, sync_steps=4, kv_cache=kv_cache),
                                sampling=SamplingConfig(), programs=programs), state


_ONE_CHIP: dict = {}  # (topology, kv_cache) -> {program: (compiled, s)}: v5e's bf16 and fp8 decode serve two tests


def _compile_one_chip(topology, kv_cache="auto", programs=("decode",)):
    """`_compile`'s programs on one chip of `topology` with 8 slots and `kv_cache` pages, cached for the module (one
    xdist worker runs the file)."""
    _require_libtpu()
    have = _ONE_CHIP.setdefault((topology, kv_cache), {})
    missing = tuple(p for p in programs if p not in have)
    if missing:
        have.update(_compile(topology, (1, 1, 1), slots=8, kv_cache=kv_cache, programs=missing)[0])
    return have


@pytest.mark.parametrize("gen", ["v5e", "v5p", "v6e"])
def test_engine_programs_compile_with_the_kernel(gen):
    topology = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}[gen]
    programs = _compile_one_chip(topology, "auto", ("prefill", "decode"))
    assert "ragged_paged_attention" in programs["decode"][0].as_text()
    assert all("tpu_custom_call" in c.as_text() for c, _ in programs.values())  # prefill: splash attention


@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])  # v5p / v6e: the decode program, ~5 s
def test_the_tpu_kernel_compiles_on_fp8_pages(topology):
    """libtpu (ahead of time, from this CPU host) takes fp8 pages in the ragged paged attention kernel, at the
    static scales 1.0. On v5e the whole engine (prefill writes fp8 pages too, through XLA); on v5p and v6e the
    decode program, the one with the kernel (their prefill's splash kernel compiles in the test above)."""
    programs = ("prefill", "decode") if topology == "v5e:2x2" else ("decode",)
    compiled = _compile_one_chip(topology, "fp8_e4m3", programs)
    text = compiled["decode"][0].as_text()
    assert "ragged_paged_attention" in text and "f8e4m3fn" in text


def test_the_fp8_pool_is_half_the_bf16_pool_on_tpu():
    """The v5e decode program's arguments shrink by half the bf16 pool (less the scales); int8 compiles on the
    XLA path (the kernel does not take it). The bf16 and fp8 programs are the two tests' above (one process:
    the file's module cache), so this compiles the int8 one only."""
    from lrmq.generation.engine import EngineConfig, call_sizes
    from lrmq.model.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(dict(TINY), dtype="bfloat16", param_dtype="bfloat16")
    def size(kv):
        return _compile_one_chip("v5e:2x2", kv)["decode"][0].memory_analysis().argument_size_in_bytes

    pages = call_sizes(EngineConfig(slots=8, sync_steps=4), cfg, None, 8, 64, 64)[1]
    saved = pages * kv_pool.page_bytes(cfg, 16, fmt=KVFormat("fp8_e4m3"))  # half the bf16 pool (fp8: 1 byte an entry)
    assert abs((size("auto") - size("fp8_e4m3")) - saved) < 0.01 * saved
    assert "ragged_paged_attention" not in _compile_one_chip("v5e:2x2", "int8")["decode"][0].as_text()


def _weight_collectives_in_loop(compiled, state):
    """(collectives in the decode loop moving at least a weight matrix's decode-layout share (1/8 of the
    smallest; matrices: the 2-D arrays of 64 KiB or more, float kernels or packed codes, not the group scales),
    bytes the collectives outside the loop move, the collectives in the loop)."""
    from lrmq.hlo import Module, decode_loop

    leaves = [x for x in jax.tree.leaves(state) if len(x.shape) >= 2 and x.size * x.dtype.itemsize >= 64 << 10]
    smallest = min(x.size * x.dtype.itemsize for x in leaves) // 8
    module = Module(compiled.as_text())
    loop = decode_loop(module)
    inside = [c for part in ("body", "condition") for c in module.collectives(loop.attr(part))]
    heavy = [c for c in inside if c["bytes"] >= smallest]
    in_loop = {(c["computation"], c["name"]) for c in inside}
    outside = sum(c["bytes"] for c in module.collectives(module.entry) if (c["computation"], c["name"]) not in in_loop)
    return heavy, outside, inside


def test_decode_on_a_slice_gathers_weights_once_per_call_and_splits_the_pool(monkeypatch):
    """v5e:2x4, mesh fsdp=8 (the paper-1 recipes' layout): the Mosaic kernel under shard_map, no weight-sized
    collective in the decode loop, the weights relaid before it, each chip 1/8 of the pool."""
    _require_libtpu()
    from jax.sharding import PartitionSpec as P

    from lrmq.aot import memory_report
    from lrmq.generation import engine

    # decode only: the bf16 prefill (splash) on this slice compiles in test_aot.py::test_paper_recipe_0_6b_fits_v5e_8
    programs, state = _compile("v5e:2x4", (1, 8, 1), programs=("decode",))
    decode = programs["decode"][0]
    assert "ragged_paged_attention" in decode.as_text()
    heavy, outside, inside = _weight_collectives_in_loop(decode, state)
    assert not heavy, heavy
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert outside >= weights / 16, "expected the weights' relayout (FSDP -> tensor parallel) before the loop"
    assert inside and all(c["bytes"] < 64 << 10 for c in inside)  # activations of 16 slots only
    # the pool: KV heads over fsdp; arguments = its 1/8 + the weights' FSDP shards + per-slot inputs
    pool = jax.tree.leaves(decode.args_info)[len(jax.tree.leaves(state))]
    assert decode.input_shardings[0][1].spec == P(None, None, None, "fsdp", None)
    pool_bytes = int(np.prod(pool.shape)) * pool.dtype.itemsize
    assert memory_report(decode)["arguments"] < (pool_bytes + weights) / 8 + (1 << 20)

    # the check has teeth: lay out the layer runs only (not the embedding / lm head) and the lm head is
    # gathered in the loop, every step
    monkeypatch.setattr(engine, "decode_layout", _runs_only_layout)
    programs, state = _compile("v5e:2x4", (1, 8, 1), programs=("decode",))
    heavy, _, _ = _weight_collectives_in_loop(programs["decode"][0], state)
    assert heavy, "a per-step lm head gather should have been found"


@pytest.mark.parametrize("pack", ["int4", "nf4"])
@pytest.mark.slow(reason="TPU AOT compiles of the packed decode programs on a v5e:2x4 slice (int4: 26-30 s)")
def test_packed_decode_on_a_slice_keeps_weights_split(monkeypatch, pack):
    """Quantized rollouts on v5e:2x4: the packed kernels' shard_map follows the decode layout (the weights split
    over tensor x fsdp, activations gathered), so no packed weight is gathered in the loop; each chip holds 1/8
    of the packed bytes. Under the training rules (fsdp = a batch axis) every packed Linear was gathered per
    token."""
    _require_libtpu()
    from lrmq.aot import memory_report

    # prefill too: the packed kernels' prefill on a slice compiles nowhere else
    programs, state = _compile("v5e:2x4", (1, 8, 1), pack=pack)
    decode = programs["decode"][0]
    text = decode.as_text()
    assert "ragged_paged_attention" in text and text.count("tpu_custom_call") > 2  # the packed matmul kernels
    heavy, _, inside = _weight_collectives_in_loop(decode, state)
    assert not heavy, heavy
    assert all(c["bytes"] < 64 << 10 for c in inside)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    pool = jax.tree.leaves(decode.args_info)[len(jax.tree.leaves(state))]
    pool_bytes = int(np.prod(pool.shape)) * pool.dtype.itemsize
    assert memory_report(decode)["arguments"] < (pool_bytes + weights) / 8 + (1 << 20)
    if pack == "nf4":
        return
    # teeth: traced under the training rules (the engine not declaring its decode rules), the kernels' shard_map
    # gathers every packed weight over fsdp, in the loop
    import contextlib

    from lrmq.generation import engine

    monkeypatch.setattr(engine, "use_rules", lambda rules: contextlib.nullcontext())
    programs, state = _compile("v5e:2x4", (1, 8, 1), pack=pack, programs=("decode",))
    heavy, _, _ = _weight_collectives_in_loop(programs["decode"][0], state)
    assert heavy, "per-step gathers of the packed weights should have been found"


def _runs_only_layout(mesh):
    from lrmq.generation.engine import DECODE_RULES, constrain_state, layer_runs

    return lambda model: [run.replace(state=constrain_state(run.state, mesh, DECODE_RULES, stacked=True))
                          for run in layer_runs(model.layers)]


# ------------------------------------------------------------------- 8 CPU devices (numerics, sharded)
@pytest.mark.slow(reason="an 8-CPU-device subprocess compiling the sharded engine and the single-device one")
def test_sharded_engine_matches_one_device(multi_device_run):
    out = multi_device_run("test_paged_tpu.py", "sharded-engine", n_devices=8, timeout=900)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def _sharded_engine() -> None:
    from lrmq.checkpoint.load import load_model
    from lrmq.generation.engine import Engine, EngineConfig
    from lrmq.generation.sampling import SamplingConfig
    from lrmq.sharding import make_mesh, shard_model

    assert len(jax.devices()) == 8
    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lrmq", "assets", "tiny")
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [3], [5, 6, 7], [20, 21, 22, 23, 24]] * 2
    config = EngineConfig(slots=8, page_size=4, sync_steps=8)
    sampling = SamplingConfig(temperature=1.0)

    def run(mesh, impl="auto"):
        model = load_model(tiny)
        if mesh is not None:
            with jax.set_mesh(mesh):
                model = shard_model(model, mesh)
        eng = Engine(model, eos_ids=[271], pad_id=0, config=dataclasses.replace(config, attention=impl), mesh=mesh)
        return eng.generate(model, prompts, max_new_tokens=[12, 30, 7, 30, 20] * 2, sampling=sampling, seed=3)

    ref = run(None)
    # KV heads (2) over data, pages over fsdp's 4 data groups; heads over tensor, pages over data x fsdp (rows
    # there too); heads whole, pages over 8 groups; the GPU kernel (interpret mode) on its split K/V pool, heads
    # over tensor under the same shard_map
    for shape, impl in (((2, 4, 1), "auto"), ((2, 2, 2), "auto"), ((1, 8, 1), "auto"), ((2, 2, 2), "gpu")):
        mesh = make_mesh(shape)
        got = run(mesh, impl)
        np.testing.assert_array_equal(got.lengths, ref.lengths, err_msg=str(shape))
        np.testing.assert_array_equal(got.tokens, ref.tokens, err_msg=str(shape))
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4, err_msg=str(shape))
        assert got.stats["preempted"] == ref.stats["preempted"] == 0, got.stats
        print(shape, "pool heads over", kv_pool.kv_head_axes(mesh, 2), "pages over", kv_pool.kv_page_axes(mesh, 2))
    print("OK")


if __name__ == "__main__":
    if sys.argv[1:] == ["sharded-engine"]:
        _sharded_engine()
