r"""Math rewards: last-``\boxed{}`` extraction, MATH-style normalisation, bounded-time equivalence.

Reward functions are registered by name in ``REWARDS`` and are batched:

    fn(completions: list[str], answers: list[str], *, timeout_s, max_chars)
        -> (rewards float32 [N], {"correct": bool [N], "formatted": bool [N]})

``score_completions`` is the entry point the trainer uses; it never raises.

Why a subprocess pool for math-verify: math-verify's own timeouts use ``signal.alarm``, which only
works in the main thread and only interrupts Python bytecode. A sympy evaluation stuck in C (a huge
integer power such as ``9^{9^{9^9}}``, a catastrophic regex) cannot be interrupted in-process at all.
So comparisons that the normalised string match does not settle run in a few long-lived worker
processes (plain ``python -c``, so no re-import of the caller's ``__main__`` and no fork of a
multithreaded JAX process). Each worker bounds every item with ``setitimer`` (cheap, catches
Python-level slowness); the parent kills and respawns a worker that misses ``timeout_s + grace``
(catches everything else). A timeout scores as "not equivalent". See docs/grpo.md ("Rewards").
"""

from __future__ import annotations

import atexit
import inspect
import json
import logging
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections import deque

import numpy as np

from lrmq.registry import Registry

log = logging.getLogger(__name__)

REWARDS = Registry("reward")

# Only the tail of a completion is searched for the answer: bounds the work on runaway generations
# (32k chars ~ 8k tokens; the final answer of a 1k-token completion is always inside it).
DEFAULT_MAX_CHARS = 32_768
# Answers longer than this skip math-verify (string match only): real final answers are short, and
# sympy's cost grows super-linearly with expression size.
MAX_VERIFY_CHARS = 1_000
# Extra wall time the parent grants a worker beyond timeout_s before killing it.
KILL_GRACE_S = 0.5
WORKER_START_TIMEOUT_S = 60.0
FORMAT_BONUS = 0.1

# ----------------------------------------------------------------------------- extraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_BRACE_RE = re.compile(r"[{}]")


def extract_last_boxed(text: str, *, max_chars: int = DEFAULT_MAX_CHARS) -> str | None:
    r"""Content of the last ``\boxed{...}`` / ``\fbox{...}`` / ``\boxed x`` in ``text``.

    Braces are matched (``\boxed{\frac{1}{2}}`` -> ``\frac{1}{2}``). Returns None when there is no
    box, or when the last box is unbalanced or truncated (as understand-r1-zero's grader does: an
    earlier, complete box is *not* used). The space form ``\boxed 5`` runs to the next ``$`` or
    newline. Only the last ``max_chars`` characters are searched. Linear time.
    """
    if not isinstance(text, str):
        return None
    tail = text[-max_chars:] if max_chars and len(text) > max_chars else text
    last = None
    for last in _BOX_RE.finditer(tail):
        pass
    if last is None:
        return None
    i = last.end()
    if tail.startswith(" ", i) and not tail[i:].lstrip(" ").startswith("{"):
        # "\boxed 5$": the answer runs to the end of the math span or line.
        return re.split(r"[$\n]", tail[i:], maxsplit=1)[0].strip()
    while i < len(tail) and tail[i] in " \t":
        i += 1
    if i >= len(tail) or tail[i] != "{":
        return None
    depth = 0
    for m in _BRACE_RE.finditer(tail, i):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return tail[i + 1 : m.start()]
    return None


# ----------------------------------------------------------------------------- normalisation
# A superset of the Hendrycks MATH ``strip_string`` normaliser (also used by understand-r1-zero's
# mathd check). It only has to make string equality catch the common equivalent spellings; anything
# subtler goes to math-verify.


