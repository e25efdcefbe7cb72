import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from lrmq.quant.packing import pack, pack_nibbles_high_first, unpack, unpack_nibbles_high_first
from lrmq.quant.quantizers import fake_quant
from lrmq.quant.formats import dequantize, quantize_weight, unpacked_codes
from lrmq.quant.qkernel import QuantizedKernel
from lrmq.quant.qweight import QuantizedWeight, from_flat_dict, to_flat_dict


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_pack_round_trip_odd_n(bits):
    K, N = 24, 7
    codes = np.random.default_rng(bits).integers(0, 2**bits, size=(K, N), dtype=np.uint8)
    p = pack(codes, bits)
    assert isinstance(p, np.ndarray) and p.dtype == np.uint8
    assert p.shape == ({2: 6, 3: 9, 4: 12}.get(bits, K), N)
    np.testing.assert_array_equal(unpack(p, bits, K), codes)
    pj = jax.jit(pack, static_argnums=1)(jnp.asarray(codes), bits)
    np.testing.assert_array_equal(pj, p)
    np.testing.assert_array_equal(jax.jit(unpack, static_argnums=(1, 2))(pj, bits, K), codes)


def test_pack_known_bytes():
    # int4: element 2i low nibble, 2i+1 high nibble
    np.testing.assert_array_equal(pack(np.array([[1], [2], [15], [0]], np.uint8), 4), [[0x21], [0x0F]])
    # int2: element 4i+j at bits 2j
    np.testing.assert_array_equal(pack(np.array([[1], [2], [3], [0]], np.uint8), 2), [[0b00111001]])
    # int3: values 0..7 -> 24-bit LE word sum(v_j << 3j) = 0xFAC688 -> bytes 0x88, 0xC6, 0xFA
    np.testing.assert_array_equal(pack(np.arange(8, dtype=np.uint8).reshape(8, 1), 3), [[0x88], [0xC6], [0xFA]])
    np.testing.assert_array_equal(pack(np.array([[7], [0], [0], [0], [0], [0], [0], [0]], np.uint8), 3), [[7], [0], [0]])
    # value 2 (of 8) straddles bytes 0 and 1: 5 << 6 = 0x140
    c = np.zeros((8, 1), np.uint8)
    c[2] = 5
    np.testing.assert_array_equal(pack(c, 3), [[0x40], [0x01], [0x00]])
    # NF4 / bnb: even element in the high nibble
    np.testing.assert_array_equal(pack_nibbles_high_first(np.array([1, 2, 15, 0], np.uint8)), [0x12, 0xF0])
    np.testing.assert_array_equal(unpack_nibbles_high_first(np.array([[0x12, 0xF0]], np.uint8)), [[1, 2, 15, 0]])


def test_pack_errors():
    with pytest.raises(ValueError, match="K=12 must be a multiple of 8"):
        pack(np.zeros((12, 2), np.uint8), 3)
    with pytest.raises(ValueError, match="bits"):
        pack(np.zeros((8, 2), np.uint8), 1)
    with pytest.raises(ValueError, match="packed has 4 rows"):
        unpack(np.zeros((4, 2), np.uint8), 4, 16)
    with pytest.raises(TypeError, match="integer"):
        pack(np.zeros((8, 2), np.float32), 4)


@pytest.mark.parametrize("bits,g,sym", [(4, 32, False), (3, 64, False), (2, -1, True), (8, -1, True), (6, 16, False)])
def test_quantize_weight_matches_fake_quant(bits, g, sym):
    w = jnp.asarray(np.random.default_rng(bits).normal(size=(64, 5)).astype(np.float32)).astype(jnp.bfloat16)
    qw = quantize_weight(w, bits=bits, group_size=g, symmetric=sym)
    gs = 64 if g == -1 else g
    assert qw.group_size == gs and qw.shape == (64, 5) and qw.dtype == "bfloat16"
    assert qw.codes.shape == ({2: 16, 3: 24, 4: 32}.get(bits, 64), 5)
    assert qw.scales.shape == qw.zeros.shape == (64 // gs, 5)
    assert qw.nbytes == qw.codes.size + 4 * qw.scales.size + qw.zeros.size
    out = dequantize(qw)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, fake_quant(w, bits, g, sym))
    assert int(unpacked_codes(qw).max()) <= 2**bits - 1
    with pytest.raises(ValueError, match="unknown fmt"):
        quantize_weight(w, fmt="fp4")


