"""`make demo` as a recorded run: GRPO on the shipped tiny model with configs/tiny_demo.yaml.

Runs `python -m lrmq.train --config configs/tiny_demo.yaml run.out_dir=<temp> run.progress=false` (the
command `make demo` runs, into a temporary run dir), times it, and reads the run's metrics.jsonl:
held-out sampled (T=1.0) and greedy accuracy before training and at every evaluation, and the
training-batch accuracy (`reward/accuracy`) averaged per 25-step window.

    python benchmarks/demo_run.py --out docs/figures/demo_run.json
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny_demo.yaml")
    ap.add_argument("--window", type=int, default=25, help="steps per training-accuracy window")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*", help="extra dotted.key=value overrides")
    a = ap.parse_args(argv)
    info = machine_info(None)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        cmd = [sys.executable, "-m", "lrmq.train", "--config", a.config, f"run.out_dir={run_dir}",
               "run.progress=false", *a.overrides]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode:
            sys.exit(f"training failed ({p.returncode}):\n{p.stderr[-4000:]}")
        path = next(os.path.join(dp, "metrics.jsonl") for dp, _, fs in os.walk(run_dir) if "metrics.jsonl" in fs)
        with open(path) as f:
            logs = [json.loads(line) for line in f if line.strip()]
    evals = [{"step": r["step"], "sampled_accuracy": r["eval/sampled_accuracy"],
              "greedy_accuracy": r.get("eval/greedy_accuracy")} for r in logs if "eval/sampled_accuracy" in r]
    train = [(r["step"], r["reward/accuracy"]) for r in logs if "reward/accuracy" in r]
    windows = []
    for s in range(0, len(train), a.window):
        chunk = train[s:s + a.window]
        windows.append({"steps": [chunk[0][0], chunk[-1][0]], "mean": sum(v for _, v in chunk) / len(chunk)})
    info["loadavg_at_end"] = os.getloadavg()
    print(md_table(["step", "sampled accuracy", "greedy accuracy"],
                   [[e["step"], f"{e['sampled_accuracy']:.3f}", f"{e['greedy_accuracy']:.3f}"] for e in evals]))
    print("training accuracy per window:", ", ".join(f"{w['mean']:.2f}" for w in windows))
    print(f"wall {wall:.0f} s")
    write_json(a.out, {"benchmark": "demo_run", "command": cmd[1:3] + cmd[3:5] + ["run.out_dir=<temp>"] + cmd[6:],
                       "machine": info, "wall_s": wall, "evals": evals, "train_accuracy_windows": windows,
                       "metrics": logs})


if __name__ == "__main__":
    main()
