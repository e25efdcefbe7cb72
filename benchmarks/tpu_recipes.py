"""Compile every paper-1 recipe for its stated TPU hardware (no TPU needed) and tabulate per-chip memory.

Each (recipe, train mode) runs `python -m lrmq.train --config R --compile-only --report F` in a fresh
process, so one compile cannot leak memory or caches into the next. Results are merged into one JSON
file (resumable: finished entries are skipped) and rendered as the markdown table in docs/tpu.md.

    python benchmarks/tpu_recipes.py --out docs/figures/tpu_recipes.json                 # everything
    python benchmarks/tpu_recipes.py --out F --only qwen3_0.6b_grpo --modes bf16         # a subset
    python benchmarks/tpu_recipes.py --out F --only qwen3_4b_grpo --modes qlora --redo   # after a code change
    python benchmarks/tpu_recipes.py --out F --table                                     # print the tables
    python benchmarks/tpu_recipes.py --out F --only qwen3_0.6b_grpo --modes bf16 --set rollout.max_new_tokens=4096

`--set KEY=VALUE ...` compiles the recipe with those overrides (an entry of its own, keyed by them): the
long-completion entries of the second table, whose rollout KV pool is sized to the chip (rollout.kv_pages=0),
and the expert-parallel entries of Qwen3-30B-A3B (`--set mesh.fsdp=1 mesh.expert=8`).

`--rollout-on TOPOLOGY` compiles only the recipe's rollout (the engine's prefill and decode programs for its
prompts x group sequences, the KV pool sized to the chip as the trainer sizes it with rollout.kv_pages=0, less
nothing: no update shares the chips) on another slice, e.g. Qwen3-30B-A3B's rollouts on v6e-8, in this process:

    python benchmarks/tpu_recipes.py --out F --only pod_v5p64_30b_a3b_grpo --rollout-on v6e:2x4 \
        --set mesh.data=1 mesh.fsdp=4 mesh.expert=2

Every entry records each program's collectives (`lrmq.hlo.collective_totals`: the all-to-all bytes per device of
one run, loops' trip counts included).
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib

import yaml

from common import REPO, machine_info, md_table, source_commit, write_json

# Train modes as config overrides: the paper's three (bf16 full fine-tuning, QAT with its int8 STE, QLoRA
# on an NF4 base), all from the same bf16 recipe.
MODES = {
    "bf16": [],
    "qat": ["quant.mode=qat", "quant.qat_scheme=paper_int8"],
    "qlora": ["quant.mode=qlora", "quant.base_format=nf4", "optim.lr=1e-5"],
}


def recipes(only: list[str]) -> list[str]:
    paths = sorted(glob.glob(os.path.join(REPO, "configs", "paper1", "*.yaml")))
    names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    return [n for n in names if not only or n in only]


def layers_of(name: str) -> str:
    """"scan" when the recipe's update scans over the layers (model.scan_layers), else "loop"; "+pack" when
    its update uses the packed layout (rollout.update_padding, default pack: compiled at its worst case).
    Entries without "+pack" were compiled with the padded layout (before packing became the default)."""
    from lrmq.rl.config import TrainConfig

    with open(os.path.join(REPO, "configs", "paper1", name + ".yaml")) as f:
        y = yaml.safe_load(f)
    layers = "scan" if (y.get("model") or {}).get("scan_layers") else "loop"
    layout = (y.get("rollout") or {}).get("update_padding", TrainConfig().rollout.update_padding)
    return layers + ("+pack" if layout == "pack" else "")


def run_one(name: str, mode: str, timeout: float, overrides: tuple[str, ...] = ()) -> dict:
    cfg = os.path.join(REPO, "configs", "paper1", name + ".yaml")
    with tempfile.TemporaryDirectory() as tmp:
        rep = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "lrmq.train", "--config", cfg, "--compile-only", "--report", rep, *MODES[mode],
               *overrides]
        t0, load = time.perf_counter(), os.getloadavg()[0]
        try:
            r = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"recipe": name, "mode": mode, "layers": layers_of(name), "rc": None, "load_avg": load,
                    "overrides": list(overrides),
                    "error": [f"compile did not finish in {timeout:.0f} s (load average {load:.1f} at start)"]}
        wall = time.perf_counter() - t0
        if not os.path.exists(rep):
            return {"recipe": name, "mode": mode, "layers": layers_of(name), "overrides": list(overrides),
                    "error": r.stderr.strip().splitlines()[-1:], "rc": r.returncode}
        out = json.load(open(rep))
    out.update(recipe=name, mode=mode, rc=r.returncode, wall_s=wall, layers=layers_of(name), load_avg=load, commit=source_commit(),
               date=time.strftime("%Y-%m-%d"), overrides=list(overrides), verdict=r.stdout.strip().splitlines()[-1],
               traceback="Traceback" in r.stderr,
               command="python -m lrmq.train --config " + os.path.relpath(cfg, REPO) + " --compile-only "
               + " ".join([*MODES[mode], *overrides]))
    return out


def rollout_one(name: str, topology: str, overrides: tuple[str, ...] = ()) -> dict:
    """The recipe's rollout programs alone on `topology` (`aot.check_generate`, the pool sized to the chip: the
    worst case when it fits 90% of HBM), under the recipe's mesh section with `overrides`: an entry of the JSON."""
    from lrmq import aot
    from lrmq.configlib import load_config
    from lrmq.generation.sampling import SamplingConfig
    from lrmq.rl.config import TrainConfig
    from lrmq.rl.setup import model_config
    from lrmq.sharding import MeshConfig, make_mesh

    cfg = load_config(TrainConfig, os.path.join(REPO, "configs", "paper1", name + ".yaml"),
                      [*overrides, "rollout.kv_pages=0"])
    m, r = cfg.mesh, cfg.rollout
    devices = aot.target_devices(topology)
    mesh = make_mesh(MeshConfig(m.data, m.fsdp, m.tensor, m.expert), devices=devices)
    mcfg = model_config(cfg)
    run = aot.abstract_run(cfg, mesh)
    graphdef, states = aot.rollout_model(run)
    lines: list[str] = []
    t0 = time.perf_counter()
    report, verdict = aot.check_generate(
        graphdef, states, mesh, model_cfg=mcfg, engine=r.engine_config(moe=mcfg.num_experts > 0),
        requests=r.prompts_per_step * r.group_size, prompt_len=r.max_prompt_len, max_new=r.max_new_tokens,
        sampling=SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k),
        slots_option="rollout.generation_batch", pages_option="rollout.kv_pages", log=lines.append)
    for row in report.rows:
        row["name"] = "rollout " + row["name"]
    return {"target": topology, "hbm_bytes": report.hbm, "headroom": aot.HEADROOM, "fits": report.fits,
            "kv_pool": report.pool, "mode": cfg.quant.mode, "model": cfg.model.shapes or cfg.model.checkpoint,
            "programs": report.rows, "placement": {"placement": "rollout only", "sampler": dict(mesh.shape),
                                                   "sampler_chips": mesh.devices.size},
            "recipe": name, "rc": 0 if report.fits else 3, "wall_s": time.perf_counter() - t0,
            "layers": layers_of(name), "load_avg": os.getloadavg()[0], "commit": source_commit(),
            "date": time.strftime("%Y-%m-%d"), "overrides": [f"rollout-on={topology}", *overrides],
            "verdict": verdict, "log": lines, "traceback": False,
            "command": f"python benchmarks/tpu_recipes.py --out F --only {name} --rollout-on {topology} --set "
                       + " ".join(overrides)}


