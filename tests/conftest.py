"""Shared fixtures. Keep this small: tiny HF checkpoints and a many-device subprocess runner."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

# Several processes compile for TPU through libtpu at once (tests and the CLIs they launch); without this
# libtpu's machine-wide lockfile makes every process after the first fail.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# Trainers use JAX's persistent compilation cache (lrmq.compile_cache, default ~/.cache/lrmq/jax): the tests
# keep theirs in one temporary dir per session, shared with the CLIs they launch (identical tiny programs
# compiled by many tests and subprocesses are compiled once), and never touch the user's.
if "LRMQ_COMPILE_CACHE" not in os.environ:
    os.environ["LRMQ_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="lrmq-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["LRMQ_COMPILE_CACHE"], True)

# The suite is mostly XLA CPU compiles of tiny programs that then run for milliseconds: compile them without
# LLVM's expensive optimizations (JAX's own switch: XLA backend optimization level 0), for this process and the
# CLIs it launches. What the programs compute is unchanged: the whole suite passes either way (full run at
# 8d481a9: benchmarks/suite_timing/after_no_llvm_opt.json, 0 failures). TPU ahead-of-time compiles ignore it
# (same optimized HLO and memory figures, checked on a v5e:2x2 program). Tests whose run time, not their
# compiles, dominates lift it with the `optimized_xla` fixture. JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs the suite
# on fully optimized CPU code.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# XLA's CPU backend emits fused loops through its newer MLIR "fusion emitters" by default; its LLVM IR emitters
# compile the suite's programs in a third of the CPU time (the tiny GRPO step: 3.4 -> 1.2 s) and compute the same
# programs (the suite passes either way). LRMQ_TEST_FUSION_EMITTERS=1 keeps XLA's default.
CPU_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _jaxlib_knows(flag: str) -> bool:
    import importlib.util
    import mmap

    spec = importlib.util.find_spec("jaxlib")
    name = flag.lstrip("-").split("=")[0].encode()
    for lib in ("libjax_common.so", "xla_extension.so", "_jax.so"):
        path = os.path.join(os.path.dirname(spec.origin), lib) if spec and spec.origin else ""
        if os.path.isfile(path):
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(name) >= 0:
                    return True
    return False


# XLA's CPU backend splits each program's LLVM module into parts compiled on a thread pool; each worker here runs
# on one core (below), where the split only adds per-part work: one part compiles the tiny model's train step in
# 0.30 s of CPU instead of 0.42 (three interleaved compiles each), and two compile-heavy test files on one core
# took 15% less CPU (41.1 / 48.2 s against 46.6 / 58.1 s). Same programs, same code.
CPU_CODEGEN_FLAG = "--xla_cpu_parallel_codegen_split_count=1"


def _add_xla_flag(flag: str) -> None:
    """Append `flag` to XLA_FLAGS (this process and every CLI it launches inherit it; the launchers append to it)
    unless it is set there already or this jaxlib does not know it (XLA aborts on an unknown flag)."""
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", "") and _jaxlib_knows(flag):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


if os.environ.get("LRMQ_TEST_FUSION_EMITTERS") != "1":
    _add_xla_flag(CPU_COMPILE_FLAG)
_add_xla_flag(CPU_CODEGEN_FLAG)


# Each xdist worker on its own core(s), it and the processes it starts (they inherit the affinity); before anything
# creates a thread pool (XLA's CPU client and libtpu's compiler size theirs by the cores a process may use). On 2
# cores two workers' multithreaded compiles otherwise overlap, and threads waiting on their pools spin: the TPU
# compile tests used 195 s of CPU beside the other worker against ~120 s alone. LRMQ_TEST_PIN=0 leaves it.
def worker_cpus(worker: str | None, workers: int, cpus: list[int]) -> list[int] | None:
    """The cores xdist worker `worker` ("gw<i>") of `workers` keeps: every workers-th one from its index; None
    (no pinning) outside xdist, or with more workers than cores."""
    if not worker or not worker.startswith("gw") or workers < 2 or workers > len(cpus):
        return None
    return sorted(cpus)[int(worker[2:]) % workers::workers]


_pinned = worker_cpus(os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0),
                      sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else None
if _pinned and os.environ.get("LRMQ_TEST_PIN") != "0":
    os.sched_setaffinity(0, _pinned)


def compile_with_xla_defaults(lowered):
    """A lowered program (`jitted.lower(*args)`) compiled with XLA's default CPU emitters (the flag above lifted for
    this program): for tests that hold two different programs to the same bits. Those programs compute the same
    values in different company (one has extra outputs), and which emitter fuses them decides the last bit of a
    few float32 results (2.6e-8 apart in the rollout-correction step); XLA's defaults are what they are checked on."""
    return lowered.compile(compiler_options={"xla_cpu_use_fusion_emitters": True})

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(variant, dtype="float32") -> (dir, torch model); saved once per session."""
    cache: dict = {}

    def make(variant: str, dtype: str = "float32"):
        key = (variant, dtype)
        if key not in cache:
            import torch
            from hf_fixtures import save_hf_model_dir

            path = str(tmp_path_factory.mktemp(f"hf_{variant}_{dtype}"))
            model = save_hf_model_dir(variant, path, dtype=getattr(torch, dtype))
            cache[key] = (path, model)
        return cache[key]

    return make


def built_once_per_run(tmp_path_factory, name: str, build) -> str:
    """A directory that `build(dir)` fills once per test run, shared by the xdist workers (the first to ask
    builds it under a lock, the others wait and reuse it; a failed build is retried by the next one). The root
    is this run's temp dir (xdist: the workers' common parent), never one that outlives the run."""
    import fcntl
    import json

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(str(path))
            done.write_text(json.dumps({"built_by": os.environ.get("PYTEST_XDIST_WORKER", "main")}))
    return str(path)


def run_with_devices(script: str, *args: str, n_devices: int = 8, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run tests/<script> in a fresh interpreter with `n_devices` forced CPU devices.

    XLA reads the flag once at backend start, so it cannot be set inside the (1-device) pytest process.
    """
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n_devices}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, TESTS_DIR, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # the script runs as __main__ under the commands' garbage-collector settings (lrmq.cli.tune_gc)
    start = ("import runpy, sys; from lrmq import cli; cli.tune_gc(); sys.argv[:1] = []; "
             "runpy.run_path(sys.argv[0], run_name='__main__')")
    return subprocess.run([sys.executable, "-c", start, os.path.join(TESTS_DIR, script), *args], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


# A multi-process JAX run on CPU exchanges its collectives through gloo, whose TCP event loop busy-polls epoll in a
# thread of its own in every process, from start to exit (pytorch/gloo#246). Two such processes on one worker's core
# gave those two threads half of it: the gs:// launch took 84 s of CPU (49 s in the kernel) and 85 s of wall alone on
# one core. The loop's thread must still run when the processes wait on each other, so it is not stopped: it is
# moved to SCHED_IDLE, where it runs only when nothing else on the core wants to (44 s of CPU, 45 s of wall).
SPIN_TICKS = 30  # kernel time (1/100 s) after which a thread that is mostly in the kernel counts as a poller


def _thread_times(pgid: int) -> dict[int, tuple[int, int]]:
    """{tid: (user, system) ticks} of the threads other than the main one of every process in group `pgid`."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:  # field 5, the process group
                    continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                if tid != pid:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    out[int(tid)] = (int(fields[11]), int(fields[12]))  # fields 14 and 15: utime, stime
        except (OSError, ValueError, IndexError):  # the process or thread ended meanwhile
            continue
    return out


def idle_pollers(pgid: int, seen: set[int]) -> list[int]:
    """Move the busy-polling threads of process group `pgid` (over SPIN_TICKS of kernel time, more than twice their
    user time; not a main thread, not in `seen`) to SCHED_IDLE; returns their ids (added to `seen`)."""
    moved = []
    for tid, (user, system) in _thread_times(pgid).items():
        if tid not in seen and system > SPIN_TICKS and system > 2 * user:
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:
                continue
            seen.add(tid)
            moved.append(tid)
    return moved


def run_polling_launch(cmd: list[str], *, timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) for a launch of several JAX processes talking over gloo,
    in a session of its own, whose pollers `idle_pollers` moves to SCHED_IDLE every 0.2 s while it runs."""
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)
    done, seen = threading.Event(), set()

    def watch():
        while not done.wait(0.2):
            idle_pollers(proc.pid, seen)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise
    finally:
        done.set()
        watcher.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@functools.cache
