"""Ahead-of-time TPU compiles of the GRPO step and rollout (`--compile-only`) and the trainer's pre-flight
memory check. Compiles target TPU topologies through libtpu on this CPU-only host; nothing executes on a TPU."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from conftest import REPO_ROOT, tiny_train_config

pytest.importorskip("libtpu", reason="libtpu is in the test extra on Python 3.11") if sys.version_info >= (3, 12) \
    else __import__("libtpu")

TINY_OVERRIDES = ["run.progress=false", "data.synthetic_train_size=64", "data.synthetic_eval_size=8"]


@pytest.fixture
def _train(cli):
    """lrmq.train as its main() in this process (conftest's cli fixture)."""
    return lambda *args: cli("train", *args)


@pytest.mark.slow(reason="train --compile-only: two update shapes, the rollout and its pool search for 4 v5e chips")
def test_compile_only_tiny_recipe_on_a_multichip_topology_and_an_oversized_pool(tmp_path, _train):
    """The tiny GRPO step (every update shape, as the trainer compiles them before its first rollout) and the
    rollout compile for 4 v5e chips (fsdp=4), with a JSON report; a KV pool far past the chip's HBM
    (rollout.kv_pages set) is refused by the compiler for both rollout programs, and the command ends in its
    verdict line naming the rollout.kv_pages that fits, exit 3, no traceback."""
    report = tmp_path / "r.json"
    r = _train("--config", os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml"), "--compile-only",
               "--topology", "v5e:2x2", "--report", str(report), "mesh.fsdp=4", "optim.micro_batch_size=16",
               "rollout.prompts_per_step=4", "rollout.update_shapes=2", "rollout.kv_pages=20000000", *TINY_OVERRIDES)
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert "| train_step |" in r.stdout and "| rollout prefill | refused by the compiler" in r.stdout
    assert "| rollout decode | refused by the compiler" in r.stdout
    # rollout.update_shapes=2: the smaller shape is compiled too (two shapes prove the loop; a third added 10 s)
    assert "| train_step 2/2 |" in r.stdout and "| train_step 3/" not in r.stdout
    assert "compiling update 2/2" in r.stderr and "KV pool: 20,000,000 pages" in r.stdout
    line = r.stdout.strip().splitlines()[-1]
    rep = json.loads(report.read_text())
    assert line.startswith("does not fit: the compiler refused the rollout prefill (RESOURCE_EXHAUSTED")
    assert line.endswith(f"; the rollout fits with rollout.kv_pages={rep['fitting_kv_pages']}")
    assert not rep["fits"] and rep["target"] == "v5e:2x2" and rep["hbm_bytes"] == 16 * 2 ** 30
    assert 1000 < rep["fitting_kv_pages"] < 20_000_000 and rep["kv_pool"]["pages"] == 20_000_000
    assert rep["kv_pool"]["sized"] == "kv_pages" and rep["kv_memory_fraction"] == 0.9
    steps = [p for p in rep["programs"] if p["name"].startswith("train_step")]
    assert len(steps) == 2
    for prog in steps:
        assert prog["memory"]["total"] > 0 and prog["flops"] > 0 and prog["seconds"] > 0
    assert [p["name"] for p in rep["programs"] if p["memory"] is None] == ["rollout prefill", "rollout decode"]
    assert all("RESOURCE_EXHAUSTED" in p["refused"] for p in rep["programs"] if p["memory"] is None)


def test_compile_only_missing_weights_needs_shapes(tmp_path, _train):
    r = _train("--config", os.path.join(REPO_ROOT, "configs", "paper1", "qwen3_0.6b_grpo.yaml"), "--compile-only",
               "model.shapes=", "--topology", "v5e:2x4")
    assert r.returncode == 2
    assert "model.shapes" in r.stderr and "/path/to/Qwen3-0.6B-Base" in r.stderr


def test_compile_only_bad_topology_names_it(_train):
    r = _train("--config", os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml"), "--compile-only",
               "--topology", "v9z:banana")
    assert r.returncode == 2 and "v9z:banana" in r.stderr
    # a GPU target: an unknown name lists the known ones; none at all is asked for (this machine has no GPU)
    r = _train("--config", os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml"), "--compile-only",
               "--platform", "gpu", "--topology", "h300:8")
    assert r.returncode == 2 and "GPU 'h300': unknown; known: a100, b200, h100, h200" in r.stderr
    r = _train("--config", os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml"), "--compile-only", "--platform", "gpu")
    assert r.returncode == 2 and "--platform gpu needs --topology NAME:GPUS, e.g. h200:8" in r.stderr


@pytest.mark.slow(reason="the one paper-recipe fit check: Qwen3-0.6B's update and rollout compiled for v5e-8")
def test_paper_recipe_0_6b_fits_v5e_8(tmp_path, _train):
    """configs/paper1/qwen3_0.6b_grpo.yaml as written: Qwen3-0.6B, 256 sequences of 512 + 512 tokens, compiled
    for its stated hardware (8 v5e chips, 16 GiB each). Exits 0 only when every program fits with headroom; the
    KV pool sized to the chip is the worst case here (it fits in 0.9 of HBM less the update)."""
    report = tmp_path / "r.json"
    # rollout.update_shapes=1: the largest update shape decides the memory; the smaller ones cost compile time only
    # (the tiny recipe's test above compiles every shape)
    r = _train("--config", os.path.join(REPO_ROOT, "configs", "paper1", "qwen3_0.6b_grpo.yaml"), "--compile-only",
               "--report", str(report), "rollout.update_shapes=1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["target"] == "v5e:2x4" and rep["fits"]
    step = rep["programs"][0]["memory"]
    assert step["total"] < 4 * 2 ** 30  # the recipe scans its layers: 2.7 GiB; the layer loop needed 5.3 (docs/tpu.md)
    assert [p["name"] for p in rep["programs"]] == ["train_step", "rollout prefill", "rollout decode"]
    pool = rep["kv_pool"]
    assert pool["sized"] == "worst case" and pool["pages"] == pool["worst_case_pages"] and pool["slots"] == 256
    assert f"KV pool: {pool['pages']:,} pages of 16 tokens" in r.stdout


@pytest.mark.slow(reason="in-process compiles of the tiny step at two micro-batches and the rollout for 4 v5e chips")
def test_does_not_fit_names_the_largest_micro_batch(tmp_path, monkeypatch):
    """A recipe over its HBM exits 3 and names the largest micro-batch whose step fits (32 sequences of 256
    tokens on 4 chips: the micro-batch-32 step needs more memory than the micro-batch-16 one), and sizes the
    rollout's pool from that micro-batch's update."""
    from lrmq import aot
    from lrmq.train import compile_only

    cfg = tiny_train_config(str(tmp_path), mesh={"fsdp": 4}, optim={"micro_batch_size": 32},
                            rollout={"group_size": 8, "prompts_per_step": 4, "max_prompt_len": 64,
                                     "max_new_tokens": 192, "update_shapes": 1})
    devices = aot.topology_devices("v5e:2x2")
    run = aot.abstract_run(cfg, aot.make_mesh(aot.MeshConfig(1, 4, 1), devices=list(devices)))
    first = aot.compile_train_step(run)  # the micro-batch-32 step: what check_fit compiles first, on the same mesh
    base = aot.memory_report(first[0])["total"]
    monkeypatch.setitem(aot.HBM_BYTES, "TPU v5 lite", int(0.99 * base / (1 - aot.HEADROOM)))
    compile_step, calls = aot.compile_train_step, []

    def once(run, micro_batch=None, shape=None):  # that program is not compiled a second time
        calls.append(micro_batch)
        return first if len(calls) == 1 and micro_batch is None else compile_step(run, micro_batch, shape)

    monkeypatch.setattr(aot, "compile_train_step", once)
    assert compile_only(cfg, "v5e:2x2", str(tmp_path / "r.json")) == 3
    assert calls == [None, 16]  # the configured step (reused), then micro-batch 16, which fits
    rep = json.loads((tmp_path / "r.json").read_text())
    assert not rep["fits"] and rep["largest_fitting_micro_batch"] == 16
    assert rep["kv_pool"]["sized"] in ("fitted", "worst case") and rep["kv_pool"]["pages"] > 1


def test_trainer_preflight_refuses_before_the_first_step(tmp_path, _train):
    out = tmp_path / "run"
    r = _train("--config", os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml"), f"run.out_dir={out}",
               "run.preflight=on", "run.hbm_limit_gib=0.000001", "run.steps=1", "run.export_hf=false",
               "run.eval_size=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.update_shapes=1",
               *TINY_OVERRIDES)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "preflight: train_step needs" in r.stderr and "--compile-only" in r.stderr
    assert "compiled the rollout engine" not in r.stderr  # refused on the update, before any rollout compile
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


@pytest.mark.slow(reason="a one-step training run with its preflight and the smallest KV pool (preemption)")
def test_trainer_preflight_then_trains_with_the_compiled_step(tmp_path, _train):
    out = tmp_path / "run"
    r = _train("--config", os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml"), f"run.out_dir={out}",
               "run.preflight=on", "run.steps=1", "run.export_hf=false", "run.eval_size=0",
               "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.generation_batch=8",
               # a device memory figure (run.hbm_limit_gib) sizes the KV pool: a share too small for more than
               # one sequence, so the rollout runs on the smallest pool and preempts
               "run.hbm_limit_gib=1000", "rollout.kv_memory_fraction=1e-9", *TINY_OVERRIDES)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "preflight: train_step" in r.stderr and "done: step 1" in r.stdout
    pool = re.search(r"KV pool: (\d+) pages of 16 tokens \(worst case (\d+)\)", r.stderr)
    assert pool and int(pool.group(1)) < int(pool.group(2)) / 4, r.stderr[-3000:]
    m = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert m["completion/length_mean"] > 0  # both generate calls of 8 sequences produced completions


def test_generate_compile_only(cli):
    r = cli("generate", "--compile-only", "--checkpoint", os.path.join(REPO_ROOT, "lrmq", "assets", "tiny"),
            "--topology", "v5e:2x4", "--batch", "16", "--prompt-len", "64", "--max-new-tokens", "32")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| decode |" in r.stdout and "| prefill |" in r.stdout and "fits:" in r.stdout
    assert "v5e:2x4 (8 devices)" in r.stdout
    assert "KV pool: " in r.stdout and "the worst case: no sequence is ever preempted" in r.stdout


@pytest.mark.parametrize("quant,layout", [({"mode": "qlora", "base_format": "nf4"}, "pack"),
                                          ({"mode": "qlora", "base_format": "int4", "base_group_size": 32}, "pack"),
                                          ({"mode": "qat", "qat_scheme": "paper_int8"}, "max")])
def test_train_modes_compile_for_a_multichip_slice(tmp_path, quant, layout):
    """QLoRA (packed base through the Mosaic kernels, inside shard_map) and QAT train steps with layer remat,
    and their rollouts, compile for 8 v5e chips. The QAT step takes the padded update (rollout.update_padding=max)
    with two micro-batches, so the same compile shows that layout compiling for the slice, as the packed one
    (gathers and scatters per device group, segment masks) does in the QLoRA steps."""
    from lrmq import aot

    extra = {} if layout == "pack" else {"rollout": {"update_padding": layout}, "optim": {"micro_batch_size": 8}}
    cfg = tiny_train_config(str(tmp_path), mesh={"fsdp": 8}, model={"remat": "full"}, quant=quant, **extra)
    run = aot.abstract_run(cfg, aot.make_mesh(aot.MeshConfig(1, 8, 1), devices=list(aot.topology_devices("v5e:2x4"))))
    batch = aot.abstract_batch(cfg, run.mesh)
    assert batch.layout == layout and (batch.segments is not None) == (layout == "pack")
    step, _ = aot.compile_train_step(run)
    rollout, _ = aot.compile_rollout(run)
    assert aot.memory_report(step)["total"] > 0
    kernels = ["tpu_custom_call" in c.as_text() for c in (step, rollout)]
    # every step runs splash attention (Mosaic); the tiny rollout's only kernels are QLoRA's packed matmuls
    assert kernels == [True, quant["mode"] == "qlora"]


@pytest.mark.slow(reason="the slot search: prefill and decode compiles at two to four slot counts for 4 v5e chips")
def test_evaluate_compile_only_for_a_tpu_topology(capsys, monkeypatch):
    """`lrmq.evaluate --compile-only`: the suite's generate call compiled for a TPU slice without weights;
    too many decode slots for the chip's HBM exits 3 with the verdict line naming the slot count that fits."""
    from lrmq import aot
    from lrmq.evaluate import main

    assert main(["--checkpoint", "tiny", "--suite", "quantlrm", "--compile-only", "--topology", "v5e:2x2",
                 "--prompt-len", "64", "generation.batch_size=8"]) == 0
    out = capsys.readouterr().out
    assert "target: v5e:2x2 (4 devices, fsdp=4); suite quantlrm: 8 decode slots, prompt 64 + 192 new tokens" in out
    assert "| prefill |" in out and "| decode |" in out and "fits:" in out
    # the compiler refuses 65,536 slots on the chip's real HBM (~18 GB of prefill temporaries); the slot search
    # then runs against a 128 MiB budget, so it settles at 32 / 64 slots (2-3 s a compile) instead of compiling
    # 2,048 and 4,096 (about 20 s each; 128 and 256 at 1 GiB: 6-10 s each)
    monkeypatch.setitem(aot.HBM_BYTES, "TPU v5 lite", 128 * 2 ** 20)
    assert main(["--checkpoint", "tiny", "--suite", "quantlrm", "--compile-only", "--topology", "v5e:2x2",
                 "--prompt-len", "64", "generation.batch_size=65536"]) == 3
    out = capsys.readouterr().out
    assert "the smallest pool (one sequence)" in out  # the pool was not what was too large: the slots were
    line = out.strip().splitlines()[-1]
    assert line.startswith("does not fit") and "; generation.batch_size=" in line and line.endswith(")")
    assert "Traceback" not in line


def test_kv_pool_sized_to_the_device():
    """The pool's size as a pure function of the memory figures (vLLM's gpu_memory_utilization): a share of the
    device's memory less what else lives there, over the bytes of a page, the worst case its cap and one sequence
    its floor; the worst case where the memory is unknown. Then what an engine call allocates with it, and the
    search that shrinks a pool whose programs do not fit (on a linear memory model, no compile)."""
    from lrmq import aot
    from lrmq.generation.engine import EngineConfig, call_sizes, pool_info
    from lrmq.generation.kv_pool import fitted_pages, page_bytes, pool_budget
    from lrmq.model.presets import preset_config

    gib = 2 ** 30
    assert pool_budget(None, 5 * gib, 0.9) == 0 and pool_budget(0, 0, 0.9) == 0  # CPU: no limit
    assert pool_budget(16 * gib, 5 * gib, 0.9) == int(0.9 * 16 * gib) - 5 * gib
    assert pool_budget(16 * gib, 20 * gib, 0.9) == 1  # nothing left: the smallest pool
    assert fitted_pages(0, 1000, cap=500, minimum=10) == 500  # no limit: the worst case
    assert fitted_pages(100_000, 1000, cap=500, minimum=10) == 100
    assert fitted_pages(10 ** 9, 1000, cap=500, minimum=10) == 500  # the worst case caps it
    assert fitted_pages(1, 1000, cap=500, minimum=10) == 10  # one sequence at least
    cfg = preset_config("qwen3-0.6b", dtype="bfloat16")
    # K and V of 28 layers x 8 KV heads x 128 x 16 tokens in bf16; on 8 chips each holds one KV head's share
    assert page_bytes(cfg, 16) == 28 * 16 * 2 * 8 * 128 * 2
    # the paper-1 0.6B rollout at 4,096 new tokens on v5e-8: the worst case, then a pool fitted to 8.78 GiB per chip
    engine = EngineConfig(slots=256, page_size=16)
    slots, pages, _, worst = call_sizes(engine, cfg, None, 256, 512, 4096)
    assert slots == 256 and pages == worst == 1 + 256 * ((4096 + 64) // 16 + 2 + 512 // 16)
    sized = EngineConfig(slots=256, page_size=16, pool_bytes=int(8.78 * gib))
    info = pool_info(sized, cfg, None, 256, 512, 4096)
    assert info["sized"] == "fitted" and info["pages"] == int(8.78 * gib) // page_bytes(cfg, 16) < worst
    assert info["tokens"] == (info["pages"] - 1) * 16 and info["bytes_per_device"] <= 8.78 * gib
    assert pool_info(EngineConfig(slots=256, pages=777), cfg, None, 256, 512, 4096)["sized"] == "kv_pages"
    assert pool_info(engine, cfg, None, 256, 512, 4096)["sized"] == "worst case"

    # fit_pool on programs whose memory is 3x the pool plus 1 GiB: two compiles find it, none below the floor
    calls = []

    def attempt(p):
        calls.append(p)
        return [{"name": "decode", "memory": {"total": 3 * p * 1000 + gib}}]

    budget = 2 * gib
    pages, rows = aot.fit_pool(attempt, attempt(10 ** 6), 10 ** 6, 10, 1000, budget, log=lambda m: None)
    assert rows[0]["memory"]["total"] <= budget and pages > 0.9 * (gib // 3000) and len(calls) <= 4
    assert aot.fit_pool(attempt, attempt(10 ** 9), 10 ** 9, 10 ** 6, 1000, budget, log=lambda m: None) is None
    refused = [{"name": "prefill", "memory": None, "refused": "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the "
                "total memory required for HLO temporaries (1.49T) exceeds available HBM (15.75G)."}]
    assert aot.refused_bytes(refused[0]["refused"]) == 1.49 * 2 ** 40
    pages, _ = aot.fit_pool(attempt, refused, 10 ** 7, 10, 1000, budget, log=lambda m: None)
    assert 3 * pages * 1000 + gib <= budget


def test_step_estimate_counts_the_active_parameters_of_a_mixture_of_experts():
    """The update's roofline FLOPs for Qwen3-30B-A3B are those of its 3.35B active parameters (router + top-8
    experts per token), not of all 30.5B; a dense model's active parameters are all of them. No compile."""
    from lrmq import aot
    from lrmq.configlib import load_config
    from lrmq.model.presets import preset_config
    from lrmq.rl.config import TrainConfig

    recipe = os.path.join(REPO_ROOT, "configs", "paper1", "pod_v5p64_30b_a3b_grpo.yaml")
    cfg = load_config(TrainConfig, recipe)
    rows = [{"name": "train_step", "memory": {"total": 1}},
            {"name": "rollout decode", "memory": {"arguments": 2 ** 30}}]
    report = aot.FitReport(rows=rows, hbm=None, fits=True, placement={"placement": "colocated", "learner_chips": 32})
    est = aot.step_estimate(cfg, report, "TPU v5")
    moe = preset_config("qwen3-30b-a3b")
    assert est["params"] == moe.num_params(active=True) < moe.num_params() / 9
    r = cfg.rollout
    tokens = r.prompts_per_step * r.group_size * (r.max_prompt_len + r.max_new_tokens)
    assert est["update_s"] == pytest.approx(8 * est["params"] * tokens / (32 * 459e12))  # remat full: 8 x
    dense = preset_config("qwen3-8b")
    assert dense.num_params(active=True) == dense.num_params()


def test_slot_search_starts_where_the_memory_points():
    """`lrmq.evaluate/generate --compile-only`'s slot search: a bisection over the counts whose first probe is the
    count the failed programs' memory points to; from a right guess two compiles settle it (the guess fits, the
    next count up does not), and any guess still finds the largest fitting count."""
    from lrmq import aot

    for answer in (None, 0, 3, 9):  # the index of the largest count that fits (None: none fits)
        for first in (None, 0, 2, 3, 4, 9, 12):
            calls = []

            def attempt(i):
                calls.append(i)
                return aot.FitReport([], None, answer is not None and i <= answer)

            got = aot.largest_fitting(10, attempt, first)
            assert (got[0] if got else None) == answer, (answer, first, calls)
            assert len(calls) == len(set(calls)) <= 6  # never the same count twice; the bisection's 4 + 2 at most
            if first == answer and answer not in (None, 9):
                assert calls == [answer, answer + 1]
            if answer is not None and first == answer + 1:
                assert calls == [answer + 1, answer]  # a guess one too high: the count below it next
    gib = 2 ** 30
    refused = {"name": "prefill", "memory": None, "seconds": 1.0,
               "refused": "RESOURCE_EXHAUSTED: ... HLO temporaries (80.00G) exceeds available HBM (15.75G)."}
    report = aot.FitReport([refused], 16 * gib, False, pool={"slots": 4096})
    counts = [4 << k for k in range(10)]  # 4 .. 2048
    # 4096 slots asked for 80 GiB of a 14.4 GiB budget: about 737 slots fit, so 512 (index 7) is probed first
    assert aot._slot_guess(counts, 4096, report) == 7
    assert aot._slot_guess(counts, 4096, aot.FitReport([refused], None, False)) is None  # no budget known
