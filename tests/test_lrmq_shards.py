"""The safetensors storage layout of an lrmq checkpoint (lrmq.checkpoint.lrmq_shards): the tiny model and a packed
RTN result saved in both layouts load to the same arrays and logits; the readers of lrmq checkpoints take it; a
damaged one is a one-line error. (Onto an 8-device mesh: tests/sharded_check.py; from a bucket: test_pod_path.py.)"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """{(kind, storage): checkpoint dir} for kind float (the tiny model) and packed (RTN W4 g32), storage orbax and
    safetensors (shards of at most 200 kB: 3+ shards with an index)."""
    from lrmq.checkpoint.load import load_model
    from lrmq.checkpoint.orbax_io import save_lrmq
    from lrmq.ptq.exports import packed_kernels
    from lrmq.ptq.rtn import rtn_quantize_model

    root = tmp_path_factory.mktemp("lrmq_layouts")
    out, m = {}, load_model("tiny")
    for storage in ("orbax", "safetensors"):
        kw = {"max_shard_bytes": 200_000} if storage == "safetensors" else {}
        out["float", storage] = save_lrmq(m, str(root / f"float_{storage}"), tokenizer_from="tiny", storage=storage,
                                          **kw)
    r = rtn_quantize_model(m, bits=4, group_size=32)  # (in place: after the float saves)
    with packed_kernels(m, r):
        for storage in ("orbax", "safetensors"):
            kw = {"max_shard_bytes": 200_000} if storage == "safetensors" else {}
            out["packed", storage] = save_lrmq(m, str(root / f"packed_{storage}"), weight_formats=r.formats(),
                                               storage=storage, **kw)
    return out


def _arrays(model) -> dict[str, np.ndarray]:
    from lrmq.checkpoint.orbax_io import _savable_vars

    out = {}
    for p, v in _savable_vars(model).items():
        value = v.get_value()
        if hasattr(value, "arrays"):
            out.update((f"{p}.{k}", np.asarray(a)) for k, a in value.arrays().items())
            out[p + ".static"] = value.static()
        else:
            out[p] = np.asarray(value)
    return out


def _logits(model):
    """The model's logits on a fixed batch (jitted: the two layouts of one model share one compile)."""
    import jax.numpy as jnp
    from flax import nnx

    tokens = jnp.asarray(np.arange(1, 13, dtype=np.int32).reshape(2, 6))
    return np.asarray(nnx.jit(lambda m, t, p: m(t, p))(model, tokens, jnp.broadcast_to(jnp.arange(6), (2, 6))))


def _assert_same(got: dict, want: dict) -> None:
    assert want.keys() == got.keys()
    for k in want:
        if k.endswith(".static"):
            assert got[k] == want[k], k
        else:
            assert got[k].dtype == want[k].dtype, k
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("kind", ["float", "packed"])
def test_both_layouts_load_the_same(layouts, kind):
    """The two layouts of one model: the same manifest (plus "storage"), config, arrays and logits; onto a mesh the
    same arrays, placed there; the safetensors one in 3+ shards with an index whose total_size is the arrays'
    bytes."""
    import jax

    from lrmq.checkpoint.load import checkpoint_kind, load_model
    from lrmq.checkpoint.orbax_io import is_lrmq_checkpoint, read_storage, read_weight_formats
    from lrmq.sharding import make_mesh

    orb, st = layouts[kind, "orbax"], layouts[kind, "safetensors"]
    assert not os.path.exists(os.path.join(st, "params")) and os.path.isdir(os.path.join(orb, "params"))
    shards = sorted(f for f in os.listdir(st) if f.endswith(".safetensors"))
    assert len(shards) >= 3 and shards[0] == f"params-00001-of-{len(shards):05d}.safetensors", shards
    with open(os.path.join(st, "params.safetensors.index.json")) as f:
        index = json.load(f)
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(os.path.getsize(os.path.join(st, s)) for s in shards) - sum(
        8 + int.from_bytes(open(os.path.join(st, s), "rb").read(8), "little") for s in shards)
    states = []
    for d in (orb, st):
        with open(os.path.join(d, "lrmq_state.json")) as f:
            states.append(json.load(f))
    assert "storage" not in states[0] and states[1].pop("storage") == "safetensors"
    assert states[0] == states[1]
    assert (read_storage(orb), read_storage(st)) == ("orbax", "safetensors")
    assert is_lrmq_checkpoint(st) and checkpoint_kind(st) == "lrmq"
    assert read_weight_formats(st) == read_weight_formats(orb)
    if kind == "packed":
        assert "layers.0.attn.q_proj.kernel.codes" in index["weight_map"] and read_weight_formats(st)
        assert "layers.0.attn.q_proj.kernel" not in index["weight_map"]

    a, b = load_model(orb), load_model(st)
    want = _arrays(a)
    assert a.cfg == b.cfg
    _assert_same(_arrays(b), want)
    np.testing.assert_array_equal(_logits(b), _logits(a))
    mesh = make_mesh((1, 1, 1))
    with jax.set_mesh(mesh):
        c = load_model(st, mesh=mesh)
    q = c.layers[0].attn.q_proj.kernel.get_value()
    assert (q.codes if kind == "packed" else q).sharding.mesh.shape == mesh.shape
    _assert_same(_arrays(c), want)
    if kind == "float":  # the param_dtype cast, as for orbax; a bf16 checkpoint in this layout reads back
        from lrmq.checkpoint.orbax_io import save_lrmq
        from lrmq.checkpoint.tensors import open_tensors

        d = load_model(st, param_dtype="bfloat16")
        assert d.cfg.param_dtype == "bfloat16" and d.embed.embedding.get_value().dtype.name == "bfloat16"
        bf16 = save_lrmq(d, os.path.join(os.path.dirname(st), "bf16_safetensors"), storage="safetensors")
        assert os.path.exists(os.path.join(bf16, "params.safetensors"))
        want16 = _arrays(d)
        _assert_same(_arrays(load_model(bf16)), want16)
        np.testing.assert_array_equal(open_tensors(bf16).get("layers.0.mlp.up_proj.kernel"),
                                      want16["layers.0.mlp.up_proj.kernel"])


