r"""Math rewards: last-``\boxed{}`` extraction, MATH-style normalisation, bounded-time equivalence.

Reward functions are registered by name in ``REWARDS`` and are batched:

    fn(completions: list[str], answers: list[str], *, timeout_s, max_chars, lengths=None, max_len=None)
        -> (rewards float32 [N], info: dict of per-completion arrays)

``lengths`` (completion tokens) and ``max_len`` (the generation budget) are what length-shaped rewards
need; the answer rewards return ``{"correct", "formatted"}`` in ``info``. The trainer sums a main
reward and any weighted extra ones (``algo.extra_rewards``), logging each.

``score_completions`` is the entry point the trainer uses; it never raises.

Comparisons the normalised string match does not settle go to math-verify in a pool of worker
processes with hard time bounds (`lrmq.rl.verify_pool`). See docs/grpo.md ("Rewards").
"""

from __future__ import annotations

import logging
import re

import numpy as np

from lrmq.registry import Registry
from lrmq.rl.verify_pool import get_verify_pool

log = logging.getLogger(__name__)

REWARDS = Registry("reward")

# Only the tail of a completion is searched for the answer: bounds the work on runaway generations
# (32k chars ~ 8k tokens; the final answer of a 1k-token completion is always inside it).
DEFAULT_MAX_CHARS = 32_768
# Answers longer than this skip math-verify (string match only): real final answers are short, and
# sympy's cost grows super-linearly with expression size.
MAX_VERIFY_CHARS = 1_000
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


# ----------------------------------------------------------------------------- equivalence


def is_equiv_many(preds: list[str | None], golds: list[str], *, timeout_s: float = 1.0, use_math_verify: bool = True,
                  budget_s: float | None = None, stats: dict | None = None) -> list[bool]:
    """Batched ``is_equiv``: string match in-process, math-verify for the rest in parallel workers, each
    item bounded by ~timeout_s and the batch by budget_s; ``stats["timeouts"]`` counts undecided items."""
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
            pool = get_verify_pool()
            res = pool.verify_many([(str(preds[i]), str(golds[i])) for i in todo], timeout_s, budget_s)
            for i, r in zip(todo, res):
                out[i] = r
            if stats is not None:
                stats["timeouts"] = stats.get("timeouts", 0) + pool.last_timeouts
        except Exception as e:
            log.warning("math-verify batch failed: %s", e)
    return out


def is_equiv(pred: str | None, gold: str, *, timeout_s: float = 1.0) -> bool:
    """Normalised string match, then math-verify (bounded by ``timeout_s``). Never raises."""
    return is_equiv_many([pred], [gold], timeout_s=timeout_s)[0]


# ----------------------------------------------------------------------------- rewards


def _boxed_reward(completions, answers, *, timeout_s, max_chars, use_math_verify, budget_s=None):
    extracted = []
    for c in completions:
        try:
            extracted.append(extract_last_boxed(c, max_chars=max_chars))
        except Exception:
            extracted.append(None)
    # An empty box earns no format bonus (understand-r1-zero would give it 0.1): nothing to grade.
    formatted = np.array([a is not None and a.strip() != "" for a in extracted], bool)
    stats = {"timeouts": 0}
    correct = np.array(is_equiv_many(extracted, list(answers), timeout_s=timeout_s, use_math_verify=use_math_verify,
                                     budget_s=budget_s, stats=stats), bool) & formatted
    rewards = correct.astype(np.float32) + np.float32(FORMAT_BONUS) * formatted
    return rewards.astype(np.float32), {"correct": correct, "formatted": formatted, "timeouts": stats["timeouts"]}


@REWARDS.register("boxed_math")
def boxed_math_reward(completions, answers, *, timeout_s: float = 1.0, max_chars: int = DEFAULT_MAX_CHARS,
                      budget_s: float | None = None, **_):
    """Paper 1: ``1[correct] + 0.1 * 1[a \\boxed answer exists]`` in {0, 0.1, 1.1}; string match + math-verify."""
    return _boxed_reward(completions, answers, timeout_s=timeout_s, max_chars=max_chars, use_math_verify=True,
                         budget_s=budget_s)


@REWARDS.register("boxed_exact")
def boxed_exact_reward(completions, answers, *, timeout_s: float = 1.0, max_chars: int = DEFAULT_MAX_CHARS, **_):
    """Same values as ``boxed_math`` but normalised exact match only (fast; synthetic arithmetic)."""
    return _boxed_reward(completions, answers, timeout_s=timeout_s, max_chars=max_chars, use_math_verify=False)


