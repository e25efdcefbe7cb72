"""The GPU checks the docs list as pending, in one command for a lent GPU (written for an H200).

    python3 benchmarks/gpu_check.py --out "$OUT"              # everything, within --budget seconds
    python3 benchmarks/gpu_check.py --part kernels --json k.json   # one part (what the driver runs)

Parts, each in its own process with a timeout (a part that fails or hangs loses only itself):

1. env: GPU, driver, jax / jaxlib / plugin / triton versions, cuDNN version, and the measured
   device-to-device copy bandwidth (the ceiling the rooflines should be read against).
2. (together; the device's memory is not preallocated so they share it)
   kernels: the pallas_kernels Triton kernels compiled and run on the GPU (interpret=False) vs the
     f32 reference computed on the host CPU: every case of tests/test_kernels.py (same inputs, same
     rigorous bound) plus model-sized shapes; impl="auto" resolving to the kernel; the gradient and
     public-API tests of tests/test_kernels.py called as they are (on a GPU they run the kernel).
   attention: the cuDNN path of lrmq.model.attention (values and q/k/v gradients) vs the dense
     reference `decoder.attend` and vs the blockwise XLA path, with the test's tolerance, and the
     compiled program checked for a cuDNN call.
   paged: JAX's Triton paged attention as lrmq.generation.paged calls it vs the XLA path, at the
     test's shapes and at model-sized ones (bf16, f32; int8 / fp8 pages with scale pages).
   pytest_paged: tests/test_paged_gpu.py on the GPU (its one CPU-host assertion deselected); there
     the kernel runs compiled, the engine included.
3. int4: `benchmarks/int4_matmul.py --out <out>/int4_h200` (the documented full sweep), alone.
4. bench (alone, if time is left): GPU paged decode vs the XLA path, cuDNN vs blockwise XLA
   attention (forward + backward), and a small tile sweep of the int4 kernel at decode.

Writes <out>/gpu_check.json (every part's results, machine and date), <out>/gpu_check.md (summary),
<out>/parts_log.txt (each part's output) and the sweep's int4_h200.{json,md}; prints the summary last.
`--smoke` runs the same on a CPU with tiny shapes (kernels interpreted, cuDNN's call through its XLA
implementation, no pytest): it checks this script, not a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TESTS = os.path.join(REPO, "tests")
# --smoke (CPU, this script's own check): tiny shapes, Pallas interpret mode, the cuDNN call's XLA implementation
SMOKE = os.environ.get("GPU_CHECK_SMOKE") == "1"
sys.path.insert(0, HERE)
from common import time_dispatched  # noqa: E402


def _now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _err(e: BaseException) -> str:
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    keep = [ln for ln in text.splitlines() if "JAX has removed its internal frames" not in ln
            and set(ln.strip()) != {"-"}]
    return "\n".join(keep)[-3000:]


def _first_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    # the exception line of a traceback: the last line that starts at column 0 and names an Error / Exception
    for ln in reversed(lines):
        if not ln.startswith(" ") and ("Error" in ln.split(":")[0] or "Exception" in ln.split(":")[0]):
            return ln[:300]
    return (lines[-1] if lines else "")[:300]


class Checks:
    """Named checks of one part: each runs in a try, records pass / fail, numbers and the error."""

    def __init__(self, out: dict):
        self.out = out
        out.setdefault("checks", [])

    def run(self, name, fn, *args, **kw):
        t0 = time.perf_counter()
        rec = dict(name=name)
        try:
            res = fn(*args, **kw)
            if isinstance(res, dict):
                rec.update(res)
            rec.setdefault("passed", True)
        except Exception as e:  # noqa: BLE001 - recorded
            rec.update(passed=False, error=_err(e))
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        self.out["checks"].append(rec)
        status = "PASS" if rec["passed"] else "FAIL"
        extra = "" if rec["passed"] else "  " + _first_line(rec.get("error", "") or rec.get("why", ""))
        print(f"[{status}] {name} ({rec['seconds']} s){extra}", flush=True)
        return rec


# --------------------------------------------------------------------------------------------- env
def part_env(out):
    import jax
    import jax.numpy as jnp

    info = dict(python=platform.python_version(), host=platform.node(), jax=jax.__version__,
                backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
                device_kind=jax.devices()[0].device_kind)
    try:
        import jaxlib

        info["jaxlib"] = jaxlib.__version__
    except Exception as e:  # noqa: BLE001
        info["jaxlib"] = repr(e)
    try:
        from importlib import metadata

        info["packages"] = {p: _version(metadata, p) for p in (
            "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "triton", "flax", "torch",
            "transformers", "nvidia-cudnn-cu13", "numpy")}
    except Exception as e:  # noqa: BLE001
        info["packages"] = repr(e)
    try:
        from jax._src.lib import cuda_versions

        info["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception as e:  # noqa: BLE001
        info["cudnn"] = repr(e)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,"
                              "clocks.max.sm,power.limit", "--format=csv"], capture_output=True, text=True,
                             timeout=30)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except Exception as e:  # noqa: BLE001
        info["nvidia_smi"] = repr(e)
    out["info"] = info
    print(json.dumps(info, indent=1), flush=True)
    checks = Checks(out)

    def copy_bandwidth():
        n = 1 << (20 if SMOKE else 30)  # 1 Gi bf16 elements: 2 GiB read + 2 GiB written per call
        a = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
        f = jax.jit(lambda x: x * 2)
        t = time_dispatched(f, a, warmup=2, iters=10, reps=3)
        return dict(bytes_per_call=4 * n, seconds=t, GBps=4 * n / t / 1e9)

    rec = checks.run("copy bandwidth (2 GiB bf16 read + written)", copy_bandwidth)
    if rec["passed"]:
        out["copy_GBps"] = rec["GBps"]


def _version(metadata, name):
    try:
        return metadata.version(name)
    except Exception:  # noqa: BLE001
        return None


# ----------------------------------------------------------------------------------------- kernels
# model-sized shapes with the default (untuned) tiles: decode and prefill M, 16-bit and f32 activations
# (format, M, K, N, group (K: per-channel), activation dtype)
MODEL_KERNEL_CASES = [("int4", m, 4096, 4096, 128, "bfloat16") for m in (1, 16, 256)] + [
    ("int4", 16, 4096, 14336, 64, "float32"), ("int4", 1, 14336, 4096, 128, "bfloat16"),
    ("int4", 16, 4096, 4096, 4096, "bfloat16"),  # per-channel
    ("int8", 1, 4096, 4096, 4096, "bfloat16"), ("int8", 64, 4096, 4096, 128, "bfloat16"),
    ("nf4", 1, 4096, 4096, 64, "bfloat16"), ("nf4", 128, 4096, 4096, 64, "float32")]
SMOKE_KERNEL_CASES = [("int4", 1, 512, 256, 128, "bfloat16"), ("nf4", 16, 256, 128, 64, "float32")]


def part_kernels(out):
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, TESTS)
    import test_kernels as tk  # its cases, inputs and bound

    from pallas_kernels import dispatch as pk
    from pallas_kernels import reference as ref

    cpu = jax.devices("cpu")[0]
    checks = Checks(out)

    def resolves():
        got = pk.resolve_impl("auto")
        return dict(passed=got == ("gpu", False), resolved=list(got))

    checks.run("resolve_impl('auto') == ('gpu', False)", resolves)

    def on_cpu(fn, *args):
        with jax.default_device(cpu):
            return fn(*jax.device_put(args, cpu))

    def compare(fmt, x, q, g, kw):
        """The GPU kernel, compiled, vs the f32 reference on the host CPU, under the test's bound."""
        kernel = tk._kernel(fmt, "gpu")
        if fmt == "int4":
            y = kernel(x, *q, g, interpret=SMOKE, **kw)
            y_ref = on_cpu(lambda x, c, s, z: ref.int4_matmul_reference(x, c, s, z, g), x, *q)
            w = on_cpu(lambda c, s, z: ref.dequantize_int4(c, s, z, g), *q)
        elif fmt == "int8":
            y = kernel(x, *q, interpret=SMOKE, **kw)
            y_ref = on_cpu(ref.int8_matmul_reference, x, *q)
            w = on_cpu(ref.dequantize_int8, *q)
        else:
            y = kernel(x, *q, g, interpret=SMOKE, **kw)
            y_ref = on_cpu(lambda x, c, a: ref.nf4_matmul_reference(x, c, a, g), x, *q)
            w = on_cpu(lambda c, a: ref.dequantize_nf4(c, a, g).T, *q)
        y = np.asarray(jax.device_get(y), np.float64)
        y_ref64 = np.asarray(jax.device_get(y_ref), np.float64)
        assert y.shape == y_ref64.shape, (y.shape, y_ref64.shape)
        x_host = jax.device_put(x, cpu)
        tol = tk._bound(x_host, np.asarray(w), y_ref)
        err = np.abs(y - y_ref64)
        ratio = float(np.max(err / tol)) if err.size else 0.0
        rel = float(np.linalg.norm(y - y_ref64) / max(np.linalg.norm(y_ref64), 1e-30))
        return dict(passed=bool(np.isfinite(y).all() and ratio <= 1.0), max_abs_err=float(err.max()),
                    max_err_over_bound=ratio, rel_err=rel, dtype=str(x.dtype))

    def case(fmt, m, k, n, g, dtype, kw):
        if fmt == "int4":
            x, c, s, z, _ = tk._int4_inputs(m, k, n, g, dtype)
            return compare(fmt, x, (c, s, z), g, kw)
        if fmt == "int8":
            x, c, s, z = tk._int8_inputs(m, k, n, g, dtype)
            return compare(fmt, x, (c, s, z), None, kw)
        x, c, a, _ = tk._nf4_inputs(m, k, n, dtype)
        return compare(fmt, x, (c, a), 64, kw)

    name = lambda fmt, m, k, n, g, dtype, kw: (  # noqa: E731
        f"{fmt} gpu kernel M={m} K={k} N={n} g={g} {jnp.dtype(dtype).name} {kw or ''}")
    cut = 1 if SMOKE else None
    for m, k, n, g, dtype, kw in tk.INT4_CASES[:cut]:
        kw = tk._overrides(kw, "gpu")
        checks.run("test case: " + name("int4", m, k, n, g, dtype, kw), case, "int4", m, k, n, g, dtype, kw)
    for m, k, n, g, dtype, kw in tk.INT8_CASES[:cut]:
        kw = tk._overrides(kw, "gpu")
        checks.run("test case: " + name("int8", m, k, n, g, dtype, kw), case, "int8", m, k, n, g, dtype, kw)
    for m, k, n, dtype, kw in tk.NF4_CASES[:cut]:
        kw = tk._overrides(kw, "gpu")
        checks.run("test case: " + name("nf4", m, k, n, 64, dtype, kw), case, "nf4", m, k, n, 64, dtype, kw)

    for fmt, m, k, n, g, dtype in (SMOKE_KERNEL_CASES if SMOKE else MODEL_KERNEL_CASES):
        dtype = jnp.dtype(dtype)
        checks.run("model shape: " + name(fmt, m, k, n, g, dtype, {}), case, fmt, m, k, n, g, dtype, {})

    def bf16_scales_auto():
        """The sweep's call: int4 g128 with bf16 scales through the public API, impl='auto'."""
        x, c, s, z, _ = tk._int4_inputs(16, 512 if SMOKE else 4096, 256 if SMOKE else 4096, 128, jnp.bfloat16)
        s = s.astype(jnp.bfloat16)
        y = jax.jit(lambda *a: pk.int4_matmul(*a, 128, impl="auto"))(x, c, s, z)
        y_ref = on_cpu(lambda x, c, s, z: ref.int4_matmul_reference(x, c, s, z, 128), x, c, s, z)
        y, y_ref = np.asarray(y, np.float64), np.asarray(y_ref, np.float64)
        rel = float(np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref))
        return dict(passed=rel < 1e-2, rel_err=rel)

    checks.run("int4 g128 bf16 scales, public API impl='auto' (rel. err < 1e-2)", bf16_scales_auto)
    # the test functions whose kernel calls resolve to the compiled kernel on a GPU, called as they are
    for fmt in ("int4",) if SMOKE else ("int4", "int8", "nf4"):
        for dtype in (jnp.bfloat16, jnp.float32):
            checks.run(f"test_grad_wrt_x_matches_reference[{fmt}, gpu, {jnp.dtype(dtype).name}]",
                       tk.test_grad_wrt_x_matches_reference, fmt, "gpu", dtype)
    checks.run("test_public_api_batch_dims_and_jit[auto]", tk.test_public_api_batch_dims_and_jit, "auto")
    checks.run("test_no_gradient_into_frozen_quantized_base (auto)", tk.test_no_gradient_into_frozen_quantized_base)


