"""Per-chip memory of a GRPO update at long completions, dense attention vs blockwise (splash on TPU).

Compiles the optimizer update (`lrmq.aot.compile_train_step`: micro-batched forward + backward + AdamW) of a
train config for a TPU topology through libtpu (no TPU needed) with rollout.max_new_tokens set to each of
--new-tokens, twice: "dense" swaps the decoder's attention for `lrmq.model.decoder.attend` (the [B, KVH, G,
T, S] f32 score path every training forward took before `lrmq.model.attention`), "blockwise" keeps
`lrmq.model.attention` (splash attention on TPU). XLA's memory analysis gives arguments, temporaries and the
total per chip. Each (tokens, attention) pair compiles in a fresh process, one at a time; results merge into
--out (resumable: finished entries are skipped unless --redo).

    python benchmarks/attention_memory.py --out docs/figures/attention_memory.json
    python benchmarks/attention_memory.py --out F --new-tokens 4096 --attention dense --layers 4   # a subset
    python benchmarks/attention_memory.py --out F --table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CONFIG = "configs/paper1/qwen3_0.6b_grpo.yaml"
ATTENTION = ("dense", "blockwise")


def compile_one(config: str, topology: str, new_tokens: int, attention: str, layers: int | None) -> dict:
    """One compile in this process: the update's per-chip memory and compile seconds."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from lrmq import aot
    from lrmq.configlib import load_config
    from lrmq.model import decoder
    from lrmq.model.attention import splash_block
    from lrmq.rl.config import TrainConfig
    from lrmq.sharding import MeshConfig, make_mesh

    if attention == "dense":  # what the no-cache branch called before lrmq.model.attention
        decoder.attention = lambda q, k, v, qp, kp, window, segments=None, **_: decoder.attend(
            q, k, v, qp, kp, window, segments=segments)
    cfg = load_config(TrainConfig, os.path.join(common.REPO, config))
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_new_tokens=new_tokens))
    mcfg = aot.model_config(cfg)
    if layers:
        mcfg = dataclasses.replace(mcfg, num_layers=layers, layer_types=tuple(mcfg.layer_types[:layers]))
    devices = aot.topology_devices(topology)
    mesh = make_mesh(MeshConfig(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor), devices=devices)
    run = aot.abstract_run(cfg, mesh, mcfg)
    length = cfg.rollout.max_prompt_len + new_tokens
    print("SETUP " + json.dumps({"layers": mcfg.num_layers, "tokens_per_row": length}), flush=True)  # kept on failure
    t0 = time.perf_counter()
    compiled, _ = aot.compile_train_step(run)
    secs = time.perf_counter() - t0
    text = compiled.as_text()
    return {"memory": aot.memory_report(compiled), "flops": aot._flops(compiled), "compile_s": secs,
            "splash_calls": text.count("tpu_custom_call"), "tokens_per_row": length,
            "splash_block": splash_block(length) if attention == "blockwise" else None,
            "hbm_bytes": aot.hbm_bytes(devices[0]), "layers": mcfg.num_layers,
            "micro_batch": cfg.optim.micro_batch_size, "sequences": cfg.rollout.prompts_per_step * cfg.rollout.group_size,
            "update_padding": cfg.rollout.update_padding, "remat": cfg.model.remat, "scan_layers": cfg.model.scan_layers,
            "mesh": [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor]}