def key_of(r: dict) -> tuple:
    return r["recipe"], r["mode"], r.get("layers", "loop"), tuple(r.get("overrides", ()))


def table(results: list[dict]) -> str:
    gib = lambda b: f"{b / 2 ** 30:.1f}"
    rows = []
    results = [r for r in results if not r.get("overrides")]  # the recipes as written (overrides: pool_table)
    for r in sorted(results, key=lambda r: (r["recipe"], ["bf16", "qat", "qlora"].index(r["mode"]), r.get("layers", "loop"))):
        if "error" in r:
            rows.append([r["recipe"], r["mode"], r.get("layers", "-"), "-", "-", "-", "-", "-", "error: " + " ".join(r["error"])[:80]])
            continue
        step, roll = r["programs"][0], r["programs"][1]
        rows.append([r["recipe"], r["mode"], r.get("layers", "loop"), r["target"], gib(r["hbm_bytes"]),
                     f"{gib(step['memory']['total'])} ({gib(step['memory']['temporaries'])})",
                     f"{gib(roll['memory']['total'])}",
                     f"{step['seconds']:.0f} / {roll['seconds']:.0f}",
                     "yes" if r["fits"] else f"no (micro-batch {r['largest_fitting_micro_batch']} fits)"])
    return md_table(["recipe", "mode", "layers", "topology", "HBM GiB", "step GiB (temporaries)", "rollout GiB",
                     "compile s (step / rollout)", "fits with 10% headroom"], rows)


