"""Expert parallelism (docs/moe.md, "Expert parallelism"): the `expert` mesh axis and its config, and the
expert-parallel `Experts` on 8 forced CPU devices (tests/expert_parallel_check.py): loss and gradients equal the
single-device ones, tokens dispatched by all-to-all, and the decode loop moves no weight."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from lrmq.configlib import ConfigError
from lrmq.sharding import (DECODE_RULES, EXPERT_AXIS, MeshConfig, batch_divisor, logical_to_spec, make_mesh,
                           mesh_axes, use_rules)


def test_expert_mesh_axis_and_config(tmp_path):
    from conftest import tiny_train_config

    # no expert axis unless asked: the (data, fsdp, tensor) mesh every config had, the tuple form too
    assert make_mesh((1, 1, 1)).axis_names == ("data", "fsdp", "tensor")
    assert mesh_axes(MeshConfig(1, 1, 1, 4)) == ("data", "fsdp", "tensor", EXPERT_AXIS)
    with pytest.raises(ValueError, match=r"'expert': 4\} needs 4 devices, have 1"):
        make_mesh((1, 1, 1, 4))
    mesh = AbstractMesh((2, 2, 1, 4), mesh_axes(MeshConfig(2, 2, 1, 4)))
    assert batch_divisor(mesh) == 16  # rows split over data x fsdp x expert
    assert batch_divisor(AbstractMesh((2, 2, 1), ("data", "fsdp", "tensor"))) == 4
    # stacked expert kernels: experts over the expert axis, the model dimension over fsdp (training) or whole and
    # the hidden one over tensor x fsdp (decode); other weights' model dimension over fsdp x expert
    assert logical_to_spec(("expert", "embed", "mlp"), (8, 64, 32), mesh) == P("expert", "fsdp", None)
    assert logical_to_spec(("expert", "embed", "mlp"), (8, 64, 32), mesh, DECODE_RULES) == P("expert", None, "fsdp")
    assert logical_to_spec(("embed", "mlp"), (64, 32), mesh) == P(("fsdp", "expert"), None)
    assert logical_to_spec(("expert", "embed", "mlp"), (6, 64, 32), mesh) == P(None, ("fsdp", "expert"), None)
    assert logical_to_spec(("embed",), (64,), AbstractMesh((2, 2, 1), ("data", "fsdp", "tensor"))) == P("fsdp")

    assert tiny_train_config(str(tmp_path)).mesh.expert == 1
    cfg = tiny_train_config(str(tmp_path), mesh={"expert": 4, "fsdp": 1})
    assert cfg.mesh.expert == 4
    with pytest.raises(ConfigError, match="mesh.experts"):
        tiny_train_config(str(tmp_path), mesh={"experts": 4})
    with pytest.raises(ConfigError, match="mesh.expert"):
        tiny_train_config(str(tmp_path), mesh={"expert": 0})
    with pytest.raises(ConfigError, match="mesh.data x mesh.fsdp x mesh.expert"):  # 16 sequences over 32 chips
        tiny_train_config(str(tmp_path), mesh={"expert": 32, "fsdp": 1})

    from lrmq.rl.placement import placement_meshes

    learner, sampler = placement_meshes(tiny_train_config(str(tmp_path)), jax.devices())
    assert learner.axis_names == ("data", "fsdp", "tensor") and sampler is learner
    with pytest.raises(ConfigError, match="mesh.expert.*needs 4 devices"):
        placement_meshes(cfg, jax.devices())  # 4 experts' chips on this 1-device host


def test_packed_experts_under_an_expert_axis_split_whole_groups():
    """Packed experts under an expert axis (the multi-device run checks their numbers): each array's leading expert
    dim over `expert`, the hidden (`mlp`) dim over the tensor axes only where every chip keeps whole groups (int4 /
    int8 codes); otherwise the plan gathers the hidden dim (`mlp=()`) rather than cutting a group."""
    from flax import nnx

    from lrmq.model.config import ModelConfig
    from lrmq.model.moe import Experts, _expert_plan
    from lrmq.quant.formats import quantize_weight
    from lrmq.quant.qmatmul import expert_shard
    from lrmq.quant.transforms import set_packed_expert_kernel

    cfg = ModelConfig.from_hf_dict(dict(model_type="qwen3_moe", vocab_size=64, hidden_size=64, intermediate_size=64,
                                        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=32, max_position_embeddings=64), dtype="float32")
    experts = Experts(cfg, nnx.Rngs(0))
    mesh = AbstractMesh((1, 1, 2, 4), mesh_axes(MeshConfig(1, 1, 2, 4)))
    w = experts.down_proj.kernel.get_value()  # [4, 32 (mlp), 64]
    q16 = quantize_weight(w, group_size=16)
    specs, shape = expert_shard(q16, ("expert", "mlp", "embed"), mesh, "expert", ("tensor",))
    assert shape == (1, 16, 64) and specs.codes == P("expert", "tensor", None) and specs.scales == P("expert", "tensor",
                                                                                                       None)
    # one group of 32 over 2 chips, NF4's flat blocks: no hidden split; the expert split alone always works
    assert expert_shard(quantize_weight(w, group_size=32), ("expert", "mlp", "embed"), mesh, "expert", ("tensor",)) is None
    nf4 = quantize_weight(w, fmt="nf4", block_size=32)
    assert expert_shard(nf4, ("expert", "mlp", "embed"), mesh, "expert", ("tensor",)) is None
    assert expert_shard(nf4, ("expert", "mlp", "embed"), mesh, "expert", ())[1] == (1, 32, 64)
    with jax.sharding.use_abstract_mesh(mesh), use_rules(DECODE_RULES):
        assert _expert_plan(experts, 8).mlp == ("tensor",)  # float kernels: hidden split over tensor
        set_packed_expert_kernel(experts.down_proj, q16)
        assert _expert_plan(experts, 8).mlp == ("tensor",)  # int4 g16: two whole groups a chip
        set_packed_expert_kernel(experts.up_proj, quantize_weight(experts.up_proj.kernel.get_value(), fmt="nf4",
                                                                  block_size=32))
        plan = _expert_plan(experts, 8)
        assert plan is not None and plan.mlp == ()  # an NF4 projection: the hidden dim gathered, not refused


def test_expert_parallel_matches_one_device(multi_device_run):
    r = multi_device_run("expert_parallel_check.py", timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-3000:] + r.stderr[-3000:]