def run_child(args, new_tokens: int, attention: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--config", args.config, "--topology", args.topology,
           "--new-tokens", str(new_tokens), "--attention", attention] + (["--layers", str(args.layers)] if args.layers else [])
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=common.REPO, env=dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1"),
                       capture_output=True, text=True, timeout=args.timeout)
    base = {"new_tokens": new_tokens, "attention": attention, "load_avg": load, "wall_s": time.perf_counter() - t0,
            "commit": common.source_commit(), "config": args.config, "topology": args.topology,
            "date": time.strftime("%Y-%m-%d")}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    for ln in r.stdout.splitlines():
        if ln.startswith("SETUP "):
            base.update(json.loads(ln[len("SETUP "):]))
    if r.returncode or not lines:
        err = (r.stderr.strip().splitlines() or ["no output"])
        err = [ln for ln in err if ("Error" in ln or "error" in ln) and "TPU_WORKER" not in ln] or err
        out = dict(base, error=err[-2:], rc=r.returncode)
        # libtpu refuses a program whose buffers exceed HBM; keep its own count of what the program needed
        unit = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
        for pattern in (r"required for HLO temporaries \(([0-9.]+)([KMGT])\) exceeds available HBM \(([0-9.]+)([KMGT])\)",
                        r"Used ([0-9.]+)([KMGT]) of ([0-9.]+)([KMGT]) hbm"):
            m = re.search(pattern, r.stderr)
            if m:
                out["oom_temporaries_bytes"] = float(m.group(1)) * unit[m.group(2)]
                out["oom_hbm_bytes"] = float(m.group(3)) * unit[m.group(4)]
                break
        return out
    return dict(base, **json.loads(lines[-1][len("RESULT "):]))


def table(results: list[dict]) -> str:
    gib = lambda b: f"{b / 2 ** 30:.2f}"  # noqa: E731
    rows = []
    for r in sorted(results, key=lambda r: (r.get("layers") or 0, r["new_tokens"], ATTENTION.index(r["attention"]))):
        if "error" in r and "oom_temporaries_bytes" in r:  # libtpu refused it: its own count of what it needed
            rows.append([r["new_tokens"], r["attention"], r.get("layers", "-"), r.get("tokens_per_row", "-"),
                         "refused", f"{gib(r['oom_temporaries_bytes'])} (> {gib(r['oom_hbm_bytes'])} HBM)",
                         f"{r['wall_s']:.0f} (to the refusal)", "no"])
            continue
        if "error" in r:
            rows.append([r["new_tokens"], r["attention"], "-", "-", "-", "-", "-", "error: " + " ".join(r["error"])[:100]])
            continue
        m = r["memory"]
        fits = m["total"] <= r["hbm_bytes"] * 0.9
        rows.append([r["new_tokens"], r["attention"], r["layers"], r["tokens_per_row"], gib(m["total"]),
                     gib(m["temporaries"]), f"{r['compile_s']:.0f}", "yes" if fits else "no"])
    return common.md_table(["new tokens", "attention", "layers", "tokens per row", "per-chip GiB", "temporaries GiB",
                            "compile s", "fits (90% of HBM)"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--topology", default="v5e:2x4", help="the recipe's TPU slice (libtpu name)")
    ap.add_argument("--new-tokens", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--attention", nargs="*", default=list(ATTENTION), choices=ATTENTION)
    ap.add_argument("--layers", type=int, default=0, help="compile only the first N decoder layers (0: all)")
    ap.add_argument("--out", help="JSON file (merged into when it exists)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--redo", action="store_true")
    ap.add_argument("--table", action="store_true", help="print the table of --out and exit")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        res = compile_one(a.config, a.topology, a.new_tokens[0], a.attention[0], a.layers or None)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    payload = json.load(open(a.out)) if a.out and os.path.exists(a.out) else {"results": []}
    if a.table:
        print(table(payload["results"]))
        return 0
    payload.setdefault("machine", common.machine_info())
    for n in a.new_tokens:
        for att in a.attention:
            key = (n, att, a.layers or None, a.topology)
            done = [r for r in payload["results"] if (r["new_tokens"], r["attention"], r.get("layers_requested"),
                                                       r["topology"]) == key and "error" not in r]
            if done and not a.redo:
                continue
            res = dict(run_child(a, n, att), layers_requested=a.layers or None)
            payload["results"] = [r for r in payload["results"]
                                  if (r["new_tokens"], r["attention"], r.get("layers_requested"), r["topology"]) != key]
            payload["results"].append(res)
            payload["date"] = time.strftime("%Y-%m-%d")
            common.write_json(a.out, payload)
            print(f"{n} new tokens, {att}: " + ("error " + " ".join(res["error"]) if "error" in res else
                  f"{res['memory']['total'] / 2 ** 30:.2f} GiB per chip, compiled in {res['compile_s']:.0f} s"), flush=True)
    print(table(payload["results"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
