"""Expert parallelism on 8 forced CPU devices (run by tests/test_expert_parallel.py through `run_with_devices`):
tiny-moe's loss and its gradients under meshes with an `expert` axis equal the single-device ones (float32), for
the all-to-all dispatch (tokens split over the expert axis: training's batch rule), with the hidden dimension
split over `tensor` as well, and for the psum path (the decode rules: tokens split over `data` only); the
dispatching program's HLO exchanges tokens with all-to-all. Prints one line per case, then OK."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrmq.checkpoint.load import load_model
from lrmq.hlo import Module
from lrmq.model.moe import _expert_plan
from lrmq.sharding import DECODE_RULES, RULES, MeshConfig, make_mesh, shard_model, use_rules

assert jax.device_count() == 8, jax.device_count()
model = load_model("tiny-moe", dtype="float32", param_dtype="float32")
cfg = model.cfg
rng = np.random.RandomState(0)
tokens = jnp.asarray(rng.randint(1, cfg.vocab_size, (8, 12)), jnp.int32)
positions = jnp.broadcast_to(jnp.arange(12), tokens.shape)


def loss(model, tokens, positions):
    logits = model(tokens, positions).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def value_and_grad(model, mesh=None):
    gdef, state = nnx.split(model)
    fn = jax.jit(lambda st, t, p: jax.value_and_grad(lambda s: loss(nnx.merge(gdef, s), t, p))(st))
    if mesh is None:
        return fn(state, tokens, positions), None
    with jax.set_mesh(mesh):
        text = fn.lower(state, tokens, positions).compile().as_text()
        return fn(state, tokens, positions), text


(ref_loss, ref_grad), _ = value_and_grad(model)
leaves = lambda g: dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(g)))
ref = leaves(ref_grad)
cases = [("data2 x expert4 (all-to-all)", MeshConfig(2, 1, 1, 4), None, True),
         ("expert4 x tensor2 (all-to-all, hidden split)", MeshConfig(1, 1, 2, 4), None, True),
         ("data2 x expert4 under DECODE_RULES (psum)", MeshConfig(2, 1, 1, 4), DECODE_RULES, False)]
for name, mc, rules, dispatch in cases:
    mesh = make_mesh(mc)
    assert mesh.axis_names[-1] == "expert", mesh.axis_names
    sharded = shard_model(nnx.clone(model), mesh)
    kernel = sharded.layers[0].mlp.experts.gate_proj.kernel.get_value()
    assert kernel.sharding.spec[0] == "expert", kernel.sharding.spec
    if rules is None:
        (val, grad), text = value_and_grad(sharded, mesh)
    else:
        with use_rules(rules):
            (val, grad), text = value_and_grad(sharded, mesh)
    np.testing.assert_allclose(float(val), float(ref_loss), rtol=1e-5, err_msg=name)
    got = leaves(grad)
    assert got.keys() == ref.keys()
    worst = 0.0
    for path, g in ref.items():
        np.testing.assert_allclose(np.asarray(got[path]), np.asarray(g), rtol=2e-4, atol=2e-6,
                                   err_msg=f"{name}: {jax.tree_util.keystr(path)}")
        worst = max(worst, float(np.max(np.abs(np.asarray(got[path]) - np.asarray(g)))))
    ops = {c["op"] for c in Module(text).collectives(Module(text).entry)}
    with jax.set_mesh(mesh), use_rules(rules or RULES):
        plan = _expert_plan(sharded.layers[0].mlp.experts, tokens.size)
    assert plan is not None and plan.dispatch == dispatch, (name, plan)
    assert "all-to-all" in ops or not dispatch, (name, ops)
    print(f"{name}: loss {float(val):.6f} (single device {float(ref_loss):.6f}), largest gradient difference "
          f"{worst:.2e}, collectives {sorted(ops)}")

# Packed experts (int4 g32, as rollout.quant=int4 packs them) under the expert axis: each chip's local experts'
# QuantizedWeight through `qragged_dot`; logits equal one device's. Then expert adapters (qlora: ExpertLoRA on the packed experts), their factors split over the expert axis:
# loss and the adapters' gradients (the only trainable ones) equal one device's.
from lrmq.quant.formats import quantize_weight  # noqa: E402
from lrmq.quant.lora import apply_lora  # noqa: E402
from lrmq.quant.transforms import set_packed_expert_kernel  # noqa: E402

packed = nnx.clone(model)
for layer in packed.layers:
    if hasattr(layer.mlp, "experts"):
        for lin in (layer.mlp.experts.gate_proj, layer.mlp.experts.up_proj, layer.mlp.experts.down_proj):
            set_packed_expert_kernel(lin, quantize_weight(lin.kernel.get_value(), group_size=32))


def logits_of(model, mesh=None, rules=None):
    gdef, state = nnx.split(model)
    fn = jax.jit(lambda st, t, p: nnx.merge(gdef, st)(t, p).astype(jnp.float32))
    if mesh is None:
        return np.asarray(fn(state, tokens, positions))
    with jax.set_mesh(mesh), use_rules(rules or RULES):
        return np.asarray(fn(state, tokens, positions))


ref_logits = logits_of(packed)
for name, mc, rules in [("packed int4 g32, data2 x expert4 (all-to-all)", MeshConfig(2, 1, 1, 4), None),
                        ("packed int4 g32, data2 x expert4 under DECODE_RULES (psum)", MeshConfig(2, 1, 1, 4),
                         DECODE_RULES)]:
    mesh = make_mesh(mc)
    sharded = shard_model(nnx.clone(packed), mesh)
    assert sharded.layers[0].mlp.experts.up_proj.kernel.get_value().codes.sharding.spec[0] == "expert"
    with jax.set_mesh(mesh), use_rules(rules or RULES):
        plan = _expert_plan(sharded.layers[0].mlp.experts, tokens.size)
    assert plan is not None and plan.dispatch == (rules is None), (name, plan)
    assert plan.mlp == (("tensor",) if mc.tensor > 1 else ()), (name, plan)
    got = logits_of(sharded, mesh, rules)
    np.testing.assert_allclose(got, ref_logits, rtol=1e-5, atol=1e-5, err_msg=name)
    print(f"{name}: logits equal one device's (largest difference {np.max(np.abs(got - ref_logits)):.2e})")

# On a TPU target the per-chip call inside the shard_map is the grouped Pallas kernel (traced only: a jaxpr, no
# TPU here), not the XLA dequantize + ragged_dot fallback it takes under a mesh outside a shard_map.
import pallas_kernels as pk  # noqa: E402

mesh = make_mesh(MeshConfig(2, 1, 1, 4))
experts_mod = shard_model(nnx.clone(packed), mesh).layers[0].mlp.experts
xe = jnp.ones((16, cfg.hidden_size), jnp.float32)
ids = jnp.asarray(rng.randint(0, cfg.num_experts, (16, cfg.num_experts_per_tok)), jnp.int32)
for platform, want in (("tpu", True), ("cpu", False)):
    with pk.target(platform, "TPU v5" if platform == "tpu" else None), jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(lambda x: experts_mod(x, ids, jnp.full(ids.shape, 0.5)))(xe))
    assert "shard_map" in jaxpr and ("pallas_call" in jaxpr) == want, (platform, want)
print("packed experts under an expert axis on a TPU target: the grouped Pallas kernel inside the shard_map")

# qlora at the layer (layer 0's packed experts with rank-4 ExpertLoRA adapters, b nonzero): the output and the
# adapters' gradients (the only trainable ones) on 16 tokens equal one device's.
qlora = nnx.clone(packed.layers[0].mlp.experts)
assert len(apply_lora(qlora, r".*_proj$", rank=4, seed=0)) == 3
for i, lin in enumerate((qlora.gate_proj, qlora.up_proj, qlora.down_proj)):
    lin.lora.b.set_value(0.05 * jax.random.normal(jax.random.key(i), lin.lora.b.get_value().shape, jnp.float32))
route_w = jnp.asarray(rng.uniform(0.1, 1.0, ids.shape), jnp.float32)
xq = jnp.asarray(rng.normal(size=(16, cfg.hidden_size)), jnp.float32)


def adapter_value_and_grad(module, mesh=None):
    gdef, lp, rest = nnx.split(module, nnx.LoRAParam, ...)
    f = lambda l, r, x: jnp.mean(jnp.square(nnx.merge(gdef, l, r)(x, ids, route_w)))
    fn = jax.jit(jax.value_and_grad(f))
    if mesh is None:
        return fn(lp, rest, xq)
    with jax.set_mesh(mesh):
        return fn(lp, rest, xq)


lref, gref = adapter_value_and_grad(qlora)
gref = leaves(gref)
assert len(gref) == 6 and all(float(np.max(np.abs(np.asarray(g)))) > 0 for g in gref.values())
# expert 4 x tensor 2: all-to-all dispatch, the packed base's hidden split over tensor kept (int4 g32 leaves whole
# groups) and the adapters' factors split with it
name, mesh = "qlora on packed experts, expert4 x tensor2 (all-to-all, hidden split)", make_mesh(MeshConfig(1, 1, 2, 4))
sharded = shard_model(nnx.clone(qlora), mesh)
assert sharded.down_proj.lora.a.get_value().sharding.spec[0] == "expert"
with jax.set_mesh(mesh):
    plan = _expert_plan(sharded, xq.shape[0])
assert plan.dispatch and plan.mlp == ("tensor",), plan
val, grad = adapter_value_and_grad(sharded, mesh)
np.testing.assert_allclose(float(val), float(lref), rtol=1e-5, err_msg=name)
got = leaves(grad)
assert got.keys() == gref.keys()
for path, g in gref.items():
    np.testing.assert_allclose(np.asarray(got[path]), np.asarray(g), rtol=2e-4, atol=2e-6,
                               err_msg=f"{name}: {jax.tree_util.keystr(path)}")
print(f"{name}: output {float(val):.6f} (single device {float(lref):.6f}), {len(got)} adapter gradients equal")

# The decode program under an expert axis (the engine traces it under DECODE_RULES: tokens split over `data` only,
# so the psum path): its loop moves no weight. Collectives in the decode loop at least as large as the smallest
# expert kernel's share are weights moved per token (tests/test_paged_tpu.py's check).
from lrmq import aot  # noqa: E402
from lrmq.generation.engine import EngineConfig  # noqa: E402
from lrmq.generation.sampling import SamplingConfig  # noqa: E402
from lrmq.hlo import decode_loop  # noqa: E402
from lrmq.model.config import ModelConfig  # noqa: E402


def weight_moves_in_decode_loop(mesh_cfg, packed_experts: bool = False):
    """(collectives in the decode loop moving at least 1/8 of the smallest weight matrix, the abstract state) of
    a Qwen3-MoE with weights large enough to tell from the activations of its 8 slots (abstract: none allocated);
    `packed_experts`: its expert kernels packed int4 g128 (a quantized rollout's experts)."""
    mcfg = ModelConfig.from_hf_dict(dict(model_type="qwen3_moe", vocab_size=512, hidden_size=512, intermediate_size=1024,
                                         moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                         max_position_embeddings=256, tie_word_embeddings=False), dtype="float32")
    mesh = make_mesh(mesh_cfg)
    graphdef, state = aot.abstract_model(mcfg, mesh)
    if packed_experts:
        from lrmq.model.decoder import Decoder
        from lrmq.sharding import abstract_state

        def build():
            m = Decoder(mcfg, nnx.Rngs(0))
            for layer in m.layers:
                for lin in (layer.mlp.experts.gate_proj, layer.mlp.experts.up_proj, layer.mlp.experts.down_proj):
                    set_packed_expert_kernel(lin, quantize_weight(lin.kernel.get_value(), group_size=128))
            return m

        graphdef, state = nnx.split(nnx.eval_shape(build))
        state = abstract_state(state, mesh)
    compiled, _ = aot.compile_generate(graphdef, state, mesh, model_cfg=mcfg, requests=8, prompt_len=16, max_new=8,
                                       engine=EngineConfig(slots=8, sync_steps=4), sampling=SamplingConfig(),
                                       programs=("decode",))["decode"]
    module = Module(compiled.as_text())
    loop = decode_loop(module)
    inside = [c for part in ("body", "condition") for c in module.collectives(loop.attr(part))]
    # weight matrices: the arrays of 2+ dimensions of 64 KiB or more (not the routers' [512, 8])
    smallest = min(n for x in jax.tree.leaves(state) if x.ndim >= 2 and (n := x.size * x.dtype.itemsize) >= 64 << 10) // 8
    return [c for c in inside if c["bytes"] >= smallest], state


heavy, state = weight_moves_in_decode_loop(MeshConfig(1, 2, 1, 4))
spec = tuple(nnx.to_pure_dict(state)["layers"][0]["mlp"]["experts"]["gate_proj"]["kernel"].sharding.spec)
assert spec[0] == "expert", spec
assert not heavy, heavy
print(f"decode, mesh fsdp2 x expert4: no weight-sized collective in the decode loop (expert kernels {spec})")
# packed int4 experts: the hidden split over fsdp kept (g128: whole groups a chip), so no weight moves either
heavy, state = weight_moves_in_decode_loop(MeshConfig(1, 2, 1, 4), packed_experts=True)
spec = tuple(nnx.to_pure_dict(state)["layers"][0]["mlp"]["experts"]["down_proj"]["kernel"].codes.sharding.spec)
assert spec[0] == "expert", spec
assert not heavy, heavy
print(f"decode with packed int4 experts, mesh fsdp2 x expert4: no weight-sized collective in the decode loop "
      f"(down_proj codes {spec})")
print("OK")
