"""The GPU kernels compiled for an H200 (sm_90a) on this CPU host, through JAX's CUDA plugin (no GPU, no driver).

* The int4, int8 and NF4 dequant-matmuls (impl="auto" under a one-H200 mesh: the Triton kernel) compile; each
  kernel's PTX (read from the XLA dump: `lrmq.hlo.gpu_kernels`) targets sm_90a and holds tensor-core instructions
  (mma.sync at decode, wgmma at a 128-row prefill tile), its shared memory is within the tile plan's estimate
  (`pallas_kernels.gpu.smem_bytes`), and where NVIDIA's ptxas is on PATH it does not spill.
* The paged decode attention compiles with bf16, int8 and fp8 pages; fp8 pages for an A100 are refused by the
  kernel's own check (the compiler would abort the process).
* A tile the hardware cannot take is refused before the compiler sees it, naming the rule: a 24-wide block
  (Triton's tensors are powers of two), a 256x256x128 bf16 tile (past the H200's 227 KiB of shared memory; XLA would
  fail with RESOURCE_EXHAUSTED).
The full grid (Qwen3 0.6B-8B shapes, every group, H200 / A100 / B200): benchmarks/gpu_aot_kernels.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from lrmq import hlo, targets
from lrmq.generation import kv_pool
from lrmq.generation.attention import gpu as attn_gpu
from lrmq.generation.kv_format import KVFormat
from pallas_kernels import gpu as pk_gpu
from pallas_kernels.target import gpu_of
from test_gpu_compile import _require_plugin


@pytest.fixture(scope="module")
def h200():
    _require_plugin()
    devices = targets.gpu_topology_devices("h200")
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    return mesh, jax.sharding.NamedSharding(mesh, jax.P())


def _compile(mesh, fn, args, dump) -> dict:
    """{kernel name: facts} of `fn` compiled for `mesh`'s GPU."""
    with jax.set_mesh(mesh):
        jax.jit(fn).lower(*args).compile({**targets.compile_options(mesh.devices.flat), "xla_dump_to": str(dump)})
    return hlo.gpu_kernels(str(dump))