def pool_table(results: list[dict]) -> str:
    """The entries compiled with overrides (long completions): the KV pool each chose and every program's memory."""
    gib = lambda b: f"{b / 2 ** 30:.2f}"
    rows = []
    for r in sorted((r for r in results if r.get("overrides")), key=lambda r: (r["recipe"], r["overrides"])):
        if "error" in r:
            rows.append([r["recipe"], " ".join(r["overrides"]), *["-"] * 8,
                         "error: " + " ".join(r["error"])[:100]])
            continue
        mem = {p["name"]: p for p in r["programs"]}
        cell = lambda n: ("-" if n not in mem else "refused" if mem[n]["memory"] is None
                          else gib(mem[n]["memory"]["total"]))
        pool = r.get("kv_pool") or {}
        pool_cell = (f"{pool['pages']:,} pages, {pool['tokens']:,} tokens, {gib(pool['bytes_per_device'])} GiB "
                     f"({pool['sized']}; worst case {pool['worst_case_pages']:,})" if pool else "-")
        secs = " / ".join(f"{mem[n]['seconds']:.0f}" for n in ("train_step", "rollout prefill", "rollout decode")
                          if n in mem)
        a2a = " / ".join(f"{all_to_all_bytes(mem[n]) / 2 ** 30:.2f}" if all_to_all_bytes(mem[n]) is not None
                         else "?" for n in ("train_step", "rollout prefill", "rollout decode") if n in mem)
        rows.append([r["recipe"], " ".join(r["overrides"]), r["target"], gib(r["hbm_bytes"]), pool_cell,
                     cell("train_step"), cell("rollout prefill"), cell("rollout decode"), secs, a2a,
                     ("yes" if r["fits"] else "no") + f" (exit {r['rc']}): {r.get('verdict', '')[:160]}"])
    return md_table(["recipe", "overrides", "topology", "HBM GiB", "KV pool per chip", "step GiB", "prefill GiB",
                     "decode GiB", "compile s (step / prefill / decode)", "all-to-all GiB per run",
                     "fits (10% headroom), verdict"], rows)


def all_to_all_bytes(program: dict) -> float | None:
    """Bytes a program's all-to-alls (ragged or not) move per device in one run (`aot.program_collectives`: loops'
    trip counts included); None for an entry compiled before they were recorded."""
    coll = program.get("collectives")
    if coll is None:
        return None
    return float(sum(c["operand_bytes"] for op, c in coll.items() if op in ("all-to-all", "ragged-all-to-all")))


def merge(out: str, res: dict) -> dict:
    """Merge one result into `out`, re-read under an exclusive lock: several invocations (e.g. one per core)
    may share the file, and each must keep the others' entries."""
    lock_path = os.path.join(tempfile.gettempdir(), "tpu_recipes-%08x.lock" % zlib.crc32(os.path.abspath(out).encode()))
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        payload = json.load(open(out)) if os.path.exists(out) else {"machine": machine_info(), "results": []}
        key = key_of(res)
        payload["results"] = [r for r in payload["results"]
                              if key_of(r) != key
                              and not (key_of(r)[::3] == key[::3] and r["mode"] == res["mode"] and "error" in r)]
        payload["results"].append(res)
        payload["date"] = time.strftime("%Y-%m-%d")
        write_json(out, payload)
    return payload


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file (merged into when it exists)")
    ap.add_argument("--only", nargs="*", default=[], help="recipe names (file stems) to compile")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--redo", action="store_true", help="compile again even where a result exists (after a code change)")
    ap.add_argument("--table", action="store_true", help="print the markdown tables of --out and exit")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for these compiles (an entry of their own)")
    ap.add_argument("--rollout-on", default=None, metavar="TOPOLOGY",
                    help="compile only the recipes' rollout programs, for this TPU topology (e.g. v6e:2x4)")
    a = ap.parse_args()
    payload = json.load(open(a.out)) if os.path.exists(a.out) else {"machine": machine_info(), "results": []}
    if a.table:
        print(table(payload["results"]) + "\n\n" + pool_table(payload["results"]))
        return 0
    done = {key_of(r) for r in payload["results"] if "error" not in r}
    if a.rollout_on:
        for name in recipes(a.only):
            res = rollout_one(name, a.rollout_on, tuple(a.set))
            payload = merge(a.out, res)
            print(f"{name} rollout on {a.rollout_on}: fits={res['fits']} ({res['wall_s']:.0f} s): {res['verdict']}",
                  flush=True)
        print(pool_table(payload["results"]))
        return 0
    for name in recipes(a.only):
        for mode in a.modes:
            if (name, mode, layers_of(name), tuple(a.set)) in done and not a.redo:
                continue
            res = run_one(name, mode, a.timeout, tuple(a.set))
            payload = merge(a.out, res)
            print(f"{name} {mode}: " + ("error " + " ".join(res["error"]) if "error" in res else
                                        f"fits={res['fits']} ({res['wall_s']:.0f} s)"), flush=True)
    print(table(payload["results"]) + "\n\n" + pool_table(payload["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
