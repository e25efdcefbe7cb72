"""QLoRA on mixture-of-experts expert weights (docs/moe.md, "Quantization in RL on MoE"): the experts packed per
expert (NF4) and frozen, stacked per-expert adapters (`ExpertLoRA`) on the same sorted rows, the router untouched;
one update trains the adapters only; merge; per-expert peft adapter names."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_train_config
from lrmq.checkpoint.load import TINY_MOE_DIR, load_model
from lrmq.quant.formats import dequantize, quantize_weight
from lrmq.quant.lora import ExpertLoRA, _drop, lora_linears, merge_lora
from lrmq.quant.qkernel import QuantizedExpertKernel, QuantizedKernel
from lrmq.quant.training import prepare_for_training, trainable_filter
from lrmq.rl.config import QuantSection

TOK = jnp.asarray(np.random.default_rng(2).integers(1, 300, (2, 12)), jnp.int32)
_forward = nnx.jit(lambda m, t: m(t))
EXPERT = "layers.0.mlp.experts.gate_proj"


@pytest.fixture(scope="module")
def qlora_moe():
    """tiny-moe (8 experts, top-2; layers 0 and 2 sparse) under quant.mode=qlora with the default targets."""
    model = load_model(TINY_MOE_DIR, dtype="float32", param_dtype="float32")
    return prepare_for_training(model, QuantSection(mode="qlora", lora_rank=4, lora_alpha=8.0), seed=0)


def _randomized(model, seed: int = 0):
    """A copy of `model` whose adapters' B are random (zero-init B makes every adapter a no-op)."""
    m = nnx.clone(model)
    for i, (_, lin) in enumerate(lora_linears(m)):
        b = lin.lora.b
        b.set_value(0.05 * jax.random.normal(jax.random.key(seed + i), b.get_value().shape, b.get_value().dtype))
    return m


def test_experts_are_packed_with_adapters_and_zero_b_gives_the_packed_base(qlora_moe):
    m = qlora_moe
    paths = [p for p, _ in lora_linears(m)]
    assert EXPERT in paths and "layers.2.mlp.experts.down_proj" in paths and len(paths) == 3 * 4 + 3 + 2 * 3  # attention, the dense MLP, the experts
    for layer in (0, 2):
        moe = m.layers[layer].mlp
        assert type(moe.router.kernel) is nnx.Param and moe.router.lora is None  # router: float, never adapted
        for name in ("gate_proj", "up_proj", "down_proj"):
            el = getattr(moe.experts, name)
            assert isinstance(el.kernel, QuantizedExpertKernel) and el.kernel.get_value().fmt == "nf4"
            lo = el.lora
            assert isinstance(lo, ExpertLoRA) and isinstance(lo.a, nnx.LoRAParam) and lo.scale == 2.0
            assert lo.a.get_value().shape == (8, el.in_features, 4) and lo.b.get_value().shape == (8, 4, el.out_features)
            assert not lo.b.get_value().any()
            bound = 1 / np.sqrt(el.in_features)  # LoRA's U(-1/sqrt(in), 1/sqrt(in)), drawn for every expert
            assert float(jnp.abs(lo.a.get_value()).max()) <= bound and float(jnp.abs(lo.a.get_value()[7]).max()) > bound / 2
    assert isinstance(m.layers[1].mlp.gate_proj.kernel, QuantizedKernel)  # the dense layer's MLP as before
    with_adapters = _forward(m, TOK)
    base = nnx.clone(m)
    for _, lin in lora_linears(base):
        lin.lora = None
    np.testing.assert_array_equal(np.asarray(with_adapters), np.asarray(_forward(base, TOK)))  # exactly
    assert not np.allclose(np.asarray(_forward(_randomized(m), TOK)), np.asarray(with_adapters), atol=1e-4)


def test_expert_adapter_is_each_experts_lora_on_its_rows():
    sizes = jnp.asarray([3, 0, 2, 5], jnp.int32)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(10, 16)), jnp.float32)
    lo = ExpertLoRA(4, 16, 6, rank=2, alpha=4.0, dropout=0.5, rngs=nnx.Rngs(0), salt=3)
    lo.b.set_value(jax.random.normal(jax.random.key(1), (4, 2, 6)))
    a, b = lo.a.get_value(), lo.b.get_value()
    ends = np.cumsum(np.asarray(sizes))
    expert = np.searchsorted(ends, np.arange(10), side="right")  # each row's expert
    want = np.stack([np.asarray(x[i] @ a[e] @ b[e]) * 2.0 for i, e in enumerate(expert)])
    np.testing.assert_allclose(np.asarray(lo(x, sizes)), want, rtol=1e-5, atol=1e-6)  # "train" mode: no dropout here
    np.testing.assert_allclose(np.asarray(lo.delta()), 2.0 * np.einsum("eir,ero->eio", a, b), rtol=1e-5, atol=1e-6)
    # differentiated: x dropped (the dense LoRA's counter-hash mask), the gradient of A is that of the dropped rows
    xd = _drop(x, 0.5, 0, 3)[0]
    graphdef, state = nnx.split(lo)
    g = jax.grad(lambda st: jnp.sum(jnp.sin(nnx.merge(graphdef, st)(x, sizes))))(state)["a"].get_value()
    g_ref = jax.grad(lambda a_: jnp.sum(jnp.sin(jax.lax.ragged_dot(jax.lax.ragged_dot(xd, a_, sizes), b, sizes) * 2.0)))(a)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(g[1]).max()) == 0.0 and float(jnp.abs(g[3]).max()) > 0  # expert 1 had no rows


