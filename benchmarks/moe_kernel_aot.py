"""The grouped (mixture-of-experts) int4 / int8 dequant-matmul kernel compiled ahead of time for TPU v5e, v5p and
v6e on a CPU-only host (libtpu compiles for a topology; no TPU is used), at Qwen3-30B-A3B's expert shapes.

Qwen3-30B-A3B: 128 experts, hidden 2048, moe_intermediate 768, top-8. Per sparse layer the experts' gate and up
projections are [128, 2048, 768] and the down projection [128, 768, 2048]; int4 g128 (asymmetric, f32 scales,
lrmq's layout) by default, also int8 per channel. Rows are token-expert slots sorted by expert: decode (64 slots:
8 sequences x top-8), prefill and update chunks (8192 slots: 1024 tokens x top-8). Each case is one
`pallas_kernels.grouped_int4_matmul` / `grouped_int8_matmul` call jitted under a one-chip mesh of the generation
(impl="auto" resolves to the Mosaic kernel, as in a compiled train or decode step) and compiled; recorded: whether
the compiled HLO holds the Mosaic custom call, the tiles, the grid, the compile seconds and XLA's
memory_analysis (argument / output / temporary bytes per chip), beside the packed expert weight's bytes.

    python benchmarks/moe_kernel_aot.py --out docs/figures/moe_kernel_aot.json
    python benchmarks/moe_kernel_aot.py --quick --out /tmp/moe_aot.json      # one case per generation
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, source_commit, write_json  # noqa: E402

TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
EXPERTS, HIDDEN, MOE_INTERMEDIATE, TOP_K = 128, 2048, 768, 8
PROJECTIONS = {"gate_up": (HIDDEN, MOE_INTERMEDIATE), "down": (MOE_INTERMEDIATE, HIDDEN)}  # (K, N)
ROWS = {"decode": 8 * TOP_K, "prefill": 1024 * TOP_K}
FORMATS = {"int4 g128": ("int4", 128), "int8 per-channel": ("int8", 0)}


def _mesh(gen: str):
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh

    devices = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[gen]).devices
    return Mesh(np.array(devices[:1]), ("x",), axis_types=(AxisType.Auto,))


def compile_case(gen: str, fmt_name: str, proj: str, phase: str, e: int = EXPERTS) -> dict:
    """Compile one grouped call for `gen`; the case's record."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import pallas_kernels as pk
    from pallas_kernels import tpu_grouped
    from pallas_kernels.tpu_tiles import generation

    fmt, g = FORMATS[fmt_name]
    k, n = PROJECTIONS[proj]
    m = ROWS[phase]
    ng = 1 if g == 0 else k // g
    rows = k // 2 if fmt == "int4" else k
    mesh = _mesh(gen)
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    args = (sd((m, k), jnp.bfloat16), sd((e,), jnp.int32), sd((e, rows, n), jnp.uint8),
            sd((e, ng, n), jnp.float32), sd((e, ng, n), jnp.uint8))
    fn = pk.grouped_int4_matmul if fmt == "int4" else pk.grouped_int8_matmul
    kind = mesh.devices.flat[0].device_kind
    t, staged = tpu_grouped.plan_grouped(fmt, m, k, n, g or k, g == 0, x_dtype=jnp.bfloat16, s_dtype=jnp.float32,
                                         gen=generation(kind))
    rec = {"generation": gen, "device_kind": kind, "format": fmt_name, "projection": proj, "phase": phase,
           "experts": e, "rows": m, "K": k, "N": n,
           "tiles": {"bm": t.bm, "bn": t.bn, "bk": t.bk, "vmem_limit_mib": t.vmem_limit >> 20,
                     "zero_points_staged": bool(staged)},
           "grid": [t.np_ // t.bn, -(-m // t.bm) + e - 1, t.kp // t.bk],
           "packed_weight_bytes": sum(a.shape[0] * a.shape[1] * a.shape[2] * jnp.dtype(a.dtype).itemsize
                                      for a in args[2:])}
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            compiled = jax.jit(fn).lower(*args).compile()
        rec["compile_s"] = round(time.perf_counter() - start, 2)
        text = compiled.as_text()
        rec["status"] = "compiled" if "tpu_custom_call" in text else "failed"
        rec["mosaic_kernel"] = "tpu_custom_call" in text
        ma = compiled.memory_analysis()
        rec["memory"] = {f: int(getattr(ma, f)) for f in ("argument_size_in_bytes", "output_size_in_bytes",
                                                           "temp_size_in_bytes", "generated_code_size_in_bytes")
                         if hasattr(ma, f)}
    except Exception as err:  # a compile failure is the finding: record it, keep going
        rec["status"] = "failed"
        rec["error"] = str(err).strip().splitlines()[0][:400]
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--quick", action="store_true", help="one case per generation (int4 g128 gate_up decode)")
    args = ap.parse_args(argv)
    import libtpu  # noqa: F401  (the AOT compiler: a missing one is an error, not a skipped figure)

    cases = [(gen, f, p, ph) for gen in TOPOLOGIES for f in FORMATS for p in PROJECTIONS for ph in ROWS]
    if args.quick:
        cases = [(gen, "int4 g128", "gate_up", "decode") for gen in TOPOLOGIES]
    results = []
    for c in cases:
        rec = compile_case(*c)
        print(f"{rec['generation']} {rec['format']} {rec['projection']} {rec['phase']} (M={rec['rows']}): "
              f"{rec['status']} {rec.get('compile_s', '')}s temp={rec.get('memory', {}).get('temp_size_in_bytes')}"
              f" {rec.get('error', '')}", flush=True)
        results.append(rec)
    payload = {"what": "grouped MoE dequant-matmul, AOT for TPU (Qwen3-30B-A3B expert shapes)",
               "machine": machine_info(), "commit": source_commit(), "cases": results,
               "all_compiled": all(r["status"] == "compiled" for r in results)}
    write_json(args.out, payload)
    return 0 if payload["all_compiled"] else 1


if __name__ == "__main__":
    sys.exit(main())
