r"""Answer extraction and scoring for the evaluation suites: small registered functions.

Extractors: ``fn(completion: str) -> str | None`` (the model's final answer, or None when it gave none).
Scorers are batched, so math-verify comparisons go to the worker pool together:

    fn(completions: list[str], golds: list[str], *, extractor: str, timeout_s: float) -> list[Score]

A ``Score`` holds the extracted answer, ``correct``, ``formatted`` (an answer was found) and ``reward``
(the paper-1 reward ``1[correct] + 0.1 * 1[boxed]`` for ``paper_reward``; ``1[correct]`` otherwise).

Math equivalence is never decided here: it is the training reward's own path
(`lrmq.grading.answers`: last ``\boxed{}``, MATH normalisation, then math-verify in bounded workers).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from lrmq.grading.answers import extract_last_boxed, is_equiv_many
from lrmq.registry import Registry

Extractor = Callable[[str], Optional[str]]
EXTRACTORS: Registry[Extractor] = Registry("answer extractor")
SCORERS: Registry[Callable] = Registry("scorer")

THINK_END = "</think>"


@dataclass
class Score:
    extracted: Optional[str]
    correct: bool
    formatted: bool
    reward: float

    def to_dict(self) -> dict:
        return asdict(self)


def after_think(text: str) -> str:
    """The text after the last ``</think>`` (the whole text when there is none)."""
    i = text.rfind(THINK_END)
    return text if i < 0 else text[i + len(THINK_END):]


# ----------------------------------------------------------------------------- extractors


@EXTRACTORS.register("last_boxed")
def last_boxed(text: str) -> Optional[str]:
    r"""Paper 1's grader: the last ``\boxed{}`` (or ``\fbox{}``) of the whole completion."""
    return extract_last_boxed(text)


@EXTRACTORS.register("final_boxed")
def final_boxed(text: str) -> Optional[str]:
    r"""Reasoning models: the last ``\boxed{}`` after ``</think>``; the last one anywhere when the answer part
    has none (a model that boxed inside its thinking and restated in words still has its box graded)."""
    return extract_last_boxed(after_think(text)) or extract_last_boxed(text)


_TF_WORD = re.compile(r"\b(true|false|uncertain|unknown)\b", re.I)
_TF_ANSWER = re.compile(r"(?:answer|conclusion)\s*(?:is|:)?\s*[*\"'(\[]*\s*(true|false|uncertain|unknown)\b", re.I)


def _tf_norm(word: str) -> str:
    w = word.strip().lower()
    return "Uncertain" if w in ("uncertain", "unknown") else w.capitalize()


@EXTRACTORS.register("true_false_uncertain")
def true_false_uncertain(text: str) -> Optional[str]:
    r"""FOLIO: "True" / "False" / "Uncertain" ("unknown" counts as Uncertain). In the answer part (after
    ``</think>``): a ``\boxed{}`` label, else the last "answer/conclusion is X", else the last label word."""
    part = after_think(text)
    box = extract_last_boxed(part)
    if box:
        m = _TF_WORD.search(re.sub(r"\\text\{([^{}]*)\}", r"\1", box))
        if m:
            return _tf_norm(m.group(1))
    for pattern in (_TF_ANSWER, _TF_WORD):
        hits = pattern.findall(part)
        if hits:
            return _tf_norm(hits[-1])
    return None


_LETTER_BOX = re.compile(r"^\s*(?:\\text\{)?\(?([A-J])\)?(?:\})?\s*(?:[:.)].*)?$", re.S)
# "answer" in any case; the letter itself upper case only ("the answer is a bit unclear" is no answer)
_LETTER_ANSWER = re.compile(r"(?i:answer)\s*(?i:is|:)\s*(?i:option\s*)?[*\s]*\(?([A-J])\)?(?![A-Za-z])")
_LETTER_PAREN = re.compile(r"\(([A-J])\)")


def _letter_norm(s: str) -> Optional[str]:
    m = _LETTER_BOX.match(s or "")
    return m.group(1) if m else None


@EXTRACTORS.register("option_letter")
def option_letter(text: str) -> Optional[str]:
    r"""Multiple choice (GPQA, BBH temporal_sequences): the option letter A-J. In the answer part: a
    ``\boxed{}`` letter (``\boxed{B}``, ``\boxed{(B)}``, ``\boxed{\text{B}}``), else the last
    "answer is (B)" / "Answer: B", else the last "(B)"."""
    part = after_think(text)
    box = extract_last_boxed(part)
    if box is not None and _letter_norm(box):
        return _letter_norm(box)
    for pattern in (_LETTER_ANSWER, _LETTER_PAREN):
        hits = pattern.findall(part)
        if hits:
            return hits[-1].upper()
    return None


# ----------------------------------------------------------------------------- scorers


def _boxed_scores(extracted, golds, timeout_s, format_bonus: float) -> list[Score]:
    formatted = [a is not None and a.strip() != "" for a in extracted]
    eq = is_equiv_many([a if f else None for a, f in zip(extracted, formatted)], [str(g) for g in golds],
                       timeout_s=timeout_s)
    out = []
    for a, f, c in zip(extracted, formatted, eq):
        c = bool(c and f)
        out.append(Score(a, c, f, float(c) + (format_bonus if f else 0.0)))
    return out


@SCORERS.register("paper_reward")
def paper_reward(completions, golds, *, extractor: str = "last_boxed", timeout_s: float = 1.0) -> list[Score]:
    r"""Paper 1: equivalence as the training reward decides it (`lrmq.grading.answers`: MATH normalisation, then
    math-verify), reward ``1[correct] + 0.1 * 1[an answer was extracted]`` in {0, 0.1, 1.1}."""
    ex = EXTRACTORS.get(extractor)
    return _boxed_scores([ex(c) for c in completions], golds, timeout_s, 0.1)


@SCORERS.register("math_equiv")
def math_equiv(completions, golds, *, extractor: str = "final_boxed", timeout_s: float = 1.0) -> list[Score]:
    """Same equivalence as `paper_reward`, reward = accuracy (no format bonus)."""
    ex = EXTRACTORS.get(extractor)
    return _boxed_scores([ex(c) for c in completions], golds, timeout_s, 0.0)


def label_norm(s) -> Optional[str]:
    """Canonical label: "(B)" / " b " -> "B", "true" -> "TRUE", "unknown" -> "UNCERTAIN"."""
    if s is None:
        return None
    t = str(s).strip().strip("()").strip().upper()
    return "UNCERTAIN" if t == "UNKNOWN" else t


@SCORERS.register("label_match")
def label_match(completions, golds, *, extractor: str = "option_letter", timeout_s: float = 1.0) -> list[Score]:
    """Labels (option letters, True/False/Uncertain): the extracted label equals the gold one after
    `label_norm`; reward = accuracy."""
    ex = EXTRACTORS.get(extractor)
    out = []
    for c, g in zip(completions, golds):
        a = ex(c)
        ok = a is not None and label_norm(a) == label_norm(g)
        out.append(Score(a, ok, a is not None, float(ok)))
    return out


def score(name: str, completions: list[str], golds: list[str], *, extractor: str,
          timeout_s: float = 1.0) -> list[Score]:
    """`SCORERS.get(name)` on a batch."""
    if len(completions) != len(golds):
        raise ValueError(f"{len(completions)} completions vs {len(golds)} gold answers")
    return SCORERS.get(name)(list(completions), list(golds), extractor=extractor, timeout_s=timeout_s)