def _jitted_forward():
    from flax import nnx

    return nnx.jit(lambda model, tokens: model(tokens))


def jit_forward(model, tokens):
    """model(tokens) as one compiled program per model structure, not op by op (each eager op is its own XLA
    compile: a forward of the tiny decoder is dozens of them)."""
    return _jitted_forward()(model, tokens)


@contextlib.contextmanager
def xla_optimized():
    """Fully optimized XLA CPU code for the programs compiled inside, where the suite runs with
    JAX_DISABLE_MOST_OPTIMIZATIONS=1 (the conftest default): it is a JAX option read at each compile, so it can be
    lifted for work whose run time, not its compiles, dominates (many training steps)."""
    import jax

    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture
def optimized_xla():
    """xla_optimized() for one whole test."""
    with xla_optimized():
        yield


@contextlib.contextmanager
def command_in_process():
    """Run a command's main() in this process (`python -m lrmq.X` without a Python + JAX start) and put back what
    the commands set process-wide: JAX_PLATFORMS (set while it runs, so lrmq.cli.select_platforms changes
    nothing), JAX's persistent-cache settings (lrmq.compile_cache.enable), the root logger and the loggers
    lrmq.train quiets (it configures logging with force=True), and the SIGTERM / SIGINT handlers it installs."""
    import logging
    import signal

    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    platforms = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = platforms or "cpu"
    cache = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir", "jax_enable_compilation_cache",
                                                   "jax_persistent_cache_min_compile_time_secs")}
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    quiet = {n: logging.getLogger(n).level for n in ("absl", "jax._src.xla_bridge")}
    handlers_of = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in handlers_of.items():
            signal.signal(s, h)
        root.handlers[:] = handlers
        root.setLevel(level)
        for n, lv in quiet.items():
            logging.getLogger(n).setLevel(lv)
        for k, v in cache.items():
            jax.config.update(k, v)
        cc.reset_cache()
        if platforms is None:
            os.environ.pop("JAX_PLATFORMS")


