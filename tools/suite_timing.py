"""Where the test suite's time goes: a pytest plugin and its report.

Plugin (tests/conftest.py loads it; it records only when $LRMQ_SUITE_TIMING names a directory): for every test,
its wall time per phase (setup / call / teardown), the JAX compile time spent in the test's own process (JAX's
compile-duration events: tracing, lowering to MLIR, backend compile) and the subprocesses it started (the
"subprocess.Popen" audit event: CLI runs and multi-device scripts, each of which imports JAX and compiles again;
their own compile time is inside the parent test's wall time, not in its compile figure), and the CPU time the
test used (user + system, of its process and of the subprocesses it waited for). CPU time hardly depends on what
else runs on the machine, so the report's "quiet lower bound" (total CPU time / workers) bounds what a quiet
machine would take from a run measured on a loaded one. Each pytest process (every xdist worker) writes
DIR/<worker>.json at the end.

Report: `python tools/suite_timing.py DIR --out FILE.json [--label TEXT]` merges the parts into one JSON
(per test, per file, totals) and prints the slowest tests and files with their compile share.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import time

ENV = "LRMQ_SUITE_TIMING"
COMPILE_EVENTS = {"/jax/core/compile/backend_compile_duration": "backend_compile_s",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
                  "/jax/core/compile/jaxpr_trace_duration": "trace_s"}


class SuiteTiming:
    """The plugin: one record per test id, filled by the hooks and the listeners."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.tests: dict[str, dict] = {}
        self.current: str | None = None
        self.started = time.time()
        sys.addaudithook(self._audit)
        self._jax_listening = False
        self._cpu_start = 0.0

    def _record(self, nodeid: str) -> dict:
        return self.tests.setdefault(nodeid, {"setup_s": 0.0, "call_s": 0.0, "teardown_s": 0.0, "outcome": "",
                                              "subprocesses": 0, "backend_compile_s": 0.0, "lower_s": 0.0,
                                              "trace_s": 0.0, "compiles": 0, "cpu_s": 0.0})

    def _audit(self, event: str, args) -> None:
        if event == "subprocess.Popen" and self.current is not None:
            self._record(self.current)["subprocesses"] += 1

    def _on_duration(self, name: str, secs: float, **_) -> None:
        key = COMPILE_EVENTS.get(name)
        if key and self.current is not None:
            rec = self._record(self.current)
            rec[key] += secs
            rec["compiles"] += key == "backend_compile_s"

    def _listen_to_jax(self) -> None:
        # registered at the first test, so that loading the plugin never imports JAX by itself
        if not self._jax_listening:
            from jax import monitoring

            monitoring.register_event_duration_secs_listener(self._on_duration)
            self._jax_listening = True

    # pytest hooks
    @staticmethod
    def _cpu() -> float:
        t = os.times()  # children: the subprocesses waited for (and theirs, once they waited for them)
        return t.user + t.system + t.children_user + t.children_system

    def pytest_runtest_protocol(self, item, nextitem):
        self._listen_to_jax()
        self.current = item.nodeid
        self._record(item.nodeid)
        self._cpu_start = self._cpu()
        return None

    def pytest_runtest_logreport(self, report):
        rec = self._record(report.nodeid)
        rec[f"{report.when}_s"] += report.duration
        if report.when == "call" or report.failed or report.skipped:
            rec["outcome"] = rec["outcome"] or report.outcome
        if report.when == "teardown":
            if self.current == report.nodeid:  # not on xdist's controller, which only hears the workers' reports
                rec["cpu_s"] += self._cpu() - self._cpu_start
            self.current = None

    def pytest_sessionfinish(self, session):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        os.makedirs(self.out_dir, exist_ok=True)
        part = {"worker": worker, "started": self.started, "finished": time.time(), "tests": self.tests}
        tmp = os.path.join(self.out_dir, f".{worker}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(part, f)
        os.replace(tmp, os.path.join(self.out_dir, f"{worker}.json"))


def pytest_configure(config):
    out = os.environ.get(ENV)
    if out and not config.pluginmanager.has_plugin("lrmq_suite_timing"):
        config.pluginmanager.register(SuiteTiming(out), "lrmq_suite_timing")


# ----------------------------------------------------------------------------- report
def _git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


def merge(parts_dir: str) -> dict:
    parts = [json.load(open(os.path.join(parts_dir, n))) for n in sorted(os.listdir(parts_dir))
             if n.endswith(".json") and not n.startswith(".")]
    if not parts:
        raise SystemExit(f"{parts_dir}: no timing parts (was ${ENV} set for the run?)")
    tests = {}
    # With xdist the controller ("main") also sees every report (wall times only, no compile or subprocess
    # figures): the workers' records win, the controller's fill in nothing else.
    workers = [p for p in parts if p["worker"] != "main"] or parts
    for p in sorted(parts, key=lambda p: p["worker"] != "main"):
        if p["worker"] == "main" and len(workers) != len(parts):
            continue
        for nodeid, rec in p["tests"].items():
            rec = dict(rec, worker=p["worker"])
            rec["wall_s"] = rec["setup_s"] + rec["call_s"] + rec["teardown_s"]
            rec["compile_s"] = rec["backend_compile_s"] + rec["lower_s"] + rec["trace_s"]
            tests[nodeid] = {k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}
    files = collections.defaultdict(lambda: {"tests": 0, "wall_s": 0.0, "compile_s": 0.0, "cpu_s": 0.0,
                                             "subprocesses": 0})
    for nodeid, rec in tests.items():
        f = files[nodeid.split("::")[0]]
        f["tests"] += 1
        f["wall_s"] += rec["wall_s"]
        f["compile_s"] += rec["compile_s"]
        f["cpu_s"] += rec.get("cpu_s", 0.0)
        f["subprocesses"] += rec["subprocesses"]
    files = {k: {kk: round(vv, 2) if isinstance(vv, float) else vv for kk, vv in v.items()}
             for k, v in sorted(files.items(), key=lambda kv: -kv[1]["wall_s"])}
    elapsed = max(p["finished"] for p in parts) - min(p["started"] for p in parts)
    totals = {"tests": len(tests), "workers": len(workers), "elapsed_s": round(elapsed, 1),
              "test_wall_s": round(sum(r["wall_s"] for r in tests.values()), 1),
              "in_process_compile_s": round(sum(r["compile_s"] for r in tests.values()), 1),
              "subprocesses": sum(r["subprocesses"] for r in tests.values()),
              "cpu_s": round(sum(r.get("cpu_s", 0.0) for r in tests.values()), 1),
              # a quiet machine with one core per worker cannot take less: the CPU time spread evenly over the workers
              "quiet_lower_bound_s": round(sum(r.get("cpu_s", 0.0) for r in tests.values()) / len(workers), 1),
              "over_30_s": sum(r["wall_s"] > 30 for r in tests.values())}
    return {"totals": totals, "files": files,
            "tests": dict(sorted(tests.items(), key=lambda kv: -kv[1]["wall_s"]))}


# ----------------------------------------------------------------------------- scheduling
# The files' CPU seconds from the last committed quiet run (`--costs` writes it). xdist's loadfile hands whole
# files to whichever worker is free, in the collection's order: the heaviest first (longest processing time first)
# keeps one worker from starting a 400 s file while the other has nothing left. Only the order depends on it.
COSTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "suite_costs.json")