# --------------------------------------------------------------------------------------- attention
ATTN_CASES = [  # (name, dtype, B, T, H, KVH, D, window, padding)
    ("bf16 padded GQA T=150 D=16", "bfloat16", 2, 150, 4, 2, 16, None, True),
    ("bf16 padded GQA window 20", "bfloat16", 2, 150, 4, 2, 16, 20, True),
    ("f16 causal T=256 D=64", "float16", 1, 256, 8, 8, 64, None, False),
    ("bf16 padded GQA T=512 D=128 window 64", "bfloat16", 2, 512, 8, 2, 128, 64, True),
    ("bf16 padded GQA T=1000 D=128", "bfloat16", 2, 1000, 16, 8, 128, None, True),
]


def part_attention(out):
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, TESTS)
    import test_attention as ta  # its inputs and tolerance

    from lrmq.model.attention import attention, choose_impl
    from lrmq.model.decoder import attend

    checks = Checks(out)
    if SMOKE:  # no cuDNN on a CPU: the same call through jax.nn.dot_product_attention's XLA implementation
        from lrmq.model import attention as attn_mod

        rolled = attn_mod._rolled_dot_product_attention
        attn_mod._rolled_dot_product_attention = lambda *a: rolled(*a[:-1], "xla")

    def one(dtype, b, t, h, kvh, d, window, padding):
        dtype = jnp.dtype(dtype)
        q, k, v, pos, _, ct = ta._inputs(b, t, h, kvh, d, dtype, padding=padding)
        path = choose_impl("auto", q.shape, k.shape, dtype, self_attn=True, segments=False)
        cud = lambda q, k, v: attention(q, k, v, pos, pos, window, None, impl="cudnn")  # noqa: E731
        xla = lambda q, k, v: attention(q, k, v, pos, pos, window, None, impl="xla")  # noqa: E731
        dense = lambda q, k, v: attend(q, k, v, pos, pos, window)  # noqa: E731
        vg = lambda f: jax.jit(lambda *a: ta._value_and_grads(f, *a))  # noqa: E731
        hlo = vg(cud).lower(q, k, v, ct).compile().as_text()
        got = vg(cud)(q, k, v, ct)
        res = dict(auto_path=list(path), cudnn_in_hlo="cudnn" in hlo.lower())
        worst = 0.0
        for ref_name, f in (("dense", dense), ("xla", xla)):
            want = vg(f)(q, k, v, ct)
            for part, g, w in zip(("out", "dq", "dk", "dv"), [got[0], *got[1]], [want[0], *want[1]]):
                g32, w32 = np.asarray(g, np.float32), np.asarray(w, np.float32)
                scale = max(float(np.abs(w32).max()), 1.0)
                e = float(np.abs(g32 - w32).max()) / scale
                res[f"{part}_vs_{ref_name}"] = e
                if not np.isfinite(g32).all():
                    res[f"{part}_nonfinite"] = True
                    e = math.inf
                worst = max(worst, e)
        res["worst_err_over_scale"] = worst
        res["passed"] = bool(worst <= 2e-2 and tuple(path) == ("cudnn", False) and res["cudnn_in_hlo"])
        return res

    for name, *case in ATTN_CASES[:1] if SMOKE else ATTN_CASES:
        checks.run(f"cudnn attention vs dense and xla: {name}", one, *case)


