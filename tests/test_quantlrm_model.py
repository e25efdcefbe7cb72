"""QuantLRM end to end on a (base, sparsely perturbed fine-tuned) pair of a tiny Qwen3."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import jit_forward


def make_pair(base_dir: str, out: str, frac: float = 0.3, seed: int = 0) -> str:
    """A 'fine-tuned' copy: ~frac of every projection's entries perturbed, the rest exactly equal."""
    import jax.numpy as jnp

    from lrmq.checkpoint.hf import load_hf_model, save_hf_model
    from lrmq.quant.transforms import iter_linears

    m = load_hf_model(base_dir)
    rng = np.random.default_rng(seed)
    for _, lin in iter_linears(m):
        w = np.asarray(lin.kernel.get_value())
        d = rng.standard_normal(w.shape).astype(np.float32) * 1e-3 * rng.lognormal(0, 1, w.shape)
        d[rng.random(w.shape) > frac] = 0
        lin.kernel.set_value(jnp.asarray(w + d))
    return save_hf_model(m, out, dtype="float32")


@pytest.fixture(scope="module")
def setup(hf_checkpoint, tmp_path_factory):
    from test_awq import _tokenizer

    base, _ = hf_checkpoint("qwen3")
    root = tmp_path_factory.mktemp("qlrm")
    ft = make_pair(base, str(root / "ft"))
    texts = [f"Compute {i}+{i % 7}*3. Answer: {i % 7}*3={(i % 7) * 3}. {i}+{(i % 7) * 3}={i + (i % 7) * 3}."
             for i in range(300)]
    tok = root / "tok"
    tok.mkdir()
    _tokenizer(str(tok), texts)
    calib = root / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    return {"base": base, "ft": ft, "tok": str(tok), "calib": str(calib), "root": root}


def qcfg(s, out, **kw):
    from lrmq.ptq.config import load_quantize_config

    ov = [f"model={s['ft']}", "method=quantlrm", f"quantlrm.base={s['base']}", "bits=3", "group_size=32",
          f"tokenizer={s['tok']}", f"calibration.path={s['calib']}", "calibration.block_size=64",
          "calibration.max_doc_tokens=64", "calibration.max_blocks=6", "calibration.batch_size=3",
          "awq.n_grid=5", "progress=false", f"outputs.dir={out}", "outputs.formats=[packed,fake_quant]",
          "outputs.dtype=float32"]
    return load_quantize_config(None, ov + [f"{k}={v}" for k, v in kw.items()])


