"""The suite's time budget (CONTRIBUTING.md): every slow marker carries its reason, the summary lists unmarked
tests over the limit, and tools/suite_timing.py merges the workers' records. Pure Python: milliseconds."""

from __future__ import annotations

import ast
import glob
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import SLOW_S, TESTS_DIR, pytest_collection_modifyitems, slow_report

import suite_timing  # tools/, put on sys.path by conftest


def _is_slow(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "slow" and isinstance(node.value, ast.Attribute) \
        and node.value.attr == "mark"


def _slow_markers(path: str):
    """(line, reason or None) of every pytest.mark.slow(...) and bare pytest.mark.slow in a test file."""
    tree = ast.parse(open(path).read(), path)
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_slow(node.func):
            called.add(id(node.func))
            reason = next((str(kw.value.value).strip() for kw in node.keywords
                           if kw.arg == "reason" and isinstance(kw.value, ast.Constant)), "")
            yield node.lineno, reason or None
    for node in ast.walk(tree):
        if _is_slow(node) and id(node) not in called:
            yield node.lineno, None


def test_every_slow_marker_in_the_suite_has_a_reason():
    """Collection refuses a bare marker only in the files it collects; this reads every test file."""
    bare, n = [], 0
    for path in sorted(glob.glob(os.path.join(TESTS_DIR, "**", "*.py"), recursive=True)):
        if os.path.samefile(path, __file__):  # this file builds bare markers on purpose
            continue
        for line, reason in _slow_markers(path):
            n += 1
            if reason is None:
                bare.append(f"{os.path.relpath(path, TESTS_DIR)}:{line}")
    assert n > 0  # the scan finds the suite's markers
    assert not bare, f"@pytest.mark.slow without reason=: {bare}"


def test_a_bare_slow_marker_stops_collection():
    def item(nodeid, *marks):
        return SimpleNamespace(nodeid=nodeid, iter_markers=lambda name: [m for m in marks if m.name == name])

    ok = [item("t.py::a", pytest.mark.slow(reason="one step too many").mark), item("t.py::b")]
    pytest_collection_modifyitems(None, ok)  # reasons given: nothing raised
    for mark in (pytest.mark.slow.mark, pytest.mark.slow(reason=" ").mark):
        with pytest.raises(pytest.UsageError, match="t.py::c"):
            pytest_collection_modifyitems(None, [*ok, item("t.py::c", mark)])


def test_slow_report_lists_unmarked_tests_over_the_limit():
    r = lambda nodeid, s: SimpleNamespace(nodeid=nodeid, duration=s)  # noqa: E731
    reports = [r("a", 1.0), r("a", SLOW_S), r("a", 0.1),  # setup + call + teardown: over the limit together
               r("b", SLOW_S + 5), r("c", SLOW_S - 1), r("d", 2 * SLOW_S)]
    over, n_marked = slow_report(reports, marked={"b"})
    assert [n for _, n in over] == ["d", "a"] and over[1][0] == pytest.approx(SLOW_S + 1.1)
    assert n_marked == 1


def test_suite_timing_merges_the_workers_parts(tmp_path):
    rec = lambda call, **kw: {"setup_s": 1.0, "call_s": call, "teardown_s": 0.5, "outcome": "passed",  # noqa: E731
                              "subprocesses": 0, "backend_compile_s": 0.0, "lower_s": 0.0, "trace_s": 0.0,
                              "compiles": 0, **kw}
    parts = {"gw0": {"f.py::a": rec(10.0, backend_compile_s=4.0, lower_s=1.0, trace_s=0.5, compiles=2, cpu_s=9.0)},
             "gw1": {"g.py::b": rec(40.0, subprocesses=3, cpu_s=70.0), "g.py::c": rec(2.0, cpu_s=1.0)},
             # the controller sees every test without compile figures: the workers' records win
             "main": {"f.py::a": rec(10.0), "g.py::b": rec(40.0), "g.py::c": rec(2.0)}}
    for i, (worker, tests) in enumerate(parts.items()):
        (tmp_path / f"{worker}.json").write_text(json.dumps({"worker": worker, "started": 100.0 + i,
                                                             "finished": 200.0 + i, "tests": tests}))
    (tmp_path / ".gw2.json.tmp").write_text("{not json: a part being written")
    out = suite_timing.merge(str(tmp_path))
    t = out["totals"]
    assert (t["tests"], t["workers"], t["elapsed_s"], t["subprocesses"], t["over_30_s"]) == (3, 2, 102.0, 3, 1)
    assert t["test_wall_s"] == pytest.approx(11.5 + 41.5 + 3.5)
    assert t["cpu_s"] == 80.0 and t["quiet_lower_bound_s"] == 40.0  # the CPU time over the 2 workers
    assert out["files"]["g.py"]["cpu_s"] == 71.0
    a = out["tests"]["f.py::a"]
    assert a["worker"] == "gw0" and a["compile_s"] == pytest.approx(5.5) and a["compiles"] == 2
    assert list(out["files"]) == ["g.py", "f.py"] and out["files"]["g.py"]["tests"] == 2
    assert list(out["tests"])[0] == "g.py::b"  # slowest first


def test_suite_timing_records_the_cpu_time_of_a_test_and_its_subprocesses(tmp_path):
    """The plugin's CPU figure counts the test's own CPU time and that of the subprocesses it waited for."""
    import subprocess
    import sys

    plugin = suite_timing.SuiteTiming(str(tmp_path))
    plugin._listen_to_jax = lambda: None  # no JAX needed for this record
    item = type("Item", (), {"nodeid": "t.py::busy"})()
    plugin.pytest_runtest_protocol(item, None)
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 0.3: pass"], check=True)
    report = type("Report", (), {"nodeid": "t.py::busy", "when": "teardown", "duration": 0.0, "failed": False,
                                 "skipped": False, "outcome": "passed"})()
    plugin.pytest_runtest_logreport(report)
    assert plugin.tests["t.py::busy"]["cpu_s"] >= 0.3
    controller = suite_timing.SuiteTiming(str(tmp_path))  # xdist's controller: reports without a protocol
    controller.pytest_runtest_logreport(report)
    assert controller.tests["t.py::busy"]["cpu_s"] == 0.0



def test_built_once_per_run_builds_once_and_retries_a_failed_build(tmp_path_factory):
    """conftest.built_once_per_run: one build per name, its directory reused; a build that raised leaves no
    done marker, so the next caller builds again into a clean directory."""
    from conftest import built_once_per_run

    calls = []

    def build(path):
        calls.append(path)
        with open(os.path.join(path, "x"), "w") as f:
            f.write("built")

    a = built_once_per_run(tmp_path_factory, "suite_budget_once", build)
    b = built_once_per_run(tmp_path_factory, "suite_budget_once", build)
    assert a == b and len(calls) == 1 and open(os.path.join(a, "x")).read() == "built"

    def broken(path):
        open(os.path.join(path, "half"), "w").close()
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError):
        built_once_per_run(tmp_path_factory, "suite_budget_retry", broken)
    c = built_once_per_run(tmp_path_factory, "suite_budget_retry", build)
    assert sorted(os.listdir(c)) == ["x"]  # rebuilt from an empty directory


