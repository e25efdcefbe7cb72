"""Model-level exports: AutoAWQ GEMM and compressed-tensors files decoded with independent unpackers
(written here from the format specs, not lrmq.ptq.export_formats) must give back our codes, scales
and zeros bit for bit; packed lrmq checkpoints load and run; writes are atomic."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def unpack_awq(q: np.ndarray) -> np.ndarray:
    """AutoAWQ unpack_awq + reverse_awq_order: int32 [R, C] -> uint4 [R, 8C]."""
    u = q.view(np.uint32)
    nib = np.stack([(u >> (4 * i)) & 0xF for i in range(8)], axis=-1)  # [R, C, 8] low -> high
    return nib[:, :, AWQ_REVERSE_ORDER].reshape(q.shape[0], -1)


def unpack_ct(q: np.ndarray, bits: int, n: int, axis: int) -> np.ndarray:
    """compressed-tensors (0.19+) unpack_from_int32: a dense little-endian bit stream per row along `axis`,
    value i at stream bit bits*i (straddling int32 words), last word zero-padded."""
    if axis == 0:
        return unpack_ct(q.T, bits, n, 1).T
    assert q.shape[1] == -(-n * bits // 32)
    stream = np.unpackbits(np.ascontiguousarray(q, "<i4").view(np.uint8), axis=1, bitorder="little")
    vals = stream[:, : n * bits].reshape(q.shape[0], n, bits).astype(np.uint32)
    return (vals << np.arange(bits, dtype=np.uint32)).sum(-1)


@pytest.fixture(scope="module")
def quantized(hf_checkpoint):
    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.ptq.awq import AWQOptions, awq_quantize_model

    d, _ = hf_checkpoint("qwen3")
    out = {}
    for bits in (3, 4):
        m = load_hf_model(d)
        toks = np.random.default_rng(0).integers(0, 128, (2, 32))
        out[bits] = (m, awq_quantize_model(m, toks, AWQOptions(bits=bits, group_size=32, n_grid=3, batch_size=2),
                                           progress=False))
    return out


def packed_logits_as_stored(m, r, dtype, toks):
    """Logits (float32 compute) of the packed model of PTQ result ``r`` with what an export in ``dtype`` stores
    rounded to it -- every float parameter and every scale: what reading the export back must give."""
    import dataclasses

    import jax.numpy as jnp

    from lrmq.checkpoint.hf import flat_params
    from lrmq.ptq.exports import packed_kernels

    rnd = lambda a: jnp.asarray(a).astype(dtype).astype(jnp.float32)  # noqa: E731
    params = flat_params(m)
    saved = {k: v.get_value() for k, v in params.items()}
    stored = dataclasses.replace(r, packed={p: qw.replace(scales=rnd(qw.scales)) for p, qw in r.packed.items()})
    try:
        for k, v in params.items():
            v.set_value(rnd(saved[k]))
        with packed_kernels(m, stored):
            return np.asarray(m(toks))
    finally:
        for k, v in params.items():
            v.set_value(saved[k])


def assert_reads_back(out_dir, m, r, dtype, toks, *, packed=True):
    """``load_model`` reads the export ``out_dir`` as the packed model it came from: every quantized Linear a
    QuantizedKernel with the same codes and zero points, and the logits of ``packed_logits_as_stored``."""
    from lrmq.checkpoint.load import load_model
    from lrmq.quant.formats import unpacked_codes
    from lrmq.quant.transforms import module_at

    q = load_model(out_dir, dtype="float32", param_dtype="float32")
    for path, qw in r.packed.items():
        got = module_at(q, path).kernel.get_value()
        assert hasattr(got, "codes") == packed, path
        if packed:
            assert (got.bits, got.group_size, got.symmetric) == (qw.bits, qw.group_size, qw.symmetric), path
            np.testing.assert_array_equal(np.asarray(unpacked_codes(got)), np.asarray(unpacked_codes(qw)), err_msg=path)
            np.testing.assert_array_equal(np.asarray(got.zeros), np.asarray(qw.zeros), err_msg=path)
    np.testing.assert_allclose(np.asarray(q(toks)), packed_logits_as_stored(m, r, dtype, toks), rtol=0, atol=2e-5)
    assert "quantization_config" not in q.cfg.to_hf_dict()  # the model carries its format in its packed kernels


def _codes(qw):
    from lrmq.quant.formats import unpacked_codes

    return np.asarray(unpacked_codes(qw)), np.asarray(qw.scales), np.asarray(qw.zeros)


def test_autoawq_and_ct_w4(quantized, tmp_path):
    import jax.numpy as jnp

    from lrmq.checkpoint.load import load_model
    from lrmq.ptq import export_formats as ef
    from lrmq.ptq.exports import write_outputs
    from lrmq.quant.transforms import module_at

    m, r = quantized[4]
    out = str(tmp_path / "o")
    write_outputs(m, r, out, formats=("packed", "fake_quant", "autoawq", "compressed_tensors"), dtype="float16",
                  extra_files={"report.json": "{}"})
    assert sorted(os.listdir(out)) == ["autoawq", "compressed_tensors", "fake_quant", "packed", "report.json"]
    awq = load_file(os.path.join(out, "autoawq", "model.safetensors"))
    ct = load_file(os.path.join(out, "compressed_tensors", "model.safetensors"))
    cfg_awq = json.load(open(os.path.join(out, "autoawq", "config.json")))
    assert cfg_awq["quantization_config"] == {"quant_method": "awq", "zero_point": True, "group_size": 32, "bits": 4,
                                              "version": "gemm", "modules_to_not_convert": None}
    cfg_ct = json.load(open(os.path.join(out, "compressed_tensors", "config.json")))["quantization_config"]
    assert cfg_ct["format"] == "pack-quantized" and cfg_ct["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    assert cfg_ct["ignore"] == ["lm_head"]  # tied embeddings: transformers' lm_head is still an nn.Linear
    for i in range(2):
        for mod, hfmod, name in (("attn", "self_attn", "q_proj"), ("attn", "self_attn", "k_proj"),
                                 ("mlp", "mlp", "down_proj")):
            codes, scales, zeros = _codes(r.packed[f"layers.{i}.{mod}.{name}"])
            K, N = codes.shape
            pre = f"model.layers.{i}.{hfmod}.{name}"
            # AutoAWQ: [K, N/8] along the output dim, interleaved nibbles
            np.testing.assert_array_equal(unpack_awq(awq[pre + ".qweight"]), codes)
            np.testing.assert_array_equal(unpack_awq(awq[pre + ".qzeros"]), zeros)
            np.testing.assert_array_equal(awq[pre + ".scales"], scales.astype(np.float16))
            assert pre + ".weight" not in awq
            deq = (unpack_awq(awq[pre + ".qweight"]).astype(np.float32)
                   - np.repeat(unpack_awq(awq[pre + ".qzeros"]), K // scales.shape[0], 0)) * \
                np.repeat(awq[pre + ".scales"].astype(np.float32), K // scales.shape[0], 0)
            np.testing.assert_array_equal(deq.astype(np.float16), ef.dequantize(codes, scales, zeros, dtype="float16"))
            # compressed-tensors: torch orientation [N, K], packed along K; zero points along N
            np.testing.assert_array_equal(unpack_ct(ct[pre + ".weight_packed"], 4, K, 1), codes.T)
            np.testing.assert_array_equal(unpack_ct(ct[pre + ".weight_zero_point"], 4, N, 0), zeros.T)
            np.testing.assert_array_equal(ct[pre + ".weight_scale"], scales.T.astype(np.float16))
            np.testing.assert_array_equal(ct[pre + ".weight_shape"], [N, K])
    for t in (awq, ct):  # non-quantized tensors as usual
        assert "model.embed_tokens.weight" in t and "model.layers.0.input_layernorm.weight" in t
    # packed lrmq checkpoint loads and runs like the fake-quant model
    toks = jnp.asarray(np.arange(24)[None] % 128)
    q = load_model(os.path.join(out, "packed"))
    assert hasattr(module_at(q, "layers.0.mlp.up_proj").kernel.get_value(), "codes")
    np.testing.assert_allclose(np.asarray(q(toks)), np.asarray(m(toks)), rtol=1e-5, atol=1e-5)
    f = load_model(os.path.join(out, "fake_quant"))
    np.testing.assert_allclose(np.asarray(f(toks)), np.asarray(m(toks)), rtol=1e-3, atol=1e-3)
    # AutoAWQ and compressed-tensors read back (lrmq.checkpoint.quantized) as the packed model they came from
    for fmt in ("autoawq", "compressed_tensors"):
        assert_reads_back(os.path.join(out, fmt), m, r, "float16", toks)


def test_ct_w3_and_refusals(quantized, tmp_path):
    from lrmq.ptq.exports import ExportError, save_compressed_tensors, write_outputs

    m, r = quantized[3]
    out = str(tmp_path / "ct3")
    save_compressed_tensors(m, r, out, dtype="bfloat16")
    ct = load_file(os.path.join(out, "model.safetensors"))
    codes, scales, zeros = _codes(r.packed["layers.1.mlp.gate_proj"])
    pre = "model.layers.1.mlp.gate_proj"
    np.testing.assert_array_equal(unpack_ct(ct[pre + ".weight_packed"], 3, codes.shape[0], 1), codes.T)
    np.testing.assert_array_equal(unpack_ct(ct[pre + ".weight_zero_point"], 3, codes.shape[1], 0), zeros.T)
    K, N = codes.shape  # dense: 3 bits per value, values straddle int32 words
    assert ct[pre + ".weight_packed"].shape == (N, -(-K * 3 // 32))
    assert ct[pre + ".weight_zero_point"].shape == (-(-N * 3 // 32), K // 32)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["tie_word_embeddings"] and cfg["quantization_config"]["ignore"] == ["lm_head"]
    assert "lm_head.weight" not in ct
    import jax.numpy as jnp

    assert_reads_back(out, m, r, "bfloat16", jnp.asarray(np.arange(24)[None] % 128))  # W3: dense 3-bit words
    with pytest.raises(ExportError, match="4-bit only"):
        write_outputs(m, r, str(tmp_path / "x"), formats=("fake_quant", "autoawq"))
    assert not os.path.exists(tmp_path / "x")
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