def _matmul(fmt, m, k, n, g, sd):
    x = sd((m, k), jnp.bfloat16)
    if fmt == "nf4":
        return (lambda *a: pk.nf4_matmul(*a, g)), (x, sd((n, k // 2), jnp.uint8), sd((n, k // g), jnp.float32))
    rows, fn = (k // 2, pk.int4_matmul) if fmt == "int4" else (k, pk.int8_matmul)
    return fn, (x, sd((rows, n), jnp.uint8), sd((k // g, n), jnp.bfloat16), sd((k // g, n), jnp.uint8))


@pytest.mark.parametrize("fmt,g,m,instruction", [("int4", 128, 16, "mma.sync"), ("int8", 128, 16, "mma.sync"),
                                                 ("nf4", 64, 16, "mma.sync"), ("int4", 128, 256, "wgmma")])
def test_dequant_matmul_compiles_to_tensor_cores_for_sm90a(h200, tmp_path, fmt, g, m, instruction):
    mesh, sharding = h200
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    k = n = 1024
    fn, args = _matmul(fmt, m, k, n, g, sd)
    kernels = _compile(mesh, fn, args, tmp_path)
    name = f"lrmq_{fmt}_matmul_gpu"
    assert name in kernels, sorted(kernels)
    facts = kernels[name]
    assert facts["target"] == "sm_90a"
    assert sum(v for ins, v in facts["tensor_core"].items() if ins.startswith(instruction)) > 0, facts["tensor_core"]
    assert facts["local_bytes"] == 0
    gpu = gpu_of(mesh.devices.flat[0].device_kind)
    t = pk_gpu.choose_tiles(m, k, n, k_unit=g, fmt=fmt, gpu=gpu)
    assert 0 < facts["shared_memory"] <= pk_gpu.smem_bytes(fmt, t.bm, t.bn, t.bk, jnp.bfloat16, 3, gpu)
    info = hlo.ptxas_info(facts["ptx"], "sm_90a", name)
    if info is not None:  # NVIDIA's ptxas is optional: XLA assembles the PTX itself
        assert info["spill_stores"] == 0, info


@pytest.mark.parametrize("pages", ["bfloat16", "int8", "float8_e4m3fn"])
def test_paged_decode_attention_compiles_for_sm90a(h200, tmp_path, pages):
    mesh, sharding = h200
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    slots, heads, kvh, d, ps, width = 4, 16, 8, 128, 16, 8
    n_pages = slots * width + 1
    dt = jnp.dtype(pages)
    kv = (sd((kvh, 1, n_pages, ps, d), dt),) * 2
    if dt == jnp.bfloat16:
        pool = kv
    else:
        scale, token = sd((kvh, 1), jnp.float32), sd((kvh, 1, n_pages, ps), jnp.float32)
        pool = kv_pool.QuantPool(kv, scale, scale, sd((kvh,), jnp.int32), token, token,
                                 fmt=KVFormat("int8" if dt == jnp.int8 else "fp8_e4m3", "split"))
    args = (sd((slots, heads, d), jnp.bfloat16), pool, sd((slots, width), jnp.int32), sd((slots,), jnp.int32))
    fn = lambda q, pool, t, l: attn_gpu.decode_attention_gpu(q, pool, 0, t, l, None)  # noqa: E731
    kernels = _compile(mesh, fn, args, tmp_path)
    [name] = [n for n in kernels if n.startswith("paged_attention")]
    assert kernels[name]["target"] == "sm_90a" and sum(kernels[name]["tensor_core"].values()) > 0
    if dt != jnp.bfloat16:  # int8 / fp8 pages: two pages (32 tokens) per block, where ptxas does not spill
        assert name.endswith("pages_per_compute_block_2")
        a100 = jax.sharding.Mesh(np.array(targets.gpu_topology_devices("a100")), ("d",))
        on_a100 = jax.sharding.NamedSharding(a100, jax.P())
        a_args = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=on_a100), args)
        with jax.set_mesh(a100):
            why = attn_gpu.gpu_unsupported(heads, (1, n_pages, ps, 2 * kvh, d), dt, scaled=True)
            if dt == jnp.int8:
                assert why is None
            else:  # "auto" takes the XLA path; the kernel forced is refused before the compiler aborts
                assert why == "float8_e4m3fn KV pages on the A100 (compute capability 8.0: Triton converts fp8 from 8.9 on)"
                with pytest.raises(ValueError, match=r"decode attention 'gpu' cannot take float8_e4m3fn KV pages"):
                    jax.jit(fn).lower(*a_args)


def test_a_tile_the_gpu_cannot_take_is_refused_before_the_compiler(h200):
    mesh, sharding = h200
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    fn, args = _matmul("int4", 256, 4096, 4096, 128, sd)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="block_m=24: Triton tiles must be powers of two"):
            jax.jit(lambda *a: fn(*a, block_m=24, block_n=24)).lower(*args)
        with pytest.raises(ValueError, match=r"tile 256x256x128 \(block_m x block_n x block_k\) with num_stages=3 and "
                                             r"bfloat16 activations needs ~293 KiB of shared memory per block, past "
                                             r"the H100/H200's 227 KiB"):
            jax.jit(lambda *a: fn(*a, block_m=256, block_n=256, block_k=128)).lower(*args)
    # a default plan is fitted instead: f32 activations at a prefill tile halve bk on the A100 (163 KiB)
    a100 = gpu_of("NVIDIA A100-SXM4-80GB")
    t = pk_gpu.choose_tiles(256, 4096, 4096, k_unit=128, fmt="int8", x_dtype=jnp.float32, gpu=a100)
    assert (t.bm, t.bn, t.bk) == (128, 128, 64)
    assert pk_gpu.smem_bytes("int8", 128, 128, 128, jnp.float32, 3, a100) > a100.smem_per_block
