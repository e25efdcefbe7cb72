"""Seeded multi-step arithmetic: a task small enough for the tiny embedded model to learn and RL on.

    problem:  "Compute 12+7*3-5."
    solution: "7*3=21. 12+21=33. 33-5=28. \\boxed{28}"
    answer:   "28"

Steps follow operator precedence: every `*` left to right, then `+`/`-` left to right. The character
set is tiny on purpose (digits, `+-*=.`, space, the words "Compute"/"boxed", a backslash and braces).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Iterable, Sequence

from lrmq.atomic import atomic_write_text
from lrmq.cli import ArgumentParser, UsageError, number, run_main, select_platforms, tune_gc

OPS = ("+", "-", "*")


@dataclass(frozen=True)
class ArithDifficulty:
    min_ops: int = 1
    max_ops: int = 3
    max_operand: int = 20  # operands are drawn from [0, max_operand]
    max_mul_operand: int = 9  # both factors of a `*` stay small so products stay short
    allow_negative: bool = False  # if False, no intermediate result is negative

    def __post_init__(self):
        if not 1 <= self.min_ops <= self.max_ops <= 3:
            raise ValueError(f"need 1 <= min_ops <= max_ops <= 3, got min_ops={self.min_ops} max_ops={self.max_ops}")
        if self.max_operand < 1 or self.max_mul_operand < 1:
            raise ValueError(f"max_operand and max_mul_operand must be >= 1, got {self.max_operand}, {self.max_mul_operand}")


def solve(numbers: Sequence[int], ops: Sequence[str]) -> tuple[list[str], int]:
    """Step strings ("7*3=21") and the value, multiplication first, then left to right."""
    if len(numbers) != len(ops) + 1:
        raise ValueError(f"{len(numbers)} numbers need {len(numbers) - 1} ops, got {len(ops)}")
    nums, ops = list(numbers), list(ops)
    steps = []
    while "*" in ops:
        i = ops.index("*")
        v = nums[i] * nums[i + 1]
        steps.append(f"{nums[i]}*{nums[i + 1]}={v}")
        nums[i : i + 2] = [v]
        del ops[i]
    while ops:
        a, op, b = nums[0], ops[0], nums[1]
        v = a + b if op == "+" else a - b
        steps.append(f"{a}{op}{b}={v}")
        nums[0:2] = [v]
        del ops[0]
    return steps, nums[0]


def _intermediates_ok(steps: list[str]) -> bool:
    return all(not s.split("=")[1].startswith("-") for s in steps)


def make_problem(rng: random.Random, difficulty: ArithDifficulty = ArithDifficulty()) -> dict:
    """One row {problem, solution, answer}; rejection-samples until the difficulty constraints hold."""
    while True:
        n_ops = rng.randint(difficulty.min_ops, difficulty.max_ops)
        ops = [rng.choice(OPS) for _ in range(n_ops)]
        # A number next to a `*` is a factor: drawn from the smaller range so products stay short.
        factor = [(i > 0 and ops[i - 1] == "*") or (i < n_ops and ops[i] == "*") for i in range(n_ops + 1)]
        nums = [rng.randint(0, difficulty.max_mul_operand if f else difficulty.max_operand) for f in factor]
        steps, value = solve(nums, ops)
        if difficulty.allow_negative or _intermediates_ok(steps):
            break
    expr = "".join(f"{n}{op}" for n, op in zip(nums, ops)) + str(nums[-1])
    return {
        "problem": f"Compute {expr}.",
        "solution": " ".join(f"{s}." for s in steps) + f" \\boxed{{{value}}}",
        "answer": str(value),
    }


def generate_split(
    n: int,
    seed: int,
    difficulty: ArithDifficulty = ArithDifficulty(),
    *,
    exclude: Iterable[str] = (),
    max_tries_per_row: int = 200,
) -> list[dict]:
    """`n` rows with distinct problem texts, none of which is in `exclude`; deterministic in `seed`."""
    rng = random.Random(seed)
    seen = set(exclude)
    rows: list[dict] = []
    tries = 0
    while len(rows) < n:
        row = make_problem(rng, difficulty)
        tries += 1
        if row["problem"] in seen:
            if tries > max_tries_per_row * max(n, 1):
                raise ValueError(f"only {len(rows)} distinct problems found for n={n} at {difficulty}; widen the ranges")
            continue
        seen.add(row["problem"])
        rows.append(row)
    return rows


def make_splits(
    n_train: int, n_eval: int, seed: int, difficulty: ArithDifficulty = ArithDifficulty()
) -> tuple[list[dict], list[dict]]:
    """(train, held_out): the held-out split is drawn first and its problems are excluded from train."""
    held_out = generate_split(n_eval, seed * 2 + 1, difficulty)
    train = generate_split(n_train, seed * 2, difficulty, exclude={r["problem"] for r in held_out})
    return train, held_out


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    """One JSON object per line; atomic (temp file + os.replace)."""
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{os.fspath(path)}:{lineno}: invalid JSON: {e}") from e
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    select_platforms()  # before JAX starts a backend (lrmq.cli)
    p = ArgumentParser("data.synthetic", description="Write train.jsonl / test.jsonl of synthetic arithmetic")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--n-train", type=number(int, ge=1), default=2000, help="problems in train.jsonl")
    p.add_argument("--n-eval", type=number(int, ge=0), default=200,
                   help="problems in test.jsonl (none shared with train)")
    p.add_argument("--seed", type=int, default=0, help="the same seed writes the same files")
    p.add_argument("--min-ops", type=number(int, ge=1), default=1, help="fewest operators per problem (1..3)")
    p.add_argument("--max-ops", type=number(int, ge=1), default=3, help="most operators per problem (1..3)")
    p.add_argument("--max-operand", type=number(int, ge=1), default=20, help="operands are drawn from 0..N")
    p.add_argument("--max-mul-operand", type=number(int, ge=1), default=9,
                   help="both factors of a * are at most N (products stay short)")
    p.add_argument("--allow-negative", action="store_true",
                   help="allow negative intermediate results (default: none is negative)")
    a = p.parse_args(argv)

    def body() -> int:
        if a.min_ops > a.max_ops:
            raise UsageError(f"--min-ops {a.min_ops} is greater than --max-ops {a.max_ops}")
        diff = ArithDifficulty(a.min_ops, a.max_ops, a.max_operand, a.max_mul_operand, a.allow_negative)
        train, test = make_splits(a.n_train, a.n_eval, a.seed, diff)
        write_jsonl(os.path.join(a.out, "train.jsonl"), train)
        write_jsonl(os.path.join(a.out, "test.jsonl"), test)
        print(f"wrote {len(train)} train and {len(test)} test rows to {a.out}")
        return 0

    return run_main("data.synthetic", body)


if __name__ == "__main__":
    tune_gc()
    raise SystemExit(main())
