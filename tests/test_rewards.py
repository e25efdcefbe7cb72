import threading
import time

import numpy as np
import pytest

from lrmq.rl.rewards import (
    REWARDS,
    VerifyPool,
    extract_last_boxed,
    get_verify_pool,
    is_equiv,
    normalize_answer,
    score_completions,
)


def test_registered_rewards():
    assert REWARDS.names() == ["boxed_exact", "boxed_math"]


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


def test_extract_is_fast_on_huge_inputs():
    t = time.perf_counter()
    assert extract_last_boxed("y" * 2_000_000) is None
    assert extract_last_boxed("\\boxed{" + "{" * 10_000 + "}" * 10_000 + "}") == "{" * 10_000 + "}" * 10_000
    assert extract_last_boxed("\\boxed{" + "{" * 1_000_000, max_chars=2_000_000) is None
    assert time.perf_counter() - t < 2.0


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


def test_adversarial_inputs_are_bounded():
    pool = get_verify_pool()
    pool.verify_many([("1", "2")] * pool.num_workers, 1.0)  # worker start-up is not part of the bound
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
    t = time.perf_counter()
    r, info = score_completions(comps, golds, "boxed_math", timeout_s=1.0)
    elapsed = time.perf_counter() - t
    np.testing.assert_allclose(r, [0.1, 0.1, 0.0, 0.1, 0.0, 0.0, 0.0, 1.1], rtol=1e-6)
    # At most two slow items, each <= timeout + 0.5 s grace, on >= 1 worker.
    assert elapsed < 2 * 1.5 + 1.5, elapsed


def _hang_equal(pred, gold):
    if pred == "hang":
        sum(range(10**14))  # a C loop that never checks for signals: only a kill stops it
    return pred == gold


def test_pool_kills_a_stuck_worker_and_recovers():
    pool = VerifyPool(num_workers=1, equal=_hang_equal)
    try:
        assert pool.verify_many([("a", "a")], 0.3) == [True]  # warm: start-up not timed
        t = time.perf_counter()
        assert pool.verify_many([("hang", "x"), ("b", "b"), ("c", "d")], 0.3) == [False, True, False]
        elapsed = time.perf_counter() - t
        assert pool.kills == 1
        # one kill (0.3 s + 0.5 s grace) plus one worker restart
        assert elapsed < 0.8 + 10.0, elapsed
    finally:
        pool.close()
    assert pool.workers == []