def test_one_update_trains_the_expert_adapters_only(qlora_moe, tmp_path):
    from lrmq.rl.batch import RolloutBatch, padded_batch
    from lrmq.rl.step import make_optimizer, make_train_step

    cfg = tiny_train_config(str(tmp_path), model={"checkpoint": TINY_MOE_DIR}, quant={"mode": "qlora"},
                            rollout={"prompts_per_step": 2, "group_size": 2, "max_prompt_len": 6,
                                     "max_new_tokens": 6, "update_padding": "max"})
    model = nnx.clone(qlora_moe)
    cfg.check_model(model.cfg)
    tokens = np.asarray(np.random.default_rng(3).integers(1, 300, (4, 12)), np.int32)
    mask = np.ones_like(tokens)
    cmask = np.ones((4, 6), np.float32)
    rb = RolloutBatch(tokens=tokens, mask=mask, completion=tokens[:, 6:], completion_mask=cmask,
                      behaviour_logp=-2.0 * cmask, advantages=np.array([1.0, -1.0, 0.5, -0.5], np.float32),
                      rewards=np.zeros(4, np.float32))
    graphdef, trainable, rest = nnx.split(model, trainable_filter("qlora"), ...)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(trainable)}
    assert names and all(n.endswith(("lora.a", "lora.b")) for n in names)  # only adapters: no router, no codes
    assert f"{EXPERT}.lora.b" in names and not any("router" in n for n in names)
    tx, _ = make_optimizer(cfg)
    before = jax.tree.map(np.asarray, trainable)
    new, _, out = make_train_step(graphdef, cfg, tx)(jax.tree.map(jnp.copy, trainable), rest, tx.init(trainable),
                                                     jax.tree.map(jnp.asarray, padded_batch(rb)), None)
    assert np.isfinite(float(out["loss"]))
    b0, b1 = (np.asarray(t["layers"][0]["mlp"]["experts"]["gate_proj"]["lora"]["b"].get_value()) for t in (before, new))
    assert (np.abs(b1 - b0).reshape(8, -1).max(1) > 0).sum() >= 2  # the routed experts' adapters moved
    # rest (packed codes, router, norms) is not an output of the step: the base is frozen by construction


def test_merge_folds_each_experts_delta_into_its_dequantized_weight(qlora_moe):
    m = _randomized(qlora_moe)
    el = m.layers[2].mlp.experts.down_proj
    want = np.asarray(dequantize(el.kernel.get_value())) + np.asarray(el.lora.delta())
    # rollout.lora=merged: the rollout copy quantizes each expert's dequantized base + delta
    from lrmq.rl.rollout_copy import RolloutQuant, quantize_for_rollout

    copy = nnx.clone(m)
    quantize_for_rollout(copy, RolloutQuant("int4", group_size=64, targets=r".*experts\.down_proj$", merge_lora=True))
    packed = copy.layers[2].mlp.experts.down_proj
    assert isinstance(packed.kernel, QuantizedExpertKernel) and packed.lora is None
    want_q = quantize_weight(jnp.asarray(want), fmt="int", bits=4, group_size=64)
    np.testing.assert_array_equal(np.asarray(packed.kernel.get_value().codes), np.asarray(want_q.codes))
    y = _forward(m, TOK)
    assert EXPERT in merge_lora(m)
    assert type(el.kernel) is nnx.Param and el.lora is None
    np.testing.assert_allclose(np.asarray(el.kernel.get_value()), want, atol=1e-6)
    np.testing.assert_allclose(np.asarray(_forward(m, TOK)), np.asarray(y), atol=2e-5, rtol=1e-5)


def test_peft_files_name_every_expert_and_load_back(qlora_moe, tmp_path):
    from lrmq.checkpoint.peft import load_lora, lora_state, save_lora

    m = _randomized(qlora_moe)
    st = lora_state(m)
    name = "base_model.model.model.layers.0.mlp.experts.{}.{}.lora_{}.weight"
    assert st[name.format(7, "gate_proj", "A")].shape == (4, 128) and st[name.format(7, "gate_proj", "B")].shape == (64, 4)
    assert st[name.format(3, "down_proj", "A")].shape == (4, 64) and st[name.format(3, "down_proj", "B")].shape == (128, 4)
    np.testing.assert_array_equal(st[name.format(5, "up_proj", "B")],
                                  np.asarray(m.layers[0].mlp.experts.up_proj.lora.b.get_value()[5]).T)
    assert "base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight" in st  # the dense layer's MLP
    assert not any("router" in k or ".mlp.gate." in k for k in st)
    assert len(st) == 2 * (3 * 4 + 3 + 2 * 3 * 8)
    save_lora(m, str(tmp_path / "adapter"))
    cfg = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert cfg["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    fresh = nnx.clone(qlora_moe)
    load_lora(fresh, str(tmp_path / "adapter"))
    for (_, l1), (_, l2) in zip(lora_linears(m), lora_linears(fresh)):
        np.testing.assert_array_equal(np.asarray(l1.lora.a.get_value()), np.asarray(l2.lora.a.get_value()))
        np.testing.assert_array_equal(np.asarray(l1.lora.b.get_value()), np.asarray(l2.lora.b.get_value()))
