"""Quantized rollouts (rollout.quant): the packed copy of the policy equals what `lrmq.quantize` makes of the
same weights (RTN int8 / int4, NF4, AWQ scales, QLoRA merged), shares every other array with the policy, and
the engine decodes from it the tokens the PTQ model decodes; the config refuses combinations that cannot work."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from lrmq.configlib import ConfigError
from lrmq.generation.engine import Engine, EngineConfig
from lrmq.generation.sampling import SamplingConfig
from lrmq.model.config import ModelConfig, RopeConfig
from lrmq.model.decoder import Decoder
from lrmq.ptq.awq import AWQOptions, awq_quantize_model
from lrmq.ptq.rtn import nf4_quantize_model, rtn_quantize_model
from lrmq.quant.formats import dequantize
from lrmq.quant.lora import apply_lora
from lrmq.quant.qat import apply_qat
from lrmq.quant.training import pack_base
from lrmq.quant.transforms import iter_linears, module_at
from lrmq.rl.rollout_copy import RolloutCopy, RolloutQuant, awq_rollout_scales

from conftest import tiny_train_config

CFG = ModelConfig(family="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, qk_norm="head", layer_types=("full_attention",) * 2,
                  rope={"full_attention": RopeConfig(theta=10000.0)}, max_position_embeddings=128,
                  dtype="float32", param_dtype="float32")


def _model(seed=0):
    return Decoder(CFG, nnx.Rngs(seed))


def _copy(model, spec, **kw):
    graphdef, trainable, rest = nnx.split(model, nnx.Param, ...)
    copy = RolloutCopy(graphdef, trainable, rest, spec, **kw)
    return copy, trainable, rest


def _packed(copy):
    """{module path: QuantizedWeight} of the copy's packed kernels."""
    return {".".join(map(str, p[:-1])): v.get_value() for p, v in nnx.to_flat_state(copy.packed)
            if p[-1] == "kernel"}


@pytest.mark.parametrize("fmt,bits,group", [("int4", 4, 32), ("int8", 8, -1), ("int4", 4, -1)])
def test_copy_is_lrmq_quantize_rtn(fmt, bits, group):
    model = _model()
    copy, tr, rest = _copy(model, RolloutQuant(fmt, group_size=group))
    copy.refresh(tr, rest)
    want = rtn_quantize_model(_model(), bits=bits, group_size=group).packed
    got = _packed(copy)
    assert sorted(got) == sorted(want) and len(got) == 14
    for path, qw in got.items():
        assert (qw.bits, qw.group_size) == (bits, want[path].group_size)
        np.testing.assert_array_equal(np.asarray(dequantize(qw)), np.asarray(dequantize(want[path])), err_msg=path)
        np.testing.assert_array_equal(np.asarray(qw.codes), np.asarray(want[path].codes), err_msg=path)


def test_copy_is_lrmq_quantize_nf4():
    model = _model()
    copy, tr, rest = _copy(model, RolloutQuant("nf4"))
    copy.refresh(tr, rest)
    want = nf4_quantize_model(_model()).packed
    for path, qw in _packed(copy).items():
        # the same 4-bit codes and double-quantized absmax codes; the absmax itself (code x scale + offset) is
        # computed inside the refresh's fused program, which may round it one ulp apart from the eager path
        for field in ("codes", "absmax_codes", "absmax_scales"):
            np.testing.assert_array_equal(np.asarray(getattr(qw, field)), np.asarray(getattr(want[path], field)),
                                          err_msg=f"{path}.{field}")
        np.testing.assert_allclose(np.asarray(dequantize(qw)), np.asarray(dequantize(want[path])), rtol=3e-7,
                                   atol=0, err_msg=path)