# ------------------------------------------------------------------------------------------- paged
# (slots, heads, KV heads, head_dim, page_size, page-table width, dtype, layer, quantized pages)
PAGED_CASES = [(32, 32, 8, 128, 16, 128, dt, layer, None) for dt in ("bfloat16", "float32") for layer in (0, 1)] + [
    (8, 16, 16, 64, 32, 32, "bfloat16", 1, None),  # no GQA, page 32
    (16, 32, 8, 128, 16, 64, "bfloat16", 1, "int8"), (16, 32, 8, 128, 16, 64, "bfloat16", 1, "fp8_e4m3")]
SMOKE_PAGED_CASES = [(4, 8, 2, 16, 16, 4, "float32", 1, None), (4, 8, 2, 16, 16, 4, "bfloat16", 1, "int8")]


def _paged_inputs(s, h, kvh, d, ps, width, layers, dtype, seed=0, lengths=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    pages = s * width + 1
    key = jax.random.key(seed)
    kk, kv, kq = jax.random.split(key, 3)
    k = jax.random.normal(kk, (kvh, layers, pages, ps, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (kvh, layers, pages, ps, d), jnp.float32).astype(dtype)
    q = jax.random.normal(kq, (s, h, d), jnp.float32).astype(dtype)
    rng = np.random.default_rng(seed)
    table = jnp.asarray(rng.permutation(np.arange(1, pages))[: s * width].reshape(s, width).astype(np.int32))
    if lengths is None:
        lengths = rng.integers(1, width * ps + 1, s)
        lengths[0], lengths[-1] = 0, width * ps  # an idle slot and a full one
    return q, (k, v), table, jnp.asarray(lengths, jnp.int32)


def part_paged(out):
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, TESTS)
    from lrmq.generation import attention, kv_format, kv_pool
    from lrmq.generation.attention import gpu as attn_gpu
    from lrmq.generation.attention import xla as attn_xla

    checks = Checks(out)

    def compare(s, h, kvh, d, ps, width, dtype, layer, window=None, quant=None):
        dtype = jnp.dtype(dtype)
        q, (k, v), table, lengths = _paged_inputs(s, h, kvh, d, ps, width, 2, jnp.float32)
        if quant is None:
            pool = (k.astype(dtype), v.astype(dtype))
            ref_pool = pool
        else:  # int8 / fp8 pages with per-token scale pages, as the engine's QuantPool holds them
            qdt = kv_format.QUANT_DTYPES[quant]
            qmax = 127.0 if quant == "int8" else float(jnp.finfo(qdt).max)
            ks = jnp.max(jnp.abs(k), -1) / qmax
            vs = jnp.max(jnp.abs(v), -1) / qmax
            kq = jnp.clip(k / ks[..., None], -qmax, qmax)
            vq = jnp.clip(v / vs[..., None], -qmax, qmax)
            if quant == "int8":
                kq, vq = jnp.round(kq), jnp.round(vq)
            kq, vq = kq.astype(qdt), vq.astype(qdt)
            kvh_, layers = k.shape[:2]
            pool = kv_pool.QuantPool(pages=(kq, vq), k_scale=jnp.ones((kvh_, layers)),
                                     v_scale=jnp.ones((kvh_, layers)), saturated=jnp.zeros((kvh_,), jnp.int32),
                                     k_token=ks, v_token=vs, fmt=kv_format.KVFormat(quant, "split"))
            ref_pool = ((kq.astype(jnp.float32) * ks[..., None]).astype(dtype),
                        (vq.astype(jnp.float32) * vs[..., None]).astype(dtype))
        q = q.astype(dtype)
        gpu = jax.jit(lambda q, pool, t, n: attn_gpu.decode_attention_gpu(q, pool, layer, t, n, window))
        got = np.asarray(gpu(q, pool, table, lengths), np.float32)
        res = dict(idle_slot_zero=bool(np.all(got[0] == 0)), finite=bool(np.isfinite(got).all()))
        for prec in ("default", "highest"):
            with jax.default_matmul_precision(prec):
                xla = jax.jit(lambda q, pool, t, n: attn_xla.decode_attention_xla(q, pool, layer, t, n, window,
                                                                                  block_pages=min(8, width)))
                want = np.asarray(xla(q, ref_pool, table, lengths), np.float32)
            res[f"max_abs_err_vs_xla_{prec}"] = float(np.abs(got - want).max())
        tol = 2e-2 if dtype != jnp.float32 or quant else 2e-5
        res["tol"] = tol
        res["passed"] = bool(res["idle_slot_zero"] and res["finite"] and res["max_abs_err_vs_xla_highest"] <= tol)
        return res

    sys.path.insert(0, TESTS)
    import test_paged_gpu as tp

    for window in (None,) if SMOKE else (None, 5):
        for dtype in (jnp.float32,) if SMOKE else (jnp.float32, jnp.bfloat16):
            checks.run(f"test_gpu_decode_attention_equals_xla[{window}, {jnp.dtype(dtype).name}] (as written)",
                       tp.test_gpu_decode_attention_equals_xla, window, dtype)
    for s_, h, kvh, d, ps, width, dtype, layer, quant in SMOKE_PAGED_CASES if SMOKE else PAGED_CASES:
        what = f"{quant} pages with per-token scale pages, {dtype} queries" if quant else dtype
        checks.run(f"paged gpu vs xla: {s_} slots, {h} heads / {kvh} KV, D={d}, page {ps}, "
                   f"{width * ps} tokens, {what}, layer {layer}", compare, s_, h, kvh, d, ps, width, dtype, layer,
                   None, quant)
    checks.run("gpu_unsupported / resolve_impl('auto') on the GPU: the kernel for bf16, page 16, D=128",
               lambda: dict(passed=attention.resolve_impl("auto", 32, (2, 9, 16, 16, 128), jnp.bfloat16) == "gpu"))


def part_pytest_paged(out):
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="0", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "tests/test_paged_gpu.py",
           "-k", "not auto_takes_the_gpu_kernel_for_a_gpu_target", "--durations=5"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    print(text[-20000:], flush=True)
    summary = [ln for ln in text.splitlines() if ln.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL"))]
    tail = [ln for ln in text.splitlines() if " passed" in ln or " failed" in ln or " error" in ln]
    out["checks"] = [dict(name="pytest tests/test_paged_gpu.py (all but the CPU-host auto test)",
                          passed=proc.returncode == 0, returncode=proc.returncode, results=summary,
                          summary=tail[-1] if tail else "", error=None if proc.returncode == 0 else text[-4000:])]
    print(f"[{'PASS' if proc.returncode == 0 else 'FAIL'}] pytest test_paged_gpu.py: "
          f"{tail[-1] if tail else proc.returncode}", flush=True)


# ------------------------------------------------------------------------------------------- bench
def part_bench(out):
    import jax
    import jax.numpy as jnp

    from lrmq.generation.attention import gpu as attn_gpu
    from lrmq.generation.attention import xla as attn_xla
    from lrmq.model.attention import attention

    sys.path.insert(0, TESTS)
    import test_attention as ta

    from pallas_kernels import dispatch as pk
    from pallas_kernels import reference as ref

    checks = Checks(out)

    def paged_decode(s, h, kvh, d, ps, width, dtype, full):
        dtype = jnp.dtype(dtype)
        lengths = [width * ps] * s if full else None
        q, (k, v), table, n = _paged_inputs(s, h, kvh, d, ps, width, 2, dtype, lengths=lengths)
        gpu = jax.jit(lambda q, pool, t, n: attn_gpu.decode_attention_gpu(q, pool, 1, t, n, None))
        xla = jax.jit(lambda q, pool, t, n: attn_xla.decode_attention_xla(q, pool, 1, t, n, None,
                                                                          block_pages=min(8, width)))
        t_gpu = time_dispatched(gpu, q, (k, v), table, n, iters=15, reps=10)
        t_xla = time_dispatched(xla, q, (k, v), table, n, iters=15, reps=10)
        live = int(jnp.sum(n)) * kvh * d * 2 * dtype.itemsize  # K and V bytes of the live tokens
        return dict(slots=s, heads=h, kv_heads=kvh, head_dim=d, page_size=ps, max_tokens=width * ps,
                    live_tokens=int(jnp.sum(n)), dtype=dtype.name, gpu_us=t_gpu * 1e6, xla_us=t_xla * 1e6,
                    gpu_speedup_vs_xla=t_xla / t_gpu, live_kv_bytes=live, gpu_GBps=live / t_gpu / 1e9,
                    xla_GBps=live / t_xla / 1e9)

    if SMOKE:
        checks.run("paged decode (smoke)", paged_decode, 4, 8, 2, 16, 16, 4, "bfloat16", True)
    else:
        checks.run("paged decode: 64 slots x 2048 tokens (full), 32 heads / 8 KV, D=128, page 16, bf16",
                   paged_decode, 64, 32, 8, 128, 16, 128, "bfloat16", True)
        checks.run("paged decode: 64 slots, random lengths <= 4096, 32 heads / 8 KV, D=128, page 16, bf16",
                   paged_decode, 64, 32, 8, 128, 16, 256, "bfloat16", False)

    def attn_speed(b, t, h, kvh, d, window):
        q, k, v, pos, _, ct = ta._inputs(b, t, h, kvh, d, jnp.bfloat16, padding=True)
        res = dict(B=b, T=t, H=h, KVH=kvh, D=d, window=window)
        for impl in ("cudnn", "xla"):
            f = lambda q, k, v, impl=impl: attention(q, k, v, pos, pos, window, None, impl=impl)  # noqa: E731
            fwd = jax.jit(f)
            fb = jax.jit(lambda *a, f=f: ta._value_and_grads(f, *a))
            res[f"{impl}_fwd_ms"] = time_dispatched(fwd, q, k, v, iters=7, reps=3) * 1e3
            res[f"{impl}_fwd_bwd_ms"] = time_dispatched(fb, q, k, v, ct, iters=7, reps=3) * 1e3
        res["cudnn_speedup_fwd"] = res["xla_fwd_ms"] / res["cudnn_fwd_ms"]
        res["cudnn_speedup_fwd_bwd"] = res["xla_fwd_bwd_ms"] / res["cudnn_fwd_bwd_ms"]
        return res

    if SMOKE:
        from lrmq.model import attention as attn_mod

        rolled = attn_mod._rolled_dot_product_attention
        attn_mod._rolled_dot_product_attention = lambda *a: rolled(*a[:-1], "xla")
        checks.run("attention speed (smoke)", attn_speed, 1, 64, 2, 1, 16, None)
    else:
        checks.run("attention speed: cuDNN vs blockwise XLA, B=4 T=4096 H=16 KVH=8 D=128 bf16 padded",
                   attn_speed, 4, 4096, 16, 8, 128, None)

    def tile_sweep(m, k, n, g):
        """int4 g128 bf16 at decode: the default tiles vs a few overrides (one weight copy: L2-resident at this
        size, so these compare tiles, not HBM speed)."""
        import numpy as np

        rng = np.random.default_rng(0)
        codes = jnp.asarray(ref.pack_int4(rng.integers(0, 16, (k, n))))
        scales = jnp.asarray(rng.uniform(1e-3, 1e-2, (k // g, n)), jnp.bfloat16)
        zeros = jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.uint8)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        from pallas_kernels import gpu as pkg

        t = pkg.choose_tiles(m, k, n, k_unit=g)
        variants = {"default": {}}
        for bn in (32, 64, 128):
            for splits in (1, 4, 8, 16):
                if (k // t.bk) % splits == 0:
                    variants[f"bn{bn}_s{splits}"] = dict(block_n=bn, splits=splits)
        variants["warps8"] = dict(num_warps=8)
        variants["stages4"] = dict(num_stages=4)
        res = dict(M=m, K=k, N=n, group=g, default_tiles=dict(bm=t.bm, bn=t.bn, bk=t.bk, splits=t.splits))
        times = {}
        for name, kw in variants.items():
            f = jax.jit(lambda x, c, s, z, kw=kw: pk.int4_matmul(x, c, s, z, g, impl="gpu", interpret=SMOKE or None,
                                                                 **kw))
            try:
                times[name] = time_dispatched(f, x, codes, scales, zeros, iters=10, reps=20) * 1e6
            except Exception as e:  # noqa: BLE001
                times[name] = _first_line(_err(e))
        res["us"] = times
        numeric = {k_: v for k_, v in times.items() if isinstance(v, float)}
        if numeric:
            res["best"] = min(numeric, key=numeric.get)
        return res

    if SMOKE:
        checks.run("int4 kernel tile sweep (smoke)", tile_sweep, 1, 256, 128, 128)
    else:
        for m in (1, 16):
            checks.run(f"int4 kernel tile sweep M={m} K=4096 N=14336 g128 bf16", tile_sweep, m, 4096, 14336, 128)


PARTS = {"env": part_env, "kernels": part_kernels, "attention": part_attention, "paged": part_paged,
         "pytest_paged": part_pytest_paged, "bench": part_bench}


def run_part(name, json_path):
    out = dict(part=name, started=_now())
    t0 = time.perf_counter()
    try:
        PARTS[name](out)
        checks = out.get("checks", [])
        out["status"] = "ok" if all(c.get("passed") for c in checks) else "failed checks"
    except Exception as e:  # noqa: BLE001
        out["status"] = "error"
        out["error"] = _err(e)
        print(out["error"], flush=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    with open(json_path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


# ------------------------------------------------------------------------------------------ driver
class Driver:
    def __init__(self, out_dir, budget):
        self.out_dir = out_dir
        self.deadline = time.monotonic() + budget
        self.tmp = tempfile.mkdtemp(prefix="gpu_check_")
        self.results = {}
        self.logs = []

    def left(self):
        return self.deadline - time.monotonic()

    def start(self, name, cmd=None):
        log = open(os.path.join(self.tmp, f"{name}.log"), "w")
        jpath = os.path.join(self.tmp, f"{name}.json")
        cmd = cmd or [sys.executable, os.path.abspath(__file__), "--part", name, "--json", jpath]
        env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
        print(f"--- start {name} ({self.left():.0f} s of budget left)", flush=True)
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return dict(name=name, proc=proc, log=log, json=jpath, t0=time.monotonic())

    def wait(self, jobs, timeout):
        end = time.monotonic() + max(timeout, 1)
        for job in jobs:
            proc = job["proc"]
            try:
                proc.wait(timeout=max(end - time.monotonic(), 0.1))
                status = None
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                status = "timeout"
            job["log"].close()
            elapsed = round(time.monotonic() - job["t0"], 1)
            res = {}
            if os.path.exists(job["json"]):
                with open(job["json"]) as f:
                    res = json.load(f)
            res.setdefault("part", job["name"])
            res["returncode"] = proc.returncode
            res["wall_s"] = elapsed
            if status or "status" not in res:
                res["status"] = status or f"exited {proc.returncode} without results"
            with open(job["log"].name) as f:
                text = f.read()
            self.logs.append(f"===== {job['name']} ({res['status']}, {elapsed} s)\n{text}")
            if res["status"] not in ("ok",):
                res["log_tail"] = text[-4000:]
            self.results[job["name"]] = res
            lines = text.splitlines()
            print(f"--- end {job['name']}: {res['status']} in {elapsed} s; last lines:", flush=True)
            print("\n".join(lines[-40:]), flush=True)

    def skip(self, name, why):
        self.results[name] = dict(part=name, status="skipped", why=why)
        print(f"--- skip {name}: {why}", flush=True)


def drive(out_dir, budget):
    os.makedirs(out_dir, exist_ok=True)
    d = Driver(out_dir, budget)
    started = _now()
    # 1. environment and the copy-bandwidth ceiling (alone)
    d.wait([d.start("env")], min(90, d.left()))
    # 2. correctness, four processes at once (not timed)
    phase2 = min(200, d.left() - 150)
    correctness = ("kernels", "attention", "paged") if SMOKE else ("kernels", "attention", "paged", "pytest_paged")
    if SMOKE:
        d.skip("pytest_paged", "--smoke: the tests run on CPU in the suite")
    if phase2 > 30:
        d.wait([d.start(n) for n in correctness], phase2)
    else:
        for n in correctness:
            d.skip(n, "no budget left")
    # 3. the documented int4 sweep, alone
    sweep = min(240, d.left() - 20)
    if sweep > 30:
        stem = os.path.join(out_dir, "int4_h200")
        d.wait([d.start("int4", [sys.executable, os.path.join(HERE, "int4_matmul.py"), "--out", stem]
                        + (["--quick", "--compile-threads", "1"] if SMOKE else []))], sweep)
        res = d.results["int4"]
        if os.path.exists(stem + ".json"):
            with open(stem + ".json") as f:
                res["sweep"] = json.load(f)
            res["status"] = "ok" if res["returncode"] == 0 else res["status"]
            if res["returncode"] == 1:
                res["status"] = "sweep written, some columns failed"
    else:
        d.skip("int4", "no budget left")
    # 4. speed of the other GPU paths, alone, with what is left
    if d.left() > 45:
        d.wait([d.start("bench")], d.left() - 10)
    else:
        d.skip("bench", "no budget left")
    return finish(d, started)


def finish(d, started):
    env = d.results.get("env", {})
    report = dict(machine=env.get("info", {}), started=started, finished=_now(), parts=d.results)
    with open(os.path.join(d.out_dir, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(d.out_dir, "parts_log.txt"), "w") as f:
        f.write("\n".join(d.logs))
    lines = summary(report)
    with open(os.path.join(d.out_dir, "gpu_check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0


def summary(report):
    info = report["machine"]
    lines = [f"# GPU check: {info.get('device_kind', '?')}, jax {info.get('jax', '?')}, {report['started']}", ""]
    copy = report["parts"].get("env", {}).get("copy_GBps")
    if copy:
        lines += [f"Measured device copy bandwidth: {copy:.0f} GB/s (read + write).", ""]
    lines += ["| part | status | checks passed | wall s |", "|---|---|---|---|"]
    for name, res in report["parts"].items():
        checks = res.get("checks", [])
        passed = sum(bool(c.get("passed")) for c in checks)
        lines.append(f"| {name} | {res.get('status')} | {passed}/{len(checks)} | {res.get('wall_s', '-')} |")
    fails = [(name, c) for name, res in report["parts"].items() for c in res.get("checks", []) if not c.get("passed")]
    if fails:
        lines += ["", "Failed checks:", ""]
        for name, c in fails:
            numbers = {k: v for k, v in c.items() if k not in ("name", "error")}
            why = _first_line(c.get("error") or "") or json.dumps(numbers, default=str)[:300]
            lines.append(f"* {name}: {c['name']}: {why}")
    sweep = report["parts"].get("int4", {}).get("sweep")
    if sweep:
        dec = [r for r in sweep["rows"] if r["M"] <= 16]
        vb = [r["speedup_vs_bf16"] for r in dec if r.get("speedup_vs_bf16")]
        vx = [r["speedup_vs_xla"] for r in dec if r.get("speedup_vs_xla")]
        lines += ["", f"int4 sweep ({len(sweep['rows'])} rows; decode M <= 16: {len(dec)} rows, "
                  f"{len(vb)} with a kernel time):"]
        if vb:
            met = len(vb) == len(dec) and min(vb) >= 2.5
            lines.append(f"* kernel vs bf16 at M <= 16: {min(vb):.2f}x .. {max(vb):.2f}x "
                         f"(bar >= 2.5x at every row: {'met' if met else 'NOT met'})")
        if vx:
            beats = len(vx) == len(dec) and min(vx) > 1
            lines.append(f"* kernel vs XLA dequant+dot at M <= 16: {min(vx):.2f}x .. {max(vx):.2f}x "
                         f"(beats XLA at every row: {'yes' if beats else 'NO'})")
        big = [r for r in sweep["rows"] if r["M"] > 16 and r.get("speedup_vs_bf16")]
        if big:
            lines.append(f"* kernel vs bf16 at M > 16: {min(r['speedup_vs_bf16'] for r in big):.2f}x .. "
                         f"{max(r['speedup_vs_bf16'] for r in big):.2f}x")
    for c in report["parts"].get("bench", {}).get("checks", []):
        if c.get("passed") and "gpu_us" in c:
            lines.append(f"* {c['name']}: gpu {c['gpu_us']:.0f} us vs xla {c['xla_us']:.0f} us "
                         f"({c['gpu_speedup_vs_xla']:.2f}x; {c['gpu_GBps']:.0f} GB/s of live KV)")
        elif c.get("passed") and "cudnn_fwd_ms" in c:
            lines.append(f"* {c['name']}: fwd {c['cudnn_fwd_ms']:.2f} vs {c['xla_fwd_ms']:.2f} ms "
                         f"({c['cudnn_speedup_fwd']:.2f}x), fwd+bwd {c['cudnn_fwd_bwd_ms']:.2f} vs "
                         f"{c['xla_fwd_bwd_ms']:.2f} ms ({c['cudnn_speedup_fwd_bwd']:.2f}x)")
        elif c.get("passed") and "us" in c:
            lines.append(f"* {c['name']}: best {c.get('best')}, " + ", ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}=FAIL" for k, v in c["us"].items()))
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check"))
    ap.add_argument("--budget", type=float, default=400, help="seconds for all parts together")
    ap.add_argument("--part", choices=sorted(PARTS), help="run one part in this process")
    ap.add_argument("--json", help="where --part writes its results")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: tiny shapes, interpreted")
    args = ap.parse_args(argv)
    if args.smoke:
        global SMOKE
        SMOKE = True
        os.environ["GPU_CHECK_SMOKE"] = "1"  # the parts' processes
    if args.part:
        return run_part(args.part, args.json or f"gpu_check_{args.part}.json")
    return drive(args.out, args.budget)


if __name__ == "__main__":
    sys.exit(main())
