"""AWQ at model level: functional layer parity, scale groups, packed == fake-quant, AWQ beats RTN.

The "structured" tiny model (Qwen3 shape, hidden 256 / intermediate 512 so group 128 divides K) is
trained for a few hundred steps on synthetic arithmetic text; random weights have no activation
outliers and would make AWQ-vs-RTN meaningless. It is built once per session (other PTQ test files
import `structured_model`).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrmq.ptq import layerwise as lw

_CACHE: dict = {}


def _tokenizer(path: str, texts):
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    t = HFTok(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=96, special_tokens=["<|endoftext|>"]))
    t.save(os.path.join(path, "tokenizer.json"))


def structured_model(tmp_path_factory) -> dict:
    """{"model": HF dir, "calib": jsonl, "eval": txt} -- trained once per pytest session."""
    if _CACHE:
        return _CACHE
    from lrmq.checkpoint.hf import save_hf_model
    from lrmq.data.synthetic import make_splits, write_jsonl
    from lrmq.model.config import ModelConfig, RopeConfig
    from lrmq.model.decoder import Decoder
    from lrmq.ptq.pseudo_ft import PseudoFTOptions, sft
    from lrmq.tokenizer import Tokenizer
    from flax import nnx

    root = tmp_path_factory.mktemp("ptq_structured")
    train, held = make_splits(1500, 300, seed=3)
    doc = lambda r: f"{r['problem']} Answer: {r['solution']}"
    calib = str(root / "calib.jsonl")
    write_jsonl(calib, [{"text": doc(r)} for r in train])
    eval_txt = str(root / "eval.txt")
    with open(eval_txt, "w") as f:
        f.write("\n\n".join(doc(r) for r in held))
    mdir = root / "model"
    mdir.mkdir()
    _tokenizer(str(mdir), [doc(r) for r in train])
    tok = Tokenizer.from_dir(str(mdir))
    cfg = ModelConfig(family="qwen3", vocab_size=128, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64, qk_norm="head", layer_types=("full_attention",) * 2,
                      rope={"full_attention": RopeConfig(theta=10000.0)}, max_position_embeddings=512)
    model = Decoder(cfg, nnx.Rngs(0))
    ids = tok.encode("\n\n".join(doc(r) for r in train))
    seq = 128
    n = len(ids) // seq
    toks = np.asarray(ids[: n * seq], np.int32).reshape(n, seq)
    sft(model, toks, np.ones_like(toks, np.float32), PseudoFTOptions(steps=150, lr=3e-3, batch_size=8, seq_len=seq))
    out = str(root / "hf")
    save_hf_model(model, out, dtype="float32", tokenizer_from=str(mdir))
    _CACHE.update(model=out, calib=calib, eval=eval_txt, root=str(root))
    return _CACHE


@pytest.fixture(scope="module")
def structured(tmp_path_factory):
    return structured_model(tmp_path_factory)


def eval_blocks(d, window=128):
    from lrmq.perplexity import read_text, windows
    from lrmq.tokenizer import Tokenizer

    return windows(Tokenizer.from_dir(d["model"]).encode(read_text(d["eval"])), window, 24)


def calib_blocks(d, n_samples=64, block=128):
    from lrmq.ptq.calibration import awq_blocks, load_documents
    from lrmq.tokenizer import Tokenizer

    return awq_blocks(load_documents(d["calib"]), Tokenizer.from_dir(d["model"]), n_samples=n_samples,
                      block_size=block, max_doc_tokens=block)


def ppl(model, blocks):
    from lrmq.perplexity import perplexity

    return perplexity(model, blocks, batch_size=8)["ppl"]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("variant", ["qwen3", "olmo3", "llama_linear"])
def test_functional_layer_matches_module(hf_checkpoint, variant):
    from lrmq.checkpoint.hf import load_hf_model

    d, _ = hf_checkpoint(variant)
    m = load_hf_model(d)
    toks = np.random.default_rng(0).integers(0, 128, (2, 16))
    x = lw.embed_tokens(m, toks)
    pos = lw.positions_for(2, 16)
    for i in range(m.cfg.num_layers):
        ref, _ = m.layers[i](jnp.asarray(x), jnp.asarray(pos))
        out, caps = lw.layer_forward(lw.get_layer_params(m.layers[i]), lw.layer_spec(m.cfg, i), x, pos, capture=True)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
        # captured o_proj input reproduces the attention contribution
        a = m.layers[i].attn.o_proj(caps["o_in"])
        assert a.shape == ref.shape
        x = np.asarray(ref)


def test_scale_groups_and_gqa(hf_checkpoint):
    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.ptq.awq import AWQOptions, awq_quantize_model, downsample_vo, upsample_vo

    d, _ = hf_checkpoint("qwen3")  # GQA: 4 heads, 2 kv heads
    toks = np.random.default_rng(1).integers(0, 128, (2, 32))
    opts = AWQOptions(bits=4, group_size=32, n_grid=4, batch_size=2)
    r = awq_quantize_model(load_hf_model(d), toks, opts, progress=False)
    g = r.info["layers"][0]["groups"]
    assert set(g) == {"attn_in", "attn_out", "mlp_in", "mlp_out"}
    assert g["attn_out"].startswith("skipped")  # llm-awq skips v->o for GQA
    assert all(g[k]["loss"] <= g[k]["loss_rtn"] for k in ("attn_in", "mlp_in", "mlp_out"))
    r2 = awq_quantize_model(load_hf_model(d), toks, AWQOptions(bits=4, group_size=32, n_grid=4, gqa_vo="downsample",
                                                                 batch_size=2), progress=False)
    assert isinstance(r2.info["layers"][0]["groups"]["attn_out"], dict)
    # olmo3 (post-norm): only the groups with a Linear before them
    d3, _ = hf_checkpoint("olmo3")
    r3 = awq_quantize_model(load_hf_model(d3), toks, AWQOptions(bits=4, group_size=32, n_grid=4, batch_size=2),
                            progress=False)
    assert set(r3.info["layers"][1]["groups"]) == {"attn_out", "mlp_out"}
    # GQA down/upsampling: query head h uses kv head h // 2
    from lrmq.ptq.layerwise import LayerSpec

    spec = LayerSpec(False, 4, 2, 3, "none", 1e-6, (1.0,), 1.0, None)
    s = jnp.arange(12, dtype=jnp.float32)
    sv = downsample_vo(s, spec)
    np.testing.assert_array_equal(np.asarray(sv), [(0 + 3) / 2, (1 + 4) / 2, (2 + 5) / 2, (6 + 9) / 2, 8.5, 9.5])
    np.testing.assert_array_equal(np.asarray(upsample_vo(sv, spec)).reshape(4, 3)[[0, 1]], np.asarray(sv[:3])[None].repeat(2, 0))


def test_scale_fold_preserves_function(hf_checkpoint):
    """Folding scales into the preceding op without quantizing leaves the layer function unchanged."""
    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.ptq.awq import ATTN_IN, ATTN_OUT, MLP_IN, MLP_OUT, apply_scale, downsample_vo, upsample_vo

    d, _ = hf_checkpoint("llama_linear")  # GQA (4 heads, 2 kv heads), biases
    m = load_hf_model(d)
    spec = lw.layer_spec(m.cfg, 0)
    p = lw.get_layer_params(m.layers[0])
    x = lw.embed_tokens(m, np.random.default_rng(2).integers(0, 128, (2, 16)))
    pos = lw.positions_for(2, 16)
    ref = lw.layer_forward(p, spec, x, pos)
    caps = {}
    rng = np.random.default_rng(3)
    for grp, k in ((ATTN_IN, 64), (ATTN_OUT, 64), (MLP_IN, 64), (MLP_OUT, 96)):
        s = jnp.asarray(rng.uniform(0.5, 2.0, k), jnp.float32)
        s_prev = s_fc = s
        if grp is ATTN_OUT:  # QuantLRM's GQA variant: v rows / downsampled, o columns * upsampled
            s_prev = downsample_vo(s, spec)
            s_fc = upsample_vo(s_prev, spec)
        p, caps = apply_scale(p, {grp.inp: jnp.ones((1, k))}, s_prev, s_fc, grp)
    np.testing.assert_allclose(np.asarray(lw.layer_forward(p, spec, x, pos)), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_packed_equals_fake_quant_forward(hf_checkpoint):
    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.ptq.awq import AWQOptions, awq_quantize_model
    from lrmq.ptq.exports import packed_kernels
    from lrmq.quant.qweight import dequantize
    from lrmq.quant.transforms import module_at

    d, _ = hf_checkpoint("olmo3")
    m = load_hf_model(d)
    toks = np.random.default_rng(0).integers(0, 128, (2, 32))
    r = awq_quantize_model(m, toks, AWQOptions(bits=4, group_size=32, n_grid=5, batch_size=2), progress=False)
    assert len(r.packed) == 7 * m.cfg.num_layers
    for path, qw in r.packed.items():  # bit for bit: packed dequantizes to the model's fake-quant kernel
        np.testing.assert_array_equal(np.asarray(dequantize(qw)), np.asarray(module_at(m, path).kernel.get_value()))
    fake = np.asarray(m(jnp.asarray(toks)))
    with packed_kernels(m, r):
        assert hasattr(module_at(m, "layers.0.attn.q_proj").kernel.get_value(), "codes")
        packed = np.asarray(m(jnp.asarray(toks)))
    np.testing.assert_allclose(packed, fake, rtol=1e-5, atol=1e-5)


def test_awq_beats_rtn_w3(structured):
    from lrmq.checkpoint.load import load_model
    from lrmq.ptq.awq import AWQOptions, awq_quantize_model, rtn_quantize_model

    ev = eval_blocks(structured)
    fp = ppl(load_model(structured["model"]), ev)
    rtn_m = load_model(structured["model"])
    rtn_quantize_model(rtn_m, bits=3, group_size=128)
    rtn = ppl(rtn_m, ev)
    awq_m = load_model(structured["model"])
    calib = calib_blocks(structured)
    r = awq_quantize_model(awq_m, calib, AWQOptions(bits=3, group_size=128), progress=False)
    awq = ppl(awq_m, ev)
    print(json.dumps({"fp": fp, "rtn_w3": rtn, "awq_w3": awq, "calib": list(calib.shape)}))
    assert fp < 8.0, "the structured model did not learn the synthetic text (vocab 96)"
    assert fp < awq < rtn  # measured: fp 3.795, AWQ 3.800, RTN 3.809
    ratios = [g["ratio"] for l in r.info["layers"].values() for g in l["groups"].values() if isinstance(g, dict)]
    assert any(x > 0 for x in ratios)
