"""Every GPU kernel compiled ahead of time for H200 (sm_90a), A100 (sm_80) and B200 (sm_100a) on a CPU-only host.

No GPU is used: JAX's CUDA plugin compiles for the target descriptions of lrmq/assets/gpu_targets
(`lrmq.targets.gpu_topology_devices`), the program's XLA dump is read for its kernels (`lrmq.hlo.gpu_kernels`:
PTX `.target`, tensor-core instructions, launch grid and shared memory) and, where NVIDIA's ptxas is on PATH,
each kernel's registers and spills (`lrmq.hlo.ptxas_info`, optional: it only reads the PTX).

Parts (each target and part in its own process, so a compiler that aborts loses one part, recorded as such):
  matmul  int4 / int8 / NF4 dequant-matmul (pallas_kernels, impl="auto" under a one-GPU mesh: the Triton kernel)
          over the (K, N) of every quantized projection of Qwen3 0.6B / 1.7B / 4B / 8B, groups 32 / 64 / 128 /
          per channel (NF4: blocks 32 / 64 / 128), M = 1, 16, 64 (decode), 300, 512 (prefill), 2048 (update),
          bf16 activations; f32 activations at M = 1 and 512 on Qwen3-8B's shapes. A100: decode, prefill and
          update M on Qwen3-0.6B's and 8B's shapes; B200: one decode and one prefill shape per kernel.
  paged   the paged decode attention (lrmq.generation.paged.decode_attention_gpu: JAX's Triton kernel) with bf16,
          f32, fp8 (e4m3, e5m2) and int8 pages, Qwen3-0.6B (16 query / 8 KV heads) and 8B (32 / 8), head_dim 128,
          32 and 256 slots, 4k and 32k contexts, pages of 16 and 64 tokens.
  tiles   the shared-memory estimate of the dequant-matmul tile plans (`pallas_kernels.gpu.smem_bytes`) against
          what Triton allocates, over 13 tile overrides x 3 formats x bf16 / f32; tiles past the GPU's shared
          memory are refused by `check_tiles` before the compiler sees them. Plus the rules' own refusals.
Each case: "compiled" (with its kernel facts, compile seconds, memory_analysis) or "refused" (the kernel's own
check, its message) or "failed" (anything else: a bug this script exists to find).

    python benchmarks/gpu_aot_kernels.py --out docs/figures/gpu_aot_kernels.json
    python benchmarks/gpu_aot_kernels.py --out /tmp/k.json --quick      # a few cases per part
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiles for GPU topologies: no TPU runtime start
from common import REPO, machine_info, source_commit, write_json  # noqa: E402

TARGETS = ("h200", "a100", "b200")
# (K, N) of every quantized projection: q, k/v, o, gate/up, down (tests/test_tpu_compile.py's grid)
MODEL_SHAPES = {
    "qwen3-0.6b": [(1024, 2048), (1024, 1024), (2048, 1024), (1024, 3072), (3072, 1024)],
    "qwen3-1.7b": [(2048, 2048), (2048, 1024), (2048, 6144), (6144, 2048)],
    "qwen3-4b": [(2560, 4096), (2560, 1024), (4096, 2560), (2560, 9728), (9728, 2560)],
    "qwen3-8b": [(4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096)],
}
KERNELS = [("int4", 32), ("int4", 64), ("int4", 128), ("int4", 0), ("int8", 32), ("int8", 64), ("int8", 128),
           ("int8", 0), ("nf4", 32), ("nf4", 64), ("nf4", 128)]  # group 0: per channel; NF4: the block size
PHASES = {1: "decode", 16: "decode", 64: "decode", 300: "prefill", 512: "prefill", 2048: "update"}
# paged attention: (query heads, KV heads) of Qwen3-0.6B and 8B, head_dim 128
ATTN_MODELS = {"qwen3-0.6b": (16, 8), "qwen3-8b": (32, 8)}
PAGE_DTYPES = ("bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "int8")
TILE_OVERRIDES = [(16, 64, 128, 3), (16, 128, 128, 3), (64, 128, 128, 3), (128, 128, 128, 3), (128, 256, 128, 3),
                  (256, 128, 128, 3), (128, 128, 64, 4), (64, 256, 64, 3), (256, 256, 64, 2), (16, 256, 64, 3),
                  (32, 512, 128, 3), (128, 128, 128, 5), (64, 64, 64, 2)]  # (block_m, block_n, block_k, stages)


def _shapes(models):
    seen = {}
    for model in models:
        for kn in MODEL_SHAPES[model]:
            seen.setdefault(kn, []).append(model)
    return seen


def matmul_cases(target: str, quick: bool) -> list[dict]:
    if target == "h200":
        plan = [(_shapes(MODEL_SHAPES), (1, 16, 64, 300, 512, 2048), "bfloat16"),
                (_shapes(["qwen3-8b"]), (1, 512), "float32")]
    elif target == "a100":
        plan = [(_shapes(["qwen3-0.6b", "qwen3-8b"]), (1, 16, 512, 2048), "bfloat16"),
                (_shapes(["qwen3-8b"]), (1, 512), "float32")]
    else:
        plan = [({(4096, 4096): ["qwen3-8b"]}, (16, 512), "bfloat16")]
    if quick:
        plan = [({(4096, 4096): ["qwen3-8b"]}, (16, 512), "bfloat16")]
    cases = []
    for shapes, ms, dtype in plan:
        for (fmt, g) in KERNELS:
            for (k, n), models in shapes.items():
                for m in ms:
                    cases.append(dict(part="matmul", fmt=fmt, group=g or "channel", M=m, K=k, N=n, dtype=dtype,
                                      phase=PHASES[m], models=models))
    return cases


def paged_cases(target: str, quick: bool) -> list[dict]:
    cases = []
    for model, (h, kvh) in ATTN_MODELS.items():
        for dtype in PAGE_DTYPES:
            for slots in (32, 256):
                for context in (4096, 32768):
                    for page_size in (16, 64):
                        cases.append(dict(part="paged", model=model, q_heads=h, kv_heads=kvh, head_dim=128,
                                          pages_dtype=dtype, slots=slots, context=context, page_size=page_size))
    if quick or target == "b200":
        cases = [c for c in cases if c["slots"] == 32 and c["context"] == 4096 and c["page_size"] == 16
                 and c["model"] == "qwen3-8b"]
    return cases


def tile_cases(target: str, quick: bool) -> list[dict]:
    cases = []
    for fmt in ("int4", "int8", "nf4"):
        for dtype in ("bfloat16", "float32"):
            for bm, bn, bk, stages in TILE_OVERRIDES[: 3 if quick else None]:
                cases.append(dict(part="tiles", fmt=fmt, group=64 if fmt == "nf4" else 128, M=256, K=2048, N=2048,
                                  dtype=dtype, block_m=bm, block_n=bn, block_k=min(bk, 64) if fmt == "nf4" else bk,
                                  num_stages=stages, splits=1))
    # the rules' own refusals: a block that is not a power of two (Triton's tensors), a tile past shared memory
    cases.append(dict(part="tiles", fmt="int4", group=128, M=16, K=4096, N=4096, dtype="bfloat16", block_m=24,
                      block_n=24, splits=None, num_stages=3, block_k=None))
    cases.append(dict(part="tiles", fmt="int4", group=128, M=256, K=4096, N=4096, dtype="bfloat16", block_m=256,
                      block_n=256, block_k=128, splits=None, num_stages=3))
    return cases


CASES = {"matmul": matmul_cases, "paged": paged_cases, "tiles": tile_cases}


# ------------------------------------------------------------------------------------------------ worker
def _program(case, sd):
    import jax.numpy as jnp

    import pallas_kernels as pk

    dt = jnp.dtype(case["dtype"])
    m, k, n = case["M"], case["K"], case["N"]
    g = case["group"]
    tiles = {t: case[t] for t in ("block_m", "block_n", "block_k", "splits", "num_stages") if case.get(t)}
    x = sd((m, k), dt)
    if case["fmt"] == "nf4":
        return (lambda *a: pk.nf4_matmul(*a, g, **tiles)), (x, sd((n, k // 2), jnp.uint8), sd((n, k // g), jnp.float32))
    gk = k if g == "channel" else g
    rows = k // 2 if case["fmt"] == "int4" else k
    fn = pk.int4_matmul if case["fmt"] == "int4" else pk.int8_matmul
    return (lambda *a: fn(*a, **tiles)), (x, sd((rows, n), jnp.uint8), sd((k // gk, n), dt), sd((k // gk, n), jnp.uint8))


def _paged_program(case, sd):
    import jax.numpy as jnp

    from lrmq.generation import kv_pool
    from lrmq.generation.attention import gpu as attn_gpu
    from lrmq.generation.kv_format import KVFormat

    s, h, kvh, d, ps = case["slots"], case["q_heads"], case["kv_heads"], case["head_dim"], case["page_size"]
    width = case["context"] // ps
    pages = s * width + 1  # every slot at full context, and the null page
    dt = jnp.dtype(case["pages_dtype"])
    kv = (sd((kvh, 1, pages, ps, d), dt),) * 2
    quant = dt in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
    q = sd((s, h, d), dt if not quant else jnp.bfloat16)
    if not quant:
        pool = kv
    else:
        scale, token = sd((kvh, 1), jnp.float32), sd((kvh, 1, pages, ps), jnp.float32)
        name = "int8" if dt == jnp.int8 else "fp8_e4m3" if "e4m3" in dt.name else "fp8_e5m2"
        pool = kv_pool.QuantPool(kv, scale, scale, sd((kvh,), jnp.int32), token, token, fmt=KVFormat(name, "split"))
    why = attn_gpu.gpu_unsupported(h, (1, pages, ps, 2 * kvh, d), dt, scaled=quant)
    fn = lambda q, pool, t, l: attn_gpu.decode_attention_gpu(q, pool, 0, t, l, None)  # noqa: E731
    return fn, (q, pool, sd((s, width), jnp.int32), sd((s,), jnp.int32)), why


def _kernel_facts(dump: str, prefix: str) -> dict:
    from lrmq import hlo

    kernels = hlo.gpu_kernels(dump)
    mine = {name: facts for name, facts in kernels.items() if name.startswith(prefix)}
    if len(mine) != 1:
        raise RuntimeError(f"expected one {prefix}* kernel in the dump, found {sorted(kernels)}")
    name, facts = next(iter(mine.items()))
    out = {"kernel": name, "ptx_target": facts.get("target"),
           **{key: facts.get(key) for key in ("tensor_core", "local_bytes", "grid", "threads", "shared_memory")}}
    info = hlo.ptxas_info(facts["ptx"], facts["target"], name) if facts.get("ptx") else None
    if info is not None:
        out["ptxas"] = info
    out["other_kernels"] = len(kernels) - 1
    return out


def _tile_plan(case, kind) -> dict | None:
    """The tiles the wrapper chooses for a matmul case, and their shared-memory estimate, on GPU `kind`."""
    import jax.numpy as jnp

    from pallas_kernels import gpu as pk_gpu
    from pallas_kernels.target import gpu_of

    g = case["group"]
    per_channel = g == "channel"
    unit = (256 if case["fmt"] == "int4" else 128) if per_channel else (g & -g)
    gpu = gpu_of(kind)
    stages = case.get("num_stages") or 3
    t = pk_gpu.choose_tiles(case["M"], case["K"], case["N"], k_unit=unit, block_m=case.get("block_m"),
                            block_n=case.get("block_n"), block_k=case.get("block_k"), splits=case.get("splits"),
                            fmt=case["fmt"], x_dtype=jnp.dtype(case["dtype"]), num_stages=stages, gpu=gpu)
    return {"block_m": t.bm, "block_n": t.bn, "block_k": t.bk, "splits": t.splits, "num_stages": stages,
            "smem_estimate": pk_gpu.smem_bytes(case["fmt"], t.bm, t.bn, t.bk, jnp.dtype(case["dtype"]), stages, gpu)}


def worker(target: str, part: str, quick: bool, out_path: str) -> None:
    import jax
    import numpy as np

    from lrmq import targets

    devices = targets.gpu_topology_devices(target)
    kind = devices[0].device_kind
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.P())
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    options = targets.compile_options(devices)
    with open(out_path, "a") as out, jax.set_mesh(mesh):  # the kernels' checks read the target from the mesh
        for case in CASES[part](target, quick):
            row = dict(case, target=target, device_kind=kind)
            out.write(json.dumps({"started": row}) + "\n")
            out.flush()
            why = None
            try:
                if part == "paged":
                    fn, args, why = _paged_program(case, sd)
                    prefix = "paged_attention"
                else:
                    fn, args = _program(case, sd)
                    prefix = f"lrmq_{case['fmt']}_matmul_gpu"
                    try:
                        row["tiles"] = _tile_plan(case, kind)
                    except ValueError:
                        pass  # the call below raises it again, as the refusal
                t0 = time.perf_counter()
                with tempfile.TemporaryDirectory() as dump:
                    lowered = jax.jit(fn).lower(*args)
                    compiled = lowered.compile({**options, "xla_dump_to": dump})
                    row["compile_s"] = round(time.perf_counter() - t0, 3)
                    row.update(_kernel_facts(dump, prefix))
                ma = compiled.memory_analysis()
                row["memory"] = {key: int(getattr(ma, f"{key}_size_in_bytes")) for key in
                                 ("argument", "output", "temp", "alias")}
                row["status"] = "compiled"
                if why is not None:  # the kernel compiled where the check says it cannot: the check is wrong
                    row.update(status="failed", message=f"compiled, though gpu_unsupported says: {why}")
            except ValueError as e:  # the kernels' own checks raise ValueError before the compiler sees the call
                row.update(status="refused", message=str(e).splitlines()[0])
            except Exception as e:  # noqa: BLE001 - recorded: the failures this sweep exists to find
                row.update(status="failed", message=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}")
            if why is not None and row["status"] == "refused":
                row["auto_takes"] = f"xla ({why})"
            out.write(json.dumps(row) + "\n")
            out.flush()


# ------------------------------------------------------------------------------------------------ driver
def run_part(target: str, part: str, quick: bool, timeout: float) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        path = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", target, part, "--jsonl", path]
    if quick:
        cmd.append("--quick")
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        rc, tail = p.returncode, (p.stderr or "").strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", [f"did not finish in {timeout:.0f} s"]
    rows, started = [], None
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "started" in rec:
                started = rec["started"]
            else:
                rows.append(rec)
                started = None
    os.unlink(path)
    if started is not None:  # the process ended inside a case: a compiler abort (or the timeout)
        rows.append(dict(started, status="failed", message=f"the compiling process ended (exit {rc}): {tail}"))
    print(f"{target} {part}: {len(rows)} cases in {time.time() - t0:.0f} s, "
          f"{sum(r['status'] == 'compiled' for r in rows)} compiled, "
          f"{sum(r['status'] == 'refused' for r in rows)} refused, "
          f"{sum(r['status'] == 'failed' for r in rows)} failed (exit {rc})", flush=True)
    return rows


def summarize(rows: list[dict]) -> dict:
    out = {}
    for target in sorted({r["target"] for r in rows}):
        for part in ("matmul", "paged", "tiles"):
            sel = [r for r in rows if r["target"] == target and r["part"] == part]
            if not sel:
                continue
            done = [r for r in sel if r["status"] == "compiled"]
            s = {"cases": len(sel), "compiled": len(done), "refused": sum(r["status"] == "refused" for r in sel),
                 "failed": sum(r["status"] == "failed" for r in sel),
                 "ptx_targets": sorted({r["ptx_target"] for r in done}),
                 "compile_s_max": max((r["compile_s"] for r in done), default=None),
                 "compile_s_median": sorted(r["compile_s"] for r in done)[len(done) // 2] if done else None}
            if part in ("matmul", "paged"):
                by = {}
                for r in done:
                    key = r["fmt"] + "/" + r["dtype"] if part == "matmul" else r["pages_dtype"]
                    tc = sum(r["tensor_core"].values())
                    b = by.setdefault(key, {"compiled": 0, "with_tensor_cores": 0, "instructions": set(),
                                            "max_shared_memory": 0, "max_registers": None, "spill_stores": 0})
                    b["compiled"] += 1
                    b["with_tensor_cores"] += tc > 0
                    b["instructions"] |= set(r["tensor_core"])
                    b["max_shared_memory"] = max(b["max_shared_memory"], r["shared_memory"])
                    if "ptxas" in r:
                        b["max_registers"] = max(b["max_registers"] or 0, r["ptxas"]["registers"])
                        b["spill_stores"] = max(b["spill_stores"], r["ptxas"]["spill_stores"])
                for b in by.values():
                    b["instructions"] = sorted(b["instructions"])
                s["by_kernel"] = by
            if part == "tiles":
                est = [r for r in done if r.get("tiles")]
                s["estimate_at_least_allocated"] = all(r["tiles"]["smem_estimate"] >= r["shared_memory"] for r in est)
                s["allocated_over_estimate_max"] = max((round(r["shared_memory"] / r["tiles"]["smem_estimate"], 3)
                                                        for r in est), default=None)
            s["failures"] = [{k: r.get(k) for k in ("fmt", "group", "M", "K", "N", "dtype", "pages_dtype", "model",
                                                     "slots", "context", "page_size", "message")}
                             for r in sel if r["status"] == "failed"][:20]
            s["refusals"] = sorted({r["message"] for r in sel if r["status"] == "refused"})[:20]
            out[f"{target} {part}"] = s
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON output path")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--parts", default="matmul,paged,tiles")
    ap.add_argument("--quick", action="store_true", help="a few cases per part (a check of this script)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per target and part")
    ap.add_argument("--worker", nargs=2, metavar=("TARGET", "PART"), help=argparse.SUPPRESS)
    ap.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker, args.quick, args.jsonl)
        return 0
    t0 = time.time()
    rows = []
    for target in args.targets.split(","):
        for part in args.parts.split(","):
            rows += run_part(target, part, args.quick, args.timeout)
    res = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "commit": source_commit(), "wall_s": round(time.time() - t0), "quick": args.quick,
           "method": __doc__.split("\n\n")[0], "summary": summarize(rows), "cases": rows}
    write_json(args.out, res)
    failed = sum(r["status"] == "failed" for r in rows)
    print(json.dumps(res["summary"], indent=1, default=str)[:4000])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
