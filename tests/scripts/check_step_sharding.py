"""Run with 8 CPU devices (tests/test_step_memory.py): sharding layouts of the train step's pieces."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder
from lrmq.rl.step import init_opt_state, micro_batches
from lrmq.sharding import MeshConfig, make_mesh, shard_model

mesh = make_mesh(MeshConfig(2, 4, 1))
rows = NamedSharding(mesh, P(("data", "fsdp"), None))

# Strided split: the scanned axis (0) is unsharded, each micro-batch is spread over all 8 devices and
# no data moves (the compiled program has no collective). A contiguous split puts the sharding on axis 0.
x = jax.device_put(jnp.arange(64 * 3, dtype=jnp.float32).reshape(64, 3), rows)
with jax.set_mesh(mesh):
    compiled = jax.jit(lambda a: micro_batches(a, 4)).lower(x).compile()
    out_spec = compiled.output_shardings.spec
    contiguous = jax.jit(lambda a: a.reshape(4, 16, 3)).lower(x).compile().output_shardings.spec
hlo = compiled.as_text()
assert out_spec[0] is None and out_spec[1] is not None, out_spec
assert contiguous[0] is not None, contiguous
for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
    assert op not in hlo, op

# Optimizer state: Adam's mu and nu sharded like each parameter, the step count replicated.
cfg = ModelConfig.from_hf_dict(dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=16),
                               dtype="float32", param_dtype="float32")
model = shard_model(Decoder(cfg, nnx.Rngs(0)), mesh)
params = nnx.state(model, nnx.Param)
from lrmq.rl.config import TrainConfig
from lrmq.rl.step import make_optimizer

tx, _ = make_optimizer(TrainConfig())
with jax.set_mesh(mesh):
    opt = init_opt_state(tx, params, mesh)
param_specs = [a.sharding.spec for a in jax.tree.leaves(params)]
adam = [s for s in jax.tree.leaves(opt, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu")][0]
for moments in (adam.mu, adam.nu):
    specs = [a.sharding.spec for a in jax.tree.leaves(moments)]
    assert specs == param_specs, (specs, param_specs)
assert any(any(ax is not None for ax in s) for s in param_specs)  # something is actually sharded
assert adam.count.sharding.is_fully_replicated
print("OK")
