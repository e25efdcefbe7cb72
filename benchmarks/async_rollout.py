"""Synchronous GRPO vs a split Sampler / Learner with one step of staleness, on emulated CPU devices.

The tiny-demo recipe (`configs/tiny_demo.yaml`: the shipped tiny model, synthetic arithmetic, 16 prompts x 8
samples per step) trained by `python -m lrmq.train` in two ways, on the same 8 emulated CPU devices:

* `sync`: today's loop (rollout.placement=colocated, rollout.max_staleness=0): generate, score, update, repeat,
  every program on all 8 devices;
* `split-k1`: rollout.placement=split (the sampler on 4 devices, the learner on the other 4), rollout.max_staleness=1:
  the rollout of step j+1 is sampled from version j-1 while update j runs.

Contenders are interleaved in one run: each (contender, seed) run advances `--chunk` steps per invocation
(`--stop-after`, the run resumes from its checkpoint), round-robin over the runs, so load from other processes
falls on both. Reported per contender: the median wall time per step (`perf/step_s`, the loop's own clock:
rollout wait + update + logging, the first step of each invocation left out: it compiles), the steps per hour
it implies, the medians of `perf/rollout_s` and `perf/update_s` (sum against max: the overlap there is to win),
and the held-out sampled accuracy after the same number of samples (the final evaluation, run.eval_size problems),
mean and standard error over the seeds. The ratio is split-k1's steps per hour over sync's.

The processes' CPU time is recorded next to their wall time (a profile of where the two cores went: a ratio of
CPU to wall time near the core count means the machine, not the schedule, is the limit).

    python benchmarks/async_rollout.py --out docs/figures/async_rollout.json          # 2 seeds x 30 steps
    python benchmarks/async_rollout.py --steps 6 --chunk 3 --seeds 0 --eval-size 32   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, machine_info, machine_str, md_table, write_json  # noqa: E402

CONTENDERS = {
    "sync": ["rollout.placement=colocated", "rollout.max_staleness=0"],
    # the sampler's mesh as measured (data=1 x fsdp=4; mesh.rollout_fsdp=0 would now pick data=2 x fsdp=2 for the
    # tiny model's 2 KV heads)
    "split-k1": ["rollout.placement=split", "mesh.rollout_fraction=0.5", "rollout.max_staleness=1",
                 "mesh.rollout_data=1", "mesh.rollout_fsdp=4"],
}


def run_chunk(run_dir: str, contender: str, seed: int, args) -> dict:
    """One invocation of lrmq.train advancing the run by `args.chunk` steps; its wall and CPU seconds."""
    cmd = [sys.executable, "-m", "lrmq.train", "--config", "configs/tiny_demo.yaml", "--stop-after", str(args.chunk),
           f"run.out_dir={run_dir}", f"run.steps={args.steps}", f"run.seed={seed}", f"run.save_every={args.chunk}",
           "run.eval_every=0", f"run.eval_size={args.eval_size}", "run.eval_greedy=false", "run.export_hf=false",
           "run.progress=false", *CONTENDERS[contender], *args.override]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{contender} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(runs: dict[int, dict], first_steps: set[int]) -> dict:
    """Medians over the timed steps of every seed's run (steps that began an invocation left out), the
    accuracy after the last step (mean, SE over seeds)."""
    timed = {k: [] for k in ("perf/step_s", "perf/rollout_s", "perf/update_s", "rollout/version_lag",
                             "rollout/sync_s", "rollout/sync_bytes", "rollout/dropped_stale")}
    acc = []
    wall = cpu = 0.0
    for seed, r in runs.items():
        wall += sum(c["wall_s"] for c in r["chunks"])
        cpu += sum(c["cpu_s"] for c in r["chunks"])
        for m in r["metrics"]:
            if "perf/step_s" in m and m["step"] not in first_steps:
                for k in timed:
                    if k in m:
                        timed[k].append(float(m[k]))
        finals = [m for m in r["metrics"] if "eval/sampled_accuracy" in m]
        acc.append(finals[-1]["eval/sampled_accuracy"])
    out = {k.replace("/", "_") + "_median": statistics.median(v) for k, v in timed.items() if v}
    out["timed_steps"] = len(timed["perf/step_s"])
    out["steps_per_hour"] = 3600.0 / out["perf_step_s_median"]
    out["accuracy_mean"] = statistics.fmean(acc)
    out["accuracy_se"] = statistics.stdev(acc) / math.sqrt(len(acc)) if len(acc) > 1 else None
    out["accuracy_per_seed"] = acc
    out["invocations_wall_s"], out["invocations_cpu_s"] = wall, cpu
    out["cpu_per_wall"] = cpu / wall if wall else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--chunk", type=int, default=10, help="steps per invocation (the interleaving unit)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--devices", type=int, default=8, help="emulated CPU devices (split: half to each side)")
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--override", nargs="*", default=[], help="more dotted overrides for both contenders")
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep", default=None, help="keep the run dirs here (default: a temporary dir, removed)")
    args = ap.parse_args(argv)
    if args.steps % args.chunk:
        ap.error("--chunk must divide --steps")

    root = args.keep or tempfile.mkdtemp(prefix="lrmq-async-bench-")
    runs = {c: {s: {"chunks": []} for s in args.seeds} for c in CONTENDERS}
    order = [(c, s) for s in args.seeds for c in CONTENDERS]
    for i in range(args.steps // args.chunk):
        rot = order[i % len(order):] + order[: i % len(order)]  # the starting contender rotates per round
        for c, s in rot:
            run_dir = os.path.join(root, f"{c}-seed{s}")
            res = run_chunk(run_dir, c, s, args)
            runs[c][s]["chunks"].append(res)
            print(f"round {i + 1}: {c} seed {s}: {args.chunk} steps in {res['wall_s']:.1f} s "
                  f"({res['cpu_s']:.1f} s CPU)", flush=True)
    first_steps = {i * args.chunk + 1 for i in range(args.steps // args.chunk)}
    results = {}
    for c in CONTENDERS:
        for s in args.seeds:
            runs[c][s]["metrics"] = read_metrics(os.path.join(root, f"{c}-seed{s}"))
        results[c] = summarize(runs[c], first_steps)
    ratio = results["split-k1"]["steps_per_hour"] / results["sync"]["steps_per_hour"]
    import jax  # noqa: F401  (machine_info reads its version; the runs were subprocesses)

    info = machine_info()
    rows = [[c, f"{r['perf_step_s_median']:.2f}", f"{r['steps_per_hour']:.0f}",
             f"{r.get('perf_rollout_s_median', float('nan')):.2f}", f"{r.get('perf_update_s_median', float('nan')):.2f}",
             f"{r['accuracy_mean']:.3f}" + (f" ± {r['accuracy_se']:.3f}" if r["accuracy_se"] is not None else ""),
             f"{r['cpu_per_wall']:.2f}"] for c, r in results.items()]
    print(md_table(["contender", "s/step (median)", "steps/h", "rollout s", "update s", "held-out acc",
                    "CPU s / wall s"], rows))
    print(f"split-k1 / sync steps per hour: {ratio:.2f}x ({machine_str(info)})")
    out = {"what": "tiny-demo GRPO, sync vs rollout.placement=split + max_staleness=1 on emulated CPU devices "
                   "(benchmarks/async_rollout.py)",
           "machine": info, "args": vars(args), "contenders": CONTENDERS, "results": results,
           "steps_per_hour_ratio_split_k1_over_sync": ratio,
           "runs": {c: {str(s): r["chunks"] for s, r in v.items()} for c, v in runs.items()}}
    if args.out:
        write_json(args.out, out)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