def test_the_suite_compiles_with_xla_s_older_cpu_emitters():
    """conftest adds CPU_COMPILE_FLAG and CPU_CODEGEN_FLAG to XLA_FLAGS for the suite and its CLIs when jaxlib knows
    them (XLA aborts on an unknown flag), once each, and compile_with_xla_defaults lifts the first for one program."""
    import jax
    import jax.numpy as jnp

    import conftest

    assert conftest._jaxlib_knows("--xla_cpu_use_fusion_emitters=false")
    assert not conftest._jaxlib_knows("--xla_cpu_no_such_flag_in_any_jaxlib=true")
    if os.environ.get("LRMQ_TEST_FUSION_EMITTERS") != "1":
        assert conftest.CPU_COMPILE_FLAG in os.environ["XLA_FLAGS"].split()
    assert conftest._jaxlib_knows(conftest.CPU_CODEGEN_FLAG)  # one LLVM module per program, not split for threads
    assert os.environ["XLA_FLAGS"].count("--xla_cpu_parallel_codegen_split_count") == 1
    f = jax.jit(lambda x: jnp.tanh(x) * 2 + 1)
    x = jnp.linspace(-2, 2, 8)
    np.testing.assert_allclose(conftest.compile_with_xla_defaults(f.lower(x))(x), f(x), rtol=1e-6)


