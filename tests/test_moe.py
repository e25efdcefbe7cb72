"""Qwen3-MoE beyond logits parity (tests/test_hf_parity.py): top-k ties against torch.topk, the config fields
(both names of the expert count, transformers' sparse-layer rule, parameter counts), transformers 5's fused
expert layout read as the per-expert one, and quantization targets that never take a router and refuse experts."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from hf_fixtures import BASE, MOE_VARIANTS
from lrmq.checkpoint.hf import CheckpointError, flat_params, hf_tensors
from lrmq.checkpoint.load import load_model
from lrmq.model.config import ConfigError, ModelConfig
from lrmq.model.moe import route
from lrmq.quant.transforms import DEFAULT_TARGETS, iter_linears


def test_router_ties_choose_the_experts_transformers_chooses(hf_checkpoint):
    """Routers whose rows 0 = 1 and 2 = 3: every token's probabilities tie in pairs, the top 2 is one pair.
    torch.topk (CPU) and lrmq's `route` order a tied pair differently, and choose the same pair."""
    path, hf_model = hf_checkpoint("qwen3_moe_ties")
    tokens = torch.tensor(np.random.RandomState(0).randint(1, 128, (2, 12)))
    with torch.no_grad():
        logits = hf_model(tokens, output_router_logits=True).router_logits
    orders_differ = False
    for layer_logits in logits:
        probs = torch.softmax(layer_logits.float(), dim=-1)
        assert torch.equal(probs[:, 0], probs[:, 1]) and torch.equal(probs[:, 2], probs[:, 3])
        theirs = torch.topk(probs, 2).indices.numpy()
        weights, ours = route(jnp.asarray(layer_logits.numpy()), 2, normalize=False)
        ours = np.asarray(ours)
        np.testing.assert_array_equal(np.sort(ours, axis=-1), np.sort(theirs, axis=-1))
        assert (ours[:, 0] < ours[:, 1]).all()  # a tie goes to the lower expert index
        orders_differ |= bool((ours != theirs).any())
    assert orders_differ  # the case the test is about: torch's order among tied experts is not lrmq's
    # and the model's logits agree (tests/test_hf_parity.py checks them at 1e-4 on a padded batch)


def test_route_breaks_ties_by_lower_expert_index():
    logits = jnp.asarray([[1.0, 1.0, 1.0, 0.0], [0.0, 2.0, 2.0, 2.0], [3.0, 0.0, 3.0, 0.0]])
    weights, experts = route(logits, 2, normalize=False)
    np.testing.assert_array_equal(np.asarray(experts), [[0, 1], [1, 2], [0, 2]])
    assert experts.dtype == jnp.int32 and weights.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(weights)[0], np.exp(1) / (3 * np.exp(1) + 1), rtol=1e-6)
    renormed, _ = route(logits, 2, normalize=True)
    np.testing.assert_allclose(np.asarray(renormed), 0.5, rtol=1e-6)


def _hf_dict(variant):
    kw = dict(BASE, **MOE_VARIANTS[variant])
    kw.pop("router_ties", None)
    return kw


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen3_moe_step"])
def test_config_matches_transformers_layers_and_counts(variant, hf_checkpoint):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    path, hf_model = hf_checkpoint(variant)
    cfg = ModelConfig.from_hf_file(path)  # transformers 5 writes the expert count as num_local_experts
    assert cfg.family == "qwen3_moe" and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    sparse = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf_model.model.layers]
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == sparse and any(sparse) and not all(sparse)
    assert cfg.num_params() == sum(p.numel() for p in hf_model.parameters())
    active = cfg.num_params(active=True)
    assert active == cfg.num_params() - sum(sparse) * 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    # the published configs' name, and the refusals
    assert ModelConfig.from_hf_dict(_hf_dict(variant)).num_experts == 4
    with pytest.raises(ConfigError, match="num_experts=4 and num_local_experts=8 disagree"):
        ModelConfig.from_hf_dict(dict(_hf_dict(variant), num_local_experts=8))
    with pytest.raises(ConfigError, match="'moe_intermediate_size' is missing"):
        ModelConfig.from_hf_dict({k: v for k, v in _hf_dict(variant).items() if k != "moe_intermediate_size"})
    with pytest.raises(ConfigError, match=r"num_experts_per_tok=5 must be in \[1, num_experts=4\]"):
        ModelConfig.from_hf_dict(dict(_hf_dict(variant), num_experts_per_tok=5))
    with pytest.raises(ConfigError, match=r"mlp_only_layers \[7\]: layers \[7\] are not in \[0, "):
        ModelConfig.from_hf_dict(dict(_hf_dict(variant), mlp_only_layers=[7]))
    # a config built without a config.json writes one transformers reads back the same
    bare = ModelConfig.from_hf_dict(_hf_dict(variant)).replace(hf_config={})
    assert ModelConfig.from_hf_dict(bare.to_hf_dict()) == bare


