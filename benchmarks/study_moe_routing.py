"""The routing figures of configs/study/moe.yaml's train arms, which the study's own tables do not carry: per arm
and seed, the mean over the run's steps of `train/moe/route_mismatch` (the share of the sampler's recorded
token-slots the learner's forward routed elsewhere; 0 by construction with routing replay), `train/mismatch/logp_diff`
and `train/mismatch/kl_k3` (sampler vs learner), `train/moe/expert_load_max` (1 = balanced, at most E / k) and
`train/moe/aux_loss` (logged with algo.router_aux_coef), read from each finished run's metrics.jsonl; then the mean
and sample std over seeds.

    python benchmarks/study_moe_routing.py [--study studies/moe] [--out docs/figures/study_moe/routing.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
METRICS = ("train/moe/route_mismatch", "train/mismatch/logp_diff", "train/mismatch/kl_k3",
           "train/moe/expert_load_max", "train/moe/aux_loss", "reward/mean")


def run_means(path: str) -> dict:
    """Mean over the run's steps of each metric in METRICS that it logged."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = {}
    for key in METRICS:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = sum(values) / len(values)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", default=os.path.join(REPO, "studies", "moe"))
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "figures", "study_moe", "routing.json"))
    a = ap.parse_args(argv)
    with open(os.path.join(a.study, "arms.json"), encoding="utf-8") as f:
        arms = [x["name"] for x in json.load(f) if x["kind"] == "train"]
    result = {"benchmark": "study_moe_routing", "study": os.path.relpath(a.study, REPO),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "machine": platform.node(),
              "cpu_count": os.cpu_count(), "arms": {}}
    for arm in arms:
        seeds = {}
        for path in sorted(glob.glob(os.path.join(a.study, "runs", arm, "seed*", "run", "metrics.jsonl"))):
            if os.path.exists(os.path.join(os.path.dirname(os.path.dirname(path)), "result.json")):
                seeds[os.path.basename(os.path.dirname(os.path.dirname(path)))] = run_means(path)
        if not seeds:
            continue
        summary = {}
        for key in METRICS:
            values = [s[key] for s in seeds.values() if key in s]
            if values:
                summary[key] = {"mean": statistics.fmean(values),
                                "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}
        result["arms"][arm] = {"seeds": seeds, "over_seeds": summary}
    if not result["arms"]:
        sys.exit(f"{a.study}: no finished train arm (runs/ARM/seedS/run/metrics.jsonl with result.json)")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    tmp = a.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, a.out)
    print(f"| arm | {' | '.join(k.split('/')[-1] for k in METRICS)} |")
    for arm, r in result["arms"].items():
        cells = [(f"{r['over_seeds'][k]['mean']:.4g} ± {r['over_seeds'][k]['std']:.2g}" if k in r["over_seeds"] else "-")
                 for k in METRICS]
        print(f"| {arm} | {' | '.join(cells)} |")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
