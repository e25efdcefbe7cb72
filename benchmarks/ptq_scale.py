"""PTQ at the papers' scale, compiled ahead of time on a CPU-only host: the four paper models x {v5e-8, v6e-8, v5p-8,
one H200} x {AWQ, GPTQ, QuantLRM} x W3 / W4 g128, each the check `python -m lrmq.quantize --compile-only` runs
(`lrmq.ptq_aot.check`): every per-layer program compiled for the target (libtpu for the TPU hosts, JAX's CUDA plugin
for the H200), fits or not, the per-chip peak from XLA's memory analysis, the host RSS the run needs (counted:
`lrmq.ptq.programs.host_bytes`), and the time per layer and per model **estimated** from the compiled programs' cost
analysis against the chip's published peak FLOP/s and HBM bandwidth (`lrmq.targets.chip_peaks`; nothing ran on a TPU
or a GPU); GPTQ's host-side quantization estimated from a rate measured on this machine. Calibration: 128 blocks x
512 tokens, 8 blocks per chip step (the defaults).

    python benchmarks/ptq_scale.py --out docs/figures/ptq_scale.json            # every target, one process each
    python benchmarks/ptq_scale.py --out docs/figures/ptq_scale.json --target v5p-8
    python benchmarks/ptq_scale.py --out docs/figures/ptq_scale.json --reasoning  # QuantLRM's calibration, W3
    python benchmarks/ptq_scale.py --out docs/figures/ptq_scale.json --moe        # Qwen3-30B-A3B GPTQ W4 per expert
    python benchmarks/ptq_scale.py --markdown docs/figures/ptq_scale.json       # docs/ptq.md's tables

--reasoning: QuantLRM's own calibration recipe (calibration.source reasoning: the first 128 x 2,048 = 262,144 tokens,
cut into 512 blocks of 512), W3, every model and target: 4x the blocks of the default, the same units on a chip.

--moe: Qwen3-30B-A3B (128 experts, top-8) AWQ / GPTQ / QuantLRM W4 g128 per expert with calibration.moe_experts=all
(GPTQ: the stage forwards with the grouped expert forward, X^T X of the shared inputs, the 128 experts' down_proj
Hessians on each chip, the host's 3 x 128 solves per layer; AWQ / QuantLRM: the per-expert up -> down statistic and
grid losses, the shared norm -> router + experts' gate/up scale, clip search and quantizer per expert slice), each
case with its own machine, date and versions.

Cases already in --out are kept (rerun with --force); the file is rewritten after each case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MODELS = ("qwen3-8b", "olmo-3-7b", "r1-distill-qwen-32b", "r1-distill-llama-70b")
# name -> (platform, topology); a v5p "-8" is 8 TensorCores: 4 chips
TARGETS = {"v5e-8": ("tpu", "v5e:2x4"), "v6e-8": ("tpu", "v6e:2x4"), "v5p-8": ("tpu", "v5p:2x2x1"),
           "H200": ("gpu", "h200:1")}
METHODS = ("awq", "gptq", "quantlrm")
BITS = (3, 4)
N_BLOCKS, BLOCK_SIZE, BATCH = 128, 512, 8
MOE_MODELS = ("qwen3-30b-a3b",)  # --moe: AWQ / GPTQ / QuantLRM W4 per expert
REASONING = (512, 512)  # QuantLRM's calibration (docs/ptq.md "Calibration"): blocks, tokens per block


def key(model, target, method, bits, reasoning=False) -> str:
    return f"{model} {target} {method} W{bits}" + (" reasoning" if reasoning else "")


def versions() -> dict:
    from importlib import metadata

    from lrmq.targets import gpu_plugin_dir

    # the CUDA plugin may sit in make install's side directory (lrmq.targets.gpu_plugin_dir), not site-packages
    side = {d.metadata["Name"]: d.version for d in metadata.distributions(path=[gpu_plugin_dir()])}
    out = {}
    for dist in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "flax"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = side.get(dist, side.get(dist.replace("-", "_")))
    return out


def load(path: str) -> dict:
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return {"cases": {}}


def save(path: str, data: dict) -> None:
    from lrmq.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def case_record(fit, cfg, qcfg, model: str, target: str, n_blocks: int, block_size: int) -> dict:
    from lrmq import ptq_aot

    rep = ptq_aot.report_dict(fit, cfg, qcfg, model, n_blocks, block_size)
    worst = max(fit.rows, key=ptq_aot.per_chip)
    rep["largest_program"] = worst["name"]
    rep["compile_seconds"] = sum(r["seconds"] for r in fit.rows)
    rep["target_name"] = target
    # the rows without their long lists: name, calls, kind, per-chip bytes, flops / bytes per call, estimate
    rep["programs"] = [{"name": r["name"], "calls": r["calls"], "kind": r["kind"],
                        "per_chip_bytes": ptq_aot.per_chip(r), "flops": r["flops"], "bytes": r["bytes"],
                        "xla_flops": r["xla_flops"], "estimate_s": r.get("estimate_s"), "compile_s": r["seconds"]}
                       for r in fit.rows]
    return rep


def cases(reasoning: bool, moe: bool) -> list[tuple[str, str, int]]:
    """(model, method, bits) of a sweep: the main one, QuantLRM's own calibration, or the MoE one."""
    if moe:
        return [(m, method, 4) for m in MOE_MODELS for method in METHODS]
    if reasoning:
        return [(m, "quantlrm", 3) for m in MODELS]
    return [(m, method, bits) for m in MODELS for method in METHODS for bits in BITS]


