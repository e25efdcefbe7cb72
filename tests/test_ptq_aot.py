"""`python -m lrmq.quantize --compile-only` (lrmq.ptq_aot): a PTQ run's per-layer programs compiled for a TPU topology
through libtpu on this CPU-only host, per-chip memory, host RSS and an estimated time; nothing runs on a TPU."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("libtpu", reason="libtpu is in the test extra on Python 3.11") if sys.version_info >= (3, 12) \
    else __import__("libtpu")

TINY = ["--compile-only", "--shapes", "tiny", "--topology", "v5e:2x2", "--calibration-blocks", "16", "--block-size",
        "64"]


def test_compile_only_fits_then_a_smaller_chip_names_the_batch_size(cli, tmp_path, monkeypatch):
    """AWQ W3 on the tiny model for 4 v5e chips: every program compiled (the table, its calls per layer and the
    weights held beside the programs that do not take them), host RSS and the estimate stated, exit 0 with the fit
    line; the report's loop correction holds AWQ's 20 alphas. On a chip too small for 8 blocks per step and a host
    too small for 16 blocks the verdict names the calibration.batch_size and calibration.max_blocks that fit (exit
    3), and with them the run fits."""
    from lrmq import aot

    report = tmp_path / "r.json"
    r = cli("quantize", *TINY, "--method", "awq", "--bits", "3", "--report", str(report))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "target: v5e:2x2 (4 x TPU v5 lite); tiny: 2 layers; awq W3 g128; calibration 16 blocks x 64 tokens, " \
           "8 per chip step" in r.stdout
    assert "| forward + captures (layer type full_attention) | 1 |" in r.stdout
    assert "| clip search down_proj [384, 128] (layer type full_attention) |" in r.stdout
    assert "host RSS (counted, not compiled):" in r.stdout and "estimated time on the chips (an estimate" in r.stdout
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("fits: ") and " GiB per chip of 14.4 GiB usable (largest: " in line
    rep = json.loads(report.read_text())
    assert rep["fits"] and rep["model"] == "tiny" and rep["bits"] == 3 and rep["hbm_bytes"] == 16 * 2 ** 30
    grid = next(p for p in rep["programs"] if p["name"].startswith("grid losses mlp_in"))
    assert grid["kind"] == "unit" and grid["loops"] == [[grid["loops"][0][0], 20]]
    assert grid["flops"] > 10 * grid["xla_flops"]  # XLA counted one of the 20 alphas
    clip = next(p for p in rep["programs"] if p["name"].startswith("clip search"))
    assert clip["kind"] == "columns" and clip["resident"] > 0
    assert rep["estimate_seconds_per_model"] > 0 and rep["host_total_bytes"] > 0

    # a chip 20% short of the largest unit program, and a host short of the calibration activations
    unit_peak = max(p["memory"]["total"] + p["resident"] for p in rep["programs"] if p["kind"] == "unit")
    monkeypatch.setitem(aot.HBM_BYTES, "TPU v5 lite", int(unit_peak * 0.8 / (1 - aot.HEADROOM)))
    host = f"{rep['host_total_bytes'] * 0.7 / 2 ** 30:.6f}"
    r = cli("quantize", *TINY, "--method", "awq", "--bits", "3", "--host-memory-gib", host)
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("does not fit: forward + captures (layer type full_attention) needs ")
    size = int(line.split("calibration.batch_size=")[1].split()[0])
    blocks = int(line.split("calibration.max_blocks=")[1].split()[0])
    assert size in (1, 2, 4) and f"; calibration.batch_size={size} fits; and host RSS " in line, line
    assert 1 <= blocks < 16 and line.endswith(f"calibration.max_blocks={blocks} fits"), line
    assert "Traceback" not in r.stderr
    r = cli("quantize", *TINY[:-3], str(blocks), *TINY[-2:], "--method", "awq", "--bits", "3", "--batch-size",
            str(size), "--host-memory-gib", host)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1].startswith("fits: "), r.stdout[-1000:]


def test_compile_only_bad_input_is_one_line(cli):
    r = cli("quantize", "--compile-only", "--shapes", "llama-9000", "--method", "awq")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "lrmq.quantize: error: --shapes 'llama-9000' is neither a known architecture (llama3.1-8b, olmo-3-7b, "
        "qwen3-0.6b, qwen3-1.7b, qwen3-30b-a3b, qwen3-4b, qwen3-8b, r1-distill-llama-70b, r1-distill-qwen-32b) nor a "
        "checkpoint directory with a config.json"]
    r = cli("quantize", TINY[0], "--shapes", "tiny-moe", *TINY[3:], "--method", "awq")  # as the run refuses it
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "lrmq.quantize: error: --group-size 128 does not divide layers.0.mlp.experts.down_proj's input size K=64 (use "
        "a divisor or -1)"]
    r = cli("quantize", *TINY, "--method", "rtn")
    assert r.returncode == 2 and "--compile-only covers awq, gptq, quantlrm" in r.stderr
    r = cli("quantize", *TINY[:-1], "512", "--method", "gptq")
    assert r.returncode == 2 and "--block-size 512 is longer than tiny's max_position_embeddings 256" in r.stderr


def test_compile_only_gptq_and_quantlrm(cli):
    """GPTQ and QuantLRM, on the tiny mixture-of-experts model (sparse layers 0 and 2, dense layer 1). GPTQ: the
    stage forwards and X^T X compiled; for the sparse layers the stages reading mlp_in for down_proj, no down_in
    capture, and each chip's [E, F, F] expert down_proj Hessians (`gptq_model.expert_hessians`); the Hessian work
    and the per-expert Hessians in the host RSS; the host-side quantization estimated from a rate measured here.
    QuantLRM: no activation statistic (its importance replaces it) but the sparse layers' per-expert token counts
    and up -> down grid losses, the experts' clip search and quantizer once per expert, v -> o searched (GQA
    downsampling), the importance pass's host memory stated."""
    r = cli("quantize", TINY[0], "--shapes", "tiny-moe", *TINY[3:], "--method", "gptq", "--group-size", "32")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "tiny-moe: 3 layers; gptq W4 g32" in r.stdout
    dense, sparse = "(layer type full_attention)", "(layer type full_attention, experts)"
    assert f"| X^T X down_in [256] {dense} |" in r.stdout and f"| stage 3 inputs down_in {dense} |" in r.stdout
    assert f"| expert X^T X down_in [8, 64, 64] {sparse} |" in r.stdout
    assert f"| stage 3 inputs mlp_in {sparse} |" in r.stdout and f"| forward {sparse} |" in r.stdout
    assert f"X^T X down_in [256] {sparse}" not in r.stdout and f"| X^T X mlp_in [128] {sparse} |" in r.stdout
    assert "GPTQ Hessian work" in r.stdout and "GPTQ's host-side quantization (numba) at the rate measured" in r.stdout
    assert "GPTQ per-expert Hessians (8 experts" in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith("fits: ")
    r = cli("quantize", TINY[0], "--shapes", "tiny-moe", *TINY[3:], "--method", "quantlrm", "--bits", "3",
            "--group-size", "32")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "| activation statistic" not in r.stdout and f"| grid losses attn_out {dense} |" in r.stdout
    assert f"| expert activation statistic mlp_out [8, 64] {sparse} | 1 |" in r.stdout
    assert f"| expert grid losses mlp_out [8, 64] {sparse} | 1 |" in r.stdout
    assert f"| grid losses mlp_out {sparse}" not in r.stdout and f"| grid losses mlp_out {dense} |" in r.stdout
    assert f"| clip search down_proj [64, 128] x 8 experts {sparse} | 8 |" in r.stdout
    assert f"| quantize up_proj [128, 64] x 8 experts {sparse} | 8 |" in r.stdout
    assert f"| grid losses mlp_in {sparse} |" in r.stdout and f"| fold scales mlp_in {sparse} |" in r.stdout
    assert "QuantLRM's importance pass before them: " in r.stdout