def test_the_heaviest_files_run_first(tmp_path):
    """conftest orders the collection by the files' recorded CPU seconds (tests/suite_costs.json), heaviest first,
    so xdist's loadfile hands the long files out before the short ones; tests keep their order inside a file and
    a file without a record counts as the median one. The Makefile stops xdist from re-sorting by test count."""
    ids = ["tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1", "tests/new.py::t1", "tests/c.py::t1",
           "tests/a.py::t3", "tests/d.py::t1"]
    costs = {"tests/a.py": 5.0, "tests/b.py": 50.0, "tests/c.py": 20.0, "tests/d.py": 1.0}
    order = [ids[i] for i in suite_timing.heaviest_files_first(ids, costs)]
    assert order == ["tests/b.py::t1", "tests/new.py::t1", "tests/c.py::t1",  # new.py: the median, 20 s, first seen
                     "tests/a.py::t1", "tests/a.py::t2", "tests/a.py::t3", "tests/d.py::t1"]
    assert [ids[i] for i in suite_timing.heaviest_files_first(ids, {})] == sorted(ids, key=lambda n: ids.index(
        n.split("::")[0] + "::t1"))  # no record: collection order, each file's tests together
    costs_file = tmp_path / "costs.json"
    costs_file.write_text(json.dumps(costs))
    assert suite_timing.load_costs(str(costs_file)) == costs and suite_timing.load_costs(str(tmp_path / "x")) == {}
    recorded = suite_timing.load_costs()
    assert recorded and all(os.path.exists(os.path.join(os.path.dirname(TESTS_DIR), f)) for f in recorded)
    make = open(os.path.join(os.path.dirname(TESTS_DIR), "Makefile")).read()
    assert "--dist loadfile --no-loadscope-reorder" in make


def test_each_worker_keeps_its_own_cores():
    """conftest pins xdist worker gw<i> (and what it starts) to every n-th core from i; nothing outside xdist or
    with more workers than cores; under `make test` (2 workers, 2 cores) each worker holds one core."""
    from conftest import worker_cpus

    assert worker_cpus("gw0", 2, [0, 1]) == [0] and worker_cpus("gw1", 2, [1, 0]) == [1]
    assert worker_cpus("gw1", 2, [0, 1, 2, 3, 4]) == [1, 3] and worker_cpus("gw0", 2, [0, 1, 2, 3, 4]) == [0, 2, 4]
    assert worker_cpus(None, 0, [0, 1]) is None and worker_cpus("gw0", 3, [0, 1]) is None
    assert worker_cpus("gw0", 1, [0, 1]) is None and worker_cpus("master", 2, [0, 1]) is None
    import conftest

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if 2 <= workers <= os.cpu_count() and os.environ.get("LRMQ_TEST_PIN") != "0":  # e.g. make test here
        assert conftest._pinned and sorted(os.sched_getaffinity(0)) == conftest._pinned
        assert len(conftest._pinned) <= os.cpu_count() // workers + 1


def test_torch_runs_on_one_thread_in_the_suite():
    """conftest's pytest_configure: torch on one intra-op thread (the suite's tensors are tiny; a second thread
    spin-waits beside the other worker), in every worker before any test module runs torch."""
    torch = pytest.importorskip("torch")
    assert torch.get_num_threads() == 1


def test_the_collector_runs_less_often_and_skips_what_collection_imported():
    """conftest's pytest_collection_finish (lrmq.cli.tune_gc): a young-generation collection every GC_GEN0
    allocations, and the objects alive after collection (modules, classes, fixtures) frozen out of the collector's
    walks."""
    import gc

    from lrmq.cli import GC_GEN0

    assert gc.get_threshold()[0] == GC_GEN0 > 700
    assert gc.get_freeze_count() > 10_000


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads' times from Linux's /proc")
def test_a_launch_s_polling_threads_go_to_sched_idle_and_its_workers_do_not():
    """run_polling_launch's watcher (conftest.idle_pollers): in a launched process, a thread that spends its time
    in system calls (as gloo's polling TCP event loop does) is moved to SCHED_IDLE; a thread computing in user
    space and the main thread keep their policy; the launch's output and exit status come back."""
    import subprocess
    import sys
    import time

    from conftest import idle_pollers, run_polling_launch

    # both threads spend their time outside the GIL (a read of /dev/zero, numpy's matrix product), so each runs as
    # much as the cores let it, pinned or not
    child = ("import os, threading, time\nimport numpy as np\n"
             "def spin():\n    fd = os.open('/dev/zero', os.O_RDONLY)\n    while True: os.read(fd, 1 << 20)\n"
             "def compute():\n    a = np.ones((256, 256))\n    while True: a @ a\n"
             "for f in (spin, compute): threading.Thread(target=f, daemon=True).start()\n"
             "print(os.getpid(), flush=True); time.sleep(60)\n")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # no BLAS pool
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)
    try:
        pid = int(proc.stdout.readline())
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        seen, moved = set(), []
        for _ in range(200):  # the spinner passes SPIN_TICKS of kernel time within a few seconds
            moved += idle_pollers(proc.pid, seen)
            if moved:
                break
            time.sleep(0.05)
        assert len(moved) == 1 and moved[0] in tids and moved[0] != pid
        policies = {t: os.sched_getscheduler(t) for t in tids}
        assert [t for t, p in policies.items() if p == os.SCHED_IDLE] == moved
        assert idle_pollers(proc.pid, seen) == []  # each thread once
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    r = run_polling_launch([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout=60)
    assert (r.returncode, r.stdout) == (3, "out\n")
