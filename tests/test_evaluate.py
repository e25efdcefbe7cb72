r"""`python -m lrmq.evaluate` and lrmq.evals: both suites end to end on fixture items (tiny model, HF and
packed int4), reproducible results, resume after a partial per-item file, --rescore, answer extraction on
tricky pairs, pass@k against enumeration, and agreement with an independent re-implementation of paper 1's
grader (last \boxed{} + math_verify.parse/verify)."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

from lrmq import evaluate as ev
from lrmq.checkpoint.load import TINY_MODEL_DIR
from lrmq.evals import benchmarks as bm
from lrmq.evals.config import GenerationSection, eval_config
from lrmq.evals.metrics import mean_se, pass_at_k, summarize
from lrmq.evals.runner import EvalError, max_new_for, read_records
from lrmq.evals.scorers import score

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "evals")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

FAST = ["--data-dir", FIXTURES, "progress=false", "generation.max_new_tokens=12", "generation.batch_size=4"]


def _run(out, *extra, checkpoint="tiny", suite="paper1"):
    return ev.main(["--checkpoint", checkpoint, "--suite", suite, "--out", str(out), *FAST, *extra])


def _results(out):
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def _lines(out):
    with open(os.path.join(out, "completions.jsonl")) as f:
        return f.read().splitlines()


@pytest.fixture(scope="module")
def paper1_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("paper1") / "run"
    assert _run(out, "--samples", "2", "pass_k=[1,2]") == 0
    return str(out)


def test_paper1_end_to_end_reproducible(paper1_run, tmp_path):
    res = _results(paper1_run)
    assert set(res["benchmarks"]) == {"aime24", "amc", "math500", "minerva", "olympiadbench"}
    assert res["weight_format"] == "float"
    assert res["pooled"]["n_problems"] == 13 and res["pooled"]["samples"] == 2
    assert res["headline"]["how"] == "pooled" and res["headline"]["metric"] == "reward"
    assert "pass@2" in res["benchmarks"]["amc"] and res["config"]["generation"]["temperature"] == 1.0
    recs = [json.loads(l) for l in _lines(paper1_run)]
    assert len(recs) == 26 and {r["sample"] for r in recs} == {0, 1}
    for r in recs:
        assert r["prompt"].startswith("<|im_start|>system\nPlease reason step by step")
        assert set(r) >= {"completion", "extracted", "correct", "reward", "prompt_tokens", "completion_tokens"}
        assert r["reward"] in (0.0, 0.1, 1.1)
    for f in ("results.md", "eval_config.yaml", "timing.json"):
        assert os.path.isfile(os.path.join(paper1_run, f))
    assert os.listdir(os.path.join(paper1_run, "tb"))
    # same config and seed, another dir: the same results file and records
    again = tmp_path / "again"
    assert _run(again, "--samples", "2", "pass_k=[1,2]") == 0
    assert _results(again) == res
    assert sorted(_lines(again)) == sorted(_lines(paper1_run))


def test_tiny_model_scores_with_its_own_prompt(tmp_path):
    """The tiny model answers its arithmetic format: completions are graded right as well as wrong."""
    out = tmp_path / "arith"
    assert ev.main(["--checkpoint", "tiny", "--suite", "aime24,amc", "--out", str(out), "--data-dir", FIXTURES,
                    "--greedy", "prompt=arith", "progress=false", "generation.max_new_tokens=40"]) == 0
    recs = [json.loads(l) for l in _lines(out)]
    assert all(r["prompt"].endswith(" Answer:") for r in recs)
    assert any(r["correct"] and r["reward"] == pytest.approx(1.1) for r in recs), [r["completion"] for r in recs]
    res = _results(out)
    assert 0 < res["pooled"]["accuracy"] and res["pooled"]["reward"] > res["pooled"]["accuracy"]


def test_resume_after_partial_file(paper1_run, tmp_path):
    import shutil

    out = tmp_path / "resumed"
    shutil.copytree(paper1_run, out)
    full = _lines(paper1_run)
    with open(out / "completions.jsonl", "w") as f:  # 5 whole records and half of the 6th (a kill mid-write)
        f.write("\n".join(full[:5]) + "\n" + full[5][: len(full[5]) // 2])
    os.remove(out / "results.json")
    assert _run(out, "--samples", "2", "pass_k=[1,2]") == 0
    lines = _lines(out)
    assert len(lines) == len(full) and lines[:5] == full[:5]
    assert sorted(lines) == sorted(full)
    assert _results(out) == _results(paper1_run)
    # another generation config refuses the dir
    assert _run(out, "--samples", "3") == 2


def test_rescore(paper1_run, tmp_path, capsys):
    import shutil

    out = tmp_path / "rescored"
    shutil.copytree(paper1_run, out)
    recs = [json.loads(l) for l in _lines(out)]
    i = next(k for k, r in enumerate(recs) if r["benchmark"] == "math500" and r["answer"] == "\\frac{3}{4}")
    recs[i]["completion"] = "6/8 reduces. <think>no</think> So \\boxed{0.75}"
    with open(out / "completions.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    assert ev.main(["--suite", "paper1", "--out", str(out), "--rescore"]) == 0  # K, pass_k: the run's own
    new = [json.loads(l) for l in _lines(out)]
    assert new[i]["extracted"] == "0.75" and new[i]["correct"] and new[i]["reward"] == pytest.approx(1.1)
    before, after = _results(paper1_run), _results(out)
    assert after["benchmarks"]["math500"]["reward"] > before["benchmarks"]["math500"]["reward"]
    assert after["benchmarks"]["amc"] == before["benchmarks"]["amc"] and after["config"] == before["config"]
    assert "MATH-500" in capsys.readouterr().out


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    from lrmq import quantize as qcli

    out = str(tmp_path_factory.mktemp("int4") / "packed")
    assert qcli.main(["--checkpoint", TINY_MODEL_DIR, "--method", "rtn", "--bits", "4", "--group-size", "32",
                      "--out", out]) == 0
    return out


def test_quantlrm_packed_int4(int4_checkpoint, tmp_path):
    out = tmp_path / "q"
    # the tiny model has 256 positions, less than FOLIO's prompt: allow more (the error case is tested below);
    # 2 slots of 4-token pages for the 4 sequences: slots are reused as sequences finish
    assert _run(out, "--limit", "1", "generation.max_positions=1024", "generation.batch_size=2",
                "generation.page_size=4", checkpoint=int4_checkpoint, suite="quantlrm") == 0
    res = _results(out)
    assert set(res["benchmarks"]) == {"aime120", "folio", "temporal_sequences", "gpqa_diamond"}
    # the model's weight format, as lrmq.quantize wrote it, heads the table and results.json
    assert res["weight_format"] == "lrmq packed int4 asym g32 f32-scale (rtn)"
    assert open(os.path.join(out, "results.md")).readline() == \
        f"Model: {int4_checkpoint} (lrmq packed int4 asym g32 f32-scale (rtn))\n"
    assert res["headline"]["how"] == "average" and res["config"]["generation"]["top_p"] == 0.95
    recs = [json.loads(l) for l in _lines(out)]
    assert all(r["prompt"].endswith("<think>\n") and "<|im_start|>" not in r["prompt"] for r in recs)
    assert all(r["reward"] in (0.0, 1.0) for r in recs)


def test_qlora_adapter_unmerged(int4_checkpoint, tmp_path):
    """A packed base plus a PEFT adapter directory, evaluated with the adapter unmerged."""
    import jax.numpy as jnp

    from lrmq.checkpoint.load import load_model
    from lrmq.checkpoint.peft import save_lora
    from lrmq.quant.lora import apply_lora, lora_linears

    m = load_model(int4_checkpoint)
    apply_lora(m, rank=4, alpha=8.0)
    for _, lin in lora_linears(m):
        lin.lora.b.set_value(jnp.full(lin.lora.b.get_value().shape, 0.01, lin.lora.b.get_value().dtype))
    adapter = str(tmp_path / "adapter")
    save_lora(m, adapter)
    cfg = eval_config({"checkpoint": int4_checkpoint, "adapter": adapter})
    model, _, _ = ev.load_eval_model(cfg)
    [(_, lin)] = lora_linears(model)[:1]
    assert lin.lora.rank == 4 and float(jnp.abs(lin.lora.b.get_value()).max()) == pytest.approx(0.01)
    assert _run(tmp_path / "o", "--limit", "1", f"adapter={adapter}", checkpoint=int4_checkpoint, suite="amc") == 0


def test_run_suite_streams_records_from_a_state_and_engine(tmp_path):
    """The trainer's path: a state + its Engine, in memory, scalars to its writer; records are written as each
    sequence finishes, equal to a run with one decode slot."""
    from flax import nnx

    from lrmq.checkpoint.load import load_model
    from lrmq.evals.runner import run_suite
    from lrmq.generation.engine import Engine, EngineConfig
    from lrmq.tokenizer import Tokenizer

    model, tok = load_model(TINY_MODEL_DIR), Tokenizer.from_dir(TINY_MODEL_DIR)
    gen = Engine(model, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
    results, generate = [], gen.generate  # what run_suite's engine calls returned (their stats)
    gen.generate = lambda *a, **k: results.append(generate(*a, **k)) or results[-1]

    from flax import nnx

    from lrmq.evals.runner import run_suite

    class Writer:
        def __init__(self):
            self.s = {}

        def add_scalar(self, k, v, step):
            self.s[k] = (v, step)

        def flush(self):
            pass

    items = bm.load_items(bm.BENCHMARKS["amc"], FIXTURES, limit=2)
    w = Writer()
    res = run_suite(nnx.state(model), tok, items, GenerationSection(max_new_tokens=8, samples=2), engine=gen,
                    max_positions=model.cfg.max_position_embeddings, writer=w, step=10, tb_prefix="bench",
                    out_dir=str(tmp_path / "a"))
    assert res["benchmarks"]["amc"]["n_problems"] == 2 and w.s["bench/amc/accuracy"][1] == 10
    # the tags TensorBoard shows (docs/evaluate.md): pass@K as pass_K, TensorBoard's tags taking no "@"
    assert {"bench/amc/pass_1", "bench/amc/pass_2"} <= set(w.s) and not any("@" in k for k in w.s), sorted(w.s)
    one_slot = Engine(model, eos_ids=tok.eos_ids, pad_id=tok.pad_id, config=EngineConfig(slots=1, page_size=4))
    run_suite(nnx.state(model), tok, items, GenerationSection(max_new_tokens=8, samples=2), engine=one_slot,
              max_positions=model.cfg.max_position_embeddings, out_dir=str(tmp_path / "b"))
    key = lambda r: (r["item_id"], r["sample"])  # noqa: E731
    a = sorted((json.loads(l) for l in _lines(tmp_path / "a")), key=key)
    b = sorted((json.loads(l) for l in _lines(tmp_path / "b")), key=key)
    assert len(a) == 4 and [r["completion"] for r in a] == [r["completion"] for r in b]
    assert [r.stats["prefilled_prompts"] for r in results] == [2]  # each item's two samples share its prompt


def test_a_quantized_kv_cache_reports_its_saturation(paper1_run, tmp_path):
    """With an fp8 KV cache, results.json and results.md report kv_saturated (the engine's count of
    K / V entries clipped at the format's max); a float cache has none to report."""
    out = tmp_path / "fp8"
    assert _run(out, "--limit", "1", "generation.kv_cache=fp8_e4m3", suite="amc") == 0
    res = _results(out)
    assert isinstance(res["kv_saturated"], int) and res["kv_saturated"] >= 0, res
    with open(os.path.join(out, "results.md")) as f:
        assert f"{res['kv_saturated']} K / V entries saturated" in f.read()
    assert "kv_saturated" not in _results(paper1_run)


def test_cli_on_two_devices(tmp_path):
    """With several devices the CLI shards the weights on the default mesh and splits batches over it
    (a fresh interpreter: XLA reads the device count once)."""
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_DATASETS_OFFLINE="1",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip())
    out = tmp_path / "mesh"
    # 3 items, 3 slots: the engine rounds the slots up to the 2 data-parallel devices
    p = subprocess.run([sys.executable, "-m", "lrmq.evaluate", "--checkpoint", "tiny", "--suite", "amc", "--out",
                        str(out), "--data-dir", FIXTURES, "progress=false", "generation.max_new_tokens=8",
                        "generation.batch_size=3", "tensorboard=false"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "on a mesh of 2 devices" in p.stderr
    assert _results(out)["benchmarks"]["amc"]["n_problems"] == 3 and len(_lines(out)) == 3


def test_length_policy_and_missing_data(tmp_path, capsys):
    g = GenerationSection(max_new_tokens=100)
    assert max_new_for([200], g, 256, "x") == 56
    with pytest.raises(EvalError, match="max positions are 256"):
        max_new_for([256], g, 256, "x")
    with pytest.raises(EvalError, match="length_policy=error"):
        max_new_for([200], GenerationSection(max_new_tokens=100, length_policy="error"), 256, "x")
    # no local file and offline: one line per benchmark naming the dataset and the file looked for
    assert ev.main(["--checkpoint", "tiny", "--suite", "gpqa_diamond", "--data-dir", str(tmp_path),
                    "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fingertap/GPQA-Diamond" in err
    assert os.path.join(str(tmp_path), "gpqa_diamond") in err


def test_configs_and_suites(tmp_path):
    cfg = eval_config({"suite": "quantlrm"}, ["generation.samples=4"])
    assert cfg.generation.temperature == 0.6 and cfg.generation.max_new_tokens == 32768 and cfg.generation.samples == 4
    assert eval_config({}, ["suite=folio"]).generation.top_p == 0.95
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("paper1", "quantlrm", "paper1_greedy"):
        args = ev.parse_args(["--config", os.path.join(repo, "configs", "eval", f"{name}.yaml")])
        ev.build_config(args)
    with pytest.raises(Exception, match="unknown key"):
        eval_config({}, ["generation.temprature=1"])
    with pytest.raises(Exception, match="mixes benchmarks"):
        eval_config({"suite": "amc,folio"})
    # BIG-Bench / BBH task files ({"examples": [...]}) read as rows
    (tmp_path / "temporal_sequences.json").write_text(json.dumps({"examples": [{"input": "Q?", "target": "(B)"}]}))
    [item] = bm.load_items(bm.BENCHMARKS["temporal_sequences"], str(tmp_path))
    assert item.answer == "(B)" and item.prompt.startswith("Use the timeline") and item.prompt.endswith("Q?\n<think>\n")
    assert bm.answer_text(142.0) == "142" and bm.answer_text(["-2", "2"]) == "-2, 2"


# ----------------------------------------------------------------------------- scorers

# (scorer, extractor, completion, gold, expected extracted, expected correct)
TRICKY = [
    ("paper_reward", "last_boxed", r"so \boxed{\frac{1}{2}}", "0.5", r"\frac{1}{2}", True),
    ("paper_reward", "last_boxed", r"so \boxed{0.5}", r"\frac12", "0.5", True),
    ("paper_reward", "last_boxed", r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", r"\dfrac{3}{4}", True),
    ("paper_reward", "last_boxed", r"\boxed{0.3333}", r"\frac{1}{3}", "0.3333", False),
    ("paper_reward", "last_boxed", r"\boxed{5\text{ cm}}", "5", r"5\text{ cm}", True),
    ("paper_reward", "last_boxed", r"\boxed{90^\circ}", "90", r"90^\circ", True),
    ("paper_reward", "last_boxed", r"\boxed{(1, \infty)}", r"(1,\infty)", r"(1, \infty)", True),
    ("paper_reward", "last_boxed", r"\boxed{[1, \infty)}", r"(1,\infty)", r"[1, \infty)", False),
    ("paper_reward", "last_boxed", r"first \boxed{3} then \boxed{4}", "4", "4", True),
    ("paper_reward", "last_boxed", r"first \boxed{4} then \boxed{3}", "4", "3", False),
    ("paper_reward", "last_boxed", "the answer is 4", "4", None, False),
    ("paper_reward", "last_boxed", r"<think>\boxed{2}</think> The answer is \boxed{4}.", "4", "4", True),
    ("paper_reward", "last_boxed", r"\boxed{x = 3}", "3", "x = 3", True),
    ("paper_reward", "last_boxed", r"\boxed{1,000}", "1000", "1,000", True),
    ("math_equiv", "final_boxed", r"<think>maybe \boxed{7}</think> so \boxed{8}", "8", "8", True),
    ("math_equiv", "final_boxed", r"<think>it is \boxed{8}</think> The answer is eight.", "8", "8", True),
    ("math_equiv", "final_boxed", r"<think>\boxed{8} ... still thinking", "8", "8", True),
    ("label_match", "true_false_uncertain", "<think>is it true? false?</think> The conclusion is Uncertain.",
     "Uncertain", "Uncertain", True),
    ("label_match", "true_false_uncertain", r"<think>true</think> \boxed{\text{False}}", "False", "False", True),
    ("label_match", "true_false_uncertain", "<think>hmm</think> Answer: unknown", "Uncertain", "Uncertain", True),
    ("label_match", "true_false_uncertain", "<think>hmm</think> I cannot tell.", "True", None, False),
    ("label_match", "option_letter", r"<think>(A) or (C)?</think> The answer is (C).", "(C)", "C", True),
    ("label_match", "option_letter", r"<think>A</think> \boxed{B}", "B", "B", True),
    ("label_match", "option_letter", r"<think>x</think> \boxed{(D)}", "D", "D", True),
    ("label_match", "option_letter", "<think>x</think> Answer: B", "(A)", "B", False),
    ("label_match", "option_letter", "<think>x</think> The answer is a bit unclear.", "A", None, False),
    ("label_match", "option_letter", "<think>x</think> The answer is D. Iron", "D", "D", True),
]


@pytest.mark.parametrize("scorer,extractor,completion,gold,extracted,correct", TRICKY)
def test_tricky_answers(scorer, extractor, completion, gold, extracted, correct):
    [s] = score(scorer, [completion], [gold], extractor=extractor)
    assert s.extracted == extracted and s.correct is correct
    if scorer == "paper_reward":
        assert s.reward == pytest.approx(float(correct) + (0.1 if extracted else 0.0))


# ----------------------------------------------------------------------------- metrics


def test_pass_at_k_against_enumeration():
    for n in range(1, 7):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    m, se = mean_se([1.0, 0.0, 1.0, 1.0])
    assert m == 0.75 and se == pytest.approx(np.std([1, 0, 1, 1], ddof=1) / 2)
    s = summarize([{"correct": [True, False], "reward": [1.1, 0.1], "formatted": [True, True],
                    "completion_tokens": [3, 5], "truncated": [False, True]},
                   {"correct": [False, False], "reward": [0.0, 0.1], "formatted": [False, True],
                    "completion_tokens": [1, 1], "truncated": [False, False]}], ks=(1, 2))
    assert s["accuracy"] == 0.25 and s["pass@1"] == 0.25 and s["pass@2"] == 0.5 and s["reward"] == pytest.approx(0.325)


# ----------------------------------------------------------------------------- agreement with paper 1's grader

SAVED = [  # (completion, gold): a saved set of MATH-style completions, right and wrong, boxed and not
    (r"We get $\boxed{19}$.", "19"),
    (r"Thus \boxed{\frac{3}{4}}", r"\frac{3}{4}"),
    (r"Thus \boxed{\dfrac{3}{4}}", r"\frac{3}{4}"),
    (r"Thus \boxed{0.75}", r"\frac{3}{4}"),
    (r"so \boxed{\frac{2}{3}}", r"\frac{3}{4}"),
    (r"the roots are \boxed{-2, 2}", "-2, 2"),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
    (r"\boxed{(1,\infty)}", r"(1,\infty)"),
    (r"\boxed{[1,\infty)}", r"(1,\infty)"),
    (r"no box: 42", "42"),
    (r"\boxed{}", "3"),
    (r"first \boxed{1} finally \boxed{6}", "6"),
    (r"\boxed{6} no wait \boxed{7}", "6"),
    (r"\boxed{x^2+2x+1}", "(x+1)^2"),
    (r"\boxed{\pi}", r"\pi"),
    (r"\boxed{3.14}", r"\pi"),
    (r"\boxed{10\%}", "10"),
    (r"\boxed{\text{(B)}}", "B"),
    (r"<think>\boxed{1}</think>\boxed{32}", "32"),
    (r"\boxed{\frac{1}{2}", r"\frac{1}{2}"),  # unbalanced last box
]


def _paper_grader(completion: str, gold: str) -> float:
    """Independent re-implementation: the last \\boxed{...} (balanced braces) of the completion, then
    math_verify.parse / verify; reward 1[correct] + 0.1 * 1[boxed]."""
    from math_verify import parse, verify

    start = completion.rfind("\\boxed")
    if start < 0:
        return 0.0
    i = completion.find("{", start)
    depth, j = 0, i
    while i >= 0 and j < len(completion):
        depth += {"{": 1, "}": -1}.get(completion[j], 0)
        if depth == 0:
            break
        j += 1
    if i < 0 or depth != 0 or not completion[i + 1:j].strip():
        return 0.0
    ans = completion[i + 1:j]
    ok = verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + ans + "}"))
    return 1.1 if ok else 0.1


def test_agreement_with_independent_paper_grader():
    # a generous per-item bound: this compares grading, and a loaded machine can take >1 s on a sympy expand
    ours = score("paper_reward", [c for c, _ in SAVED], [g for _, g in SAVED], extractor="last_boxed", timeout_s=30.0)
    theirs = [_paper_grader(c, g) for c, g in SAVED]
    diff = [(c, g, s.reward, t) for (c, g), s, t in zip(SAVED, ours, theirs) if abs(s.reward - t) > 1e-6]
    assert not diff, diff


def test_a_bad_local_jsonl_row_names_file_and_line(tmp_path):
    (tmp_path / "amc.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n{"problem": oops\n')
    with pytest.raises(bm.EvalDataError, match=r"amc\.jsonl line 2: not valid JSON"):
        bm.load_rows(bm.BENCHMARKS["amc"], str(tmp_path))