def test_qwen3_30b_a3b_preset_counts_the_published_parameters():
    from lrmq.model.presets import preset_config

    cfg = preset_config("qwen3-30b-a3b")  # the model card: 30.5B parameters, 3.3B activated (3.35B here)
    assert round(cfg.num_params() / 1e9, 1) == 30.5 and round(cfg.num_params(active=True) / 1e9, 1) == 3.4
    assert all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def test_fused_expert_layout_reads_as_per_expert(hf_checkpoint, tmp_path):
    """transformers 5's own layout (save_pretrained(save_original_format=False): gate_up_proj [E, 2I, H],
    down_proj [E, H, I]) loads to the same parameters, and exports per expert, byte for byte the original's."""
    from safetensors import safe_open

    from lrmq.checkpoint.tensors import open_tensors

    path, hf_model = hf_checkpoint("qwen3_moe")
    fused = str(tmp_path / "fused")
    hf_model.save_pretrained(fused, save_original_format=False)
    with safe_open(f"{fused}/model.safetensors", "np") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)
    want = {k: np.asarray(v.get_value()) for k, v in flat_params(load_model(path)).items()}
    got_model = load_model(fused)
    got = {k: np.asarray(v.get_value()) for k, v in flat_params(got_model).items()}
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert got["layers.0.mlp.experts.gate_proj.kernel"].shape == (4, 64, 32)
    for ckpt in (fused, path):  # one tensor at a time: the stacked experts too, from either layout
        reader = open_tensors(ckpt)
        np.testing.assert_array_equal(reader.get("layers.2.mlp.experts.up_proj.kernel"),
                                      want["layers.2.mlp.experts.up_proj.kernel"])
        assert reader.stored("layers.2.mlp.experts.down_proj.kernel") == (
            "model.layers.2.mlp.experts.0.down_proj.weight", (64, 32))
    with safe_open(f"{path}/model.safetensors", "np") as f:
        original = {n: f.get_tensor(n) for n in f.keys()}
    exported = dict(hf_tensors(got_model))
    assert sorted(exported) == sorted(original)
    for n, arr in original.items():
        np.testing.assert_array_equal(exported[n], arr, err_msg=n)


def test_fused_expert_tensor_of_wrong_shape_is_named(hf_checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    path, hf_model = hf_checkpoint("qwen3_moe")
    fused = str(tmp_path / "fused")
    hf_model.save_pretrained(fused, save_original_format=False)
    tensors = load_file(f"{fused}/model.safetensors")
    tensors["model.layers.2.mlp.experts.gate_up_proj"] = tensors["model.layers.2.mlp.experts.gate_up_proj"][:3]
    save_file(tensors, f"{fused}/model.safetensors")
    with pytest.raises(CheckpointError, match=r"fused expert tensor model.layers.2.mlp.experts.gate_up_proj has "
                                              r"shape \(3, 64, 64\)"):
        load_model(fused)


def test_quantization_targets_skip_routers_and_refuse_experts(hf_checkpoint):
    model = load_model(hf_checkpoint("qwen3_moe_step")[0])
    assert "layers.1.mlp.router" in [p for p, _ in iter_linears(model, None)]  # inspection sees every Linear
    # a target never is one
    selected = [p for p, _ in iter_linears(model, r".*\.(router|q_proj)")]
    assert selected == ["layers.0.attn.q_proj", "layers.1.attn.q_proj"]
    attention = [p for p, _ in iter_linears(model, r".*\.(q|k|v|o)_proj$")]
    assert len(attention) == 8
    with pytest.raises(ValueError, match="selects the mixture-of-experts expert weights layers.1.mlp.experts"):
        iter_linears(model, DEFAULT_TARGETS)
    dense = [p for p, _ in iter_linears(model, r"layers\.0\..*")]  # layer 0 is dense: its MLP is a target
    assert "layers.0.mlp.gate_proj" in dense
    assert isinstance(model.layers[1].mlp.experts.gate_proj.kernel, nnx.Param)


def test_ptq_refuses_a_format_without_experts_in_one_line(hf_checkpoint):
    """PTQ per expert is every method (tests/test_ptq_moe.py); the autoawq format refuses a MoE checkpoint with dense
    layers (its router key would also match their mlp.gate_proj in AutoAWQ and vLLM)."""
    from lrmq.ptq.config import OutputsSection, QuantizeConfig
    from lrmq.ptq.pipeline import prepare

    path = hf_checkpoint("qwen3_moe_step")[0]
    with pytest.raises(ConfigError, match=r"a mixture-of-experts model with dense layers \[0\]; the autoawq format"):
        cfg = QuantizeConfig(model=path, method="awq", group_size=32, outputs=OutputsSection(formats=["autoawq"]))
        cfg.calibration.block_size = 64  # within the tiny random model's positions
        prepare(cfg)