def run_target(target: str, out: str, force: bool, reasoning: bool = False, moe: bool = False) -> None:
    """Every model x method x bits case of one target (with `reasoning`: QuantLRM W3 on its own calibration), in
    this process (one heavy compile at a time)."""
    import dataclasses

    from lrmq import aot, ptq_aot
    from lrmq.ptq.config import QuantizeConfig

    platform, topology = TARGETS[target]
    devices = aot.target_devices(topology, platform)
    n_blocks, block_size = REASONING if reasoning else (N_BLOCKS, BLOCK_SIZE)
    for model, method, bits in cases(reasoning, moe):
        cfg = ptq_aot.preset_config(model)
        k = key(model, target, method, bits, reasoning)
        data = load(out)
        if k in data["cases"] and not force:
            continue
        qcfg = QuantizeConfig(model=model, method=method, bits=bits, group_size=128)
        qcfg = dataclasses.replace(qcfg, calibration=dataclasses.replace(
            qcfg.calibration, batch_size=BATCH, block_size=block_size))
        t0 = time.perf_counter()
        fit = ptq_aot.check(cfg, qcfg, devices, n_blocks=n_blocks, block_size=block_size, target=topology,
                            log=lambda m: None)
        rec = case_record(fit, cfg, qcfg, model, target, n_blocks, block_size)
        rec["wall_seconds"] = time.perf_counter() - t0
        if moe:  # compiled after the main sweep: its own machine, date and versions
            rec.update(machine=common.machine_info(), versions=versions(),
                       moe_experts=qcfg.calibration.moe_experts)
        print(f"{k}: {rec['verdict']} ({rec['wall_seconds']:.0f} s)", flush=True)
        data = load(out)  # another target's process may have written meanwhile: merge
        data["cases"][k] = rec
        save(out, data)


def header(out: str) -> None:
    from lrmq.ptq_aot import gptq_host_rate

    data = load(out)
    data.update({"machine": common.machine_info(), "versions": versions(),
                 "calibration": {"blocks": N_BLOCKS, "block_size": BLOCK_SIZE, "batch_size": BATCH},
                 "gptq_host_rate_here": gptq_host_rate(),
                 "note": "per-chip memory from XLA's memory analysis of programs compiled for the target; host RSS "
                         "counted (lrmq.ptq.programs.host_bytes); times are estimates from XLA's cost analysis against "
                         "the chips' published peaks, GPTQ's host part from a rate measured on this machine: "
                         "nothing ran on a TPU or a GPU"})
    save(out, data)


def _gib(b) -> str:
    return f"{b / 2 ** 30:.1f}"


def _dur(s) -> str:
    if s is None:
        return "?"
    if s < 1:
        return f"{1e3 * s:.0f} ms"
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _cell(r) -> str:
    if r is None:
        return "not run"
    mark = "yes" if r["chips_fit"] else "**NO**"
    cell = (f"{mark}: {_gib(r['peak_bytes_per_chip'])} GiB, {_dur(r['estimate_seconds_per_layer'])} / layer, "
            f"{_dur(r['estimate_seconds_per_model'])}")
    fitting = {k: v for k, v in r["fitting"].items() if k != "calibration.max_blocks"}
    if fitting:
        cell += " (" + ", ".join(f"{k}={v} fits" for k, v in fitting.items()) + ")"
    return cell


