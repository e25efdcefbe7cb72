"""Time to the first GRPO step of `make demo`, with an empty and with a warm compile cache, and when compiles happen.

Runs `python -m lrmq.train --config configs/tiny_demo.yaml run.out_dir=<temp> run.compile_cache=<temp cache>
run.progress=false --stop-after STEPS` twice on one fresh cache dir: "cold" (the cache empty) and "warm" (the
cache the cold run filled, as a rerun of `make demo` finds it). Each run is timed from the process start to
the moment its metrics.jsonl holds step 1 (start-up, the ahead-of-time update compiles, the initial HF export
and held-out evaluation, the first rollout and update), and the end of every later step is recorded too.
JAX_LOG_COMPILES=1 makes JAX log every XLA compile (or compile-cache load) with a timestamp, so each is
placed before the first rollout, in step 1, or in a later step, by program.

    python benchmarks/first_step.py --out docs/figures/first_step.json [--steps 5] [dotted.key=value ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import REPO, machine_info, md_table, write_json  # noqa: E402

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
COMPILED = re.compile(r"Finished XLA compilation of (\S+) in ([0-9.]+) sec")
PRECOMPILED = re.compile(r"compiled (\d+) update programs in ([0-9.]+) s")


def _stamp(line: str) -> float | None:
    m = LOG_TIME.match(line)
    if not m:
        return None
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def run_once(config: str, cache: str, steps: int, overrides: list[str]) -> dict:
    """One training process; returns its step times (s after start) and its compiles (program, s, when)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        cmd = [sys.executable, "-m", "lrmq.train", "--config", config, f"run.out_dir={run_dir}",
               f"run.compile_cache={cache}", "run.progress=false", "--stop-after", str(steps), *overrides]
        env = dict(os.environ, JAX_LOG_COMPILES="1", JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        err_path = os.path.join(tmp, "stderr.log")
        metrics = os.path.join(run_dir, "metrics.jsonl")
        step_at: dict[int, float] = {}
        t0_wall = time.time()
        t0 = time.perf_counter()
        with open(err_path, "w") as err:
            p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
            while p.poll() is None:
                if os.path.exists(metrics):
                    with open(metrics) as f:
                        for line in f:
                            s = json.loads(line).get("step") if line.strip() else None
                            if s and "reward/mean" in line and s not in step_at:
                                step_at[s] = time.perf_counter() - t0
                time.sleep(0.05)
        wall = time.perf_counter() - t0
        log = open(err_path).read()
        if p.returncode:
            sys.exit(f"training failed ({p.returncode}):\n{log[-4000:]}")
    compiles, pre = [], None
    for line in log.splitlines():
        t = _stamp(line)
        m = COMPILED.search(line)
        if m and t is not None:
            compiles.append({"program": m.group(1), "s": float(m.group(2)), "at_s": t - t0_wall})
        m = PRECOMPILED.search(line)
        if m:
            pre = {"programs": int(m.group(1)), "s": float(m.group(2)), "done_at_s": (t or t0_wall) - t0_wall}
    ends = [step_at.get(i) for i in range(1, steps + 1)]

    def phase(c):
        if ends[0] is None or c["at_s"] <= ends[0]:
            return "to step 1"
        return "after step 1"

    for c in compiles:
        c["phase"] = phase(c)
    after = [c for c in compiles if c["phase"] == "after step 1"]
    update_progs = ("jit(train_step)", "jit(reference_logprobs)")
    return {"first_step_s": ends[0], "step_end_s": ends, "wall_s": wall, "precompile": pre,
            "compiles_to_step_1": sum(c["phase"] == "to step 1" for c in compiles),
            "compile_s_to_step_1": sum(c["s"] for c in compiles if c["phase"] == "to step 1"),
            "update_compiles_after_step_1": sum(c["program"] in update_progs for c in after),
            "other_compiles_after_step_1": sorted({c["program"] for c in after if c["program"] not in update_progs}),
            "compiles": compiles}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny_demo.yaml")
    ap.add_argument("--steps", type=int, default=5, help="steps per run (the first is the one timed)")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*", help="extra dotted.key=value overrides")
    a = ap.parse_args(argv)
    info = machine_info(None)
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        for mode in ("cold", "warm"):
            results[mode] = run_once(a.config, cache, a.steps, a.overrides)
            r = results[mode]
            print(f"{mode}: first step at {r['first_step_s']:.1f} s; precompile {r['precompile']}; "
                  f"update compiles after step 1: {r['update_compiles_after_step_1']}; others after step 1: "
                  f"{r['other_compiles_after_step_1']}", flush=True)
    info["loadavg_at_end"] = os.getloadavg()
    print(md_table(["cache", "first step (s)", "update precompile (s)", "compiles to step 1",
                    "update compiles after step 1"],
                   [[m, f"{r['first_step_s']:.1f}", f"{(r['precompile'] or {}).get('s', float('nan')):.1f}",
                     r["compiles_to_step_1"], r["update_compiles_after_step_1"]] for m, r in results.items()]))
    write_json(a.out, {"benchmark": "first_step", "command": ["-m", "lrmq.train", "--config", a.config,
                                                              "run.out_dir=<temp>", "run.compile_cache=<temp>",
                                                              "run.progress=false", "--stop-after", str(a.steps),
                                                              *a.overrides],
                       "machine": info, "results": results,
                       "note": "cold: empty compile cache; warm: the cache the cold run filled. first_step_s: process "
                               "start to step 1's metrics line (start-up, the update precompile, the initial HF "
                               "export and held-out evaluation, the first rollout and update)"})


if __name__ == "__main__":
    main()