def test_refresh_follows_the_policy_and_shares_the_rest():
    model = _model()
    copy, tr, rest = _copy(model, RolloutQuant("int4", group_size=32))
    copy.refresh(tr, rest)
    before = np.asarray(dequantize(_packed(copy)["layers.0.mlp.up_proj"]))
    tr2 = jax.tree.map(lambda a: a * 1.5, tr)  # "an update"
    copy.refresh(tr2, rest)
    after = np.asarray(dequantize(_packed(copy)["layers.0.mlp.up_proj"]))
    w2 = np.asarray(module_at(nnx.merge(*nnx.split(model)), "layers.0.mlp.up_proj").kernel.get_value()) * 1.5
    assert not np.array_equal(before, after)
    np.testing.assert_allclose(after, w2, atol=np.abs(w2).max() / 7)  # int4: within one step of the grid
    packed, others = copy.states(tr2, rest)
    # the embedding and norms are the policy's own arrays (no copy), the projections are not there
    flat = dict(nnx.to_flat_state(others))
    assert ("embed", "embedding") in flat and flat[("embed", "embedding")].get_value() is \
        dict(nnx.to_flat_state(tr2))[("embed", "embedding")].get_value()
    assert not any(p[-1] == "kernel" and "proj" in str(p[-2]) for p in flat)
    b = copy.weight_bytes(tr2, rest)
    float_linears = sum(lin.kernel.get_value().nbytes for _, lin in iter_linears(model))
    assert b["packed"] < float_linears / 4  # int4 codes + f32 group scales / zeros of 32 rows


@pytest.mark.parametrize("qat", [False, True])
def test_engine_samples_from_the_copy_as_from_the_ptq_model(qat):
    model = _model(1)
    if qat:  # a QAT policy's copy packs its float master weights; the AQT dot_generals leave the copy
        apply_qat(model, "paper_int8")
    copy, tr, rest = _copy(model, RolloutQuant("int4", group_size=32))
    copy.refresh(tr, rest)
    ptq = _model(1)
    from lrmq.quant.training import quantize_linears
    quantize_linears(ptq, rtn_quantize_model(_model(1), bits=4, group_size=32).packed)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    greedy = SamplingConfig(greedy=True)
    eng = Engine(None, eos_ids=[95], pad_id=0, graphdef=copy.graphdef, model_cfg=CFG, config=EngineConfig(slots=4))
    got = eng.generate(copy.states(tr, rest), prompts, max_new_tokens=12, sampling=greedy)
    want = Engine(ptq, eos_ids=[95], pad_id=0, config=EngineConfig(slots=4)).generate(
        nnx.state(ptq), prompts, max_new_tokens=12, sampling=greedy)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    flt = Engine(_model(1), eos_ids=[95], pad_id=0, config=EngineConfig(slots=4)).generate(
        nnx.state(_model(1)), prompts, max_new_tokens=12, sampling=greedy)
    assert not np.allclose(got.logprobs, flt.logprobs, atol=1e-5)  # the copy really is quantized


def test_awq_scales_fold_as_lrmq_quantize_awq():
    model = _model(2)
    tokens = np.random.default_rng(0).integers(1, CFG.vocab_size, (4, 32)).astype(np.int32)
    spec = RolloutQuant("int4", group_size=32)
    copy, tr, rest = _copy(model, spec, awq_scales=True)
    copy.scales = awq_rollout_scales(copy_graphdef := nnx.split(model, nnx.Param, ...)[0], tr, rest, tokens, spec)
    assert copy_graphdef is not None and set(copy.scales) == {"0", "1"}
    copy.refresh(tr, rest)
    want = awq_quantize_model(_model(2), tokens, AWQOptions(bits=4, group_size=32, clip=False), progress=False)
    got = _packed(copy)
    for path, qw in want.packed.items():
        np.testing.assert_allclose(np.asarray(dequantize(got[path])), np.asarray(dequantize(qw)), atol=1e-6,
                                   err_msg=path)
    # the folded norms travel with the copy: its forward is AWQ's fake-quant model's
    norms = {p for p, _ in nnx.to_flat_state(copy.packed) if "attn_norm" in p or "mlp_norm" in p}
    assert len(norms) == 4


def test_qlora_merged_copy_quantizes_base_plus_adapters():
    model = _model(3)
    pack_base(model, r".*\.(q|k|v|o|gate|up|down)_proj$", "nf4")
    apply_lora(model, rank=4, alpha=8.0, rngs=nnx.Rngs(params=1))
    for _, lin in iter_linears(model):  # non-zero adapters
        lin.lora.b.set_value(jnp.full(lin.lora.b.get_value().shape, 0.01))
    graphdef, tr, rest = nnx.split(model, nnx.LoRAParam, ...)
    with pytest.raises(ValueError, match="rollout.lora=merged"):
        RolloutCopy(graphdef, tr, rest, RolloutQuant("int4", group_size=32))
    copy = RolloutCopy(graphdef, tr, rest, RolloutQuant("int4", group_size=32, merge_lora=True))
    copy.refresh(tr, rest)
    lin = module_at(model, "layers.1.attn.o_proj")
    merged = np.asarray(lin.float_weight() + lin.lora.delta())
    from lrmq.ptq.rtn import quantize_linear
    fq, _ = quantize_linear(merged, 4, 32, False)
    # the merge (NF4 dequantization + a @ b) runs fused inside the refresh program: its rounding may differ from
    # the eager merge by an ulp, which moves a group's scale by as much (a code flip would be a full grid step)
    np.testing.assert_allclose(np.asarray(dequantize(_packed(copy)["layers.1.attn.o_proj"])), np.asarray(fq),
                               rtol=0, atol=1e-7)


