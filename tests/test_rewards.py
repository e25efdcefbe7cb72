import sys
import threading

import numpy as np
import pytest

import lrmq.grading.answers as answers
from lrmq.grading.answers import DEFAULT_MAX_CHARS, MAX_VERIFY_CHARS, extract_last_boxed, is_equiv, normalize_answer
from lrmq.grading.verify_pool import VerifyPool, get_verify_pool
from lrmq.rl.rewards import REWARDS, score_completions


def test_registered_rewards():
    assert REWARDS.names() == ["boxed_exact", "boxed_math", "format", "length_penalty", "overlong_penalty",
                              "think_format"]


# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, want",
    [
        (r"so \boxed{5}.", "5"),
        (r"first \boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),
        (r"$\boxed {x+1}$", "x+1"),
        (r"answer: \fbox{7}", "7"),
        (r"\boxed{3} and \fbox{4}", "4"),
        ("$\\boxed 42$ done", "42"),
        (r"\boxed{}", ""),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        ("no answer here", None),
        (r"\boxed{1} then \boxed{2", None),  # last box unbalanced: None, not the earlier one
        (r"\boxed", None),
        (r"\boxedx{3}", None),
        (r"\boxed}{", None),
    ],
)
def test_extract_last_boxed(text, want):
    assert extract_last_boxed(text) == want


def test_extract_only_scans_the_tail():
    text = r"\boxed{1}" + "x" * 100
    assert extract_last_boxed(text, max_chars=200) == "1"
    assert extract_last_boxed(text, max_chars=50) is None


class _CountingPattern:
    """Stand-in for a compiled regex that counts the characters each scan covers and the matches it yields."""

    def __init__(self, pattern):
        self.pattern, self.chars, self.matches = pattern, 0, 0

    def finditer(self, string, pos=0, endpos=sys.maxsize):
        self.chars += min(len(string), endpos) - pos
        for m in self.pattern.finditer(string, pos, endpos):
            self.matches += 1
            yield m


def _extract_work(text, **kw):
    """(result, Python lines run in lrmq/grading/answers.py, characters scanned by its regexes): the work
    extract_last_boxed does, counted rather than timed (a shared machine's clock says little)."""
    patterns = answers._BOX_RE, answers._BRACE_RE
    box, brace = answers._BOX_RE, answers._BRACE_RE = [_CountingPattern(p) for p in patterns]
    lines = 0

    def local(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename == answers.__file__ else None

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        out = extract_last_boxed(text, **kw)
    finally:
        sys.settrace(old)
        answers._BOX_RE, answers._BRACE_RE = patterns
    return out, lines, box.chars + brace.chars


def test_extract_work_is_linear_in_the_searched_tail():
    """Work bounds, not seconds: only the last max_chars characters are scanned, each at most twice (the
    box search, then the brace match), with a constant number of Python lines per brace."""
    # no box in 2M characters: one scan of the default 32k-character tail, a handful of lines
    out, lines, chars = _extract_work("y" * 2_000_000)
    assert out is None and chars <= DEFAULT_MAX_CHARS and lines <= 20, (lines, chars)
    for n in (1_000, 10_000):
        deep = "\\boxed{" + "{" * n + "}" * n + "}"  # 2n + 2 braces, all matched
        out, lines, chars = _extract_work(deep)
        assert out == "{" * n + "}" * n
        assert chars <= 2 * len(deep) and lines <= 3 * (2 * n + 2) + 20, (n, lines, chars)
        unbalanced = "\\boxed{" + "{" * n  # every brace visited once, then None
        out, lines, chars = _extract_work(unbalanced, max_chars=2 * len(unbalanced))
        assert out is None and chars <= 2 * len(unbalanced) and lines <= 3 * (n + 1) + 20, (n, lines, chars)


def test_extract_huge_inputs():
    assert extract_last_boxed("y" * 2_000_000) is None
    assert extract_last_boxed("\\boxed{" + "{" * 10_000 + "}" * 10_000 + "}") == "{" * 10_000 + "}" * 10_000
    assert extract_last_boxed("\\boxed{" + "{" * 1_000_000, max_chars=2_000_000) is None


def _within(seconds, fn, *args, **kw):
    """fn(*args, **kw), failing (not hanging the suite) if it has not returned after `seconds`. A hang guard
    far above any expected run time, not a speed bound."""
    box = {}

    def run():
        try:
            box["out"] = fn(*args, **kw)
        except BaseException as e:  # re-raised in the test thread
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds} s: a hang"
    if "err" in box:
        raise box["err"]
    return box["out"]


