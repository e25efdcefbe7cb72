"""Shared helpers for lrmq benchmarks: thread setup, machine info, timing, markdown tables, JSON output.

Speed is always reported as figures measured side by side in one process (and ratios between them),
never as absolute thresholds in tests.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def set_threads(n: int | None) -> int:
    """Pin XLA's CPU intra-op pool (must run before jax is imported) and torch to `n` threads.

    n=None/0 -> all available cores. Returns the thread count used.
    """
    n = n or cpu_count()
    if "jax" in sys.modules:
        print("warning: jax already imported; XLA thread count not applied", file=sys.stderr)
    flags = os.environ.get("XLA_FLAGS", "")
    if "intra_op_parallelism_threads" not in flags:
        os.environ["XLA_FLAGS"] = (flags + f" --xla_cpu_multi_thread_eigen=true "
                                   f"intra_op_parallelism_threads={n}").strip()
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:  # torch is optional for lrmq-only benchmarks
        pass
    return n


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def machine_info(threads: int | None = None) -> dict[str, Any]:
    import jax

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": cpu_count(),
        "mem_gib": round(_mem_gib() or 0.0, 1),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "threads": threads,
        "date": datetime.date.today().isoformat(),
        "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "lrmq_commit": source_commit(),
    }
    try:
        import flax

        info["flax"] = flax.__version__
    except ImportError:
        pass
    if "torch" in sys.modules:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    if "transformers" in sys.modules:
        import transformers

        info["transformers"] = transformers.__version__
    return info


def machine_str(info: dict[str, Any]) -> str:
    parts = [f"{info['cpu']} ({info['cores']} cores, {info['mem_gib']} GiB)", f"jax {info['jax']} ({info['backend']})"]
    if "flax" in info:
        parts.append(f"flax {info['flax']}")
    if "torch" in info:
        parts.append(f"torch {info['torch']} ({info.get('torch_threads')} threads)")
    if "transformers" in info:
        parts.append(f"transformers {info['transformers']}")
    parts.append(f"python {info['python']}")
    return ", ".join(parts)


def block(x: Any) -> Any:
    """Wait for every jax array in a pytree (no-op for numpy / torch results)."""
    import jax

    return jax.block_until_ready(x)


def time_call(fn: Callable[[], Any], *, repeats: int = 3, warmup: int = 1) -> dict[str, Any]:
    """Time `fn()` (blocking on its jax outputs): first (warmup) call times, then `repeats` timed calls.

    Returns {"first_s": [...], "times_s": [...], "median_s", "min_s"}; `first_s[0] - median_s` estimates
    the compile time of a jitted fn.
    """
    first = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        block(fn())
        first.append(time.perf_counter() - t0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - t0)
    return {"first_s": first, "times_s": times, "median_s": statistics.median(times), "min_s": min(times)}


def time_dispatched(fn: Callable[..., Any], *args: Any, warmup: int = 2, iters: int = 10, reps: int = 1) -> float:
    """Median seconds of one `fn(*args)` over `iters` samples, each `reps` calls dispatched back to back and
    synchronised once (device kernels: the dispatch overhead is amortised, not timed per call)."""
    for _ in range(warmup):
        block(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn(*args)
        block(out)
        ts.append((time.perf_counter() - t0) / reps)
    return statistics.median(ts)


def time_interleaved(fns: dict[str, Callable[[], Any]], *, repeats: int = 3, warmup: int = 1) -> dict[str, dict]:
    """Like `time_call` for several contenders, alternating them call by call (warmups first), so that
    load from other processes on a shared machine hits every contender alike. Returns name -> timing dict."""
    out = {k: {"first_s": [], "times_s": []} for k in fns}
    for _ in range(warmup):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            block(fn())
            out[k]["first_s"].append(time.perf_counter() - t0)
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            block(fn())
            out[k]["times_s"].append(time.perf_counter() - t0)
    for v in out.values():
        v["median_s"], v["min_s"] = statistics.median(v["times_s"]), min(v["times_s"])
    return out


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v):
        if isinstance(v, float):
            if v == 0:
                return "0"
            if abs(v) >= 100:
                return f"{v:,.0f}"
            if abs(v) >= 10:
                return f"{v:.1f}"
            return f"{v:.2f}" if abs(v) >= 0.1 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str | None, payload: dict[str, Any], sort_keys: bool = False) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str, sort_keys=sort_keys)
    print(f"wrote {path}")


def count_params(tree: Any) -> int:
    import jax
    import numpy as np

    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree) if hasattr(x, "shape")))


def source_commit() -> str | None:
    """The lrmq commit measured: $LRMQ_COMMIT (set when running from an exported snapshot), else git HEAD
    (with "+dirty" when tracked files of lrmq/ or pallas_kernels/ differ)."""
    import subprocess

    if os.environ.get("LRMQ_COMMIT"):
        return os.environ["LRMQ_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no", "lrmq",
                                "pallas_kernels"],
                               capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None
