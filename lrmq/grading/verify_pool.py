r"""A pool of worker processes that decide math-verify equivalence within hard time bounds.

Why a subprocess pool: math-verify's own timeouts use ``signal.alarm``, which only works in the
main thread and only interrupts Python bytecode. A sympy evaluation stuck in C (a huge integer power
such as ``9^{9^{9^9}}``, a catastrophic regex) cannot be interrupted in-process at all. So
comparisons run in a few long-lived worker processes (plain ``python -c``, so no re-import of the
caller's ``__main__`` and no fork of a multithreaded JAX process). Each worker bounds every item with
``setitimer`` (cheap, catches Python-level slowness); the parent kills and respawns a worker that
misses ``timeout_s + grace`` (catches everything else). A timeout scores as "not equivalent".
"""

from __future__ import annotations

import atexit
import inspect
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from collections import deque

log = logging.getLogger(__name__)

# Extra wall time the parent grants a worker beyond timeout_s before killing it.
KILL_GRACE_S = 0.5
WORKER_START_TIMEOUT_S = 60.0


def _math_verify_equal(pred: str, gold: str) -> bool:
    """math-verify equivalence with its signal timeouts off (the caller bounds the time)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    cfg = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    # Wrapping in \boxed{} makes the LaTeX extractor take the whole answer, "$" inside included.
    g = parse("\\boxed{" + gold + "}", cfg, parsing_timeout=None)
    p = parse("\\boxed{" + pred + "}", cfg, parsing_timeout=None)
    return bool(g and p and verify(g, p, timeout_seconds=None))


def _worker_main(equal) -> None:
    """Loop of a verify worker process: JSON lines ``{"id","pred","gold","timeout"}`` in, ``{"id","ok"}`` out.

    Self-contained (stdlib + ``equal``'s source) because it is run via ``python -c`` from the
    functions' source, without importing lrmq (whose package may pull in JAX).
    """
    import json
    import logging
    import os
    import signal
    import sys

    logging.disable(logging.CRITICAL)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol stream
    try:
        import resource

        # A runaway big-int power should fail with MemoryError, not swap the host.
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    except Exception:
        pass

    class _Timeout(BaseException):  # BaseException: math-verify/sympy swallow Exception
        pass

    def _alarm(signum, frame):
        raise _Timeout()

    signal.signal(signal.SIGALRM, _alarm)
    try:
        import math_verify  # noqa: F401  (import before reporting ready: keeps it off the item clock)
    except ImportError:
        pass

    try:
        equal("1", "1")  # warm lazy imports and parser caches off the item clock too
    except Exception:
        pass
    out.write('{"ready": true}\n')
    for line in sys.stdin:
        job = json.loads(line)
        ok = False
        try:
            signal.setitimer(signal.ITIMER_REAL, max(float(job["timeout"]), 1e-3))
            ok = equal(job["pred"], job["gold"])
        except BaseException:
            ok = False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.write(json.dumps({"id": job["id"], "ok": bool(ok)}) + "\n")


class _Worker:
    def __init__(self, equal):
        src = inspect.getsource(equal) + "\n" + inspect.getsource(_worker_main)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"{src}\n_worker_main({equal.__name__})\n"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()
        self.job: tuple[int, float] | None = None  # (item index, kill deadline)
        self.dead = False

    def lines(self) -> list[dict]:
        """Complete protocol messages available now (call when the fd is readable)."""
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            raise EOFError
        self.buf += chunk
        *done, self.buf = self.buf.split(b"\n")
        return [json.loads(d) for d in done if d.strip()]

    def send(self, idx: int, pred: str, gold: str, timeout_s: float) -> None:
        msg = json.dumps({"id": idx, "pred": pred, "gold": gold, "timeout": timeout_s}) + "\n"
        self.proc.stdin.write(msg.encode())
        self.proc.stdin.flush()
        self.job = (idx, time.monotonic() + timeout_s + KILL_GRACE_S)

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass


class VerifyPool:
    """A few long-lived math-verify worker processes; ``verify_many`` bounds each item's time."""

    def __init__(self, num_workers: int | None = None, equal=_math_verify_equal):
        # ``equal(pred, gold) -> bool`` must be a self-contained top-level function (its source is
        # what the worker runs); tests substitute one that hangs.
        self.equal = equal
        # sized to the machine: one worker per core up to 8 (the trainer's own threads mostly wait meanwhile)
        self.num_workers = num_workers or max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                     else os.cpu_count() or 1))
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()
        self.broken = False
        self.kills = 0  # workers killed for missing a deadline (diagnostics)
        self.last_timeouts = 0  # items of the last verify_many that ran out of time (or were never run)

    def _spawn(self) -> _Worker | None:
        try:
            return _Worker(self.equal)
        except Exception as e:  # e.g. no fork allowed: degrade to string matching only
            log.warning("math-verify worker failed to start (%s); using string match only", e)
            self.broken = True
            return None

    def verify_many(self, pairs: list[tuple[str, str]], timeout_s: float, budget_s: float | None = None) -> list[bool]:
        """Equivalence of each (pred, gold), each item bounded by ~timeout_s and the whole batch by budget_s
        (None: no batch bound): items not decided in time score False and are counted in last_timeouts."""
        results = [False] * len(pairs)
        self.last_timeouts = 0
        if not pairs:
            return results
        end = time.monotonic() + budget_s if budget_s else None
        with self.lock:
            while len(self.workers) < min(self.num_workers, len(pairs)) and not self.broken:
                w = self._spawn()
                if w is not None:
                    self.workers.append(w)
            if self.broken and not self.workers:
                return results
            pending = deque(range(len(pairs)))
            failed_starts = 0
            while pending or any(w.job for w in self.workers):
                if end is not None and time.monotonic() > end:  # the batch's budget is spent
                    self.last_timeouts += len(pending)
                    pending.clear()
                    for k, w in enumerate(self.workers):
                        if w.job:
                            self.last_timeouts += 1
                            self.kills += 1
                            w.kill()
                            self.workers[k] = self._spawn()
                    self.workers = [w for w in self.workers if w is not None]
                    break
                for w in self.workers:
                    if w.ready and w.job is None and pending:
                        i = pending.popleft()
                        try:
                            w.send(i, pairs[i][0], pairs[i][1], timeout_s)
                        except Exception:
                            w.dead = True  # broken pipe: the item scores False, worker replaced below
                now = time.monotonic()
                deadlines = [w.job[1] for w in self.workers if w.job]
                deadlines += [w.started + WORKER_START_TIMEOUT_S for w in self.workers if not w.ready]
                if end is not None:
                    deadlines.append(end)
                wait = max(0.0, min(deadlines) - now) if deadlines else 0.0
                # selectors (poll/epoll), not select.select: a big process can hold fds >= 1024.
                with selectors.DefaultSelector() as sel:
                    for w in self.workers:
                        sel.register(w.fd, selectors.EVENT_READ)
                    readable = {key.fd for key, _ in sel.select(wait)}
                now = time.monotonic()
                for k, w in enumerate(self.workers):
                    dead = w.dead
                    if w.fd in readable and not dead:
                        try:
                            for msg in w.lines():
                                if msg.get("ready"):
                                    w.ready = True
                                    failed_starts = 0
                                elif w.job and msg.get("id") == w.job[0]:
                                    results[w.job[0]] = bool(msg.get("ok"))
                                    w.job = None
                        except (EOFError, ValueError):
                            dead = True
                    if (w.job and now > w.job[1]) or (not w.ready and now > w.started + WORKER_START_TIMEOUT_S):
                        dead = True
                    if dead:
                        self.last_timeouts += bool(w.job)
                        failed_starts += not w.ready
                        self.kills += 1
                        w.kill()  # its item (if any) stays False
                        replacement = self._spawn() if failed_starts < 3 else None
                        if replacement is None:
                            self.broken = True
                        self.workers[k] = replacement
                self.workers = [w for w in self.workers if w is not None]
                if not self.workers:
                    break  # could not keep any worker alive: the rest score False
        return results

    def close(self) -> None:
        with self.lock:
            for w in self.workers:
                w.kill()
            self.workers = []


_POOL: VerifyPool | None = None
_POOL_LOCK = threading.Lock()


def get_verify_pool() -> VerifyPool:
    """The process-wide pool, created on first use and shut down at exit."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = VerifyPool()
            atexit.register(_POOL.close)
        return _POOL