# ----------------------------------------------------------------------------- normalisation


@pytest.mark.parametrize(
    "a, b",
    [
        (r"\dfrac12", r"\frac{1}{2}"),
        (r"\tfrac{1}{2}", "0.5"),
        (".5", r"\frac{1}{2}"),
        ("1/2", r"\frac{1}{2}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"90^\circ", "90"),
        (r"50\%", "50"),
        (r"5\text{ cm}", "5"),
        (r"\text{(A)}", "(A)"),
        ("x = 3", "3"),
        ("3.", "3"),
        ("2.50", "2.5"),
        ("3.0", "3"),
        ("1,000", "1000"),
        (r"\$10", "10"),
        (r"2\sqrt2", r"2\sqrt{2}"),
        (r"\!1\,000", "1000"),
    ],
)
def test_normalize_equal(a, b):
    assert normalize_answer(a) == normalize_answer(b)


@pytest.mark.parametrize("a, b", [("3", "4"), (r"\frac{1}{2}", r"\frac{1}{3}"), ("(1,2)", "[1,2]"), ("10", "100")])
def test_normalize_distinct(a, b):
    assert normalize_answer(a) != normalize_answer(b)


# ----------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize(
    "pred, gold, want",
    [
        ("0.5", r"\frac{1}{2}", True),
        (r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}", True),  # needs math-verify
        (r"2\sqrt{3}", r"\sqrt{12}", True),
        (r"\{1,2\}", r"\{2,1\}", True),
        ("4", "5", False),
        ("", "5", False),
        (None, "5", False),
        (r"\frac{", "5", False),
    ],
)
def test_is_equiv(pred, gold, want):
    assert is_equiv(pred, gold) is want


