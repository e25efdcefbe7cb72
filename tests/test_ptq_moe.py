"""PTQ per expert on the shipped tiny Qwen3-MoE (lrmq/assets/tiny-moe: sparse / dense / sparse, 8 experts top-2):
GPTQ with llmcompressor's all-experts calibration (each expert's Hessian over every calibration token), the
routed alternative, RTN per expert, the router never quantized, and the compressed-tensors export's per-expert
tensors and ignore list (llmcompressor's names; benchmarks/ptq_moe_vs_llmcompressor.py compares them with
llmcompressor's own output)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from lrmq.checkpoint.load import load_model
from lrmq.model.config import ConfigError
from lrmq.ptq import export_formats as ef
from lrmq.ptq import layer_fn as lf
from lrmq.ptq.gptq import gptq_quantize
from lrmq.ptq.gptq_model import GPTQOptions, gptq_quantize_model, hessian
from lrmq.ptq.layerwise import embed_tokens, positions_for
from lrmq.quant.formats import dequantize, expert_slice, unpacked_codes

TOKS = np.random.default_rng(0).integers(0, 300, (2, 24)).astype(np.int32)
OPTS = GPTQOptions(bits=4, group_size=32, symmetric=True, act_order=True, static_groups=True, true_sequential=False,
                   batch_size=2)


@pytest.fixture(scope="module")
def float_moe():
    return load_model("tiny-moe")


@pytest.fixture(scope="module")
def gptq_moe():
    """(float layer-0 weights and input, GPTQ'd model, result): llmcompressor's settings (act-order static, one
    float forward per layer, all-experts calibration)."""
    model = load_model("tiny-moe")
    p0 = {k: np.asarray(v, np.float32) for k, v in lf.get_layer_params(model.layers[0]).items()}
    x0 = embed_tokens(model, TOKS)
    result = gptq_quantize_model(model, TOKS, OPTS, progress=False)
    return p0, x0, model, result


def test_gptq_per_expert_uses_every_token_and_keeps_the_router(gptq_moe):
    p0, x0, model, result = gptq_moe
    cfg = model.cfg
    assert [i for i in range(cfg.num_layers) if f"layers.{i}.mlp.experts.gate_proj" in result.packed] == [0, 2]
    assert "layers.1.mlp.gate_proj" in result.packed  # the dense layer between them
    assert not any("router" in k for k in result.packed)
    np.testing.assert_array_equal(np.asarray(model.layers[0].mlp.router.kernel.get_value()), p0["router"])
    # layer 0 by hand: gate/up of every expert GPTQ'd with the Hessian of mlp_in over ALL calibration tokens,
    # down_proj of expert e with silu(x Wg[e]) * (x Wu[e]) over all tokens (llmcompressor's calibrate_all_experts)
    _, caps = lf.layer_forward(p0, lf.layer_spec(cfg, 0), x0, positions_for(*TOKS.shape), capture=True)
    mlp_in = np.asarray(caps["mlp_in"])
    h_in = hessian(mlp_in)
    hid = np.asarray(lf.expert_hidden(mlp_in, p0["gate_proj"], p0["up_proj"]))
    kw = dict(bits=4, group_size=32, symmetric=True, act_order=True, static_groups=True)
    for name in ("gate_proj", "down_proj"):
        qw = result.packed[f"layers.0.mlp.experts.{name}"]
        assert qw.shape == p0[name].shape and qw.num_experts == cfg.num_experts
        w_model = np.asarray(getattr(model.layers[0].mlp.experts, name).kernel.get_value())
        np.testing.assert_array_equal(np.asarray(dequantize(qw)), w_model)  # the model holds the packed codes
        for e in (0, cfg.num_experts - 1):
            h = h_in if name == "gate_proj" else np.float32(2.0 / len(TOKS)) * (hid[e].T @ hid[e])
            ref = gptq_quantize(p0[name][e], h, **kw)
            np.testing.assert_allclose(np.asarray(dequantize(expert_slice(qw, e))), ref.w_q, atol=1e-6)


def test_routed_calibration_counts_only_routed_tokens(float_moe):
    """calibration.moe_experts=routed: expert e's Hessian sums over the tokens its router sends it (top-k of the
    router's softmax), so it differs from the all-token one and is zero for an expert no token reaches."""
    cfg = float_moe.cfg
    p0 = {k: np.asarray(v, np.float32) for k, v in lf.get_layer_params(float_moe.layers[0]).items()}
    x = np.random.default_rng(1).normal(size=(40, cfg.hidden_size)).astype(np.float32)
    kw = dict(top_k=cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob)
    mask = np.asarray(lf.expert_token_mask(x, p0["router"], calibration="routed", **kw))
    assert mask.shape == (cfg.num_experts, 40) and (mask.sum(0) == cfg.num_experts_per_tok).all()
    routed = np.asarray(lf.expert_mlp_in_xtx(x, p0["router"], calibration="routed", **kw))
    every = np.asarray(lf.expert_mlp_in_xtx(x, p0["router"], calibration="all", **kw))
    for e in range(cfg.num_experts):
        sel = x[mask[e] > 0]
        np.testing.assert_allclose(routed[e], sel.T @ sel, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(every[e], x.T @ x, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="'all' or 'routed'"):
        lf.expert_token_mask(x, p0["router"], calibration="some", **kw)
    # the whole model with routed statistics and lrmq's own GPTQ defaults (true-sequential stages, asymmetric): the
    # down stage's expert Hessians come from the already-quantized gate/up
    model = load_model("tiny-moe")
    result = gptq_quantize_model(model, TOKS[:1], GPTQOptions(group_size=32, moe_calibration="routed", batch_size=1),
                                 progress=False)
    qw = result.packed["layers.2.mlp.experts.down_proj"]
    assert qw.num_experts == cfg.num_experts and not qw.symmetric
    np.testing.assert_array_equal(np.asarray(dequantize(qw)),
                                  np.asarray(model.layers[2].mlp.experts.down_proj.kernel.get_value()))


def test_rtn_per_expert_and_compressed_tensors_names(tmp_path):
    """RTN quantizes each expert's slice as a Linear alone; the compressed-tensors export writes llmcompressor's
    per-expert tensors (model.layers.N.mlp.experts.E.*_proj.weight_packed / weight_scale / weight_shape
    [/ weight_zero_point]) and its ignore list (the routers by name in module order, lm_head last)."""
    from lrmq.ptq.exports import save_compressed_tensors
    from lrmq.ptq.rtn import quantize_linear, rtn_quantize_model
    from safetensors.numpy import load_file

    model = load_model("tiny-moe")
    w = np.asarray(model.layers[2].mlp.experts.up_proj.kernel.get_value())
    router = np.asarray(model.layers[2].mlp.router.kernel.get_value())
    result = rtn_quantize_model(model, bits=4, group_size=64, symmetric=False)
    qw = result.packed["layers.2.mlp.experts.up_proj"]
    _, ref = quantize_linear(w[5], 4, 64, False)
    for f in ("codes", "scales", "zeros"):
        np.testing.assert_array_equal(np.asarray(getattr(expert_slice(qw, 5), f)), np.asarray(getattr(ref, f)))
    np.testing.assert_array_equal(np.asarray(model.layers[2].mlp.router.kernel.get_value()), router)
    out = save_compressed_tensors(model, result, str(tmp_path / "ct"), dtype="float32")
    t = load_file(os.path.join(out, "model.safetensors"))
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert qc["ignore"] == ["model.layers.0.mlp.gate", "model.layers.2.mlp.gate", "lm_head"]
    pre = "model.layers.2.mlp.experts.5.up_proj."
    assert {k[len(pre):] for k in t if k.startswith(pre)} == {"weight_packed", "weight_scale", "weight_shape",
                                                              "weight_zero_point"}
    assert t["model.layers.2.mlp.gate.weight"].shape == (8, 128) and not any(".experts.8." in k for k in t)
    codes, scales, zeros, _ = ef.ct_pack_quantized_import({k[len(pre):]: v for k, v in t.items() if k.startswith(pre)},
                                                          bits=4, symmetric=False)
    np.testing.assert_array_equal(codes, np.asarray(unpacked_codes(expert_slice(qw, 5))))  # expert 5's own codes
    np.testing.assert_array_equal(scales, np.asarray(expert_slice(qw, 5).scales))
    # read back (lrmq.checkpoint.quantized): each projection's experts stacked into one QuantizedExpertKernel; its
    # logits are the packed model's written (the PTQ result's kernels swapped in), exactly in float32
    import re

    from conftest import jit_forward
    from lrmq.checkpoint.hf import CheckpointError
    from lrmq.quant.qkernel import QuantizedExpertKernel
    from lrmq.quant.transforms import module_at, set_packed_expert_kernel, set_packed_kernel
    from safetensors.numpy import save_file

    back = load_model(out)
    assert isinstance(back.layers[2].mlp.experts.up_proj.kernel, QuantizedExpertKernel)
    for f in ("codes", "scales", "zeros"):
        np.testing.assert_array_equal(np.asarray(getattr(back.layers[2].mlp.experts.up_proj.kernel.get_value(), f)),
                                      np.asarray(getattr(qw, f)))
    for path, packed in result.packed.items():
        (set_packed_expert_kernel if len(packed.shape) == 3 else set_packed_kernel)(module_at(model, path), packed)
    np.testing.assert_allclose(np.asarray(jit_forward(back, TOKS)), np.asarray(jit_forward(model, TOKS)), rtol=0,
                               atol=1e-6)
    save_file({k: v for k, v in t.items() if k != pre + "weight_scale"}, os.path.join(out, "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{out}/model.safetensors: missing {pre}weight_scale \(expert 5 of "
                                              r"layers.2.mlp.experts.up_proj, compressed-tensors pack-quantized"):
        load_model(out)
    # compressed-tensors "dense" (llmcompressor's save_compressed=False): each expert's fake-quant float weight read,
    # its weight_scale / weight_zero_point skipped -- a float model with the packed model's logits
    dense = {k: v for k, v in t.items() if not k.endswith((".weight_packed", ".weight_shape"))}
    for hf in [k[: -len(".weight_packed")] for k in t if k.endswith(".weight_packed")]:
        m = re.fullmatch(r"model\.(layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)", hf)
        lin = module_at(back, f"{m[1]}.{m[3]}" if m else hf.removeprefix("model.").replace("self_attn", "attn"))
        w = np.asarray(lin.float_weight())
        dense[f"{hf}.weight"] = np.ascontiguousarray((w[int(m[2])] if m else w).T)
    save_file(dense, os.path.join(out, "model.safetensors"))
    c = json.load(open(os.path.join(out, "config.json")))
    c["quantization_config"].update(format="dense", quantization_status="frozen")
    c["quantization_config"]["config_groups"]["group_0"]["format"] = "dense"
    json.dump(c, open(os.path.join(out, "config.json"), "w"))
    fq = load_model(out)
    assert not isinstance(fq.layers[2].mlp.experts.up_proj.kernel, QuantizedExpertKernel)
    np.testing.assert_allclose(np.asarray(jit_forward(fq, TOKS)), np.asarray(jit_forward(back, TOKS)), rtol=0,
                               atol=1e-5)
    # pack-quantized with one expert left float: that projection's experts dequantized once into a float kernel
    pre3 = "model.layers.2.mlp.experts.3.down_proj."
    mixed = {k: v for k, v in t.items() if not k.startswith(pre3)}
    mixed[pre3 + "weight"] = dense[pre3 + "weight"]
    save_file(mixed, os.path.join(out, "model.safetensors"))
    c["quantization_config"].update(format="pack-quantized", quantization_status="compressed")
    c["quantization_config"]["config_groups"]["group_0"]["format"] = "pack-quantized"
    json.dump(c, open(os.path.join(out, "config.json"), "w"))
    mx = load_model(out)
    assert isinstance(mx.layers[0].mlp.experts.down_proj.kernel, QuantizedExpertKernel)
    np.testing.assert_array_equal(np.asarray(mx.layers[2].mlp.experts.down_proj.kernel.get_value()),
                                  np.asarray(back.layers[2].mlp.experts.down_proj.float_weight()))
    # NF4 per expert: expert e's blocks are those of NF4-quantizing its slice alone (bitsandbytes, double quant)
    from lrmq.ptq.rtn import nf4_quantize_model
    from lrmq.quant.formats import quantize_weight

    model = load_model("tiny-moe")
    w = np.asarray(model.layers[0].mlp.experts.down_proj.kernel.get_value())
    nf4 = nf4_quantize_model(model, block_size=64).packed["layers.0.mlp.experts.down_proj"]
    ref = quantize_weight(w[3], fmt="nf4", bits=4, block_size=64, double_quant=True)
    assert nf4.fmt == "nf4" and nf4.num_experts == 8
    for f, v in ref.arrays().items():
        np.testing.assert_array_equal(np.asarray(getattr(expert_slice(nf4, 3), f)), np.asarray(v))


def test_moe_refusals():
    """A format that does not write experts, and a group size that does not divide an expert's K, are refused
    before anything is read, naming the tensor; every method passes (awq / quantlrm per expert included)."""
    from lrmq.ptq.config import OutputsSection, QuantizeConfig
    from lrmq.ptq.pipeline import check_moe, model_config, resolve_model_path

    path = resolve_model_path("tiny-moe")
    mcfg = model_config(path)
    with pytest.raises(ConfigError, match=r"--group-size 128 does not divide layers.0.mlp.experts.down_proj's "
                                          r"input size K=64"):
        check_moe(QuantizeConfig(model=path, method="gptq", group_size=128), mcfg, path, {"group_size": "--group-size"})
    with pytest.raises(ConfigError, match=r"with dense layers \[1\]; the autoawq format keeps its routers float"):
        check_moe(QuantizeConfig(model=path, method="gptq", group_size=64, outputs=OutputsSection(formats=["autoawq"])),
                  mcfg, path)
    for method in ("gptq", "awq", "quantlrm", "rtn"):
        check_moe(QuantizeConfig(model=path, method=method, group_size=64), mcfg, path)


def test_checkpoint_source_reads_sparse_and_dense_layers(float_moe):
    """The streamed run's source (layer by layer from the checkpoint) gives each layer's weights as the loaded
    model holds them: a sparse layer's router and stacked experts, the dense layer's MLP."""
    from lrmq.checkpoint.load import resolve_checkpoint
    from lrmq.ptq.source import CheckpointSource

    src = CheckpointSource(resolve_checkpoint("tiny-moe"))
    for i in (0, 1):
        got = src.layer(i)
        want = {k: np.asarray(v, np.float32) for k, v in lf.get_layer_params(float_moe.layers[i]).items()}
        assert sorted(got) == sorted(want) and ("router" in got) == (i != 1)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


@pytest.fixture(scope="module")
def awq_moe():
    """(float layer-0 weights and input, AWQ'd model, result): AWQ W4 g32 per expert, all-experts calibration."""
    from lrmq.ptq.awq import AWQOptions, awq_quantize_model

    model = load_model("tiny-moe")
    p0 = {k: np.asarray(v, np.float32) for k, v in lf.get_layer_params(model.layers[0]).items()}
    x0 = embed_tokens(model, TOKS)
    result = awq_quantize_model(model, TOKS, AWQOptions(group_size=32, batch_size=2), progress=False)
    return p0, x0, model, result


def test_awq_per_expert_folds_exactly_and_beats_rtn(awq_moe):
    """AWQ on a sparse layer (llmcompressor's Qwen3-MoE mappings): one norm -> router + every expert's gate/up scale,
    the router's rows multiplied by it and left float; one up -> down scale per expert. Folding the chosen scales into
    the float weights keeps the layer's function (routing included); the quantized layer is closer to the float one
    than RTN of the same weights."""
    from lrmq.ptq.awq import MLP_IN, fold_expert_scales, fold_scale
    from lrmq.ptq.rtn import quantize_experts, quantize_linear

    p0, x0, model, result = awq_moe
    pos = positions_for(*TOKS.shape)
    s_in = result.scales[0]["mlp_in"][1]
    s_out = result.scales[0]["mlp_out"][1]
    assert s_out.shape == (8, 64) and len(set(result.info["layers"][0]["groups"]["mlp_out"]["ratio"])) > 1
    assert not any("router" in k for k in result.packed)
    assert result.packed["layers.0.mlp.experts.down_proj"].codes.ndim == 3
    folded = fold_expert_scales(fold_scale(p0, s_in, s_in, MLP_IN), s_out)
    np.testing.assert_allclose(np.asarray(model.layers[0].mlp.router.kernel.get_value()), folded["router"], rtol=1e-6)
    y0 = np.asarray(lf.layer_forward(p0, _spec0(model), x0, pos))
    np.testing.assert_allclose(np.asarray(lf.layer_forward(folded, _spec0(model), x0, pos)), y0, atol=2e-5)
    unrouted = dict(folded, router=p0["router"])  # the router left unscaled: its input changed, routing moves
    assert np.abs(np.asarray(lf.layer_forward(unrouted, _spec0(model), x0, pos)) - y0).max() > 1e-3
    awq = {k: np.asarray(v, np.float32) for k, v in lf.get_layer_params(model.layers[0]).items()}
    rtn = dict(p0)
    for k in lf.LINEARS:
        rtn[k] = (quantize_experts if p0[k].ndim == 3 else quantize_linear)(p0[k], 4, 32, False)[0]
    err = lambda p: float(np.mean((np.asarray(lf.layer_forward(p, _spec0(model), x0, pos)) - y0) ** 2))  # noqa: E731
    assert err(awq) < err(rtn)


def _spec0(model):
    return lf.layer_spec(model.cfg, 0)


def test_quantlrm_importance_per_expert(float_moe):
    """QuantLRM over expert dW: a stacked-experts pair's importance is the dense function of each expert's slice; the
    per-expert up -> down search gets each expert's down_proj importance, the shared norm -> gate/up scale their
    mean over experts."""
    from lrmq.ptq.awq import MLP_IN, MLP_OUT
    from lrmq.ptq.importance import global_stats, pair_importance
    from lrmq.ptq.quantlrm import importance_stat_fn

    base = np.asarray(float_moe.layers[0].mlp.experts.down_proj.kernel.get_value(), np.float32)
    ft = base.copy()
    rng = np.random.default_rng(1)
    ft[3] += rng.normal(0, 1e-3, ft[3].shape).astype(np.float32) * (rng.random(ft[3].shape) < 0.7)
    ft[5, :10] += 1e-2
    stats = global_stats([("layers.0.mlp.experts.down_proj", ft, base)], stats_targets=("down_proj",))
    imp = pair_importance(ft, base, stats)
    assert imp.shape == (8, 64)
    for e in range(8):
        np.testing.assert_array_equal(imp[e], pair_importance(ft[e], base[e], stats))
    assert not np.array_equal(imp[3], imp[0])

    class Ctx:
        index, cfg = 0, float_moe.cfg

    gate = np.random.default_rng(2).random((8, 128)).astype(np.float32)
    fn = importance_stat_fn({"layers.0.mlp.experts.down_proj": imp, "layers.0.mlp.experts.gate_proj": gate})
    np.testing.assert_array_equal(fn(Ctx, MLP_OUT, None), imp)
    np.testing.assert_allclose(fn(Ctx, MLP_IN, np.zeros((1, 2, 128), np.float32)), gate.mean(axis=0))


def test_awq_expert_statistic_over_all_or_routed_tokens(float_moe):
    """AWQ's up -> down statistic per expert: mean |h_e| over every token (all) or over the tokens routed to expert e
    (routed: top-k of the router), with the token counts; an expert routed no token gets a zero statistic."""
    from lrmq.model.moe import route
    from lrmq.ptq.awq import AWQOptions, expert_activation_stat
    from lrmq.ptq.shard import UnitRunner, ptq_mesh

    cfg = float_moe.cfg
    p = {k: np.asarray(v, np.float32) for k, v in lf.get_layer_params(float_moe.layers[0]).items()}
    x = np.random.default_rng(3).normal(0, 1, (2, 24, cfg.hidden_size)).astype(np.float32)

    class Ctx:
        runner = UnitRunner(ptq_mesh(1), 2, 1)

    Ctx.cfg = cfg
    h = np.abs(np.asarray(lf.expert_hidden(x, p["gate_proj"], p["up_proj"])))  # [E, 48, F]
    stat, count = expert_activation_stat(Ctx, p, x, AWQOptions(moe_calibration="all"))
    np.testing.assert_allclose(stat, h.mean(axis=1), rtol=1e-5)
    assert count.tolist() == [48.0] * 8
    _, chosen = route(x.reshape(-1, cfg.hidden_size) @ p["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    chosen = np.asarray(chosen)
    stat, count = expert_activation_stat(Ctx, p, x, AWQOptions(moe_calibration="routed"))
    for e in range(8):
        rows = (chosen == e).any(axis=1)
        assert count[e] == rows.sum()
        np.testing.assert_allclose(stat[e], h[e, rows].mean(axis=0) if rows.any() else 0, rtol=1e-5, atol=1e-7)
