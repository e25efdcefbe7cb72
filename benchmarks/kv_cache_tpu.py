"""The quantized KV cache (issue 36) compiled for TPU slices (no TPU needed): bytes per decode step, slots that fit.

Two parts, each case in a fresh process, one compile at a time (resumable: a case already in --out is kept
unless --redo):

* **decode**: the rollout engine's decode program (`benchmarks/decode_tpu.py`'s `measure`: mesh data=1 x
  fsdp=8, 16-token pages, the worst-case pool, i.e. no sequence is ever preempted) with the KV pages in bf16 (the
  model's dtype, `kv_cache=auto`) and in fp8 (`fp8_e4m3`; int8 for one case), bf16 and fp8 rows of a shape
  compiled one after the other in the same run. Per chip: XLA's memory of the compiled program against HBM; the
  HBM bytes one decode step reads, i.e. the chip's share of the weights in the decode layout plus the KV pages its
  attention reads at the mean context (prompt + new / 2, rounded up to the kernel's blocks), at the bytes per
  token of the compiled program's pool argument (its input sharding and dtype; int8 with its scale pages); the
  dtype of the pool operand the Mosaic kernel reads in the compiled HLO (fp8 pages, not a bf16 copy); the
  memory-bound tok/s per chip (slots / chips x published HBM bandwidth / bytes per step).
* **evaluate**: `python -m lrmq.evaluate --compile-only --shapes qwen3-8b --suite quantlrm --topology v5e:2x4
  generation.kv_cache=F` (`benchmarks/evaluate_tpu.py`'s `run`): QuantLRM's 32 slots of 512 + 32,256 tokens,
  the command's verdict line, table, pool line and exit status.

    python benchmarks/kv_cache_tpu.py --out docs/figures/kv_cache_tpu.json          # every case
    python benchmarks/kv_cache_tpu.py --only qwen3-0.6b/v5e:2x4/256x512+512/kv=fp8_e4m3
    python benchmarks/kv_cache_tpu.py --redo --mesh 2x4                             # the decode rows at 2x4
    python benchmarks/kv_cache_tpu.py --table                                       # the markdown tables
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re

from common import REPO, machine_info, md_table, write_json
from decode_tpu import _case, run_case
from evaluate_tpu import run as run_evaluate

FP8 = "fp8_e4m3"  # fp8_e5m2 has the same bytes (1 per entry, per-head scales)
KERNEL_FP8 = dict(kv_cache=FP8, mesh=(2, 4))  # 2 KV heads per chip: JAX's kernel tiles fp8 pages (below)
XLA_FP8 = dict(kv_cache=FP8, impl="xla")  # the XLA path on the fp8 pool, 1 KV head per chip (data=1 x fsdp=8)


def _rows(model, topology, slots, prompt, new, *variants, **kw):
    return [_case(model, topology, slots, prompt, new, **kw, **v) for v in variants]


# Each shape: bf16 pages (the engine as before: data=1 x fsdp=8, the TPU kernel, 1 of Qwen3's 8 KV heads per
# chip), then fp8 pages. With 1 KV head per chip (2 combined K/V heads) JAX's ragged paged attention refuses fp8
# pages ("num_combined_kv_heads=2 can not be XLA fully tiled": fp8 packs 4 to a 32-bit word), so `kv_cache=fp8`
# with impl "auto" fails there; the two paths that compile are the kernel on a data=2 x fsdp=4 mesh (2 KV heads
# per chip; since issue 49 the pool's pages split over data too) and the XLA path on the fp8 pool at data=1 x fsdp=8.
DECODE = dict([
    # Qwen3-0.6B, the paper-1 rollout (256 x 512 + 512 on v5e-8); int8 (the XLA path: the kernel has no int8)
    *_rows("qwen3-0.6b", "v5e:2x4", 256, 512, 512, {}, dict(kv_cache=FP8), KERNEL_FP8, dict(mesh=(2, 4)), XLA_FP8,
           dict(kv_cache="int8")),
    *_rows("qwen3-0.6b", "v5p:2x2x2", 256, 512, 512, {}, KERNEL_FP8),
    *_rows("qwen3-0.6b", "v6e:2x4", 256, 512, 512, {}, KERNEL_FP8),
    # longer reasoning: 256 x 512 + 4,096 (bf16 does not fit v5e-8 without preemption; v6e-8 holds it)
    *_rows("qwen3-0.6b", "v6e:2x4", 256, 512, 4096, {}, KERNEL_FP8, XLA_FP8),
    *_rows("qwen3-0.6b", "v5e:2x4", 256, 512, 4096, {}, KERNEL_FP8, XLA_FP8),
    # Qwen3-8B on v6e-8, 256 slots: the paper's 512 + 1,024 (where int4 weights alone gave 1.23x) and 512 + 4,096
    *_rows("qwen3-8b", "v6e:2x4", 256, 512, 1024, {}, dict(weights="int4"), KERNEL_FP8,
           dict(weights="int4", **KERNEL_FP8)),
    *_rows("qwen3-8b", "v6e:2x4", 256, 512, 4096, {}, dict(weights="int4"), KERNEL_FP8,
           dict(weights="int4", **KERNEL_FP8), XLA_FP8, dict(kv_cache=FP8)),
    # QuantLRM's evaluation (32 slots of 512 + 32,256, Qwen3-8B) on v5e-8, the prefill compiled too: bf16 needed
    # 16 slots (docs/figures/evaluate_tpu.json); fp8 pages on the kernel (2 KV heads per chip) and int8 pages (the
    # XLA path, 1 KV head per chip) at 32
    *_rows("qwen3-8b", "v5e:2x4", 32, 512, 32256, KERNEL_FP8, dict(kv_cache="int8"), prefill=True),
    *_rows("qwen3-8b", "v5e:2x4", 16, 512, 32256, KERNEL_FP8, prefill=True),
])

# the command issue 49 names, with fp8 pages: 32 slots of 512 + 32,256 tokens; with no mesh given, evaluate takes
# data=2 x fsdp=4 (2 KV heads per chip for the fp8 kernel) and the KV pool's pages split over data
EVALUATE = {f"qwen3-8b/quantlrm/v5e:2x4/kv={FP8}": ("v5e:2x4", FP8)}
EVALUATE_ARGS = ("--prompt-len", "512", "generation.batch_size=32")


def baseline(name: str) -> str:
    """The bf16-weights, bf16-KV case (data=1 x fsdp=8, the kernel) of the same model, topology and shape."""
    return "/".join(name.split("/")[:3])


def decode_table(results: dict) -> str:
    gib, mib = (lambda b: b / 2 ** 30), (lambda b: b / 2 ** 20)
    rows = []
    for name in [n for n in DECODE if n in results]:
        r, base = results[name], results.get(baseline(name), {})
        fmt = {"auto": "bf16"}.get(r.get("kv_cache", "auto"), r.get("kv_cache"))
        mesh = "x".join(map(str, r.get("mesh") or (1, 8)))
        head = [r["model"], r["topology"], f"{r['slots']} x {r['prompt']}+{r['new']}", r.get("weights", "bf16"), fmt,
                mesh]
        if "error" in r:
            m = re.search(r"temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", r["error"])
            why = (f"refused by the compiler: {m.group(1)} of temporaries > {m.group(2)}" if m
                   else f"error: {r['error'][:160]}")
            if r.get("prefill", {}).get("refused"):
                m = re.search(r"temporaries \(([\d.]+G)\)", r["prefill"]["refused"])
                why += f"; prefill refused too ({m.group(1) if m else '?'})"
            rows.append(head + [r.get("impl", "-"), "-", "-", why, "no"] + ["-"] * 6)
            continue
        ratio = base["step_hbm_bytes"] / r["step_hbm_bytes"] if "step_hbm_bytes" in base else None
        path = ("kernel, " + ",".join(o.split("[")[0] for o in r["kernel_pool_operands"])
                if r["impl"] == "tpu" else "XLA")
        fits = "yes" if r["fits"] else "no"
        if "prefill" in r:
            pre = r["prefill"]
            fits = ("yes" if r["fits_with_prefill"] else "no") + (
                f" (prefill {gib(aot_total(pre)):.2f})" if pre["memory"] else " (prefill refused)")
        rows.append(head + [path, gib(r["pool_bytes_per_chip"]), mib(r["weight_bytes_per_chip"]),
                            f"{gib(r['memory']['total']):.2f} of {gib(r['hbm_bytes']):.0f}", fits,
                            mib(r["kv_read_bytes_per_step"]), mib(r.get("pool_copy_bytes_per_step", 0)),
                            mib(r["step_hbm_bytes"]), "-" if ratio is None else f"{ratio:.2f}x",
                            r["tokens_per_s_per_chip"], f"{r['compile_s']:.0f}"])
    return md_table(["model", "topology", "slots x prompt+new", "weights", "KV pages", "mesh data x fsdp",
                     "decode attention", "KV pool GiB/chip", "weights MiB/chip", "decode GiB/chip",
                     "fits (10% headroom)", "KV read MiB/step/chip", "pool copies MiB/step/chip",
                     "HBM MiB/step/chip", "bf16 bytes / these", "tok/s/chip bound", "compile s"], rows)


def aot_total(row: dict) -> float:
    m = row["memory"]
    return m["total"]


def evaluate_table(results: dict) -> str:
    rows = []
    for name, r in results.items():
        pool = next((ln for ln in r.get("output", []) if ln.startswith("KV pool:")), "-")
        decode = next((ln for ln in r.get("table", []) if ln.startswith("| decode")), "")
        prefill = next((ln for ln in r.get("table", []) if ln.startswith("| prefill")), "")
        total = lambda ln: ln.split("|")[6].strip() if ln.count("|") > 6 else "-"  # noqa: E731
        rows.append([r["topology"], {"auto": "bf16"}.get(r["kv_cache"], r["kv_cache"]),
                     r.get("exit_status", "-"), total(prefill), total(decode), pool.removeprefix("KV pool: "),
                     r.get("verdict") or r.get("exception") or r.get("error")])
    return md_table(["topology", "KV pages", "exit", "prefill GiB/chip", "decode GiB/chip", "KV pool", "verdict"],
                    rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "figures", "kv_cache_tpu.json"))
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--mesh", help="only the decode cases at this mesh, data x fsdp (e.g. 2x4; 1x8: the default "
                    "mesh); other rows in --out are kept")
    ap.add_argument("--redo", action="store_true")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    data = json.load(open(args.out)) if os.path.exists(args.out) else {}
    data.setdefault("decode", {})
    data.setdefault("evaluate", {})
    if args.table:
        print(decode_table(data["decode"]), evaluate_table(data["evaluate"]), sep="\n\n")
        return
    if args.mesh and not re.fullmatch(r"\d+x\d+", args.mesh):
        ap.error(f"--mesh {args.mesh!r}: expected data x fsdp, e.g. 2x4")
    data["machine"] = machine_info()
    chips = lambda topology: math.prod(map(int, topology.split(":")[1].split("x")))  # noqa: E731
    mesh_of = lambda spec: "x".join(map(str, spec.get("mesh") or (1, chips(spec["topology"]))))  # noqa: E731
    todo = lambda name, part: ((not args.only or name in args.only)  # noqa: E731
                               and (args.redo or name not in data[part]))
    for name, spec in DECODE.items():
        if not todo(name, "decode") or (args.mesh and mesh_of(spec) != args.mesh):
            continue
        print(f"compiling {name} ...", flush=True)
        data["decode"][name] = r = run_case(name, args.timeout, spec)
        print(json.dumps({k: r.get(k) for k in ("fits", "error", "compile_s", "pool_bytes_per_chip",
                                                 "step_hbm_bytes", "tokens_per_s_per_chip",
                                                 "kernel_pool_operands")}), flush=True)
        write_json(args.out, data, sort_keys=True)
    for name, (topology, kv) in EVALUATE.items():
        if not todo(name, "evaluate") or args.mesh:  # evaluate picks its own mesh
            continue
        print(f"compiling {name} ...", flush=True)
        r = run_evaluate(topology, "qwen3-8b", "quantlrm", args.timeout,
                         overrides=(*EVALUATE_ARGS, f"generation.kv_cache={kv}"))
        data["evaluate"][name] = r = {**r, "kv_cache": kv}
        print(r.get("verdict") or r.get("error"), f"(exit {r.get('exit_status')})", flush=True)
        write_json(args.out, data, sort_keys=True)
    print(decode_table(data["decode"]), evaluate_table(data["evaluate"]), sep="\n\n")


if __name__ == "__main__":
    main()
