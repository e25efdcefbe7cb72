"""Run 2 GRPO steps on a (data=2, fsdp=2, tensor=2) mesh of 8 forced CPU devices; dump params."""

import os
import sys

import numpy as np

out_dir, npz, tiny = sys.argv[1], sys.argv[2], sys.argv[3]
if tiny:
    os.environ["LRMQ_TEST_TINY"] = tiny
import jax  # noqa: E402
from flax import nnx  # noqa: E402

from conftest import tiny_train_config  # noqa: E402
from lrmq.rl.trainer import GRPOTrainer  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()
t = GRPOTrainer(tiny_train_config(out_dir, run={"steps": 2}, mesh={"data": 2, "fsdp": 2, "tensor": 2}))
q = t.learner.trainable["layers"][0]["attn"]["q_proj"]["kernel"].get_value()
assert len(q.sharding.device_set) > 1, q.sharding
t.train()
flat = nnx.to_flat_state(t.learner.trainable)
np.savez(npz, **{".".join(map(str, k)): np.asarray(v.get_value()) for k, v in flat})
print("ok")
