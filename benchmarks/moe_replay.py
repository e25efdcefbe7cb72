"""What rollout routing replay removes, at trainer level, on the shipped tiny MoE (docs/moe.md, 'RL on MoE').

Runs `python -m lrmq.train --config configs/tiny_demo.yaml model.checkpoint=tiny-moe run.steps=3` with
rollout.routing_replay false and true, for each rollout arm: float rollouts (the learner's own weights) and
rollout.quant=int4 (the sampler routes through int4 weights, the learner through float ones;
rollout.quant_group_size=64: the experts' down_proj has 64 input rows, so the default 128 is refused). Reads each
run's metrics.jsonl: per step the sampler-vs-learner log-prob mismatch (`train/mismatch/*`, the learner before
the step's update) and `train/moe/route_mismatch` (the share of the sampler's recorded token-slots whose expert
the update's forward did not run: 0 by construction with replay) and `train/moe/expert_load_max`.

    python benchmarks/moe_replay.py --arms float int4 --out docs/figures/moe_replay.json
    python benchmarks/moe_replay.py --arms int4 --out docs/figures/moe_replay.json --merge   # add / redo arms
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import REPO, machine_info, md_table, write_json  # noqa: E402

ARMS = {"float": [], "int4": ["rollout.quant=int4", "rollout.quant_group_size=64"]}
BASE = ["--config", "configs/tiny_demo.yaml", "model.checkpoint=tiny-moe", "run.steps=3"]
METRICS = ("train/mismatch/logp_diff", "train/mismatch/kl_k3", "train/mismatch/chi2_token", "train/moe/route_mismatch",
           "train/moe/expert_load_max")


def run(overrides: list[str]) -> tuple[list[dict], float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "lrmq.train", *BASE, *overrides, f"run.out_dir={tmp}/run", "run.progress=false"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode:
            sys.exit(f"training failed ({p.returncode}): {' '.join(overrides)}\n{p.stderr[-4000:]}")
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            logs = [json.loads(line) for line in f if line.strip()]
    return [{"step": r["step"], **{k: r[k] for k in METRICS if k in r}} for r in logs if METRICS[0] in r], wall


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=sorted(ARMS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", action="store_true", help="keep the --out file's other arms")
    a = ap.parse_args(argv)
    result = {"benchmark": "moe_replay", "command": ["python", "-m", "lrmq.train", *BASE], "arms": {}}
    if a.merge and a.out and os.path.exists(a.out):
        with open(a.out) as f:
            result = json.load(f)
    for arm in a.arms:
        for replay in (False, True):
            overrides = [*ARMS[arm], f"rollout.routing_replay={str(replay).lower()}"]
            steps, wall = run(overrides)
            result["arms"][f"{arm}/replay={str(replay).lower()}"] = {
                "overrides": overrides, "wall_s": round(wall, 1), "steps": steps,
                "machine": machine_info(None)}
    rows = []
    for name, r in sorted(result["arms"].items()):
        for s in r["steps"]:
            rows.append([name, s["step"]] + [f"{s[k]:.4g}" if k in s else "-" for k in METRICS])
    print(md_table(["arm", "step", *(k.removeprefix("train/") for k in METRICS)], rows))
    write_json(a.out, result)


if __name__ == "__main__":
    main()