def test_pytree_and_jit():
    w = jnp.asarray(np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32))
    qw = quantize_weight(w, bits=4, group_size=16)
    leaves, treedef = jax.tree.flatten(qw)
    assert len(leaves) == 3  # codes, scales, zeros; static fields live in the treedef
    qw2 = jax.tree.unflatten(treedef, leaves)
    assert qw2.bits == 4 and qw2.group_size == 16
    np.testing.assert_array_equal(jax.jit(dequantize)(qw), dequantize(qw))
    qj = jax.jit(lambda w: quantize_weight(w, bits=3, group_size=8))(w)
    np.testing.assert_array_equal(dequantize(qj), fake_quant(w, 3, 8, False))


def _qweights():
    w = jnp.asarray(np.random.default_rng(1).normal(size=(64, 6)).astype(np.float32))
    return {
        "int4": quantize_weight(w, bits=4, group_size=32),
        "int3s": quantize_weight(w.astype(jnp.bfloat16), bits=3, group_size=-1, symmetric=True),
        "nf4": quantize_weight(w.astype(jnp.bfloat16), fmt="nf4"),
        "nf4_plain": quantize_weight(w, fmt="nf4", double_quant=False),
    }


def _assert_same(a: QuantizedWeight, b: QuantizedWeight):
    assert a.static() == b.static()
    assert a.arrays().keys() == b.arrays().keys()
    for k, v in a.arrays().items():
        assert v.dtype == b.arrays()[k].dtype, k
        np.testing.assert_array_equal(v, b.arrays()[k])
    np.testing.assert_array_equal(dequantize(a), dequantize(b))


def test_safetensors_round_trip(tmp_path):
    qws = _qweights()
    tensors, meta = {}, {}
    for name, qw in qws.items():
        t, m = to_flat_dict(qw, f"layers.0.{name}")
        tensors.update(t)
        meta.update(m)
    assert "layers.0.int4.codes" in tensors and "layers.0.nf4.absmax_offset" in tensors
    assert all(isinstance(v, str) for v in meta.values())
    path = os.path.join(tmp_path, "q.safetensors")
    save_file(tensors, path, metadata=meta)
    from safetensors import safe_open

    with safe_open(path, "np") as f:
        meta2 = f.metadata()
    loaded = load_file(path)
    for name, qw in qws.items():
        _assert_same(qw, from_flat_dict(loaded, meta2, f"layers.0.{name}"))
    with pytest.raises(KeyError, match="layers.1.x.fmt"):
        from_flat_dict(loaded, meta2, "layers.1.x")


class _Lin(nnx.Module):
    def __init__(self, qw):
        self.kernel = QuantizedKernel(qw)
        self.bias = nnx.Param(jnp.ones((qw.N,)))

    def __call__(self, x):
        return x @ dequantize(self.kernel.get_value()).astype(x.dtype) + self.bias[...]


class _Model(nnx.Module):
    def __init__(self, qws):
        self.a = _Lin(qws["int4"])
        self.b = _Lin(qws["nf4"])

    def __call__(self, x):
        return self.a(x) + self.b(x)


def test_nnx_split_merge_jit_orbax(tmp_path):
    qws = _qweights()
    model = _Model(qws)
    x = jnp.ones((2, 64))
    y = model(x)
    graphdef, state = nnx.split(model)
    m2 = nnx.merge(graphdef, state)
    _assert_same(m2.b.kernel.get_value(), qws["nf4"])
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(model, x), y)
    np.testing.assert_array_equal(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x), y)
    # not trainable: Param filters see only the biases
    params = nnx.state(model, nnx.Param)
    assert len(jax.tree.leaves(params)) == 2

    ckpt = ocp.StandardCheckpointer()
    path = os.path.join(tmp_path, "ckpt")
    ckpt.save(path, nnx.state(model))
    ckpt.wait_until_finished()
    abstract = nnx.state(nnx.eval_shape(lambda: _Model(qws)))
    restored = ckpt.restore(path, abstract)
    m3 = nnx.merge(graphdef, restored)
    for k in ("a", "b"):
        _assert_same(getattr(m3, k).kernel.get_value(), getattr(model, k).kernel.get_value())
    np.testing.assert_array_equal(m3(x), y)
