"""lrmq.checkpoint.tensors: one float tensor at a time from a sharded HF directory and an lrmq (orbax) checkpoint,
equal to what load_model gives; only the tensor asked for is read. (gs:// readers: test_pod_path.py.)"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import threading

import numpy as np
import pytest


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny Qwen3 with an untied (transposed) lm_head: HF bf16 in 5 shards with an index, and the lrmq checkpoint
    load_model + save_lrmq make of it."""
    import jax.numpy as jnp
    from flax import nnx

    from lrmq.checkpoint.hf import flat_params, save_hf_model
    from lrmq.checkpoint.load import TINY_MODEL_DIR, load_model
    from lrmq.checkpoint.orbax_io import save_lrmq
    from lrmq.model.config import ModelConfig
    from lrmq.model.decoder import Decoder

    root = tmp_path_factory.mktemp("tensors")
    with open(os.path.join(TINY_MODEL_DIR, "config.json")) as f:
        hf = json.load(f)
    hf["tie_word_embeddings"] = False
    untied = nnx.eval_shape(lambda: Decoder(ModelConfig.from_hf_dict(hf, source="tiny"), nnx.Rngs(1)))
    tiny, rng = flat_params(load_model("tiny")), np.random.default_rng(0)
    for k, v in flat_params(untied).items():  # the shipped weights, and a random head (a random init costs 2 s)
        v.set_value(tiny[k].get_value() if k in tiny else
                    jnp.asarray(rng.standard_normal(v.get_value().shape, np.float32) * 0.05))
    hf_dir = save_hf_model(untied, str(root / "hf"), dtype="bfloat16", max_shard_bytes=200_000)
    model = load_model(hf_dir)
    lrmq_dir = save_lrmq(model, str(root / "lrmq"))
    return {"hf": hf_dir, "lrmq": lrmq_dir, "model": model, "root": root}


def _file_bytes_read() -> int:
    import tensorstore as ts

    m = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(v.get("value", 0) for x in m for v in x["values"])


def test_readers_equal_load_model(ckpts):
    from lrmq.checkpoint.hf import flat_params
    from lrmq.checkpoint.tensors import open_tensors

    want = {k: np.asarray(v.get_value()) for k, v in flat_params(ckpts["model"]).items()}
    assert "lm_head.kernel" in want and want["embed.embedding"].dtype.name == "bfloat16"
    assert len([f for f in os.listdir(ckpts["hf"]) if f.endswith(".safetensors")]) > 1
    for kind in ("hf", "lrmq"):
        r = open_tensors(ckpts[kind])
        assert r.names() == list(want) and r.cfg.tie_word_embeddings is False, kind
        for name, w in want.items():
            got = r.get(name)
            assert got.shape == r.shape(name) == w.shape and got.dtype == r.dtype(name) == w.dtype, (kind, name)
            np.testing.assert_array_equal(got, w, err_msg=f"{kind} {name}")
        layer = [n for n in want if n.startswith("layers.1.")]
        many = r.get_many(layer)  # (lrmq: one restore for the layer)
        assert list(many) == layer and all(np.array_equal(many[n], want[n]) for n in layer), kind
    hf = open_tensors(ckpts["hf"])
    assert hf.stored("lm_head.kernel") == ("lm_head.weight", want["lm_head.kernel"].shape[::-1])
    # a local HF tensor is a view of a mapping of its own pages only, not of its file
    q = hf.get("layers.1.attn.q_proj.kernel")
    base = q
    while isinstance(base, np.ndarray):
        base = base.base
    base = base.obj if isinstance(base, memoryview) else base
    assert isinstance(base, mmap.mmap), type(base)
    assert len(base) < q.nbytes + mmap.ALLOCATIONGRANULARITY and not q.flags.writeable
    # a second thread (a prefetch) reads the same values
    out = {}
    t = threading.Thread(target=lambda: out.update(a=open_tensors(ckpts["lrmq"]).get("layers.1.mlp.down_proj.kernel")))
    t.start()
    t.join()
    np.testing.assert_array_equal(out["a"], want["layers.1.mlp.down_proj.kernel"])


def test_lrmq_reads_one_array_only(ckpts):
    """One orbax partial restore per tensor: reading a norm scale (64 bytes) reads under 1 KiB (with tree metadata), not
    the checkpoint's ~930 KiB of arrays (a whole-tree restore reads every byte); the largest tensor reads its own."""
    from lrmq.checkpoint.tensors import open_tensors

    r = open_tensors(ckpts["lrmq"])
    total = sum(int(np.prod(r.shape(n))) * r.dtype(n).itemsize for n in r.names())
    before = _file_bytes_read()
    r.get("layers.0.attn.q_norm.scale")
    small = _file_bytes_read() - before
    before = _file_bytes_read()
    emb = r.get("embed.embedding")
    big = _file_bytes_read() - before
    assert 0 < small < total / 20, (small, total)
    assert big >= emb.nbytes / 2 and big < emb.nbytes + total / 20, (big, emb.nbytes, total)  # (zstd-compressed)


def test_reader_errors(ckpts, tmp_path):
    from lrmq.checkpoint.hf import CheckpointError
    from lrmq.checkpoint.tensors import open_tensors

    # a tensor the config needs, missing from the index
    hf = str(tmp_path / "hf")
    shutil.copytree(ckpts["hf"], hf)
    index = os.path.join(hf, "model.safetensors.index.json")
    with open(index) as f:
        idx = json.load(f)
    del idx["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    with open(index, "w") as f:
        json.dump(idx, f)
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        open_tensors(hf)
    # the index names a file that lacks the tensor
    idx["weight_map"]["model.layers.1.mlp.up_proj.weight"] = idx["weight_map"]["model.norm.weight"]
    with open(index, "w") as f:
        json.dump(idx, f)
    with pytest.raises(CheckpointError, match=r"safetensors: no tensor model\.layers\.1\.mlp\.up_proj\.weight "
                                              r"\(the index lists it there\)"):
        open_tensors(hf)
    # an lrmq manifest whose shape is not the config's
    lq = str(tmp_path / "lrmq")
    shutil.copytree(ckpts["lrmq"], lq)
    state = os.path.join(lq, "lrmq_state.json")
    with open(state) as f:
        st = json.load(f)
    st["variables"]["layers.0.mlp.gate_proj.kernel"]["array"][0] = [128, 999]
    with open(state, "w") as f:
        json.dump(st, f)
    with pytest.raises(CheckpointError, match=r"wrong shape for layers\.0\.mlp\.gate_proj\.kernel: the config needs "
                                              r"\(128, 384\), the checkpoint has \(128, 999\)"):
        open_tensors(lq)
    r = open_tensors(ckpts["lrmq"])
    with pytest.raises(CheckpointError, match=r"lrmq: no tensor 'layers\.9\.attn\.q_proj\.kernel'"):
        r.get("layers.9.attn.q_proj.kernel")
    # a quantized checkpoint is refused in one line naming its config.json
    llmc = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "llmc_w4a16")
    with pytest.raises(CheckpointError, match=r"llmc_w4a16/config.json: reading it tensor by tensor needs float "
                                              r"weights, this checkpoint is already quantized \(compressed-tensors"):
        open_tensors(llmc)