def test_tensor_readers_take_the_safetensors_layout(layouts):
    """open_tensors (get / get_many) and restore_arrays read the new layout's tensors, equal to the model's."""
    from lrmq.checkpoint.load import load_model
    from lrmq.checkpoint.orbax_io import restore_arrays
    from lrmq.checkpoint.tensors import open_tensors

    st = layouts["float", "safetensors"]
    want = _arrays(load_model(layouts["float", "orbax"]))
    r = open_tensors(st)
    assert r.names() == list(want)
    got = r.get_many(r.names()[:5])
    got["layers.1.mlp.down_proj.kernel"] = r.get("layers.1.mlp.down_proj.kernel")
    for k, v in got.items():
        assert v.dtype == want[k].dtype, k
        np.testing.assert_array_equal(v, want[k], err_msg=k)
    packed = layouts["packed", "safetensors"]
    pw = _arrays(load_model(layouts["packed", "orbax"]))
    names = ["layers.1.mlp.up_proj.kernel.codes", "layers.1.mlp.up_proj.kernel.scales", "embed.embedding"]
    got = restore_arrays(packed, {n: (pw[n].shape, pw[n].dtype) for n in names})
    for n in names:
        np.testing.assert_array_equal(got[n], pw[n], err_msg=n)


def test_damaged_safetensors_layout_errors(layouts, tmp_path):
    """A missing shard, a tensor missing from the index, a header shape other than the manifest's: one line naming
    the file and the tensor; a writer closed with a variable never added names it."""
    import shutil

    from lrmq.checkpoint.hf import CheckpointError
    from lrmq.checkpoint.load import load_model
    from lrmq.checkpoint.orbax_io import LrmqWriter
    from lrmq.checkpoint.orbax_io import read_lrmq_config

    st = layouts["packed", "safetensors"]
    bad = shutil.copytree(st, tmp_path / "missing_shard")
    os.remove(sorted(bad.glob("params-00002-of-*.safetensors"))[0])
    with pytest.raises(CheckpointError) as e:
        load_model(str(bad))
    msg = str(e.value)
    assert "\n" not in msg and "params-00002-of-" in msg and "missing" in msg and "lists it for tensor" in msg, msg

    bad = shutil.copytree(st, tmp_path / "no_tensor")
    idx = bad / "params.safetensors.index.json"
    index = json.loads(idx.read_text())
    del index["weight_map"]["layers.1.attn.k_proj.kernel.scales"]
    idx.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"params.safetensors.index.json: no tensor "
                                              r"layers.1.attn.k_proj.kernel.scales \(lrmq_state.json lists it\)$"):
        load_model(str(bad))

    bad = shutil.copytree(st, tmp_path / "wrong_shape")
    state = json.loads((bad / "lrmq_state.json").read_text())
    shape = state["variables"]["layers.0.attn.q_proj.kernel"]["arrays"]["scales"][0]
    state["variables"]["layers.0.attn.q_proj.kernel"]["arrays"]["scales"][0] = [shape[0] + 1, shape[1]]
    (bad / "lrmq_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=rf"params-\d+-of-\d+.safetensors: tensor layers.0.attn.q_proj.kernel.scales "
                                              rf"is float32\[{shape[0]}, {shape[1]}\], lrmq_state.json says "
                                              rf"float32\[{shape[0] + 1}, {shape[1]}\]$"):
        load_model(str(bad))

    w = LrmqWriter(str(tmp_path), read_lrmq_config(st), max_shard_bytes=10**6)
    w.add_param("embed.embedding", np.zeros(w._want_shape("embed.embedding"), np.float32))
    with pytest.raises(CheckpointError, match="shape"):
        w.add_param("final_norm.scale", np.zeros((3,), np.float32))
    with pytest.raises(CheckpointError, match="missing from the model: .*layers.0.attn_norm.scale"):
        w.close()