def test_is_equiv_off_main_thread():
    out = []
    th = threading.Thread(target=lambda: out.append(is_equiv(r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}")))
    th.start()
    th.join(30)
    assert out == [True]


# ----------------------------------------------------------------------------- rewards


def test_boxed_math_reward_values():
    comps = [
        r"... so the answer is \boxed{\dfrac12}.",  # correct via normalisation
        r"\boxed{\frac{1}{\sqrt{2}}}",  # correct via math-verify
        r"\boxed{7}",  # wrong, formatted
        "the answer is 1/2",  # no box
        r"\boxed{}",  # empty box: no bonus
        r"\boxed{\frac{1}{2}",  # unbalanced
    ]
    golds = ["0.5", r"\frac{\sqrt{2}}{2}", "5", r"\frac{1}{2}", "5", r"\frac{1}{2}"]
    r, info = score_completions(comps, golds, "boxed_math")
    assert r.dtype == np.float32
    np.testing.assert_allclose(r, [1.1, 1.1, 0.1, 0.0, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(info["correct"], [1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(info["formatted"], [1, 1, 1, 0, 0, 0])
    # boxed_exact: the math-verify-only case is no longer correct.
    r, _ = score_completions(comps, golds, "boxed_exact")
    np.testing.assert_allclose(r, [1.1, 0.1, 0.1, 0.0, 0.0, 0.0], rtol=1e-6)


def test_score_completions_checks_config():
    with pytest.raises(KeyError):
        score_completions(["x"], ["1"], "nope")
    with pytest.raises(ValueError):
        score_completions(["x"], [], "boxed_math")


def test_adversarial_inputs_are_bounded(monkeypatch):
    """Bounded by work, not seconds: only short answers reach math-verify, with the caller's per-item
    timeout, and at most the two huge-number items are killed at their deadline."""
    pool = get_verify_pool()
    pool.verify_many([("1", "2")] * pool.num_workers, 1.0)  # worker start-up is not part of the bound
    sent = []
    verify_many = pool.verify_many

    def recording(pairs, timeout_s, budget_s=None):
        sent.append((list(pairs), timeout_s))
        return verify_many(pairs, timeout_s, budget_s)

    monkeypatch.setattr(pool, "verify_many", recording)
    comps = [
        r"\boxed{9^{9^{9^{9^9}}}}",
        r"\boxed{(10^{10^{10}})!}",
        "z" * 1_000_000,
        "\\boxed{" + "{" * 5_000 + "1" + "}" * 5_000 + "}",
        "\\boxed{" + "\\frac{" * 3_000,
        r"\boxed{}",
        None,
        r"\boxed{\frac{1}{2}}",
    ]
    golds = ["5"] * 7 + ["0.5"]
    kills = pool.kills
    r, info = _within(120, score_completions, comps, golds, "boxed_math", timeout_s=1.0)
    np.testing.assert_allclose(r, [0.1, 0.1, 0.0, 0.1, 0.0, 0.0, 0.0, 1.1], rtol=1e-6)
    items = [p for pairs, _ in sent for p in pairs]
    assert all(t == 1.0 for _, t in sent), sent  # the caller's timeout reaches every item
    # the 10k-character nested answer, the unbalanced box, the empty one and None never reach math-verify
    assert len(items) <= 3 and all(len(p) <= MAX_VERIFY_CHARS for p, _ in items), [p[:40] for p, _ in items]
    assert {r"9^{9^{9^{9^9}}}", r"(10^{10^{10}})!"} <= {p for p, _ in items}
    assert pool.kills - kills <= 2  # each of the two huge numbers costs at most timeout + grace, then a kill


def _hang_equal(pred, gold):
    if pred == "hang":
        sum(range(10**14))  # a C loop that never checks for signals: only a kill stops it
    return pred == gold


def test_pool_kills_a_stuck_worker_and_recovers(monkeypatch):
    """The hung item (a C loop of 10^14 steps: it never returns by itself) costs one kill and one restart;
    the rest of the batch is verified by the replacement worker."""
    pool = VerifyPool(num_workers=1, equal=_hang_equal)
    spawns = []
    spawn = pool._spawn
    monkeypatch.setattr(pool, "_spawn", lambda: spawns.append(1) or spawn())
    try:
        assert pool.verify_many([("a", "a")], 0.3) == [True]
        assert len(spawns) == 1 and pool.kills == 0
        assert _within(120, pool.verify_many, [("hang", "x"), ("b", "b"), ("c", "d")], 0.3) == [False, True, False]
        assert pool.kills == 1 and len(spawns) == 2  # one kill at the deadline, one replacement
        assert pool.verify_many([("e", "e")], 0.3) == [True]  # recovered: no further kills or restarts
        assert pool.kills == 1 and len(spawns) == 2 and len(pool.workers) == 1
    finally:
        pool.close()
    assert pool.workers == []


def _slow_equal(pred, gold):
    import time

    time.sleep(0.4)  # each comparison is slow but within its own timeout
    return pred == gold


def test_batch_budget_bounds_a_slow_batch_and_counts_timeouts():
    """24 comparisons of 0.4 s on one worker would take ~10 s; a 1.5 s batch budget stops after ~3, the rest
    score False and are counted, and the pool keeps working."""
    import time

    pool = VerifyPool(num_workers=1, equal=_slow_equal)
    try:
        pool.verify_many([("w", "w")], 5.0)  # worker start-up is not part of the bound
        t0 = time.monotonic()
        res = pool.verify_many([("a", "a")] * 24, 5.0, budget_s=1.5)
        took = time.monotonic() - t0
        assert took < 1.5 + 2.0, took
        assert 1 <= sum(res) < 24 and pool.last_timeouts == 24 - sum(res)
        assert pool.verify_many([("b", "b")], 5.0) == [True] and pool.last_timeouts == 0
    finally:
        pool.close()