@pytest.fixture
def cli(capsys):
    """cli(module, *argv) -> (returncode, stdout, stderr) of `python -m lrmq.<module>` run as its main() in this
    process, with command_in_process putting back what it sets: for tests about what a command does and writes,
    not about its Python + JAX (+ libtpu) start (3-4 s of CPU each)."""
    import importlib
    from types import SimpleNamespace

    def call(module: str, *argv: str):
        capsys.readouterr()
        rc = importlib.import_module(f"lrmq.{module}").main(list(argv))
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=rc, stdout=out, stderr=err)

    with command_in_process():
        yield call


@pytest.fixture(scope="session")
def multi_device_run():
    """The `run_with_devices` helper as a fixture (tests need not import conftest)."""
    return run_with_devices


TINY_MODEL_DIR = os.path.join(REPO_ROOT, "lrmq", "assets", "tiny")


def tiny_train_config(out_dir: str, **sections):
    """A small, fast TrainConfig on the shipped tiny model (sections override dotted groups)."""
    from lrmq.configlib import config_from_dict
    from lrmq.rl.config import TrainConfig

    d = {
        "model": {"checkpoint": os.environ.get("LRMQ_TEST_TINY", TINY_MODEL_DIR)},
        "data": {"synthetic_train_size": 256, "synthetic_eval_size": 16},
        # one packed update shape (the worst case; the default 5 cost 4 more compiles per trainer): the shapes
        # themselves are tested in test_precompile.py
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_prompt_len": 32, "max_new_tokens": 40,
                    "update_shapes": 1},
        "algo": {"reward": "boxed_exact"},
        "optim": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant"},
        "run": {"out_dir": out_dir, "steps": 4, "save_every": 2, "eval_size": 16, "export_hf": False,
                "progress": False},
    }
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    return config_from_dict(TrainConfig, d)


