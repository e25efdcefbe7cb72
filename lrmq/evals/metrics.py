"""Benchmark metrics: pass@1 averaged over K samples, unbiased pass@k, and a standard error for every mean.

Each problem contributes one number (its mean over its K samples); a benchmark's score is the mean over
problems, and its standard error is the sample standard deviation of those per-problem numbers over
sqrt(#problems) (as lm-evaluation-harness reports `stderr`). Pooled scores pool problems, so larger
benchmarks weigh more (paper 1's "mean evaluation reward").
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct among `n` samples (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k), as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean); the SE is 0 for fewer than two values."""
    v = np.asarray(values, np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    se = float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0
    return float(v.mean()), se


def summarize(per_problem: Sequence[dict], ks: Sequence[int] = (1,)) -> dict:
    """Metrics of one benchmark (or a pool) from per-problem sample lists.

    per_problem: one dict per problem with lists over its samples: `correct` (bool), `reward` (float),
    `formatted` (bool), `completion_tokens` (int), `truncated` (bool).
    Returns {n_problems, samples, accuracy, accuracy_se, reward, reward_se, pass@k..., formatted, ...}.
    """
    if not per_problem:
        return {"n_problems": 0}
    ns = {len(p["correct"]) for p in per_problem}
    out: dict = {"n_problems": len(per_problem), "samples": min(ns) if len(ns) == 1 else sorted(ns)}
    for name, key in (("accuracy", "correct"), ("reward", "reward"), ("formatted", "formatted"),
                      ("truncated", "truncated"), ("completion_tokens", "completion_tokens")):
        m, se = mean_se([float(np.mean(np.asarray(p[key], np.float64))) for p in per_problem])
        out[name], out[f"{name}_se"] = m, se
    for k in ks:
        if all(len(p["correct"]) >= k for p in per_problem):
            vals = [pass_at_k(len(p["correct"]), int(np.sum(p["correct"])), k) for p in per_problem]
            out[f"pass@{k}"], out[f"pass@{k}_se"] = mean_se(vals)
    return out


def average_of(summaries: Sequence[dict], key: str = "accuracy") -> tuple[float, float]:
    """Unweighted average of benchmark means (QuantLRM's "average"), SE from the per-benchmark SEs
    (independent benchmarks: sqrt(sum se^2) / #benchmarks)."""
    ms = [s[key] for s in summaries if key in s]
    ses = [s.get(f"{key}_se", 0.0) for s in summaries if key in s]
    if not ms:
        return float("nan"), float("nan")
    return float(np.mean(ms)), float(math.sqrt(sum(x * x for x in ses)) / len(ms))
