"""GPTQ at model level: beats RTN at W3 g128, packed == fake-quant, true-sequential and act-order."""

from __future__ import annotations

import os

import numpy as np
import pytest

from test_awq import calib_blocks, eval_blocks, structured_model, window_nll, z_score


@pytest.fixture(scope="module")
def structured(tmp_path_factory):
    return structured_model(tmp_path_factory)


@pytest.mark.slow(reason="the structured model's fixture trains it first (~35 s), then GPTQ and RTN at W3")
def test_gptq_beats_rtn_w3(structured):
    from lrmq.checkpoint.load import load_model
    from lrmq.ptq.rtn import rtn_quantize_model
    from lrmq.ptq.gptq_model import GPTQOptions, gptq_quantize_model
    from lrmq.quant.formats import dequantize
    from lrmq.quant.transforms import module_at

    ev = eval_blocks(structured)
    fp = window_nll(load_model(structured["model"]), ev)
    m = load_model(structured["model"])
    rtn_quantize_model(m, bits=3, group_size=128)
    rtn = window_nll(m, ev)
    m = load_model(structured["model"])
    r = gptq_quantize_model(m, calib_blocks(structured), GPTQOptions(bits=3, group_size=128), progress=False)
    gptq = window_nll(m, ev)
    z = {"gptq>fp": z_score(gptq - fp), "rtn>gptq": z_score(rtn - gptq),
         "gptq recovers 1/2": z_score(0.5 * (rtn - fp) - (gptq - fp))}
    print({"ppl": {k: float(np.exp(v.mean())) for k, v in (("fp", fp), ("rtn", rtn), ("gptq", gptq))}, "z": z})
    # FP < GPTQ < RTN, paired over the 62 eval windows (z = mean per-window NLL difference / its standard
    # error). Measured (the model built on XLA-optimized CPU code, 464f0d4): ppl FP 3.7465, GPTQ 3.782, RTN
    # 3.9699; GPTQ above FP by 7.1 SE, RTN above GPTQ by 14.8 SE, GPTQ's loss under half of RTN's: 11.6 SE.
    # Thresholds at about half the measured z leave 3+ SE for drift; GPTQ with a swamping damping
    # (percdamp=100, ~RTN) fails the last at -15.7 SE.
    assert z["gptq>fp"] > 4 and z["rtn>gptq"] > 6 and z["gptq recovers 1/2"] > 4, z
    assert len(r.packed) == 14 and not r.g_idx
    for path, qw in r.packed.items():  # the packed codes reproduce GPTQ's weights bit for bit
        np.testing.assert_array_equal(np.asarray(dequantize(qw)), np.asarray(module_at(m, path).kernel.get_value()))


def test_sequential_and_act_order(hf_checkpoint):
    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.ptq.exports import ExportError, save_packed
    from lrmq.ptq.gptq_model import GPTQOptions, gptq_quantize_model
    from lrmq.quant.transforms import module_at

    d, _ = hf_checkpoint("llama3")
    toks = np.random.default_rng(0).integers(0, 128, (4, 32))
    ws = {}
    for ts in (True, False):
        m = load_hf_model(d)
        gptq_quantize_model(m, toks, GPTQOptions(bits=3, group_size=32, true_sequential=ts), progress=False)
        ws[ts] = {p: np.asarray(module_at(m, p).kernel.get_value()) for p in ("layers.0.attn.q_proj",
                                                                                 "layers.0.attn.o_proj")}
    # q/k/v come first in both orders (same Hessian); o sees quantized q/k/v only with true_sequential
    np.testing.assert_array_equal(ws[True]["layers.0.attn.q_proj"], ws[False]["layers.0.attn.q_proj"])
    assert not np.array_equal(ws[True]["layers.0.attn.o_proj"], ws[False]["layers.0.attn.o_proj"])
    m = load_hf_model(d)
    r = gptq_quantize_model(m, toks, GPTQOptions(bits=4, group_size=32, act_order=True), progress=False)
    assert r.g_idx  # dynamic groups in permuted order: fake-quant only
    with pytest.raises(ExportError, match="static_groups"):
        save_packed(m, r, str(d) + "_never")
    m = load_hf_model(d)
    r = gptq_quantize_model(m, toks, GPTQOptions(bits=4, group_size=32, act_order=True, static_groups=True),
                            progress=False)
    assert not r.g_idx and len(r.packed) == 14


def test_worker_threads_follow_the_thread_budget(monkeypatch):
    from lrmq.ptq.median import default_workers

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_workers() == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert 1 <= default_workers() <= min(4, len(os.sched_getaffinity(0)))
