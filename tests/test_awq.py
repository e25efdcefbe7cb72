"""AWQ at model level: functional layer parity, scale groups, packed == fake-quant, AWQ beats RTN.

The "structured" tiny model (Qwen3 shape, hidden 256 / intermediate 512 so group 128 divides K) is
trained for 150 steps on synthetic arithmetic text, then given activation-outlier channels by a
function-preserving rescale (`plant_outlier_channels`). Random weights have no activation outliers and
would make AWQ-vs-RTN meaningless; the trained model alone has too few (W3 g128 over 62 windows: RTN
3.751 vs FP 3.742 ppl, 3.5 standard errors; AWQ, GPTQ within 1.5 SE of FP). It is built once per
session (other PTQ test files import `structured_model`).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrmq.ptq import layer_fn
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
    """{"model": HF dir, "calib": jsonl, "eval": txt} -- trained once per test run, whichever worker asks first
    (test_awq.py and test_gptq_model.py may run on different xdist workers)."""
    from conftest import built_once_per_run

    if not _CACHE:
        root = built_once_per_run(tmp_path_factory, "ptq_structured", _build_structured)
        _CACHE.update(model=os.path.join(root, "hf"), calib=os.path.join(root, "calib.jsonl"),
                      eval=os.path.join(root, "eval.txt"), root=root)
    return _CACHE


def _build_structured(root: str) -> None:
    from conftest import xla_optimized
    from lrmq.checkpoint.hf import save_hf_model
    from lrmq.data.synthetic import make_splits, write_jsonl
    from lrmq.model.config import ModelConfig, RopeConfig
    from lrmq.model.decoder import Decoder
    from lrmq.ptq.pseudo_ft import PseudoFTOptions, sft
    from lrmq.tokenizer import Tokenizer
    from flax import nnx

    train, held = make_splits(1500, 300, seed=3)
    doc = lambda r: f"{r['problem']} Answer: {r['solution']}"
    write_jsonl(os.path.join(root, "calib.jsonl"), [{"text": doc(r)} for r in train])
    with open(os.path.join(root, "eval.txt"), "w") as f:
        f.write("\n\n".join(doc(r) for r in held))
    mdir = os.path.join(root, "model")
    os.mkdir(mdir)
    _tokenizer(mdir, [doc(r) for r in train])
    tok = Tokenizer.from_dir(mdir)
    cfg = ModelConfig(family="qwen3", vocab_size=128, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64, qk_norm="head", layer_types=("full_attention",) * 2,
                      rope={"full_attention": RopeConfig(theta=10000.0)}, max_position_embeddings=512)
    model = Decoder(cfg, nnx.Rngs(0))
    ids = tok.encode("\n\n".join(doc(r) for r in train))
    seq = 128
    n = len(ids) // seq
    toks = np.asarray(ids[: n * seq], np.int32).reshape(n, seq)
    # 150 training steps: their run time, not the one compile, dominates (XLA's optimizations on: 50 -> 35 s of CPU)
    with xla_optimized():
        sft(model, toks, np.ones_like(toks, np.float32), PseudoFTOptions(steps=150, lr=3e-3, batch_size=8, seq_len=seq))
    probe = jnp.asarray(toks[:2])
    before = np.asarray(model(probe))
    plant_outlier_channels(model)
    np.testing.assert_allclose(np.asarray(model(probe)), before, rtol=1e-4, atol=1e-4)  # same function
    save_hf_model(model, os.path.join(root, "hf"), dtype="float32", tokenizer_from=mdir)


def plant_outlier_channels(model, frac=0.2, s=16.0, seed=0):
    """Give each layer the activation-outlier input channels of real LLMs (LLM.int8, AWQ section 3), keeping
    the function: for `frac` of the channels, multiply the norm scale feeding q/k/v (gate/up) by `s` and
    divide those input rows of q/k/v (gate/up) by `s`; likewise scale up_proj's output columns by `s` and
    down_proj's input rows by 1/s. Per-group RTN then rounds those tiny rows to zero and loses the channels;
    AWQ's scale search and GPTQ's Hessian weighting can keep them."""
    rng = np.random.default_rng(seed)
    d, f = model.cfg.hidden_size, model.cfg.intermediate_size

    def factors(n):
        v = np.ones(n, np.float32)
        v[rng.choice(n, int(frac * n), replace=False)] = s
        return jnp.asarray(v)

    for layer in model.layers:
        p = dict(layer_fn.get_layer_params(layer))
        for norm, linears in (("attn_norm", ("q_proj", "k_proj", "v_proj")), ("mlp_norm", ("gate_proj", "up_proj"))):
            v = factors(d)
            p[norm] = p[norm] * v
            for name in linears:
                p[name] = p[name] / v[:, None]
        v = factors(f)
        p["up_proj"], p["down_proj"] = p["up_proj"] * v[None, :], p["down_proj"] / v[:, None]
        layer_fn.set_layer_params(layer, p)


@pytest.fixture(scope="module")
def structured(tmp_path_factory):
    return structured_model(tmp_path_factory)


def eval_blocks(d, window=128):
    """All 62 held-out windows of 128 tokens (300 documents)."""
    from lrmq.perplexity import read_text, windows
    from lrmq.tokenizer import Tokenizer

    return windows(Tokenizer.from_dir(d["model"]).encode(read_text(d["eval"])), window)


def window_nll(model, blocks, batch_size=8) -> np.ndarray:
    """Mean next-token NLL of each window [n] (what lrmq.perplexity averages; kept per window here so that
    methods can be compared window by window, on the same text)."""
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def nll(state, tokens):
        logp = jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens).astype(jnp.float32)[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0], axis=1)

    n = len(blocks)
    padded = np.concatenate([blocks, blocks[:-n % batch_size]]) if n % batch_size else blocks  # one compiled shape
    return np.concatenate([np.asarray(nll(state, jnp.asarray(padded[i:i + batch_size])))
                           for i in range(0, len(padded), batch_size)])[:n]


def z_score(diff) -> float:
    """Mean of per-window differences over its standard error (windows as the independent samples)."""
    diff = np.asarray(diff, np.float64)
    return float(diff.mean() / (diff.std(ddof=1) / np.sqrt(len(diff))))


def calib_blocks(d, n_samples=64, block=128):
    from lrmq.ptq.calibration import awq_blocks, load_documents
    from lrmq.tokenizer import Tokenizer

    return awq_blocks(load_documents(d["calib"]), Tokenizer.from_dir(d["model"]), n_samples=n_samples,
                      block_size=block, max_doc_tokens=block)


# ----------------------------------------------------------------------------- tests


def _layer_checks(layer, x, pos, spec):
    """What test_functional_layer_matches_module compares for one layer: the module's output and the functional
    layer's (with its captured Linear inputs), and the layer rebuilt from those captures with the module's own
    Linears and norms (attention = o_proj(o_in), MLP = down_proj(down_in))."""
    ref, _ = layer(x, pos)
    out, caps = layer_fn.layer_forward(layer_fn.get_layer_params(layer), spec, x, pos, capture=True)
    attn = layer.attn.o_proj(caps["o_in"])
    pairs = {"out": (out, ref), "attn": (layer.attn(caps["attn_in"], pos)[0], attn)}
    if layer.post_norm:  # Olmo: x + norm(f(x))
        h = x + layer.attn_out_norm(attn)
        mlp = layer.mlp_out_norm(layer.mlp.down_proj(caps["down_in"]))
        pairs.update(attn_in=(caps["attn_in"], x), mlp_in=(caps["mlp_in"], h),
                     mlp=(layer.mlp_out_norm(layer.mlp(caps["mlp_in"])), mlp))
    else:  # x + f(norm(x))
        h = x + attn
        mlp = layer.mlp.down_proj(caps["down_in"])
        pairs.update(attn_in=(caps["attn_in"], layer.attn_norm(x)), mlp_in=(caps["mlp_in"], layer.mlp_norm(h)),
                     mlp=(layer.mlp(caps["mlp_in"]), mlp))
    pairs["sum"] = (h + mlp, ref)
    return pairs, jnp.abs(attn).max(), jnp.abs(mlp).max()


@pytest.mark.parametrize("variant", ["qwen3", "olmo3", "llama_linear"])
def test_functional_layer_matches_module(hf_checkpoint, variant):
    import functools

    from flax import nnx

    from lrmq.checkpoint.hf import load_hf_model

    d, _ = hf_checkpoint(variant)
    m = load_hf_model(d)
    toks = np.random.default_rng(0).integers(0, 128, (2, 16))
    x = lw.embed_tokens(m, toks)
    pos = jnp.asarray(lw.positions_for(2, 16))
    for i in range(m.cfg.num_layers):
        # one compiled program per layer, not op by op
        checks = nnx.jit(functools.partial(_layer_checks, spec=layer_fn.layer_spec(m.cfg, i)))
        pairs, attn_max, mlp_max = checks(m.layers[i], jnp.asarray(x, jnp.float32), pos)
        for name, (a, b) in pairs.items():
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{variant} layer {i} {name}")
        assert float(attn_max) > 1e-3 and float(mlp_max) > 1e-3  # both branches matter
        x = np.asarray(pairs["out"][1])


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
    from lrmq.ptq.layer_fn import LayerSpec

    spec = LayerSpec(post_norm=False, num_heads=4, num_kv_heads=2, head_dim=3)
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
    spec = layer_fn.layer_spec(m.cfg, 0)
    p = layer_fn.get_layer_params(m.layers[0])
    x = lw.embed_tokens(m, np.random.default_rng(2).integers(0, 128, (2, 16)))
    pos = lw.positions_for(2, 16)
    ref = layer_fn.layer_forward(p, spec, x, pos)
    caps = {}
    rng = np.random.default_rng(3)
    for grp, k in ((ATTN_IN, 64), (ATTN_OUT, 64), (MLP_IN, 64), (MLP_OUT, 96)):
        s = jnp.asarray(rng.uniform(0.5, 2.0, k), jnp.float32)
        s_prev = s_fc = s
        if grp is ATTN_OUT:  # QuantLRM's GQA variant: v rows / downsampled, o columns * upsampled
            s_prev = downsample_vo(s, spec)
            s_fc = upsample_vo(s_prev, spec)
        p, caps = apply_scale(p, {grp.inp: jnp.ones((1, k))}, s_prev, s_fc, grp)
    np.testing.assert_allclose(np.asarray(layer_fn.layer_forward(p, spec, x, pos)), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_packed_equals_fake_quant_forward(hf_checkpoint):
    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.ptq.awq import AWQOptions, awq_quantize_model
    from lrmq.ptq.exports import packed_kernels
    from lrmq.quant.formats import dequantize
    from lrmq.quant.transforms import module_at

    d, _ = hf_checkpoint("olmo3")
    m = load_hf_model(d)
    toks = np.random.default_rng(0).integers(0, 128, (2, 32))
    r = awq_quantize_model(m, toks, AWQOptions(bits=4, group_size=32, n_grid=5, batch_size=2), progress=False)
    assert len(r.packed) == 7 * m.cfg.num_layers
    for path, qw in r.packed.items():  # bit for bit: packed dequantizes to the model's fake-quant kernel
        np.testing.assert_array_equal(np.asarray(dequantize(qw)), np.asarray(module_at(m, path).kernel.get_value()))
    from flax import nnx

    forward = nnx.jit(lambda m, t: m(t))  # one compiled program per model structure, not op by op
    fake = np.asarray(forward(m, jnp.asarray(toks)))
    with packed_kernels(m, r):
        assert hasattr(module_at(m, "layers.0.attn.q_proj").kernel.get_value(), "codes")
        packed = np.asarray(forward(m, jnp.asarray(toks)))
    np.testing.assert_allclose(packed, fake, rtol=1e-5, atol=1e-5)


@pytest.mark.slow(reason="AWQ's scale search over every layer of the structured model, then both perplexities")
def test_awq_beats_rtn_w3(structured):
    from lrmq.checkpoint.load import load_model
    from lrmq.ptq.awq import AWQOptions, awq_quantize_model
    from lrmq.ptq.rtn import rtn_quantize_model

    ev = eval_blocks(structured)
    fp = window_nll(load_model(structured["model"]), ev)
    rtn_m = load_model(structured["model"])
    rtn_quantize_model(rtn_m, bits=3, group_size=128)
    rtn = window_nll(rtn_m, ev)
    awq_m = load_model(structured["model"])
    calib = calib_blocks(structured)
    r = awq_quantize_model(awq_m, calib, AWQOptions(bits=3, group_size=128), progress=False)
    awq = window_nll(awq_m, ev)
    z = {"rtn>fp": z_score(rtn - fp), "rtn>awq": z_score(rtn - awq),
         "awq recovers 3/4": z_score(0.25 * (rtn - fp) - (awq - fp))}
    print(json.dumps({"ppl": {k: float(np.exp(v.mean())) for k, v in (("fp", fp), ("rtn", rtn), ("awq", awq))},
                      "z": z, "windows": len(ev), "calib": list(calib.shape)}))
    assert np.exp(fp.mean()) < 8.0, "the structured model did not learn the synthetic text (vocab 96)"
    # Paired over the 62 eval windows (z = mean per-window NLL difference / its standard error). Measured:
    # ppl FP 3.7465, AWQ 3.7497, RTN 3.9699; RTN - FP 0.0579 nats (15.8 SE), RTN - AWQ 0.0571 (15.4 SE),
    # AWQ - FP 0.0009 (before the SFT ran XLA-optimized: 0.0013, 1.8 SE: AWQ is lossless within noise, so
    # "FP < AWQ" is not asserted; instead AWQ must keep its loss under a quarter of RTN's: 11.6 SE). A
    # threshold of 5 SE leaves 6+ SE for drift; AWQ without its scale search (clip only) failed the last check
    # at -15.6 SE. The margins depend on the SFT's batch order: PseudoFTOptions(seed=1) gave 7.9 / 7.1 / 3.4 SE,
    # seed=2 13.7 / 11.9 / 5.4 (seed 0, the one used, 15.8 / 15.4 / 11.6).
    assert z["rtn>fp"] > 5 and z["rtn>awq"] > 5 and z["awq recovers 3/4"] > 5, z
    ratios = [g["ratio"] for l in r.info["layers"].values() for g in l["groups"].values() if isinstance(g, dict)]
    assert any(x > 0 for x in ratios)