def test_group_size_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"rollout.quant_group_size=48 does not divide layers.0.attn.\w_proj.s 64 input rows"):
        _copy(_model(), RolloutQuant("int4", group_size=48))


@pytest.mark.parametrize("sections,match", [
    (dict(rollout={"lora": "merged", "quant": "int4"}), "no adapters to merge under quant.mode=none"),
    (dict(rollout={"quant": "int4"}, quant={"mode": "qlora"}), "set rollout.lora=merged"),
    (dict(rollout={"lora": "merged"}, quant={"mode": "qlora"}), "needs a rollout.quant format"),
    (dict(rollout={"quant": "nf4", "quant_scales": "awq"}), "quant_scales=awq needs rollout.quant int8 or int4"),
    (dict(rollout={"quant_group_size": 0}), "rollout.quant_group_size"),
])
def test_config_refuses(tmp_path, sections, match):
    with pytest.raises(ConfigError, match=match):
        tiny_train_config(str(tmp_path), **sections)


def test_auto_correction_turns_on_with_a_quantized_rollout(tmp_path):
    rollout_correction = lambda cfg: cfg.loss_config().rollout_correction  # noqa: E731

    assert rollout_correction(tiny_train_config(str(tmp_path))) == "none"
    assert rollout_correction(tiny_train_config(str(tmp_path), rollout={"quant": "int8"})) == "sequence_mask"
    assert rollout_correction(tiny_train_config(str(tmp_path), rollout={"quant": "int8"},
                                                algo={"rollout_correction": "token_truncate"})) == "token_truncate"


def test_uncorrected_ratio_against_the_sampler_is_warned(tmp_path):
    from lrmq.rl.step import rollout_quant_warning

    cfg = lambda **a: tiny_train_config(str(tmp_path), **a)  # noqa: E731
    assert "old_logprobs=recompute" in rollout_quant_warning(
        cfg(rollout={"quant": "int4"}, algo={"rollout_correction": "none"}))
    assert rollout_quant_warning(cfg(rollout={"quant": "int4"})) is None  # auto: sequence_mask
    assert rollout_quant_warning(cfg(rollout={"quant": "int4"}, algo={"rollout_correction": "none",
                                                                     "old_logprobs": "recompute"})) is None
    assert rollout_quant_warning(cfg(algo={"rollout_correction": "none"})) is None  # the learner samples
    assert "rollout.max_staleness=2" in rollout_quant_warning(cfg(rollout={"max_staleness": 2},
                                                                  algo={"rollout_correction": "none"}))


@pytest.mark.slow(reason="three in-process GRPO steps with the int4 rollout copy packed and refreshed")
def test_trainer_samples_from_a_copy_refreshed_every_k_updates(tmp_path):
    """rollout.quant=int4, quant_refresh=2: the warm-up packs the initial policy (step 1 samples from it), the
    copy is re-quantized before step 3's rollout and not before step 2's; every step logs the mismatch between
    the int4 sampler and the float learner, and the copy's bytes."""
    import json

    from lrmq.rl.trainer import GRPOTrainer

    cfg = tiny_train_config(str(tmp_path), rollout={"quant": "int4", "quant_refresh": 2},
                            run={"steps": 3, "eval_size": 0, "save_every": 3})
    trainer = GRPOTrainer(cfg)
    trainer.train()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in rows if "perf/requantize_s" in r] == [3]
    for r in rows:
        assert r["train/mismatch/kl_k3"] > 0 and np.isfinite(r["train/mismatch/kl_k1"])
        assert r["train/mismatch/ppl_ratio"] != 1.0  # int4 sampling really differs from the learner
    float_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(trainer.learner.states()))
    assert rows[-1]["rollout/weight_bytes"] < 0.6 * float_bytes
    # The copy holds the RTN of the weights the third rollout saw (after two updates), not of the current ones.
    assert trainer.learner.version - trainer.learner.quantized_at == 1