def assert_adam_step_close(actual, desired, *, lr: float, atol: float, err_msg: str = ""):
    """Parameters after an Adam step taken from two float-equivalent computations (another tiling, mesh or
    CPU's vector width): every element within atol but a rare few (<= 0.1%), and those within a tenth of a
    step. Adam divides by sqrt(v), so an element whose gradient is near zero moves by the gradient's float noise
    scaled up to a fraction of lr; a real difference moves many elements, or some by a whole step."""
    actual, desired = np.asarray(actual), np.asarray(desired)
    assert actual.shape == desired.shape, (err_msg, actual.shape, desired.shape)
    diff = np.abs(actual - desired)
    outliers = int((diff > atol).sum())
    assert outliers <= max(1, diff.size // 1000) and diff.max() <= 0.1 * lr, \
        f"{err_msg}: {outliers} of {diff.size} elements differ by more than {atol}, the largest by {diff.max():.3g}"


# ----------------------------------------------------------------------------- the suite's time budget
# CONTRIBUTING.md: `make test` within 12 minutes on 2 quiet cores; a test over SLOW_S seconds carries
# @pytest.mark.slow(reason="one line: why it must take this long"). tools/suite_timing.py records where the time
# goes when $LRMQ_SUITE_TIMING names a directory.
SLOW_S = 30.0
sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
import suite_timing  # noqa: E402  (tools/, just put on the path)


# ----------------------------------------------------------------------------- the temp dir is left as found
# Commands remove their temporary dirs (local views and copies of bucket files, mirrored run logs: lrmq-copy-PID-*,
# lrmq-remote-PID-*, lrmq-run-logs-PID-*; lrmq.paths.process_temp_dir) when they exit. The main pytest process
# (after xdist's workers have exited) fails the session when one is left by a process that is gone, or by itself
# once it has removed its own as its exit would; another live process's (a concurrent session's) are not its to
# judge. The suite's own JAX cache dir (lrmq-test-jax-cache*) has no pid and is not looked at.
_TEMPS_AT_START: set[str] = set()


def _lrmq_temps() -> set[str]:
    from lrmq.paths import temp_owner

    root = tempfile.gettempdir()
    return {n for n in os.listdir(root) if temp_owner(n) is not None}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def left_temps(before: set[str]) -> list[str]:
    """lrmq temporary dirs made since `before` by a process that has exited, or by this one."""
    from lrmq.paths import temp_owner

    return sorted(n for n in _lrmq_temps() - before if temp_owner(n) == os.getpid() or not _alive(temp_owner(n)))


@pytest.hookimpl(hookwrapper=True)
def pytest_sessionfinish(session, exitstatus):
    yield  # after xdist's own sessionfinish, which shuts its workers down (their atexit hooks have run)
    if hasattr(session.config, "workerinput"):
        return
    from lrmq import paths

    paths.remove_process_temps()  # what this process's exit does
    left = left_temps(_TEMPS_AT_START)
    if left:
        tw = session.config.get_terminal_writer()
        tw.line()
        tw.line(
            f"FAILED: the suite left {len(left)} lrmq temporary dirs in {tempfile.gettempdir()}: " + ", ".join(left[:10]),
            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    _TEMPS_AT_START.update(_lrmq_temps())
    suite_timing.pytest_configure(config)
    # torch (the reference models, the consumer libraries' unpackers) on one intra-op thread: the suite's tensors
    # are tiny, and a second thread only spin-waits beside the other xdist worker (test_exports_consumers: CPU
    # 67.7 -> 26.8 s). The test modules import torch anyway; without it there is nothing to set.
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


# Python's cyclic garbage collector set as the commands set theirs (lrmq.cli.tune_gc), once collection is done:
# every module, model class and fixture function imported so far (they live for the whole session) leaves the
# collector's view, and young collections run every GC_GEN0 allocations instead of 700. Measured on three
# in-process files, one core: CPU 42.6 -> 40.5 s, the same tests.
def pytest_collection_finish(session):
    from lrmq import cli

    cli.tune_gc()


def pytest_collection_modifyitems(config, items):
    bare = [item.nodeid for item in items
            for m in item.iter_markers("slow") if not str(m.kwargs.get("reason", "")).strip()]
    if bare:
        raise pytest.UsageError(f"@pytest.mark.slow needs reason=\"...\" (one line: why it takes over {SLOW_S:.0f} s): "
                                + ", ".join(bare[:5]))
    # the heaviest files first (the Makefile keeps xdist from reordering them: --no-loadscope-reorder)
    order = suite_timing.heaviest_files_first([item.nodeid for item in items], suite_timing.load_costs())
    items[:] = [items[i] for i in order]


def slow_report(reports, marked: set[str]) -> tuple[list[tuple[float, str]], int]:
    """(unmarked tests over SLOW_S, slowest first; how many marked slow ran) from pytest's reports."""
    total: dict[str, float] = {}
    for r in reports:
        total[r.nodeid] = total.get(r.nodeid, 0.0) + r.duration
    over = sorted(((s, n) for n, s in total.items() if s > SLOW_S and n not in marked), reverse=True)
    return over, sum(n in marked for n in total)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    reports = [r for key in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
               for r in terminalreporter.stats.get(key, []) if hasattr(r, "duration") and hasattr(r, "nodeid")]
    marked = {r.nodeid for r in reports if "slow" in getattr(r, "keywords", {})}
    over, n_marked = slow_report(reports, marked)
    terminalreporter.write_line(f"slow tests: {n_marked} marked slow ran; {len(over)} unmarked over {SLOW_S:.0f} s"
                                + "".join(f"\n  {s:.0f} s {n}" for s, n in over[:15]))
