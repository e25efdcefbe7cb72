r"""Math rewards over `lrmq.grading.answers` (last-``\boxed{}`` extraction, MATH-style normalisation,
bounded-time equivalence) plus format and length rewards.

Reward functions are registered by name in ``REWARDS`` and are batched:

    fn(completions: list[str], answers: list[str], *, timeout_s, max_chars, lengths=None, max_len=None)
        -> (rewards float32 [N], info: dict of per-completion arrays)

``lengths`` (completion tokens) and ``max_len`` (the generation budget) are what length-shaped rewards
need; the answer rewards return ``{"correct", "formatted"}`` in ``info``. The trainer sums a main
reward and any weighted extra ones (``algo.extra_rewards``), logging each.

``score_completions`` is the entry point the trainer uses; it never raises.

Grading (extraction, normalisation, math-verify in bounded worker processes) is `lrmq.grading.answers`,
shared with the evaluation suites. See docs/grpo.md ("Rewards").
"""

from __future__ import annotations

import logging

import numpy as np

from lrmq.grading.answers import (DEFAULT_MAX_CHARS, MAX_VERIFY_CHARS, extract_last_boxed, is_equiv,  # noqa: F401
                                  is_equiv_many, normalize_answer)
from lrmq.registry import Registry

log = logging.getLogger(__name__)

REWARDS = Registry("reward")

FORMAT_BONUS = 0.1

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
