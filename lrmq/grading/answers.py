r"""Answer grading shared by the GRPO rewards (`lrmq.rl.rewards`) and the evaluation suites (`lrmq.evals`):
last-``\boxed{}`` extraction, MATH-style normalisation, and bounded-time equivalence.

Comparisons the normalised string match does not settle go to math-verify in a pool of worker
processes with hard time bounds (`lrmq.grading.verify_pool`). See docs/grpo.md ("Rewards").
It sits below both the RL and the evaluation layers, so neither imports the other to grade.
"""

from __future__ import annotations

import logging
import re

from lrmq.grading.verify_pool import get_verify_pool

log = logging.getLogger(__name__)

# Only the tail of a completion is searched for the answer: bounds the work on runaway generations
# (32k chars ~ 8k tokens; the final answer of a 1k-token completion is always inside it).
DEFAULT_MAX_CHARS = 32_768
# Answers longer than this skip math-verify (string match only): real final answers are short, and
# sympy's cost grows super-linearly with expression size.
MAX_VERIFY_CHARS = 1_000

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
