"""W4A16 (int4, asymmetric, group g) matmul benchmark: bf16 dense vs XLA dequant+dot vs kernel.

    python benchmarks/int4_matmul.py --out runs/bench/int4        # full sweep on GPU/TPU
    python benchmarks/int4_matmul.py --quick --out /tmp/int4      # CPU smoke check

Writes <out>.md and <out>.json. Roofline fraction = bytes moved / time / peak HBM bandwidth.
On CPU the "kernel" column is the XLA path (impl="auto" resolves to "xla"; Pallas interpret mode
is an emulator whose timings mean nothing), so CPU runs only check that the script works.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels import dispatch as pkd  # noqa: E402
from pallas_kernels import reference as ref  # noqa: E402

FULL_M = (1, 8, 16, 32, 64, 128, 256)
FULL_KN = ((4096, 4096), (4096, 12288), (12288, 4096), (4096, 14336))
QUICK_M = (1, 16)
QUICK_KN = ((512, 384),)
# Peak HBM bandwidth (B/s) by device_kind substring (lower-cased); first match wins.
PEAK_BW = (("h200", 4.8e12), ("h100", 3.35e12), ("v5 lite", 8.19e11), ("v5e", 8.19e11),
           ("v6 lite", 1.64e12), ("v6e", 1.64e12))


def peak_bandwidth(kind: str, flag_gbps: float | None) -> float | None:
    if flag_gbps:
        return flag_gbps * 1e9
    kind = kind.lower()
    return next((bw for key, bw in PEAK_BW if key in kind), None)


def time_fn(fn, *args, warmup: int, iters: int) -> float:
    """Median wall time (s) of one call, each synchronised with block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def make_weights(k, n, g, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (k, n), dtype=np.uint8)
    codes = jnp.asarray(ref.pack_int4(q))
    scales = jnp.asarray(rng.uniform(1e-3, 1e-2, (k // g, n)), jnp.bfloat16)
    zeros = jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.uint8)
    w_dense = ref.dequantize_int4(codes, scales, zeros, g, dtype=jnp.bfloat16)
    return codes, scales, zeros, w_dense


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny subset (CPU smoke check)")
    ap.add_argument("--out", default="int4_matmul_bench", help="output path stem (.md/.json)")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--peak-gbps", type=float, default=None, help="peak HBM GB/s if not in table")
    args = ap.parse_args(argv)

    ms, kns = (QUICK_M, QUICK_KN) if args.quick else (FULL_M, FULL_KN)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    iters = args.iters if args.iters is not None else (5 if args.quick else 100)
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    peak = peak_bandwidth(kind, args.peak_gbps)
    impl, interpret = pkd.resolve_impl("auto")
    note = ""
    if impl == "xla":
        note = ("backend has no Pallas kernel path: the 'kernel' column is the XLA dequant+dot "
                "path (impl='auto' -> 'xla'); timings only show the script runs")
    g = args.group

    dense = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    xla = jax.jit(lambda x, c, s, z: pkd.int4_matmul(x, c, s, z, g, impl="xla"))
    kern = jax.jit(lambda x, c, s, z: pkd.int4_matmul(x, c, s, z, g, impl="auto"))

    rows = []
    for k, n in kns:
        codes, scales, zeros, w_dense = make_weights(k, n, g)
        for m in ms:
            x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
            t_bf16 = time_fn(dense, x, w_dense, warmup=warmup, iters=iters)
            t_xla = time_fn(xla, x, codes, scales, zeros, warmup=warmup, iters=iters)
            t_kern = time_fn(kern, x, codes, scales, zeros, warmup=warmup, iters=iters)
            act = 2 * (m * k + m * n)
            b_dense = 2 * k * n + act
            b_q = k * n // 2 + (k // g) * n * (scales.dtype.itemsize + 1) + act
            row = dict(M=m, K=k, N=n, group=g, bf16_us=t_bf16 * 1e6, xla_us=t_xla * 1e6,
                       kernel_us=t_kern * 1e6, speedup_vs_bf16=t_bf16 / t_kern,
                       speedup_vs_xla=t_xla / t_kern, bytes_bf16=b_dense, bytes_int4=b_q,
                       roofline_kernel=(b_q / t_kern / peak) if peak else None,
                       roofline_bf16=(b_dense / t_bf16 / peak) if peak else None)
            rows.append(row)
            print(f"M={m:4d} K={k:6d} N={n:6d}  bf16 {row['bf16_us']:9.1f}us  xla {row['xla_us']:9.1f}us"
                  f"  kernel {row['kernel_us']:9.1f}us  x{row['speedup_vs_bf16']:.2f} vs bf16"
                  f"  x{row['speedup_vs_xla']:.2f} vs xla", flush=True)

    meta = dict(device=str(dev), device_kind=kind, backend=jax.default_backend(),
                jax=jax.__version__, kernel_impl=impl, interpret=interpret, group=g,
                peak_bw_Bps=peak, warmup=warmup, iters=iters, quick=args.quick, note=note)
    fmt = lambda v: "n/a" if v is None else f"{v:.0%}"  # noqa: E731
    lines = [f"# int4 (g={g}, asym) matmul: {kind}", "",
             f"jax {jax.__version__}, backend {jax.default_backend()}, kernel impl `{impl}`, "
             f"peak {'n/a' if peak is None else f'{peak / 1e9:.0f} GB/s'}, median of {iters} "
             f"after {warmup} warmup.", ""]
    if note:
        lines += [f"**Note:** {note}.", ""]
    lines += ["| M | K | N | bf16 us | XLA dequant+dot us | kernel us | vs bf16 | vs XLA | "
              "kernel roofline | bf16 roofline |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {r['bf16_us']:.1f} | {r['xla_us']:.1f} | "
                     f"{r['kernel_us']:.1f} | {r['speedup_vs_bf16']:.2f}x | {r['speedup_vs_xla']:.2f}x"
                     f" | {fmt(r['roofline_kernel'])} | {fmt(r['roofline_bf16'])} |")
    stem = args.out[:-3] if args.out.endswith(".md") else args.out[:-5] if args.out.endswith(".json") else args.out
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("\n".join(lines))
    print(f"wrote {stem}.md and {stem}.json")


if __name__ == "__main__":
    main()
