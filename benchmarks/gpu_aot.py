"""Paper 1's recipes and QuantLRM's 32k evaluation compiled for 8 x H200 on a CPU-only host, and estimates from
the compiled programs (no GPU needed; JAX's CUDA plugin compiles for the H200 target in lrmq/assets/gpu_targets).

1. Programs: each command in a fresh process, as a user runs it, recording its table, KV pool, memory and verdict
   lines and exit status (0 fits, 3 does not):
     python -m lrmq.train --config configs/paper1/qwen3_{0.6b,8b}_grpo.yaml --compile-only --platform gpu
         --topology h200:8 rollout.update_shapes=1   (the largest update shape decides the memory)
     python -m lrmq.evaluate --config configs/eval/quantlrm.yaml --shapes qwen3-8b --compile-only --platform gpu
         --topology h200:8
2. Estimates (labelled so: nothing here ran on a GPU): the int4 W4A16 g128 matmul (pallas_kernels.gpu, Triton)
   against the bf16 matmul at Qwen3-8B's decode shapes, each compiled for one H200; time = max(bytes / bandwidth,
   flops / peak), bytes = the compiled program's operands and result (its memory analysis: what a memory-bound
   matmul moves at least), flops from XLA's cost analysis of the compiled program (2*M*K*N for the Triton kernel,
   a custom call the analysis cannot see inside); XLA's byte counts are recorded beside. Beside Marlin's 3.87x (FP16 x INT4 g128 over FP16 up to batch 16-32, A10). And the
   rollout decode step's memory-bound tokens/s: decode slots / (bytes the step reads / bandwidth), the bytes being
   every argument of the compiled decode program per GPU (its share of the weights, split tensor parallel in the
   decode layout, and of the whole KV pool) — a floor on the memory-bound rate, since a step reads only the pages
   in use; the collectives of tensor parallelism (activations only) are not counted.

    python benchmarks/gpu_aot.py --out docs/figures/gpu_aot.json
    python benchmarks/gpu_aot.py --out F --only estimates
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process compiles for GPU topologies: no TPU runtime start
from common import REPO, machine_info, source_commit, write_json  # noqa: E402

TOPOLOGY = "h200:8"
TRAIN = {"qwen3-0.6b grpo": "configs/paper1/qwen3_0.6b_grpo.yaml", "qwen3-8b grpo": "configs/paper1/qwen3_8b_grpo.yaml"}
# Qwen3-8B's linears (K, N) and the decode batch sizes (decode slots) of the estimate
SHAPES_8B = {"q/o proj": (4096, 4096), "gate/up proj": (4096, 12288), "down proj": (12288, 4096)}
DECODE_M = (1, 16, 32, 64, 128)
GROUP = 128
MARLIN = 3.87


def _run(cmd: list[str], timeout: float) -> tuple[subprocess.CompletedProcess | None, float]:
    t0 = time.time()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    try:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env), time.time() - t0
    except subprocess.TimeoutExpired:
        return None, time.time() - t0


def _summary(cmd, p, wall) -> dict:
    if p is None:
        return {"command": " ".join(["python", *cmd[1:]]), "error": f"did not finish in {wall:.0f} s"}
    lines = p.stdout.strip().splitlines()
    return {"command": " ".join(["python", *cmd[1:]]), "exit_status": p.returncode, "fits": p.returncode == 0,
            "table": [ln for ln in lines if ln.startswith("|")],
            "kv_pool": next((ln for ln in lines if ln.startswith("KV pool:")), None),
            "memory_line": next((ln for ln in lines if "JAX's allocator takes" in ln), None),
            "verdict": next((ln for ln in reversed(lines) if re.match(r"(fits|does not fit)", ln)), None),
            "traceback": "Traceback" in p.stderr, "wall_s": round(wall, 1)}


def programs(timeout: float) -> dict:
    out = {}
    for name, config in TRAIN.items():
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "r.json")
            cmd = [sys.executable, "-m", "lrmq.train", "--config", config, "--compile-only", "--platform", "gpu",
                   "--topology", TOPOLOGY, "--report", report, "rollout.update_shapes=1"]
            print(" ".join(cmd[1:]), flush=True)
            p, wall = _run(cmd, timeout)
            out[name] = _summary(cmd, p, wall)
            if os.path.exists(report):
                with open(report) as f:
                    out[name]["report"] = json.load(f)
        print(out[name].get("verdict") or out[name], flush=True)
    cmd = [sys.executable, "-m", "lrmq.evaluate", "--config", "configs/eval/quantlrm.yaml", "--shapes", "qwen3-8b",
           "--compile-only", "--platform", "gpu", "--topology", TOPOLOGY]
    print(" ".join(cmd[1:]), flush=True)
    p, wall = _run(cmd, timeout)
    out["quantlrm eval qwen3-8b 32k"] = _summary(cmd, p, wall)
    print(out["quantlrm eval qwen3-8b 32k"].get("verdict"), flush=True)
    return out


def peak_bf16_flops(kind: str = "h200") -> float:
    """Dense BF16 FLOP/s of a kept GPU target (`lrmq.targets.gpu_peak_flops`): 989 TFLOP/s for H100 / H200."""
    from lrmq.targets import gpu_peak_flops

    return gpu_peak_flops(kind, "bf16")


def estimates() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from lrmq.aot import compiled_cost
    from lrmq.targets import gpu_specs, gpu_topology_devices
    from pallas_kernels import gpu as pk_gpu

    dev = gpu_topology_devices("h200")[0]
    spec = gpu_specs()[dev.device_kind]
    bw, peak = spec["bandwidth"], peak_bf16_flops("h200")
    sd = SingleDeviceSharding(dev)
    S = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sd)  # noqa: E731

    def timed(compiled, flops_analytic):
        cost = compiled_cost(compiled)
        ma = compiled.memory_analysis()
        io = float(ma.argument_size_in_bytes + ma.output_size_in_bytes)
        # the bytes a memory-bound matmul moves at least: its operands read once, its result written once (the
        # same rule for both programs; XLA's own count is recorded beside: it does not see inside the Triton custom
        # call, and for cuBLAS it adds the fusions around the call)
        nbytes = io
        flops = float(cost.get("flops", 0.0)) or flops_analytic
        return {"bytes": nbytes, "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)), "operand_bytes": io,
                "flops": flops, "xla_flops": float(cost.get("flops", 0.0)),
                "us": 1e6 * max(nbytes / bw, flops / peak), "bound": "memory" if nbytes / bw >= flops / peak else "compute"}

    rows = []
    for layer, (k, n) in SHAPES_8B.items():
        for m in DECODE_M:
            bf16 = jax.jit(lambda x, w: x @ w).lower(S((m, k), jnp.bfloat16), S((k, n), jnp.bfloat16)).compile()
            int4 = jax.jit(lambda x, c, s, z: pk_gpu.int4_matmul_gpu(x, c, s, z, GROUP)).lower(
                S((m, k), jnp.bfloat16), S((k // 2, n), jnp.uint8), S((k // GROUP, n), jnp.bfloat16),
                S((k // GROUP, n), jnp.uint8)).compile()
            a, b = timed(bf16, 2.0 * m * k * n), timed(int4, 2.0 * m * k * n)
            rows.append({"layer": layer, "M": m, "K": k, "N": n, "bf16": a, "int4_g128": b,
                         "speedup_estimate": a["us"] / b["us"]})
            print(f"{layer} M={m}: bf16 {a['us']:.1f} us ({a['bound']}), int4 {b['us']:.1f} us ({b['bound']}), "
                  f"x{a['us'] / b['us']:.2f}", flush=True)
    return {"device": dev.device_kind, "bandwidth_bytes_per_s": bw, "peak_bf16_flops": peak, "group_size": GROUP,
            "marlin_anchor": MARLIN, "rows": rows}


def decode_rate(prog: dict) -> dict | None:
    """Memory-bound tokens/s of a train report's rollout decode program (see the module docstring)."""
    rep = prog.get("report")
    if not rep:
        return None
    from lrmq.targets import gpu_specs

    bw = gpu_specs()["NVIDIA H200 141GB HBM3e"]["bandwidth"]
    dec = next(p for p in rep["programs"] if p["name"] == "rollout decode")
    if dec["memory"] is None:
        return None
    nbytes = dec["memory"]["arguments"]
    slots = rep["kv_pool"]["slots"]
    step = nbytes / bw
    return {"bytes_read_per_gpu": nbytes, "decode_slots_all_gpus": slots, "step_ms": 1e3 * step,
            "tokens_per_s_all_gpus": slots / step,
            "note": "bytes: the decode program's arguments per GPU, its share of the weights (tensor parallel in the "
                    "decode layout) and of the whole KV pool; collectives (activations only) not counted"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "figures", "gpu_aot.json"))
    ap.add_argument("--only", nargs="*", default=["programs", "estimates"], choices=["programs", "estimates"])
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    old = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
    res = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "commit": source_commit(), "topology": TOPOLOGY,
           "programs": old.get("programs"), "decode_rate": old.get("decode_rate"), "estimates": old.get("estimates")}
    if "programs" in args.only:
        res["programs"] = programs(args.timeout)
        res["decode_rate"] = {k: decode_rate(v) for k, v in res["programs"].items() if "report" in v}
    if "estimates" in args.only:
        res["estimates"] = estimates()
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
