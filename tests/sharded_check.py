"""Run by tests/test_sharded_model.py in a fresh interpreter with 8 forced CPU devices.

usage: sharded_check.py WORK_DIR HF_DIR [HF_DIR ...]   (exit 0 and print OK on success)
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrmq.checkpoint.hf import load_hf_model
from lrmq.checkpoint.orbax_io import load_lrmq, save_lrmq
from lrmq.model.decoder import positions_from_mask
from lrmq.sharding import batch_sharding, make_mesh


@nnx.jit  # one compile per model instead of one per eager op on 8 devices
def forward(model, tokens, positions):
    return model(tokens, positions)


def flat(model):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def is_sharded(a) -> bool:
    return any(s is not None for s in a.sharding.spec) and a.addressable_shards[0].data.shape != a.shape


def check(work: str, hf_dir: str) -> None:
    name = os.path.basename(hf_dir.rstrip("/"))
    ref = load_hf_model(hf_dir)
    rng = np.random.RandomState(0)
    tokens = rng.randint(1, 128, (4, 12)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[1, :4] = mask[3, :7] = 0  # left padding
    positions = positions_from_mask(jnp.asarray(mask))
    ref_logits = np.asarray(forward(ref, jnp.asarray(tokens), positions))
    real = mask.astype(bool)

    mesh = make_mesh((2, 2, 2))
    with jax.set_mesh(mesh):
        model = load_hf_model(hf_dir, mesh=mesh)
        q = model.layers[0].attn.q_proj.kernel.get_value()
        assert tuple(q.sharding.spec) == ("fsdp", "tensor"), (name, q.sharding.spec)
        assert is_sharded(q) and len(q.sharding.device_set) == 8, name
        assert is_sharded(model.embed.embedding.get_value()), name
        logits = forward(model, jax.device_put(jnp.asarray(tokens), batch_sharding(mesh)),
                       jax.device_put(positions, batch_sharding(mesh)))
    err = np.abs(np.asarray(logits) - ref_logits)[real].max()
    assert err <= 1e-5, (name, "(2,2,2) logits differ", err)

    # Save from the (2,2,2) mesh, restore onto a different mesh shape.
    ckpt = os.path.join(work, f"lrmq_{name}")
    save_lrmq(model, ckpt)
    mesh2 = make_mesh((1, 8, 1))
    with jax.set_mesh(mesh2):
        restored = load_lrmq(ckpt, mesh=mesh2)
        emb = restored.embed.embedding.get_value()
        assert tuple(emb.sharding.spec) == (None, "fsdp") and emb.sharding.mesh.shape == mesh2.shape, emb.sharding
        assert is_sharded(emb), name
        logits2 = forward(restored, jnp.asarray(tokens), positions)
    want, got = flat(ref), flat(restored)
    assert sorted(want) == sorted(got), name
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=f"{name} {k}")
    err2 = np.abs(np.asarray(logits2) - ref_logits)[real].max()
    assert err2 <= 1e-5, (name, "(1,8,1) logits differ", err2)

    # The safetensors layout of the same checkpoint (several shards), saved from the (2,2,2) mesh and placed on
    # (1,8,1) shard by shard: the orbax restore's arrays, with the same shardings.
    st = os.path.join(work, f"lrmq_st_{name}")
    save_lrmq(model, st, storage="safetensors", max_shard_bytes=200_000)
    assert os.path.exists(os.path.join(st, "params.safetensors.index.json")), os.listdir(st)
    with jax.set_mesh(mesh2):
        st_flat = flat(load_lrmq(st, mesh=mesh2))
    assert sorted(st_flat) == sorted(got), name
    for k, v in st_flat.items():
        assert v.sharding.is_equivalent_to(got[k].sharding, v.ndim) and v.dtype == got[k].dtype, (name, k, v.sharding)
        np.testing.assert_array_equal(np.asarray(v), np.asarray(got[k]), err_msg=f"{name} safetensors {k}")
    print(f"{name}: (2,2,2) err {err:.2e}, (1,8,1) err {err2:.2e}")


def main() -> None:
    t0 = time.time()
    assert len(jax.devices()) == 8, f"expected 8 forced CPU devices, got {jax.devices()}"
    work, *hf_dirs = sys.argv[1:]
    for d in hf_dirs:
        check(work, d)
    print(f"OK ({time.time() - t0:.1f}s)")


if __name__ == "__main__":
    main()