@REWARDS.register("format")
def format_reward(completions, answers, *, max_chars: int = DEFAULT_MAX_CHARS, **_):
    r"""1 when the completion ends with a non-empty ``\boxed{}`` answer (right or wrong), else 0."""
    del answers
    ok = np.array([bool((extract_last_boxed(c, max_chars=max_chars) or "").strip()) for c in completions], bool)
    return ok.astype(np.float32), {}


@REWARDS.register("think_format")
def think_format_reward(completions, answers, *, max_chars: int = DEFAULT_MAX_CHARS, **_):
    r"""1 when the completion closes its reasoning exactly once (one ``</think>``) and puts a non-empty
    ``\boxed{}`` answer after it (the R1 format), else 0."""
    del answers
    out = []
    for c in completions:
        head, sep, tail = c.partition("</think>")
        out.append(bool(sep) and "</think>" not in tail and bool((extract_last_boxed(tail, max_chars=max_chars)
                                                                   or "").strip()))
    return np.array(out, np.float32), {}


def _lengths(lengths, max_len, n):
    if lengths is None or not max_len:
        raise ValueError("a length reward needs the completion lengths and the generation budget max_len")
    lengths = np.asarray(lengths, np.float32)
    if lengths.shape != (n,):
        raise ValueError(f"{lengths.shape} lengths for {n} completions")
    return lengths


@REWARDS.register("length_penalty")
def length_penalty_reward(completions, answers, *, lengths=None, max_len=None, **_):
    """-length / max_len in [-1, 0]: every token costs the same."""
    del answers
    return -_lengths(lengths, max_len, len(completions)) / np.float32(max_len), {}


# DAPO's soft overlong punishment ramps over the last quarter of the budget.
OVERLONG_BUFFER_FRACTION = 0.25


@REWARDS.register("overlong_penalty")
def overlong_penalty_reward(completions, answers, *, lengths=None, max_len=None, **_):
    """DAPO's soft overlong punishment: 0 up to max_len - buffer, then linear down to -1 at max_len
    (buffer = a quarter of max_len)."""
    del answers
    lengths = _lengths(lengths, max_len, len(completions))
    buffer = max(1.0, OVERLONG_BUFFER_FRACTION * max_len)
    start = max_len - buffer
    return np.clip((start - lengths) / np.float32(buffer), -1.0, 0.0).astype(np.float32), {}


def score_completions(
    completions: list[str],
    answers: list[str],
    reward_name: str = "boxed_math",
    *,
    timeout_s: float = 1.0,
    max_chars: int = DEFAULT_MAX_CHARS,
    lengths=None,
    max_len: int | None = None,
    budget_s: float | None = None,
):
    """Rewards for ``completions`` against ``answers``: ``(float32 [N], info)``; the answer rewards' info has
    ``correct``, ``formatted`` and ``timeouts`` (comparisons not decided in time); ``failed`` is True when the
    reward function raised and the batch was scored 0.

    Never raises on bad completions (an unknown ``reward_name`` or mismatched lengths still raise:
    those are configuration bugs). Each math-verify comparison takes at most ~``timeout_s`` + 0.5 s and
    the batch at most ~``budget_s`` (None: unbounded).
    """
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions vs {len(answers)} answers")
    fn = REWARDS.get(reward_name)
    n = len(completions)
    try:
        return fn(list(completions), list(answers), timeout_s=timeout_s, max_chars=max_chars, lengths=lengths,
                  max_len=max_len, budget_s=budget_s)
    except Exception as e:
        log.warning("reward %s failed on a batch (%s); scoring it 0", reward_name, e)
        return np.zeros(n, np.float32), {"correct": np.zeros(n, bool), "formatted": np.zeros(n, bool),
                                         "timeouts": n, "failed": True}


def weighted_rewards(algo, texts: list[str], answers: list[str], lengths, max_len: int, *,
                     score_fn=score_completions) -> tuple[np.ndarray, dict, dict]:
    """The training reward of a batch: ``algo.reward_weight`` x ``algo.reward`` plus each of ``algo.extra_rewards``
    times its weight. Returns (total float32 [N], {reward name: its unweighted values}, the main reward's info);
    math-verify bounded by ``algo.reward_timeout_s`` per item and ``algo.reward_budget_s`` per batch."""
    kw = dict(timeout_s=algo.reward_timeout_s, lengths=lengths, max_len=max_len, budget_s=algo.reward_budget_s or None)
    main, info = score_fn(texts, answers, algo.reward, **kw)
    parts = {algo.reward: main}
    total = np.float32(algo.reward_weight) * main
    for name, weight in algo.extra_rewards.items():
        parts[name] = score_fn(texts, answers, name, **kw)[0]
        total = total + np.float32(weight) * parts[name]
    return total.astype(np.float32), parts, info
