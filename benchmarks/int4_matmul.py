"""W4A16 (int4, asymmetric, group g) matmul benchmark: bf16 dense vs XLA dequant+dot vs kernel.

    python benchmarks/int4_matmul.py --out runs/bench/int4        # full sweep on GPU/TPU
    python benchmarks/int4_matmul.py --quick --out /tmp/int4      # CPU smoke check

Writes <out>.md and <out>.json. Roofline fraction = bytes moved / time / peak HBM bandwidth.
On CPU the "kernel" column is the XLA path (impl="auto" resolves to "xla"; Pallas interpret mode
is an emulator whose timings mean nothing), so CPU runs only check that the script works.

Timing (a decode matmul takes microseconds, less than one Python dispatch, and its weight fits in a
GPU's L2): each timed program runs the matmul on `copies` different weight copies (one launch each,
unrolled in one jit), enough that one program streams >= --rotate-mb of int4 weights (several times
an H100/H200's 60 MB L2), so every weight read comes from HBM; `reps` programs are dispatched back to
back and synchronised once; the time per matmul is that over reps * copies, median of --iters
samples after --warmup. All programs are compiled first, in threads. Each row also records the
kernel's and the XLA path's relative error against the f32 reference (HIGHEST) on copy 0, and a
column whose compile or run fails records its error instead of ending the sweep.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels import dispatch as pkd  # noqa: E402
from pallas_kernels import reference as ref  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import time_dispatched  # noqa: E402

FULL_M = (1, 8, 16, 32, 64, 128, 256)
FULL_KN = ((4096, 4096), (4096, 12288), (12288, 4096), (4096, 14336))
QUICK_M = (1, 16)
QUICK_KN = ((512, 384),)
# Peak HBM bandwidth (B/s) by device_kind substring (lower-cased); first match wins.
PEAK_BW = (("h200", 4.8e12), ("h100", 3.35e12), ("v5 lite", 8.19e11), ("v5e", 8.19e11),
           ("v6 lite", 1.64e12), ("v6e", 1.64e12))
COLUMNS = ("bf16", "xla", "kernel")


def peak_bandwidth(kind: str, flag_gbps: float | None) -> float | None:
    if flag_gbps:
        return flag_gbps * 1e9
    kind = kind.lower()
    return next((bw for key, bw in PEAK_BW if key in kind), None)


def make_weights(k, n, g, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (k, n), dtype=np.uint8)
    codes = jnp.asarray(ref.pack_int4(q))
    scales = jnp.asarray(rng.uniform(1e-3, 1e-2, (k // g, n)), jnp.bfloat16)
    zeros = jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.uint8)
    w_dense = ref.dequantize_int4(codes, scales, zeros, g, dtype=jnp.bfloat16)
    return codes, scales, zeros, w_dense


@jax.jit
def _variant(codes, scales, c):
    """Copy c of a weight: other codes and scales (same shapes and dtypes), made on the device."""
    return ((codes.astype(jnp.int32) + 37 * c) % 256).astype(jnp.uint8), \
        (scales.astype(jnp.float32) * (1 + 0.01 * c)).astype(scales.dtype)


def weight_copies(k, n, g, copies):
    codes, scales, zeros, _ = make_weights(k, n, g)
    out = []
    for c in range(copies):
        cc, sc = (codes, scales) if c == 0 else _variant(codes, scales, c)
        out.append((cc, sc, zeros, ref.dequantize_int4(cc, sc, zeros, g, dtype=jnp.bfloat16)))
    return out


def copies_for(k, n, g, rotate_bytes, quick):
    if quick:
        return 1
    int4_bytes = k * n // 2 + (k // g) * n * 3
    return max(2, min(64, math.ceil(rotate_bytes / int4_bytes)))


def programs(g):
    """column -> f(x, weights) running the matmul once per weight copy (one launch each)."""
    def dense(x, ws):
        return tuple(jnp.dot(x, w[3], preferred_element_type=jnp.float32).astype(x.dtype) for w in ws)

    def xla(x, ws):
        return tuple(pkd.int4_matmul(x, *w[:3], g, impl="xla") for w in ws)

    def kern(x, ws):
        return tuple(pkd.int4_matmul(x, *w[:3], g, impl="auto") for w in ws)

    return {"bf16": jax.jit(dense), "xla": jax.jit(xla), "kernel": jax.jit(kern)}


def _err(e: BaseException) -> str:
    """The exception's type and message, without jax's traceback-filtering note."""
    text = "".join(traceback.format_exception_only(type(e), e))
    keep = [line for line in text.splitlines() if line.strip() and "JAX has removed its internal frames" not in line
            and set(line.strip()) != {"-"}]
    return "\n".join(keep)[:4000]


def rel_err(y, y_ref) -> float:
    y, y_ref = np.asarray(y, np.float64), np.asarray(y_ref, np.float64)
    return float(np.linalg.norm(y - y_ref) / max(np.linalg.norm(y_ref), 1e-30))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny subset (CPU smoke check)")
    ap.add_argument("--out", default="int4_matmul_bench", help="output path stem (.md/.json)")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None, help="timed samples per column (median)")
    ap.add_argument("--reps", type=int, default=None, help="programs dispatched per sample")
    ap.add_argument("--rotate-mb", type=float, default=256.0,
                    help="int4 weight MB one timed program streams (weight copies; L2 rotation)")
    ap.add_argument("--compile-threads", type=int, default=8)
    ap.add_argument("--peak-gbps", type=float, default=None, help="peak HBM GB/s if not in table")
    args = ap.parse_args(argv)

    ms, kns = (QUICK_M, QUICK_KN) if args.quick else (FULL_M, FULL_KN)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    iters = args.iters if args.iters is not None else (3 if args.quick else 15)
    reps = args.reps if args.reps is not None else (1 if args.quick else 5)
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    peak = peak_bandwidth(kind, args.peak_gbps)
    impl, interpret = pkd.resolve_impl("auto")
    note = ""
    if impl == "xla":
        note = ("backend has no Pallas kernel path: the 'kernel' column is the XLA dequant+dot "
                "path (impl='auto' -> 'xla'); timings only show the script runs")
    g = args.group
    progs = programs(g)
    t_start = time.perf_counter()

    # weights and activations, then every program compiled (threads: XLA compiles release the GIL)
    shapes = {}
    for k, n in kns:
        copies = copies_for(k, n, g, args.rotate_mb * 2 ** 20, args.quick)
        ws = weight_copies(k, n, g, copies)
        for m in ms:
            x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
            shapes[m, k, n] = (x, ws)
    jax.block_until_ready(shapes)

    def compile_one(key):
        (m, k, n), col = key
        x, ws = shapes[m, k, n]
        try:
            return progs[col].lower(x, ws).compile(), None
        except Exception as e:  # noqa: BLE001 - recorded in the row
            return None, _err(e)

    keys = [(s, col) for s in shapes for col in COLUMNS]
    with ThreadPoolExecutor(max(1, args.compile_threads)) as pool:
        compiled = dict(zip(keys, pool.map(compile_one, keys)))
    t_compiled = time.perf_counter()
    print(f"compiled {len(keys)} programs in {t_compiled - t_start:.1f} s "
          f"({sum(c[1] is not None for c in compiled.values())} failed)", flush=True)

    def report(complete: bool):
        """Write <out>.md / <out>.json for the rows so far (after every row: a sweep cut short keeps them)."""
        meta = dict(device=str(dev), device_kind=kind, backend=jax.default_backend(),
                    jax=jax.__version__, kernel_impl=impl, interpret=interpret, group=g,
                    peak_bw_Bps=peak, warmup=warmup, iters=iters, reps=reps, rotate_mb=args.rotate_mb,
                    quick=args.quick, note=note, complete=complete, host=platform.node(),
                    python=platform.python_version(),
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    compile_s=round(t_compiled - t_start, 1),
                    total_s=round(time.perf_counter() - t_start, 1),
                    method=("per matmul: median over samples of (reps programs back to back, one sync) / "
                            "(reps * copies); each program runs the matmul on `copies` weight copies"))
        fmt = lambda v: "n/a" if v is None else f"{v:.0%}"  # noqa: E731
        us = lambda v: "FAIL" if v is None else f"{v:.1f}"  # noqa: E731
        sx = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        lines = [f"# int4 (g={g}, asym) matmul: {kind}", "",
                 f"jax {jax.__version__}, backend {jax.default_backend()}, kernel impl `{impl}`, "
                 f"peak {'n/a' if peak is None else f'{peak / 1e9:.0f} GB/s'}, {meta['date']}. Per matmul: "
                 f"median of {iters} samples ({reps} programs of `copies` matmuls on distinct weight copies, "
                 f"one sync) after {warmup} warmup.", ""]
        if note:
            lines += [f"**Note:** {note}.", ""]
        lines += ["| M | K | N | copies | bf16 us | XLA dequant+dot us | kernel us | kernel vs bf16 | kernel vs XLA | "
                  "XLA vs bf16 | kernel rel. err | kernel roofline | XLA roofline | bf16 roofline |",
                  "|" + "---|" * 14]
        for r in rows:
            ke = r.get("kernel_rel_err")
            lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {r['copies']} | {us(r['bf16_us'])} | {us(r['xla_us'])} | "
                         f"{us(r['kernel_us'])} | {sx(r['speedup_vs_bf16'])} | {sx(r['speedup_vs_xla'])} | "
                         f"{sx(r['xla_speedup_vs_bf16'])} | {'-' if ke is None else f'{ke:.1e}'} | "
                         f"{fmt(r['roofline_kernel'])} | {fmt(r['roofline_xla'])} | {fmt(r['roofline_bf16'])} |")
        errors = {f"{col}: {r[col + '_error'].splitlines()[0][:300]}" for r in rows for col in COLUMNS
                  if col + "_error" in r}
        if errors:
            lines += ["", "Failures (first line of each distinct error; full text in the JSON):", ""]
            lines += [f"* {e}" for e in sorted(errors)]
        stem = args.out[:-3] if args.out.endswith(".md") else args.out[:-5] if args.out.endswith(".json") else args.out
        os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
        with open(stem + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(stem + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        return stem, lines, errors

    f32_ref = jax.jit(lambda x, c, s, z: ref.int4_matmul_reference(x, c, s, z, g))
    rows = []
    for (m, k, n), (x, ws) in shapes.items():
        copies = len(ws)
        row = dict(M=m, K=k, N=n, group=g, copies=copies)
        y_ref = f32_ref(x, *ws[0][:3])
        for col in COLUMNS:
            fn, err = compiled[(m, k, n), col]
            row[f"{col}_us"] = None
            if err is None:
                try:
                    row[f"{col}_us"] = time_dispatched(fn, x, ws, warmup=warmup, iters=iters, reps=reps) / copies * 1e6
                    if col != "bf16":
                        row[f"{col}_rel_err"] = rel_err(fn(x, ws)[0], y_ref)
                except Exception as e:  # noqa: BLE001 - recorded in the row
                    err = _err(e)
            if err is not None:
                row[f"{col}_error"] = err
        tb, tx, tk = row["bf16_us"], row["xla_us"], row["kernel_us"]
        act = 2 * (m * k + m * n)
        b_dense = 2 * k * n + act
        b_q = k * n // 2 + (k // g) * n * (ws[0][1].dtype.itemsize + 1) + act
        ratio = lambda a, b: (a / b) if a and b else None  # noqa: E731
        row.update(speedup_vs_bf16=ratio(tb, tk), speedup_vs_xla=ratio(tx, tk),
                   xla_speedup_vs_bf16=ratio(tb, tx), bytes_bf16=b_dense, bytes_int4=b_q,
                   roofline_kernel=(b_q / (tk * 1e-6) / peak) if peak and tk else None,
                   roofline_xla=(b_q / (tx * 1e-6) / peak) if peak and tx else None,
                   roofline_bf16=(b_dense / (tb * 1e-6) / peak) if peak and tb else None)
        rows.append(row)
        report(complete=False)
        f = lambda v, w=9: f"{v:{w}.1f}" if v is not None else " " * (w - 4) + "FAIL"  # noqa: E731
        r = lambda v: f"x{v:.2f}" if v is not None else "x-"  # noqa: E731
        print(f"M={m:4d} K={k:6d} N={n:6d}  bf16 {f(tb)}us  xla {f(tx)}us  kernel {f(tk)}us  "
              f"{r(row['speedup_vs_bf16'])} vs bf16  {r(row['speedup_vs_xla'])} vs xla", flush=True)
        for col in COLUMNS:
            if f"{col}_error" in row:
                print(f"  {col} failed: {row[col + '_error'].splitlines()[0][:300]}", flush=True)

    stem, lines, errors = report(complete=True)
    print("\n".join(lines))
    print(f"wrote {stem}.md and {stem}.json")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