@pytest.mark.slow(reason="the full QuantLRM pipeline (importance, quantize, export, reload) on the tiny model")
def test_end_to_end(setup):
    from lrmq.checkpoint.load import load_model
    from lrmq.ptq.pipeline import run_quantize
    from lrmq.ptq.importance import importance_for_model
    from lrmq.quant.transforms import iter_linears, module_at

    out = str(setup["root"] / "out")
    rep = run_quantize(qcfg(setup, out))
    for f in ("importance.npz", "importance.png", "report.json", "quantize_config.yaml", "packed/config.json",
              "fake_quant/model.safetensors"):
        assert os.path.exists(os.path.join(out, f)), f
    imps = dict(np.load(os.path.join(out, "importance.npz")))
    assert sorted(imps) == sorted(f"layers.{i}.{m}.{p}" for i in range(2) for m, p in
                                  (("attn", "q_proj"), ("attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "down_proj")))
    # the same vectors as the importance module on in-memory weights (streamed pipeline == direct)
    b, f = load_model(setup["base"]), load_model(setup["ft"])
    pairs = [(p, np.asarray(lin.kernel.get_value()), np.asarray(module_at(b, p).kernel.get_value()))
             for p, lin in iter_linears(f)]
    direct = importance_for_model(pairs)
    for k in imps:
        np.testing.assert_array_equal(imps[k], direct[k])
    groups = rep["info"]["layers"]["0"]["groups"]
    assert isinstance(groups["attn_out"], dict)  # GQA v->o kept (downsampled), unlike AWQ
    assert rep["importance_stats"]["count"] > 0
    q = load_model(os.path.join(out, "packed"))
    assert hasattr(module_at(q, "layers.1.mlp.down_proj").kernel.get_value(), "codes")
    fake = load_model(os.path.join(out, "fake_quant"))
    toks = np.arange(32)[None] % 96
    np.testing.assert_allclose(np.asarray(jit_forward(q, toks)), np.asarray(jit_forward(fake, toks)), rtol=1e-5,
                               atol=1e-5)


def test_grpo_run_dir_and_mapping(setup, tmp_path):
    import shutil

    from lrmq.ptq.pipeline import run_quantize

    run = tmp_path / "run"
    shutil.copytree(setup["ft"], run / "final_policy")
    shutil.copytree(setup["base"], run / "initial_policy")
    out = str(tmp_path / "o1")
    r1 = run_quantize(qcfg(setup, out, **{"quantlrm.run_dir": str(run), "quantlrm.base": "null", "model": "null",
                                          "quantlrm.plot": "false", "outputs.formats": "[fake_quant]"}))
    assert r1["model"].endswith("final_policy")
    out2 = str(tmp_path / "o2")
    run_quantize(qcfg(setup, out2, **{"quantlrm.mapping": "constant", "quantlrm.plot": "false",
                                      "outputs.formats": "[fake_quant]"}))
    a, c = np.load(os.path.join(out, "importance.npz")), np.load(os.path.join(out2, "importance.npz"))
    assert not np.array_equal(a["layers.0.attn.q_proj"], c["layers.0.attn.q_proj"])


def test_pseudo_ft_pair(setup, tmp_path):
    """Pseudo-fine-tuning writes (before, after); QuantLRM on it quantizes `before` (quantize=base)."""
    import shutil

    from lrmq.checkpoint.load import load_model
    from lrmq.ptq.pipeline import run_quantize
    from lrmq.ptq.pseudo_ft import PseudoFTOptions, pseudo_finetune

    m = tmp_path / "m"
    shutil.copytree(setup["base"], m)
    shutil.copy(os.path.join(setup["tok"], "tokenizer.json"), m / "tokenizer.json")
    tr = tmp_path / "traces.jsonl"
    tr.write_text("\n".join(json.dumps({"prompt": f"Compute {i}+1.", "completion": f" Answer: {i + 1}"})
                            for i in range(40)))
    r = pseudo_finetune(str(m), str(tr), str(tmp_path / "pft"), PseudoFTOptions(steps=4, lr=1e-3, batch_size=4,
                                                                                 seq_len=32))
    assert r["losses"][-1] < r["losses"][0]
    b, a = load_model(r["before"]), load_model(r["after"])
    np.testing.assert_array_equal(np.asarray(b.layers[0].attn.q_proj.kernel.get_value()),
                                  np.asarray(load_model(setup["base"]).layers[0].attn.q_proj.kernel.get_value()))
    assert not np.array_equal(np.asarray(a.layers[0].attn.q_proj.kernel.get_value()),
                              np.asarray(b.layers[0].attn.q_proj.kernel.get_value()))
    rep = run_quantize(qcfg(setup, str(tmp_path / "q"), **{"model": r["after"], "quantlrm.base": r["before"],
                                                            "quantlrm.quantize": "base", "quantlrm.plot": "false",
                                                            "outputs.formats": "[fake_quant]"}))
    assert rep["model"] == r["before"]


def test_importance_of_lrmq_and_mixed_pairs(setup):
    """The importance pass reads an lrmq (orbax) pair tensor by tensor, as an HF pair: the same vectors and stats
    as the HF pair's, which are today's (the importance module on the weights load_model gives)."""
    from lrmq.checkpoint.load import load_model
    from lrmq.checkpoint.orbax_io import save_lrmq
    from lrmq.ptq.importance import global_stats, importance_for_model
    from lrmq.ptq.quantlrm import QuantLRMOptions, TensorSource, check_pair, compute_importance
    from lrmq.quant.transforms import iter_linears, module_at

    b, f = load_model(setup["base"]), load_model(setup["ft"])
    lrmq = {k: os.path.join(setup["root"], f"{k}_lrmq") for k in ("base", "ft")}
    for k, m in (("base", b), ("ft", f)):
        if not os.path.exists(lrmq[k]):
            save_lrmq(m, lrmq[k])
    pairs = [(p, np.asarray(lin.kernel.get_value()), np.asarray(module_at(b, p).kernel.get_value()))
             for p, lin in iter_linears(f)]
    opts = QuantLRMOptions()
    targets, stats_targets = opts.resolved(f.cfg)
    direct_stats = global_stats(pairs, stats_targets=stats_targets)
    direct = importance_for_model(pairs, targets, stats=direct_stats)
    for ft, base in ((setup["ft"], setup["base"]), (lrmq["ft"], lrmq["base"]), (setup["ft"], lrmq["base"])):
        a, c = TensorSource(ft), TensorSource(base)
        assert a._model is None and c._model is None  # read tensor by tensor, never loaded whole
        check_pair(a, c)
        imps, stats, _, _ = compute_importance(a, c, opts)
        assert stats == direct_stats and sorted(imps) == sorted(direct), (ft, base)
        for k in imps:
            np.testing.assert_array_equal(imps[k], direct[k], err_msg=f"{ft} vs {base}: {k}")
    src = TensorSource(lrmq["ft"])
    assert src.shapes()["layers.0.attn.q_proj"] == ("layers.0.attn.q_proj.kernel", src.kn_shape("layers.0.attn.q_proj"))
