"""`python -m lrmq.study`: the quick study end to end (configs/study/quick.yaml: base, a short GRPO run and RTN
W4 of its policy, one seed), resume (a rerun skips finished jobs; a job missing only its evaluation reruns
only that), results.json / results.md contents, plots, and the matrix presets and config checks."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import types

import numpy as np
import pytest

from conftest import REPO_ROOT, command_in_process
from lrmq.configlib import ConfigError
from lrmq.studies.config import load_study_config
from lrmq.studies.matrix import expand

QUICK = os.path.join(REPO_ROOT, "configs", "study", "quick.yaml")


def _quick_train(max_new_tokens: int = 24) -> str:
    """The quick recipe's train.overrides with rollout.max_new_tokens=24 (the recipe's 48 halves every decode of
    the study's training rollouts and its four held-out evaluations: the tests check the machinery, not the
    accuracy), as one study override."""
    import yaml

    with open(QUICK) as f:
        items = [o for o in yaml.safe_load(f)["train"]["overrides"] if not o.startswith("rollout.max_new_tokens=")]
    return "train.overrides=[" + ", ".join([*items, f"rollout.max_new_tokens={max_new_tokens}"]) + "]"


def _study(*args: str) -> types.SimpleNamespace:
    """`python -m lrmq.study ARGS` as lrmq.study.main in this process (returncode, stderr): the study command
    only plans, starts its jobs' processes (lrmq.train, lrmq.quantize, lrmq.studies.heldout, lrmq.evaluate:
    they run as processes either way) and writes the report, so in process it spares a Python + JAX start per
    call and changes nothing the tests check (conftest's command_in_process puts back what it sets)."""
    from lrmq import study

    err = io.StringIO()
    with command_in_process(), contextlib.redirect_stderr(err):
        rc = study.main(list(args))
    return types.SimpleNamespace(returncode=rc, stderr=err.getvalue())


# ----------------------------------------------------------------------------- presets and config


def test_paper_matrices():
    p1 = expand(load_study_config(os.path.join(REPO_ROOT, "configs/study/paper1.yaml")))
    names = {a.name: a for a in p1}
    # per algorithm: FP, 4 QAT, 2 QLoRA, PTQ rtn/awq/gptq/quantlrm x W4/W3 + nf4 + int8 + RTN in the two QAT formats
    # no other arm has (int8 per tensor, int4 symmetric per channel); plus the base model
    assert len(p1) == 1 + 2 * (1 + 4 + 2 + 4 * 2 + 2 + 2)
    assert names["drgrpo-ptq-nf4-w4"].group_size == 64 and names["grpo-ptq-int8-w8"].bits == 8
    assert names["grpo-ptq-gptq-w3"].group_size == 128 and names["grpo-ptq-gptq-w3"].source == "grpo"
    assert "quant.qat_scheme=paper_int8" in names["drgrpo-qat-paper_int8"].train
    assert "algo.advantage=drgrpo" in names["drgrpo-qlora-int4"].train
    assert names["grpo-qlora-nf4"].baseline == "grpo" and names["grpo"].baseline == "base"
    # each QAT arm is paired with RTN of the FP policy in exactly its weight format; paper_int8 also with AWQ W4
    from lrmq.studies.matrix import arm_format

    cfg1 = load_study_config(os.path.join(REPO_ROOT, "configs/study/paper1.yaml"))
    same = {a.name: a.compare["same format"] for a in p1 if "qat" in a.name}
    assert same == {f"{alg}-qat-{s}": f"{alg}-ptq-{p}" for alg in ("grpo", "drgrpo") for s, p in (
        ("paper_int8", "rtn-w8-pt-sym"), ("int8", "int8-w8"), ("int4", "rtn-w4-pc-sym"), ("int4_asym", "rtn-w4"))}
    for a, b in same.items():
        fa, fb = arm_format(cfg1, names[a]), arm_format(cfg1, names[b])
        assert fa.same_format(fb) and fa.scheme.startswith("qat:") and fb.scheme in ("rtn", "int8"), (a, b)
    assert arm_format(cfg1, names["grpo-qat-int4_asym"]).describe() == "int4 asym g128 f32-scale (qat:int4_asym)"
    assert names["grpo-ptq-rtn-w4-pc-sym"].quantize == ["symmetric=true"]
    assert names["grpo-ptq-rtn-w8-pt-sym"].group_size == 0
    assert names["grpo-qat-paper_int8"].compare["paper 1 pairing"] == "grpo-ptq-awq-w4"
    assert not arm_format(cfg1, names["grpo-qat-paper_int8"]).same_format(arm_format(cfg1, names["grpo-ptq-awq-w4"]))
    # sources come before the arms that quantize them
    order = [a.name for a in p1]
    assert all(order.index(a.source) < order.index(a.name) for a in p1 if a.kind == "ptq")

    p2 = {a.name: a for a in expand(load_study_config(os.path.join(REPO_ROOT, "configs/study/paper2.yaml")))}
    assert {f"grpo-ptq-{m}-w{b}" for m in ("quantlrm", "awq", "gptq", "rtn") for b in (3, 4)} <= set(p2)
    assert p2["grpo-quantlrm-inverted_u-w3"].quantize == ["quantlrm.mapping=inverted_u"]
    assert p2["grpo-quantlrm-pft-w3"].before == "pseudo_ft"
    assert p2["grpo-quantlrm-constant-w3"].baseline == "grpo-ptq-quantlrm-w3"
    # both presets: paper 2 reuses paper 1's GRPO run and its PTQ arms
    both = expand(load_study_config(os.path.join(REPO_ROOT, "configs/study/paper1.yaml"), ["paper2.enabled=true"]))
    assert len(both) == len(p1) + 5 and len({a.name for a in both}) == len(both)
    for scaled in ("paper1_qwen3.yaml", "paper2_qwen3.yaml"):
        cfg = load_study_config(os.path.join(REPO_ROOT, "configs/study", scaled))
        assert cfg.eval.kind == "suite" and os.path.exists(os.path.join(REPO_ROOT, cfg.train.config))
        assert expand(cfg)


def test_quant_rollout_studies():
    """Both quantized-rollout studies expand, pair every quantized arm with FP, and give each arm a train config
    that loads, with a group size that divides every Linear of the model it trains (tiny: 128, small: 192/512)."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
    import build_tiny_model as b

    from lrmq.configlib import load_config
    from lrmq.rl.config import TrainConfig

    for name, n_arms, arch in (("quant_rollouts.yaml", 9, "tiny"), ("quant_rollouts_small.yaml", 8, "small")):
        cfg = load_study_config(os.path.join(REPO_ROOT, "configs/study", name))
        arms = expand(cfg)
        assert len(arms) == n_arms and all(a.baseline == "fp" for a in arms if a.name != "fp")
        hf = dict(b.BASE_CONFIG, **b.ARCHS[arch])
        for a in arms:
            train = load_config(TrainConfig, os.path.join(REPO_ROOT, cfg.train.config), [*cfg.train.overrides, *a.train])
            assert (train.rollout.quant != "none") == (a.name != "fp"), a.name
            for dim in (hf["hidden_size"], hf["intermediate_size"]) if a.name != "fp" else ():
                assert dim % train.rollout.quant_group_size == 0, (name, a.name, dim)


def test_moe_study():
    """configs/study/moe.yaml (tiny-moe, docs/RESULTS.md "Tiny MoE") expands; every train arm's config loads on
    tiny-moe with what its name says (routing replay, int4 rollouts with a group dividing every input size of
    tiny-moe, the load-balancing loss); every PTQ arm quantizes grpo's policy by a per-expert method whose group
    divides every expert projection's K (lrmq.quantize's own MoE check)."""
    from lrmq.configlib import load_config
    from lrmq.ptq.config import QuantizeConfig
    from lrmq.ptq.pipeline import check_moe, model_config
    from lrmq.rl.config import TrainConfig

    cfg = load_study_config(os.path.join(REPO_ROOT, "configs/study/moe.yaml"))
    arms = {a.name: a for a in expand(cfg)}
    assert len(arms) == 14 and arms["base"].kind == "base"
    mcfg = model_config(os.path.join(REPO_ROOT, "lrmq/assets/tiny-moe"))
    ks = (mcfg.hidden_size, mcfg.intermediate_size, mcfg.moe_intermediate_size)
    for a in arms.values():
        if a.kind == "train":
            t = load_config(TrainConfig, os.path.join(REPO_ROOT, cfg.train.config), [*cfg.train.overrides, *a.train])
            assert t.model.checkpoint == "tiny-moe" and t.run.steps == 30, a.name
            assert t.rollout.routing_replay == a.name.endswith("-replay"), a.name
            assert (t.algo.router_aux_coef == 0.001) == (a.name == "grpo-aux"), a.name
            assert (t.rollout.quant == "int4") == a.name.startswith("int4"), a.name
            if t.rollout.quant != "none":
                assert all(k % t.rollout.quant_group_size == 0 for k in ks), a.name
        elif a.kind == "ptq":
            assert a.source == "grpo" and a.baseline in ("", "grpo"), a.name  # empty: compared with its source
            q = load_config(QuantizeConfig, None, ["model=tiny-moe", "quantlrm.base=tiny-moe", "calibration.path=c.jsonl",
                                                   f"method={a.method}", f"bits={a.bits}", f"group_size={a.group_size}"])
            check_moe(q, mcfg, "tiny-moe")
            assert all(k % a.group_size == 0 for k in ks), a.name


@pytest.mark.parametrize("overrides, message", [
    (["arms=[{name: q, kind: ptq, source: nope, method: rtn}]"], "source 'nope' is not an arm"),
    (["arms=[{name: b, kind: base}, {name: q, kind: ptq, source: b, method: quantlrm}]"], "needs a train arm"),
    (["arms=[{name: t, kind: train, train: [quant.mode=qat]}, {name: q, kind: ptq, source: t, method: rtn}]"],
     "trains with QAT/QLoRA"),
    (["arms=[{name: b, kind: base}, {name: q, kind: ptq, source: b, method: quantlrm, before: pseudo_ft}]"],
     "before=pseudo_ft is for quantlrm with a train arm"),
    (["only=[nope]"], "only: unknown arms"),
    (["eval.metric=headline"], "eval.metric"),
    (["paper1.ptq_methods=[rtm]"], "rtm"),
    (["paper1.enabled=true", "paper1.paper_pairs={int4: awq-w9}"], "'grpo-ptq-awq-w9' is not a ptq arm"),
    (["paper1.enabled=true", "paper1.qat_group_size={int2: 8}"], "not in paper1.qat_schemes"),
    (["seeds=[]"], "seeds is empty"),
    (["parallel=0"], "parallel"),
    (["eval.sizes=3"], "unknown key"),
])
def test_config_errors(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        expand(load_study_config(QUICK, overrides))


def test_only_keeps_sources():
    cfg = load_study_config(QUICK, ["only=[grpo-ptq-rtn-w4]"])
    assert [a.name for a in expand(cfg)] == ["grpo", "grpo-ptq-rtn-w4"]


def test_bad_config_is_one_line(tmp_path):
    p = _study("--config", QUICK, "eval.sizes=3", f"out_dir={tmp_path / 's'}")
    assert p.returncode == 2 and p.stderr.strip().startswith("lrmq.study: error:")
    assert "Traceback" not in p.stderr and not (tmp_path / "s").exists()


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study") / "quick"
    # 16 problems: the quick recipe's run.eval_size, so the grpo arm's evaluation is also what
    # test_heldout_matches_the_trainer compares with the trainer's own last evaluation
    p = _study("--config", QUICK, f"out_dir={out}", _quick_train(), "eval.size=16", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    return out, p


@pytest.mark.slow(reason="its fixture runs the quick study: base, GRPO and PTQ arms and their evaluations, each job a subprocess")
def test_quick_study_results(quick_study):
    out, _ = quick_study
    res = json.loads((out / "results.json").read_text())
    arms = {a["name"]: a for a in res["arms"]}
    assert list(arms) == ["base", "grpo", "grpo-ptq-rtn-w4"]
    assert res["metric"] == "sampled_accuracy" and res["seeds"] == [0] and not res["failed"]
    for a in arms.values():
        assert a["n"] == 1 and 0.0 <= a["mean"] <= 1.0 and a["std"] == 0.0
        assert a["seeds"]["0"]["problems"] == 16 and "greedy_accuracy" in a["seeds"]["0"]
        job = json.loads((out / "runs" / a["name"] / "seed0" / "result.json").read_text())
        assert job["metrics"]["sampled_accuracy"] == a["mean"]  # the table is the jobs' numbers
    # memory: the packed W4 model is far smaller than the float policy; training memory is the recipe's
    fp, q = arms["grpo"]["memory"], arms["grpo-ptq-rtn-w4"]["memory"]
    assert q["weight_bytes"] < fp["weight_bytes"] / 3
    assert fp["train_opt_bytes"] >= 2 * fp["train_param_bytes"] > 0  # AdamW: two moments per float param
    assert q["train_param_bytes"] == fp["train_param_bytes"] and "train_param_bytes" not in arms["base"]["memory"]
    assert arms["grpo-ptq-rtn-w4"]["nominal_bits"] == 4 and arms["grpo"]["nominal_bits"] == 32
    assert arms["grpo-ptq-rtn-w4"]["vs_baseline"]["baseline"] == "grpo"
    d = arms["grpo-ptq-rtn-w4"]["vs_baseline"]["diff"]
    assert d == pytest.approx(arms["grpo-ptq-rtn-w4"]["mean"] - arms["grpo"]["mean"])
    # the train arm's own log: 6 steps with a reward curve
    steps = [json.loads(x)["step"] for x in (out / "runs/grpo/seed0/run/metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 6

    md = (out / "results.md").read_text()
    assert "| arm | group | bits | weight format | sampled_accuracy |" in md
    assert "| grpo-ptq-rtn-w4 | GRPO + PTQ | 4 | int4 asym g128 f32-scale (rtn) |" in md
    for name in arms:
        assert f"| {name} |" in md
    assert f"{arms['grpo']['mean']:.3f}" in md and "1 seed, no spread" in md
    for plot in ("reward_curves.png", "accuracy_vs_bits.png", "accuracy_vs_bytes.png"):
        f = out / "plots" / plot
        assert f.stat().st_size > 5000 and f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(plots/{plot})" in md
    assert not (out / "plots" / "importance_hist.png").exists()  # no QuantLRM arm


def test_heldout_matches_the_trainer(quick_study):
    """lrmq.studies.heldout scores a float policy exactly as its trainer's final held-out evaluation did (same
    problems, prompts, key): the study's numbers and the training logs agree. The study's own evaluation of the
    grpo arm is that command (--checkpoint run/final_policy --train-config train_config.yaml --seed 0 --size 16)."""
    out, _ = quick_study
    run = out / "runs" / "grpo" / "seed0" / "run"
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    log = (out / "runs" / "grpo" / "seed0" / "logs" / "eval.log").read_text()
    assert "-m lrmq.studies.heldout --checkpoint " + str(run / "final_policy") in log and "--size 16" in log
    ev = json.loads((out / "runs" / "grpo" / "seed0" / "eval.json").read_text())
    assert ev["problems"] == 16  # the quick recipe's run.eval_size
    for k in ("greedy_accuracy", "sampled_accuracy", "greedy_reward", "sampled_reward"):
        assert ev[k] == pytest.approx(last[f"eval/{k}"], abs=1e-6), k


@pytest.mark.slow(reason="reruns the quick study to check that finished arms are skipped; one evaluation runs again")
def test_quick_study_resumes(quick_study):
    out, _ = quick_study
    results = {n: (out / "runs" / n / "seed0" / "result.json") for n in ("base", "grpo", "grpo-ptq-rtn-w4")}
    mtimes = {n: p.stat().st_mtime_ns for n, p in results.items()}
    p = _study("--config", QUICK, f"out_dir={out}", _quick_train(), "eval.size=16", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "3 of 3 jobs already done" in p.stderr and "0 ran" in p.stderr
    assert {n: q.stat().st_mtime_ns for n, q in results.items()} == mtimes

    # a job killed after quantizing: only its evaluation runs again (quant/packed is kept)
    job = out / "runs" / "grpo-ptq-rtn-w4" / "seed0"
    before = json.loads(results["grpo-ptq-rtn-w4"].read_text())
    os.remove(job / "result.json")
    os.remove(job / "eval.json")
    p = _study("--config", QUICK, f"out_dir={out}", _quick_train(), "eval.size=16", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 of 3 jobs already done" in p.stderr and "1 ran" in p.stderr
    assert (job / "logs" / "quantize.log").read_text().count("$ ") == 1  # not quantized again
    assert (job / "logs" / "eval.log").read_text().count("$ ") == 2
    after = json.loads(results["grpo-ptq-rtn-w4"].read_text())
    assert after["metrics"] == before["metrics"]  # same seed, same model: the same numbers
    assert results["grpo"].stat().st_mtime_ns == mtimes["grpo"]

    # another study's settings in the same dir are refused, not mixed
    p = _study("--config", QUICK, f"out_dir={out}", _quick_train(), "eval.size=8", "--no-progress")
    assert p.returncode == 2 and "holds a study with different eval settings" in p.stderr


def test_report_importance_histogram(quick_study):
    """--report rewrites the results from finished jobs; an importance.npz (what quantlrm writes) is plotted."""
    out, _ = quick_study
    q = out / "runs" / "grpo-ptq-rtn-w4" / "seed0" / "quant"
    rng = np.random.default_rng(0)
    np.savez(q / "importance.npz", **{"layers.0.attn.q_proj": rng.lognormal(size=128).astype(np.float32),
                                      "layers.0.mlp.down_proj": rng.lognormal(size=384).astype(np.float32)})
    try:
        p = _study("--config", QUICK, f"out_dir={out}", _quick_train(), "eval.size=16", "--report")
        assert p.returncode == 0, p.stderr[-3000:]
        res = json.loads((out / "results.json").read_text())
        assert "importance_hist.png" in res["plots"]
        assert (out / "plots" / "importance_hist.png").stat().st_size > 5000
    finally:
        os.remove(q / "importance.npz")


def test_suite_eval_arm(tmp_path):
    """eval.kind=suite: the arm is scored by python -m lrmq.evaluate (fixture items of paper 1's suite) and its
    memory by lrmq.studies.heldout --memory-only; the headline is the table's number."""
    out = tmp_path / "suite"
    data = os.path.join(REPO_ROOT, "tests", "fixtures", "evals")
    p = _study("--config", QUICK, f"out_dir={out}", "only=[base]", "eval.kind=suite", "eval.metric=headline",
               f"eval.overrides=[data_dir={data}, limit=2, generation.max_new_tokens=8, tensorboard=false]",
               "plots=false", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    job = out / "runs" / "base" / "seed0"
    ev = json.loads((job / "eval" / "results.json").read_text())
    res = json.loads((out / "results.json").read_text())
    (arm,) = res["arms"]
    assert arm["metric"] == "headline" and arm["mean"] == ev["headline"]["value"]
    assert set(ev["benchmarks"]) == {"aime24", "amc", "math500", "minerva", "olympiadbench"}
    assert arm["memory"]["weight_bytes"] == json.loads((job / "memory.json").read_text())["weight_bytes"] > 0
    assert not (out / "plots").exists()


def test_qat_arms_are_scored_quantized(tmp_path):
    """A QAT arm's model is its run's quantized export (final_policy_quantized/packed), scored by both eval kinds
    without a QAT forward of its own; w8a8 (no weight-only export) keeps the held-out QAT forward and is scored
    on its float weights by the suite path, asked for by name."""
    from lrmq.configlib import load_config
    from lrmq.studies.config import StudyConfig
    from lrmq.studies.runner import Study

    arms = ("arms=[{name: fp, kind: train}, {name: q4, kind: train, baseline: fp, "
            "train: [quant.mode=qat, quant.qat_scheme=int4, quant.qat_group_size=32]}, "
            "{name: q8a8, kind: train, baseline: fp, train: [quant.mode=qat, quant.qat_scheme=w8a8]}]")
    for kind in ("heldout", "suite"):
        metric = ["eval.metric=headline"] if kind == "suite" else []
        cfg = load_config(StudyConfig, QUICK, [f"out_dir={tmp_path / kind}", arms, f"eval.kind={kind}", *metric])
        jobs = {j.arm.name: j for j in Study(cfg, log=lambda s: None).plan()}
        assert jobs["q4"].model.endswith(os.path.join("run", "final_policy_quantized", "packed"))
        assert jobs["fp"].model.endswith(os.path.join("run", "final_policy"))
        assert jobs["q8a8"].model.endswith(os.path.join("run", "final_policy"))
        for name, job in jobs.items():
            cmds = [" ".join(st.cmd) for st in job.steps if st.cmd]
            assert ("--qat-scheme w8a8" in " ".join(cmds)) == (name == "q8a8"), (name, cmds)
            assert all("--qat-scheme int4" not in c for c in cmds)
            if kind == "suite":
                ev = [c for c in cmds if "lrmq.evaluate" in c]
                assert ev and f"checkpoint={job.model}" in ev[0]
                assert ("float_qat_policy=true" in ev[0]) == (name == "q8a8")


def test_ptq_pairs_are_paired_by_seed():
    from lrmq.studies.report import ptq_pairs

    def arm(name, accs, bits=3, source="grpo"):
        return {"name": name, "kind": "ptq", "source": source, "bits": bits,
                "seeds": {str(s): {"acc": v} for s, v in enumerate(accs)}}

    arms = [arm("q", [0.30, 0.40, 0.50]), arm("a", [0.28, 0.37, 0.49]), arm("r4", [0.1, 0.2, 0.3], bits=4),
            {"name": "grpo", "kind": "train", "seeds": {}}]
    (p,) = ptq_pairs(arms, "acc")  # only the two W3 arms of the same source pair up
    d = np.array([0.02, 0.03, 0.01])
    assert (p["a"], p["b"], p["n"]) == ("q", "a", 3)
    assert p["diff"] == pytest.approx(d.mean()) and p["se"] == pytest.approx(d.std(ddof=1) / np.sqrt(3))
    assert p["beyond_2se"] is True  # a consistent per-seed gain is real although the seed spread is large


def test_equal_bits_pairs_compare_quantized_training_with_ptq():
    from lrmq.studies.report import equal_bits_pairs, paired

    def arm(name, kind, accs, bits=None, nominal=32.0, source="", baseline=""):
        return {"name": name, "kind": kind, "source": source, "bits": bits, "nominal_bits": nominal,
                "baseline": baseline, "seeds": {str(s): {"acc": v} for s, v in enumerate(accs)}}

    arms = [arm("grpo", "train", [0.40, 0.42, 0.38], baseline="base"),
            arm("grpo-qat-int4", "train", [0.30, 0.33, 0.28], nominal=4.0, baseline="grpo"),
            arm("grpo-qat-paper_int8", "train", [0.39, 0.41], nominal=8.0, baseline="grpo"),
            arm("grpo-ptq-rtn-w4", "ptq", [0.35, 0.36, 0.34], bits=4, nominal=4.0, source="grpo"),
            arm("grpo-ptq-rtn-w3", "ptq", [0.30, 0.31, 0.29], bits=3, nominal=3.0, source="grpo"),
            arm("grpo-ptq-int8-w8", "ptq", [0.40, 0.42, 0.38], bits=8, nominal=8.0, source="grpo")]
    pairs = {(p["a"], p["b"]): p for p in equal_bits_pairs(arms, "acc")}
    assert set(pairs) == {("grpo-qat-int4", "grpo-ptq-rtn-w4"), ("grpo-qat-paper_int8", "grpo-ptq-int8-w8")}
    d = np.array([-0.05, -0.03, -0.06])
    p = pairs[("grpo-qat-int4", "grpo-ptq-rtn-w4")]
    assert p["diff"] == pytest.approx(d.mean()) and p["se"] == pytest.approx(d.std(ddof=1) / np.sqrt(3))
    assert p["beyond_2se"] is True and p["bits"] == 4 and p["source"] == "grpo"
    assert pairs[("grpo-qat-paper_int8", "grpo-ptq-int8-w8")]["n"] == 2  # only the seeds both have
    # an arm that names its pairs gets exactly those rows, labelled, with both formats
    arms[1].update(compare={"same format": "grpo-ptq-rtn-w3", "paper 1 pairing": "grpo-ptq-int8-w8"},
                   weight_format="int4 sym per-channel f32-scale (qat:int4)")
    rows = [(p["pairing"], p["a"], p["b"], p["a_format"]) for p in equal_bits_pairs(arms, "acc")]
    assert rows[:2] == [("same format", "grpo-qat-int4", "grpo-ptq-rtn-w3", "int4 sym per-channel f32-scale (qat:int4)"),
                        ("paper 1 pairing", "grpo-qat-int4", "grpo-ptq-int8-w8", arms[1]["weight_format"])]
    assert [p["pairing"] for p in equal_bits_pairs(arms, "acc")][2:] == ["equal bits"]  # paper_int8: no compare
    one = paired(arms[0], {"name": "b", "seeds": {"0": {"acc": 0.1}}}, "acc")
    assert one["n"] == 1 and one["se"] is None and one["beyond_2se"] is None


def test_quantized_rollout_arms_report_mismatch(tmp_path):
    """A train arm's result keeps the reward and the sampler/learner mismatch averaged over its steps (not the
    last step's), and results.md gets the rollout table for arms that logged a mismatch."""
    from lrmq.studies.report import markdown
    from lrmq.studies.runner import last_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/sampled_accuracy": 0.2}]
    rows += [{"step": s, "reward/mean": 0.1 * s, "train/mismatch/kl_k3": 0.01 * s, "train/mismatch/kl_k1": 0.02,
              "train/mismatch/corrected_frac": 0.0, "rollout/weight_bytes": 2 ** 20} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = last_metrics(str(path))
    assert m["reward/mean"] == pytest.approx(0.3) and m["reward/mean_avg"] == pytest.approx(0.2)
    assert m["mismatch/kl_k3_avg"] == pytest.approx(0.02) and m["rollout/weight_bytes"] == 2 ** 20
    assert m["eval/sampled_accuracy"] == 0.2

    stat = lambda v: {"mean": v, "std": 0.0, "n": 1}  # noqa: E731
    arm = {"name": "int4-mis", "group": "int4 rollouts", "nominal_bits": 32.0, "mean": 0.3, "n": 1,
           "metrics": {f"train/{k}": stat(v) for k, v in m.items()}, "memory": {}, "vs_baseline": None}
    res = {"study": "s", "metric": "sampled_accuracy", "eval": {"kind": "heldout", "size": 8, "samples": 1},
           "seeds": [0], "written": "now", "arms": [arm, {**arm, "name": "fp", "metrics": {}}]}
    md = markdown(res)
    assert "| int4-mis | 0.200 | 0.02000 | 0.02000 | 0.000 | 1.000 |" in md
    assert "| fp | 0.200" not in md  # no mismatch logged: not a rollout row