def test_chip_peaks():
    """The peaks the estimates divide by: Google Cloud's TPU figures; an H200's from XLA's target description (bf16:
    NVIDIA's dense 989 TFLOP/s; f32 at TF32, half of it), with its 4.8 TB/s."""
    from lrmq.targets import chip_peaks, gpu_peak_flops

    assert chip_peaks("TPU v5") == (459e12, 2765e9) and chip_peaks("TPU v5 lite") == (197e12, 819e9)
    assert abs(gpu_peak_flops("h200") / 1e12 - 989.2) < 0.5
    flops, bandwidth = chip_peaks("NVIDIA H200 141GB HBM3e", "f32")
    assert abs(flops / 1e12 - 494.6) < 0.5 and bandwidth == 4.8e12
    assert chip_peaks("cpu") is None


def test_gptq_host_seconds_count_every_expert():
    """GPTQ's host estimate of a sparse layer: E solves per stacked expert projection, one down_proj Hessian inverse
    per expert, and gate/up's one shared inverse (calibration.moe_experts=all) or one per expert ("routed"); a dense
    layer one of each (tiny-moe: layer 0 sparse, 8 experts of width 64, layer 1 dense). QuantLRM's importance pass
    counts the stacked experts as its largest weight."""
    import dataclasses

    from lrmq import ptq_aot
    from lrmq.ptq.config import QuantizeConfig
    from lrmq.quantize import compile_only_model

    cfg = compile_only_model("tiny-moe")
    qcfg = QuantizeConfig(model="tiny-moe", method="gptq")
    routed = dataclasses.replace(qcfg, calibration=dataclasses.replace(qcfg.calibration, moe_experts="routed"))
    solves = {"kn": 1.0, "f32_flops": float("inf"), "f64_flops": float("inf")}
    inverses = {"kn": 0.0, "f32_flops": float("inf"), "f64_flops": 2 / 3}  # one inverse of [K, K] costs K^3
    attn = 128 * 128 + 2 * 128 * 64 + 128 * 128  # q, o [128, 128] (4 heads x 32), k / v [128, 64] (2 kv heads)
    assert ptq_aot._gptq_host_layer(cfg, qcfg, 0, solves) == attn + 8 * 3 * 128 * 64
    assert ptq_aot._gptq_host_layer(cfg, qcfg, 1, solves) == attn + 3 * 128 * 256
    assert ptq_aot._gptq_host_layer(cfg, qcfg, 0, inverses) == pytest.approx(3 * 128 ** 3 + 8 * 64 ** 3)
    assert ptq_aot._gptq_host_layer(cfg, routed, 0, inverses) == pytest.approx(2 * 128 ** 3 + 8 * (128 ** 3 + 64 ** 3))
    assert ptq_aot._gptq_host_layer(cfg, qcfg, 1, inverses) == pytest.approx(3 * 128 ** 3 + 256 ** 3)
    # QuantLRM's importance pass holds two pairs of the largest weight: the stacked [8, 128, 64] experts
    assert ptq_aot.importance_host_bytes(cfg) == 2 * 2 * 4 * 8 * 128 * 64 + 8 * 37 * 2 ** 20