def markdown(path: str) -> str:
    """docs/ptq.md's tables from the JSON: one row per model, method and width; per target: fits (yes / NO), the
    per-chip peak and the estimated time per layer and for the model; then QuantLRM's own calibration."""
    data = load(path)
    cases = data["cases"]
    lines = ["| model | method | bits | host RSS (GiB) | " + " | ".join(TARGETS) + " | GPTQ host part (this machine) |",
             "|---|---|---|---|" + "---|" * len(TARGETS) + "---|"]
    for model in MODELS:
        for method in METHODS:
            for bits in BITS:
                row = [cases.get(key(model, t, method, bits)) for t in TARGETS]
                any_rec = next((r for r in row if r), None)
                if any_rec is None:
                    continue
                host = _gib(max(any_rec["host_total_bytes"], any_rec["importance_host_bytes"]))
                gptq = "" if method != "gptq" else (
                    f"{_dur(any_rec['gptq_host_seconds_per_layer'])} / layer, "
                    f"{_dur(any_rec['gptq_host_seconds_per_layer'] * any_rec['layers'])}")
                lines.append(f"| {model} | {method} | W{bits} | {host} | " + " | ".join(map(_cell, row)) +
                             f" | {gptq} |")
    rows = [[cases.get(key(model, t, "quantlrm", 3, True)) for t in TARGETS] for model in MODELS]
    if any(any(r) for r in rows):
        lines += ["", f"QuantLRM's own calibration ({REASONING[0]} blocks x {REASONING[1]:,} tokens), W3 g128:", "",
                  "| model | host RSS (GiB) | " + " | ".join(TARGETS) + " |", "|---|---|" + "---|" * len(TARGETS)]
        for model, row in zip(MODELS, rows):
            any_rec = next((r for r in row if r), None)
            if any_rec is not None:
                host = _gib(max(any_rec["host_total_bytes"], any_rec["importance_host_bytes"]))
                lines.append(f"| {model} | {host} | " + " | ".join(map(_cell, row)) + " |")
    moe = [(model, method, [cases.get(key(model, t, method, 4)) for t in TARGETS]) for model in MOE_MODELS
           for method in METHODS]
    if any(any(r) for _, _, r in moe):
        lines += ["", "Mixture of experts, W4 g128 per expert (calibration.moe_experts=all):", "",
                  "| model | method | host RSS (GiB) | " + " | ".join(TARGETS) + " | GPTQ host part (this machine) | "
                  "compiled on |", "|---|---|---|" + "---|" * len(TARGETS) + "---|---|"]
        for model, method, row in moe:
            r0 = next((r for r in row if r), None)
            if r0 is not None:
                mm, vv = r0.get("machine", {}), r0.get("versions", {})
                gptq = "" if method != "gptq" else (f"{_dur(r0['gptq_host_seconds_per_layer'])} / layer, "
                                                    f"{_dur(r0['gptq_host_seconds_per_layer'] * r0['layers'])}")
                host = _gib(max(r0["host_total_bytes"], r0["importance_host_bytes"]))
                lines.append(f"| {model} | {method} | {host} | " + " | ".join(map(_cell, row)) +
                             f" | {gptq} | {mm.get('cpu')} ({mm.get('cores')} cores), {mm.get('date')}; jax "
                             f"{vv.get('jax')}, libtpu {vv.get('libtpu')}, jax-cuda12-plugin "
                             f"{vv.get('jax-cuda12-plugin')} |")
    m = data.get("machine", {})
    v = data.get("versions", {})
    lines.append("")
    lines.append(f"Compiled on {m.get('cpu')} ({m.get('cores')} cores), {m.get('date')}; jax {v.get('jax')}, "
                 f"libtpu {v.get('libtpu')}, jax-cuda12-plugin {v.get('jax-cuda12-plugin')}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="the JSON to write (cases merged into it)")
    ap.add_argument("--target", choices=list(TARGETS), help="one target, in this process (default: every target, "
                                                            "one child process each)")
    ap.add_argument("--force", action="store_true", help="recompile cases already in --out")
    ap.add_argument("--reasoning", action="store_true", help="QuantLRM W3 on its own calibration (512 blocks of 512)")
    ap.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B GPTQ W4 per expert (the main sweep's header "
                                                       "kept; each case records its machine)")
    ap.add_argument("--markdown", metavar="JSON", help="print docs/ptq.md's table from this JSON and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    if not args.out:
        ap.error("--out is required")
    if args.target:
        run_target(args.target, args.out, args.force, args.reasoning, args.moe)
        return 0
    if args.moe:
        pass  # each case carries its machine and versions (run_target)
    elif not args.reasoning:
        header(args.out)
    else:  # the versions this pass compiled with (the header's machine and GPTQ rate stay the main sweep's)
        save(args.out, {**load(args.out), "versions": versions()})
    for target in TARGETS:  # one process per target: libtpu's and the CUDA plugin's devices apart
        cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--target", target]
        cmd += ["--force"] * args.force + ["--reasoning"] * args.reasoning + ["--moe"] * args.moe
        rc = subprocess.call(cmd)
        if rc:
            print(f"{target}: exit {rc}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