def load_costs(path: str = COSTS) -> dict[str, float]:
    try:
        with open(path) as f:
            return {k: float(v) for k, v in json.load(f).items()}
    except (OSError, ValueError):
        return {}


def heaviest_files_first(nodeids: list[str], costs: dict[str, float]) -> list[int]:
    """The order (indices into nodeids) that runs whole files by their cost, heaviest first; a file without a
    recorded cost counts as the median file. Tests keep their order inside a file, files of equal cost theirs."""
    by_name = {os.path.basename(k): v for k, v in costs.items()}  # pytest's node ids depend on where it runs
    known = sorted(by_name.values())
    default = known[len(known) // 2] if known else 0.0
    files = [n.split("::")[0] for n in nodeids]
    first: dict[str, int] = {}
    for i, f in enumerate(files):
        first.setdefault(f, i)
    return sorted(range(len(nodeids)),
                  key=lambda i: (-by_name.get(os.path.basename(files[i]), default), first[files[i]], i))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts_dir", help=f"the directory ${ENV} named for the run")
    ap.add_argument("--out", required=True, help="merged JSON to write")
    ap.add_argument("--label", default="", help="what ran, on what, beside what (stored in the JSON)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--costs", default=None, metavar="FILE",
                    help=f"also write the files' CPU seconds, the suite's scheduling order (default place: {COSTS})")
    args = ap.parse_args(argv)
    report = merge(args.parts_dir)
    report["meta"] = {"label": args.label, "date": datetime.date.today().isoformat(), "commit": _git_head(),
                      "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, args.out)
    if args.costs:
        with open(args.costs + ".tmp", "w") as f:
            json.dump({k: v["cpu_s"] for k, v in sorted(report["files"].items(), key=lambda kv: -kv[1]["cpu_s"])},
                      f, indent=0)
        os.replace(args.costs + ".tmp", args.costs)
    t = report["totals"]
    print(f"{t['tests']} tests on {t['workers']} workers in {t['elapsed_s']:.0f} s; test time {t['test_wall_s']:.0f} s, "
          f"in-process compile {t['in_process_compile_s']:.0f} s, {t['subprocesses']} subprocesses, "
          f"{t['over_30_s']} tests over 30 s; CPU time {t['cpu_s']:.0f} s, at least {t['quiet_lower_bound_s']:.0f} s")
    print(f"\n{'wall s':>8} {'cpu s':>7} {'compile s':>9} {'subproc':>7}  test")
    for nodeid, r in list(report["tests"].items())[:args.top]:
        print(f"{r['wall_s']:8.1f} {r.get('cpu_s', 0):7.1f} {r['compile_s']:9.1f} {r['subprocesses']:7d}  {nodeid}")
    print(f"\n{'wall s':>8} {'cpu s':>7} {'compile s':>9} {'subproc':>7} {'tests':>5}  file")
    for name, r in list(report["files"].items())[:args.top]:
        print(f"{r['wall_s']:8.1f} {r['cpu_s']:7.1f} {r['compile_s']:9.1f} {r['subprocesses']:7d} {r['tests']:5d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
