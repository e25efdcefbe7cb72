"""Paper-1 recipes compiled for their TPU slice colocated and with the sampler and the learner split (no TPU needed).

For each recipe, `python -m lrmq.train --config R --compile-only --report F` twice, in fresh processes: as written
(rollout.placement=colocated, every program on the whole slice) and with rollout.placement=split (half of the
slice's chips to the sampler, half to the learner, the learner's mesh axes given for its half). Reported per case:
the fit, the per-chip memory of the update and of the rollout's decode (each on its own mesh), the KV pool sized to
the sampler's chips (kv_memory_fraction of HBM less the update, colocated, or less the sampler's own weights,
split), and the step time ESTIMATE `lrmq.aot.step_estimate` prints (a roofline: the update compute-bound at peak,
the rollout memory-bound at HBM bandwidth; colocated their sum, split their max). rollout.update_shapes=1: the
largest update shape decides the memory.

    python benchmarks/split_recipes.py --out docs/figures/split_recipes.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, machine_info, md_table, write_json  # noqa: E402

GIB = 1024 ** 3
# (recipe, overrides of the split case: the learner's mesh over its half of the chips)
CASES = {
    "qwen3_0.6b_grpo": ["mesh.data=1", "mesh.fsdp=4"],  # v5e-8: 4 + 4 chips
    # v5p-64 (32 chips): 16 + 16; the sampler data=2 x fsdp=8 as the recipe's own mesh splits the 8 KV heads (its
    # default fsdp=16 does not divide them: each chip would hold every head's pages)
    "pod_v5p64_8b_grpo": ["mesh.data=2", "mesh.fsdp=8", "mesh.rollout_data=2", "mesh.rollout_fsdp=8"],
}


def run_case(recipe: str, split: bool) -> dict:
    with tempfile.TemporaryDirectory() as d:
        report = os.path.join(d, "r.json")
        extra = ["rollout.placement=split", "mesh.rollout_fraction=0.5", *CASES[recipe]] if split else []
        cmd = [sys.executable, "-m", "lrmq.train", "--config", os.path.join("configs", "paper1", recipe + ".yaml"),
               "--compile-only", "--report", report, "rollout.update_shapes=1", *extra]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        wall = time.perf_counter() - t0
        if p.returncode not in (0, 3) or not os.path.exists(report):
            raise SystemExit(f"{recipe} split={split}: exit {p.returncode}\n{p.stderr[-3000:]}")
        with open(report) as f:
            rep = json.load(f)
    rows = {r["name"]: r for r in rep["programs"]}
    mem = lambda name: rows[name]["memory"]["total"] if rows.get(name, {}).get("memory") else None  # noqa: E731
    return {"recipe": recipe, "placement": "split" if split else "colocated", "fits": rep["fits"],
            "target": rep["target"], "hbm_bytes": rep["hbm_bytes"], "mesh": rep["placement"],
            "train_step_bytes": mem("train_step"), "decode_bytes": mem("rollout decode"),
            "prefill_bytes": mem("rollout prefill"), "kv_pool": rep["kv_pool"], "step_estimate": rep["step_estimate"],
            "compile_wall_s": wall, "overrides": extra}


def table(cases: list[dict]) -> str:
    rows = []
    for c in cases:
        e, pool, m = c["step_estimate"] or {}, c["kv_pool"], c["mesh"]
        rows.append([c["recipe"], c["target"], c["placement"],
                     f"{m['learner_chips']} / {m['sampler_chips']}" if c["placement"] == "split" else str(m["learner_chips"]),
                     "yes" if c["fits"] else "no", f"{c['train_step_bytes'] / GIB:.2f}", f"{c['decode_bytes'] / GIB:.2f}",
                     f"{pool['pages']:,} ({pool['bytes_per_device'] / GIB:.2f} GiB, {pool['sized']})",
                     f"{e.get('rollout_s', float('nan')):.1f}", f"{e.get('update_s', float('nan')):.1f}",
                     f"{e.get('step_s', float('nan')):.1f}"])
    return md_table(["recipe", "slice", "placement", "chips (learner / sampler)", "fits", "update GiB/chip",
                     "decode GiB/chip", "KV pool pages", "rollout s*", "update s*", "step s*"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="*", default=list(CASES))
    args = ap.parse_args(argv)
    cases = []
    if args.out and os.path.exists(args.out):  # the cases not rerun are kept
        with open(args.out) as f:
            cases = [c for c in json.load(f)["cases"] if c["recipe"] not in args.only]
    for recipe in args.only:
        for split in (False, True):
            c = run_case(recipe, split)
            cases.append(c)
            print(f"{recipe} {c['placement']}: fits={c['fits']} in {c['compile_wall_s']:.0f} s", flush=True)
    cases.sort(key=lambda c: (list(CASES).index(c["recipe"]), c["placement"]))
    print(table(cases))
    print("* a roofline estimate, not a measurement (lrmq.aot.step_estimate)")
    info = machine_info()
    write_json(args.out, {"what": "paper-1 recipes compiled colocated and split (benchmarks/split_recipes.py)",
                          "machine": info, "cases": cases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