def _fix_fracs(s: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{x}`` -> ``\frac{1}{x}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for sub in parts[1:]:
        out += "\\frac"
        if sub.startswith("{"):
            out += sub
        elif len(sub) < 2:
            return s
        elif sub[1] != "{":
            out += "{" + sub[0] + "}{" + sub[1] + "}" + sub[2:]
        else:
            out += "{" + sub[0] + "}" + sub[1:]
    return out


def _fix_sqrt(s: str) -> str:
    r"""``\sqrt2`` -> ``\sqrt{2}``."""
    parts = s.split("\\sqrt")
    out = parts[0]
    for sub in parts[1:]:
        out += "\\sqrt" + (sub if not sub or sub[0] in "{[" else "{" + sub[0] + "}" + sub[1:])
    return out


_A_SLASH_B = re.compile(r"^(-?\d+)/(\d+)$")
_TEXT_WRAP = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}$")
_TRAILING_UNITS = re.compile(r"\\(?:text|mbox|mathrm)\{\s*[^{}]*\}$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL = re.compile(r"^-?\d+\.\d*$|^-?\d*\.\d+$")


def normalize_answer(s: str | None) -> str | None:
    r"""MATH-style canonical string for an answer (None stays None).

    Removes: whitespace and line breaks, ``\left``/``\right``, ``\!``/``\,``/``\;``/``\ ``,
    ``\displaystyle``, ``$``/``\$``, ``\%``/``%``, degree marks ``^\circ``, a trailing ``.``, a
    trailing units ``\text{...}`` (``5\text{ cm}`` -> ``5``), a short left-hand side (``x = 3`` -> ``3``).
    Rewrites: ``\dfrac``/``\tfrac`` -> ``\frac``, ``\frac12`` -> ``\frac{1}{2}``, ``\sqrt2`` -> ``\sqrt{2}``,
    ``a/b`` of integers -> ``\frac{a}{b}``, ``\text{X}`` alone -> ``X``, ``1,000`` -> ``1000``,
    ``.5`` -> ``0.5``, decimals without trailing zeros (``2.50`` -> ``2.5``, ``3.0`` -> ``3``) and
    ``0.5`` -> ``\frac{1}{2}`` (as Hendrycks does; other decimals are left to math-verify).
    """
    if s is None:
        return None
    s = str(s).replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    for sp in ("\\,", "\\;", "\\:", "\\ "):
        s = s.replace(sp, " ")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("^{°}", "").replace("°", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.strip()
    m = _TEXT_WRAP.match(s)
    if m:
        s = m.group(1).strip()
    else:
        s = _TRAILING_UNITS.sub("", s).strip()
    s = s.rstrip(".").rstrip()  # sentence full stop: "5." -> "5"
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs.strip()) <= 2:
        s = rhs
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if _DECIMAL.match(s):
        s = s.rstrip("0").rstrip(".") if "." in s else s
        s = s or "0"
        if s.startswith("."):
            s = "0" + s
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = _A_SLASH_B.match(s)
    if m:
        s = "\\frac{%s}{%s}" % m.groups()
    return s


# ----------------------------------------------------------------------------- math-verify (worker side)


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
        self.num_workers = num_workers or max(1, min(4, os.cpu_count() or 1))
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()
        self.broken = False
        self.kills = 0  # workers killed for missing a deadline (diagnostics)

    def _spawn(self) -> _Worker | None:
        try:
            return _Worker(self.equal)
        except Exception as e:  # e.g. no fork allowed: degrade to string matching only
            log.warning("math-verify worker failed to start (%s); using string match only", e)
            self.broken = True
            return None

    def verify_many(self, pairs: list[tuple[str, str]], timeout_s: float) -> list[bool]:
        results = [False] * len(pairs)
        if not pairs:
            return results
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


# ----------------------------------------------------------------------------- equivalence


def is_equiv_many(preds: list[str | None], golds: list[str], *, timeout_s: float = 1.0, use_math_verify: bool = True) -> list[bool]:
    """Batched ``is_equiv``: string match in-process, math-verify for the rest in parallel workers."""
    out = [False] * len(preds)
    todo: list[int] = []
    for i, (p, g) in enumerate(zip(preds, golds)):
        try:
            if p is None or g is None or not str(p).strip():
                continue
            np_, ng = normalize_answer(p), normalize_answer(g)
            if np_ and np_ == ng:
                out[i] = True
            elif use_math_verify and len(p) <= MAX_VERIFY_CHARS and len(str(g)) <= MAX_VERIFY_CHARS:
                todo.append(i)
        except Exception:
            pass
    if todo:
        try:
            res = get_verify_pool().verify_many([(str(preds[i]), str(golds[i])) for i in todo], timeout_s)
            for i, r in zip(todo, res):
                out[i] = r
        except Exception as e:
            log.warning("math-verify batch failed: %s", e)
    return out


def is_equiv(pred: str | None, gold: str, *, timeout_s: float = 1.0) -> bool:
    """Normalised string match, then math-verify (bounded by ``timeout_s``). Never raises."""
    return is_equiv_many([pred], [gold], timeout_s=timeout_s)[0]


# ----------------------------------------------------------------------------- rewards


def _boxed_reward(completions, answers, *, timeout_s, max_chars, use_math_verify):
    extracted = []
    for c in completions:
        try:
            extracted.append(extract_last_boxed(c, max_chars=max_chars))
        except Exception:
            extracted.append(None)
    # An empty box earns no format bonus (understand-r1-zero would give it 0.1): nothing to grade.
    formatted = np.array([a is not None and a.strip() != "" for a in extracted], bool)
    correct = np.array(
        is_equiv_many(extracted, list(answers), timeout_s=timeout_s, use_math_verify=use_math_verify), bool
    ) & formatted
    rewards = correct.astype(np.float32) + np.float32(FORMAT_BONUS) * formatted
    return rewards.astype(np.float32), {"correct": correct, "formatted": formatted}


@REWARDS.register("boxed_math")
def boxed_math_reward(completions, answers, *, timeout_s: float = 1.0, max_chars: int = DEFAULT_MAX_CHARS):
    """Paper 1: ``1[correct] + 0.1 * 1[a \\boxed answer exists]`` in {0, 0.1, 1.1}; string match + math-verify."""
    return _boxed_reward(completions, answers, timeout_s=timeout_s, max_chars=max_chars, use_math_verify=True)


@REWARDS.register("boxed_exact")
def boxed_exact_reward(completions, answers, *, timeout_s: float = 1.0, max_chars: int = DEFAULT_MAX_CHARS):
    """Same values as ``boxed_math`` but normalised exact match only (fast; synthetic arithmetic)."""
    return _boxed_reward(completions, answers, timeout_s=timeout_s, max_chars=max_chars, use_math_verify=False)


def score_completions(
    completions: list[str],
    answers: list[str],
    reward_name: str = "boxed_math",
    *,
    timeout_s: float = 1.0,
    max_chars: int = DEFAULT_MAX_CHARS,
):
    """Rewards for ``completions`` against ``answers``: ``(float32 [N], {"correct", "formatted"})``.

    Never raises on bad completions (an unknown ``reward_name`` or mismatched lengths still raise:
    those are configuration bugs). Each math-verify comparison takes at most ~``timeout_s`` + 0.5 s.
    """
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions vs {len(answers)} answers")
    fn = REWARDS.get(reward_name)
    n = len(completions)
    try:
        return fn(list(completions), list(answers), timeout_s=timeout_s, max_chars=max_chars)
    except Exception as e:
        log.warning("reward %s failed on a batch (%s); scoring it 0", reward_name, e)
        return np.zeros(n, np.float32), {"correct": np.zeros(n, bool), "formatted": np.zeros(n, bool)}
