"""QuantLRM's evaluation lengths on TPU slices, compiled ahead of time (no TPU needed).

Runs `python -m lrmq.evaluate --compile-only --shapes qwen3-8b --suite quantlrm --topology T` (the suite's
32 decode slots of 512 + 32,256 tokens, bf16) for each topology in a fresh process and records what the
command prints: the per-program memory table, the verdict line (fits / does not fit, and the setting that
fits) and its exit status (0 fits, 3 does not).

    python benchmarks/evaluate_tpu.py --out docs/figures/evaluate_tpu.json            # v5e:2x4 and v6e:2x4
    python benchmarks/evaluate_tpu.py --out F --only v6e:2x4
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from common import REPO, machine_info, source_commit, write_json

TOPOLOGIES = ("v5e:2x4", "v6e:2x4")


def run(topology: str, shapes: str, suite: str, timeout: float, overrides: tuple[str, ...] = ()) -> dict:
    """One compile-only command (overrides: key=value settings appended, e.g. generation.kv_cache=fp8_e4m3)."""
    cmd = [sys.executable, "-m", "lrmq.evaluate", "--compile-only", "--shapes", shapes, "--suite", suite,
           "--topology", topology, *overrides]
    t0, load = time.time(), os.getloadavg()[0]
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"topology": topology, "error": f"did not finish within {timeout:.0f} s",
                "wall_s": round(time.time() - t0, 1), "load_at_start": round(load, 1), "commit": source_commit()}
    lines = p.stdout.strip().splitlines()
    verdict = next((ln for ln in reversed(lines) if re.match(r"(fits|does not fit)", ln)), None)
    return {"topology": topology, "command": " ".join(["python"] + cmd[1:]), "exit_status": p.returncode,
            "fits": p.returncode == 0, "target_line": next((ln for ln in lines if ln.startswith("target:")), None),
            "table": [ln for ln in lines if ln.startswith("|")], "verdict": verdict,
            **({"output": lines, "log": [ln for ln in p.stderr.splitlines()
                                         if ln.startswith(("trying", "the worst-case", "KV pool"))],
                "exception": next((ln for ln in reversed(p.stderr.splitlines())
                                   if re.match(r"[\w.]+(Error|Exception|: error): ", ln)), None)}
               if overrides else {}),
            "traceback": "Traceback" in p.stderr, "wall_s": round(time.time() - t0, 1),
            "load_at_start": round(load, 1), "commit": source_commit()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "figures", "evaluate_tpu.json"))
    ap.add_argument("--only", nargs="*", default=list(TOPOLOGIES))
    ap.add_argument("--shapes", default="qwen3-8b")
    ap.add_argument("--suite", default="quantlrm")
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    results = {}
    for topology in args.only:
        print(f"compiling {args.shapes} / {args.suite} for {topology} ...", flush=True)
        results[topology] = r = run(topology, args.shapes, args.suite, args.timeout)
        print(r.get("verdict") or r.get("error"), f"(exit {r.get('exit_status')})", flush=True)
    write_json(args.out, {"machine": machine_info(), "shapes": args.shapes, "suite": args.suite, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
