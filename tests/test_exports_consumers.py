"""Exports read by the consumer libraries themselves (compressed-tensors 0.20, transformers 5).

* compressed-tensors ``pack-quantized``, every bit width lrmq exports (2..8), symmetric and asymmetric:
  compressed-tensors' own ``PackedQuantizationCompressor.decompress`` (its ``unpack_from_int32`` and
  ``dequantize``) gives back lrmq's ``QuantizedWeight`` dequantization bit for bit (scales rounded to the
  export dtype first, as the file stores them). The export equals compressed-tensors' own checkpoint of the
  same quantized values (its ModelCompressor, the writer inside llmcompressor) tensor for tensor and its
  quantization_config key for key (but for CT_ONLY_KEYS / CT_OMITS_NULL), and llmcompressor's own output
  (LLMC_ONLY_KEYS) where a side venv has llmcompressor ($LLMC_PYTHON). transformers' compressed-tensors
  integration loads the float32 export of the shipped tiny model (lrmq/assets/tiny, tied embeddings)
  exactly where it loads the reference writers' checkpoints, on both paths -- ``dequantize=True`` (dense
  weights at load) and ``dequantize=False`` (compressed modules, decompressed on the first forward) --
  and its logits match lrmq's forward within ``LOGIT_ATOL``: float32 matmuls in a different order;
  observed max |diff| <= 6e-6 on logits of magnitude ~8 (torch CPU, 2..8 bit). Asymmetric exports on the
  compressed path fail for every writer (ASYM_COMPRESSED_XFAIL, a transformers 5.24 regression).
* AutoAWQ GEMM: compressed-tensors' own AutoAWQ reader (``AutoAWQConverter``: unpack, reverse the AWQ
  nibble order) converts the export and its decompression is again compared bit for bit; and transformers'
  own AWQ path (it needs gptqmodel, which lrmq never depends on: gptqmodel 7.6 installs on CPU next to
  torch 2.13, 7.7 needs torch >= 2.14.1) loads the export in a side virtualenv named by
  $LRMQ_GPTQMODEL_PYTHON (``tests/scripts/awq_gptqmodel_worker.py``): dequantized weights bit for bit,
  logits against lrmq's forward.

Skipped when compressed-tensors is not installed (it is pinned in the ``test`` extra); the gptqmodel test
is skipped when neither this interpreter nor $LRMQ_GPTQMODEL_PYTHON has gptqmodel, the llmcompressor test
when neither $LLMC_PYTHON nor /work/llmcvenv/bin/python has llmcompressor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
import ct_llmcompressor_worker as worker  # noqa: E402

TINY = os.path.join(os.path.dirname(__file__), "..", "lrmq", "assets", "tiny")
GROUP = 32
LOGIT_ATOL = 1e-4
TOKS = np.arange(24)[None] % 300


@pytest.fixture(scope="module")
def rtn_tiny():
    """(bits, symmetric) -> (fake-quant lrmq model, PTQResult, lrmq logits [1, T, V] float32)."""
    import jax.numpy as jnp

    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.ptq.rtn import rtn_quantize_model

    cache = {}

    def make(bits, symmetric, targets=None, group_size=GROUP):
        key = (bits, symmetric, targets, group_size)
        if key not in cache:
            m = load_hf_model(TINY)
            kw = {} if targets is None else {"targets": targets}
            r = rtn_quantize_model(m, bits=bits, group_size=group_size, symmetric=symmetric, **kw)
            cache[key] = (m, r, np.asarray(m(jnp.asarray(TOKS)), np.float32))
        return cache[key]

    return make


@pytest.fixture(scope="module")
def ct_pair(rtn_tiny, tmp_path_factory):
    """(bits, symmetric, group_size) -> dict of dirs: ``lrmq`` (lrmq's compressed-tensors export, float32),
    ``fake_quant`` (lrmq's float32 fake-quant export: the same model, dense), ``values`` (the quantized values as
    the reference writers take them) and ``ct``: compressed-tensors' own checkpoint of those values (its
    ``ModelCompressor``: what llmcompressor's save wrapper runs), written by ``ct_llmcompressor_worker.ct_write``."""
    from lrmq.ptq.exports import save_compressed_tensors, save_fake_quant

    cache = {}

    def make(bits, symmetric, group_size=GROUP):
        key = (bits, symmetric, group_size)
        if key not in cache:
            m, r, _ = rtn_tiny(bits, symmetric, group_size=group_size)
            d = tmp_path_factory.mktemp(f"ct_w{bits}_{'sym' if symmetric else 'asym'}_g{group_size}")
            out = {k: str(d / k) for k in ("lrmq", "fake_quant", "ct")}
            out["values"] = str(d / "values.npz")
            save_compressed_tensors(m, r, out["lrmq"], dtype="float32", tokenizer_from=TINY)
            save_fake_quant(m, out["fake_quant"], dtype="float32", tokenizer_from=TINY)
            np.savez(out["values"], **worker.lrmq_values(m, r, "float32"))
            worker.ct_write(out["fake_quant"], out["values"], out["ct"])
            cache[key] = out
        return cache[key]

    return make


def _scheme(out_dir):
    qc = json.load(open(os.path.join(out_dir, "config.json")))["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    return qc, QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**w))


def _ct_decompress(tensors, prefix, scheme):
    sd = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".weight")}
    return PackedQuantizationCompressor.decompress(sd, scheme)["weight"]  # [N, K] in the scale dtype


def _lrmq_dequant(qw, dtype):
    """lrmq's own QuantizedWeight dequantization, scales rounded to the export dtype as the file holds them."""
    import jax.numpy as jnp

    from lrmq.quant.formats import dequantize

    s = jnp.asarray(qw.scales).astype(getattr(jnp, dtype)).astype(jnp.float32)
    return torch.from_numpy(np.array(dequantize(dataclasses.replace(qw, scales=s, dtype=dtype)).astype(jnp.float32)))


def _bits_equal(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    view = torch.int16 if a.element_size() == 2 else torch.int32
    assert torch.equal(a.contiguous().view(view), b.contiguous().view(view))


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_ct_decompress_bit_exact(rtn_tiny, tmp_path, bits, symmetric, dtype):
    from lrmq.ptq.exports import _hf_prefixes, save_compressed_tensors

    m, r, _ = rtn_tiny(bits, symmetric)
    out = str(tmp_path / "ct")
    save_compressed_tensors(m, r, out, dtype=dtype)
    qc, scheme = _scheme(out)
    assert qc["ignore"] == ["lm_head"] and scheme.weights.num_bits == bits and scheme.weights.symmetric == symmetric
    t = load_file(os.path.join(out, "model.safetensors"))
    prefixes = _hf_prefixes(m)
    assert len(r.packed) == 14
    for path, qw in r.packed.items():
        w = _ct_decompress(t, prefixes[path], scheme)
        ref = _lrmq_dequant(qw, dtype).to(getattr(torch, dtype)).T
        _bits_equal(w, ref)


def _hf_load(d, dequantize):
    """transformers' logits of TOKS for checkpoint ``d`` loaded with ``CompressedTensorsConfig(dequantize)``,
    or the load error."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    try:
        hf = AutoModelForCausalLM.from_pretrained(d, quantization_config=CompressedTensorsConfig(dequantize=dequantize))
    except RuntimeError as e:
        return e
    if not dequantize:
        assert hasattr(hf.model.layers[0].mlp.down_proj, "quantization_scheme")
    with torch.no_grad():
        return hf(torch.from_numpy(TOKS)).logits.float().numpy()


# transformers 5.24 (5.17 did not) checks every checkpoint tensor's shape against the model it builds, quantized
# or not, unless the quantizer quantizes that parameter itself (core_model_loading.set_param_for_module:
# `hf_quantizer.param_needs_quantization`, False for compressed-tensors). For dequantize=False that model is
# compressed on meta by compressed-tensors (0.19 and 0.20.1), whose PackedQuantizationCompressor.compress leaves
# a meta zero point unpacked [N, K/g] while a real one is packed [ceil(N*b/32), K/g] -- so transformers 5.24
# refuses every asymmetric pack-quantized checkpoint on that path, compressed-tensors' and llmcompressor's own
# included (benchmarks/ct_export_vs_llmcompressor.py: transformers 5.17 + compressed-tensors 0.19 load them
# all both ways).
ASYM_COMPRESSED_XFAIL = ("transformers 5.24 refuses the packed asymmetric weight_zero_point on the compressed path "
                         "(dequantize=False) for compressed-tensors' and llmcompressor's own checkpoints as well")


def _load_like_reference(ours, ref_dir, dequantize, lrmq_logits):
    """transformers loads lrmq's export exactly where it loads the reference writer's checkpoint of the same
    values, with the same logits (and lrmq's forward's within LOGIT_ATOL)."""
    got, want = _hf_load(ours, dequantize), _hf_load(ref_dir, dequantize)
    assert isinstance(got, Exception) == isinstance(want, Exception), (got, want)
    if isinstance(got, Exception):
        assert str(got) == str(want).replace(ref_dir, ours)
        pytest.xfail(ASYM_COMPRESSED_XFAIL)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, lrmq_logits, rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dequantize", [True, False])
def test_transformers_loads_ct_export(rtn_tiny, ct_pair, bits, symmetric, dequantize):
    """Loads (and matches lrmq's forward) wherever compressed-tensors' own checkpoint of the same values does;
    the asymmetric compressed path fails for both (ASYM_COMPRESSED_XFAIL)."""
    _, _, ref = rtn_tiny(bits, symmetric)
    d = ct_pair(bits, symmetric)
    _load_like_reference(d["lrmq"], d["ct"], dequantize, ref)


def test_transformers_loads_partial_quantization(rtn_tiny, tmp_path):
    """Linears PTQ left unquantized (here every down_proj) are listed in ignore next to lm_head."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from lrmq.ptq.exports import save_compressed_tensors

    m, r, ref = rtn_tiny(4, True, targets=r"layers\.\d+\.(attn\.(q|k|v|o)_proj|mlp\.(gate|up)_proj)$")
    assert len(r.packed) == 12
    out = str(tmp_path / "ct")
    save_compressed_tensors(m, r, out, dtype="float32")
    qc, _ = _scheme(out)
    assert qc["ignore"] == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    for dequantize in (False, True):
        hf = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=dequantize))
        with torch.no_grad():
            logits = hf(torch.from_numpy(TOKS)).logits.float().numpy()
        np.testing.assert_allclose(logits, ref, rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("symmetric", [False, True])
def test_ct_per_channel(rtn_tiny, ct_pair, symmetric):
    """group_size -1 is written as strategy "channel" (weight_scale [N, 1]), like compressed-tensors' own."""
    from lrmq.ptq.exports import _hf_prefixes

    m, r, ref = rtn_tiny(4, symmetric, group_size=-1)
    d = ct_pair(4, symmetric, -1)
    out = d["lrmq"]
    qc, scheme = _scheme(out)
    assert scheme.weights.strategy == "channel" and scheme.weights.group_size is None
    t = load_file(os.path.join(out, "model.safetensors"))
    prefixes = _hf_prefixes(m)
    for path, qw in r.packed.items():
        assert t[prefixes[path] + ".weight_scale"].shape == (qw.N, 1)
        _bits_equal(_ct_decompress(t, prefixes[path], scheme), _lrmq_dequant(qw, "float32").T)
    _assert_same_as_ct_writer(d)
    for dequantize in (True, False):
        got, want = _hf_load(out, dequantize), _hf_load(d["ct"], dequantize)
        assert isinstance(got, Exception) == isinstance(want, Exception), (got, want)
        if isinstance(got, Exception):  # ASYM_COMPRESSED_XFAIL
            assert not symmetric and not dequantize, got
            continue
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(got, ref, rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("bits, symmetric, group_size", [(4, True, -1), (8, False, GROUP)])  # W3: test_exports.py
def test_lrmq_reads_ct_checkpoints_back(rtn_tiny, ct_pair, bits, symmetric, group_size):
    """``load_model`` reads lrmq's float32 export and compressed-tensors' own checkpoint of the same values (its
    ModelCompressor) as the packed model they came from: the same codes and zero points in every QuantizedKernel
    and the packed model's logits bit for bit (float32: nothing is rounded on the way)."""
    import jax.numpy as jnp

    from lrmq.checkpoint.load import load_model
    from lrmq.ptq.exports import packed_kernels
    from lrmq.quant.formats import unpacked_codes
    from lrmq.quant.transforms import module_at

    m, r, _ = rtn_tiny(bits, symmetric, group_size=group_size)
    with packed_kernels(m, r):
        want = np.asarray(m(jnp.asarray(TOKS)))
    d = ct_pair(bits, symmetric, group_size)
    for which in ("lrmq", "ct"):
        q = load_model(d[which])
        for path, qw in r.packed.items():
            got = module_at(q, path).kernel.get_value()
            assert (got.bits, got.group_size, got.symmetric) == (qw.bits, qw.group_size, qw.symmetric), (which, path)
            np.testing.assert_array_equal(np.asarray(unpacked_codes(got)), np.asarray(unpacked_codes(qw)))
            np.testing.assert_array_equal(np.asarray(got.zeros), np.asarray(qw.zeros))
        np.testing.assert_array_equal(np.asarray(q(jnp.asarray(TOKS))), want, err_msg=which)


# quantization_config keys compressed-tensors 0.20.1's ModelCompressor.update_config writes and lrmq does not
# (the writer's own version; a field for MoE checkpoints), and those lrmq writes as null where 0.20.1 leaves
# null fields out (llmcompressor 0.14 / compressed-tensors 0.19 write them null, as lrmq does)
CT_ONLY_KEYS = {"version", "moe_sparsity_config"}
CT_OMITS_NULL = {"config_groups.group_0.weights.actorder", "config_groups.group_0.weights.block_structure"}
# ... and those llmcompressor 0.14.0.1 (compressed-tensors 0.19.0) writes and lrmq does not (see
# lrmq.ptq.export_formats.ct_quantization_config)
LLMC_ONLY_KEYS = {"version"} | {f"config_groups.group_0.weights.{k}"
                                for k in ("observer", "observer_kwargs", "zp_dtype", "scale_dtype")}


def _parsed(d):
    from compressed_tensors.quantization import QuantizationConfig

    qc = json.load(open(os.path.join(d, "config.json")))["quantization_config"]
    return QuantizationConfig.model_validate(qc)


def _assert_same_as_ct_writer(d):
    """lrmq's export == compressed-tensors' own checkpoint of the same values: every tensor (name, shape, dtype,
    bytes), and the quantization_config key for key but for CT_ONLY_KEYS / CT_OMITS_NULL, and field for field
    once parsed by compressed-tensors."""
    c = worker.compare_dirs(d["lrmq"], d["ct"])
    assert c["tensors_identical"], (c["only_in_a"], c["only_in_b"], c["mismatched"][:5])
    assert not c["config_differ"], c["config_differ"]
    assert set(c["config_only_in_b"]) <= CT_ONLY_KEYS, c["config_only_in_b"]
    assert set(c["config_only_in_a"]) <= CT_OMITS_NULL and not any(c["config_only_in_a"].values()), c
    pa, pb = _parsed(d["lrmq"]), _parsed(d["ct"])
    assert pa.model_dump() == pb.model_dump()
    wa, wb = pa.config_groups["group_0"].weights, pb.config_groups["group_0"].weights
    assert (wa.zp_dtype, wa.scale_dtype, wa.observer) == (wb.zp_dtype, wb.scale_dtype, wb.observer)
    return c


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [False, True])
def test_ct_export_equals_compressed_tensors_writer(ct_pair, bits, symmetric):
    """Tensor for tensor what compressed-tensors' own ModelCompressor (the writer inside llmcompressor) writes for
    the same quantized values; asymmetric zero points packed along N: int32 [ceil(N*b/32), K/g]."""
    d = ct_pair(bits, symmetric)
    c = _assert_same_as_ct_writer(d)
    shapes = {k.rsplit(".", 1)[1]: v for k, v in c["shapes"].items()}  # q_proj: N = K = 128, g = 32
    assert shapes["weight_packed"] == ["int32", [128, -(-128 * bits // 32)]]
    assert shapes["weight_scale"] == ["float32", [128, 4]] and shapes["weight_shape"] == ["int64", [2]]
    if symmetric:
        assert "weight_zero_point" not in shapes
    else:
        assert shapes["weight_zero_point"] == ["int32", [-(-128 * bits // 32), 4]]


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_ct_pack_equals_compressed_tensors_compressor(bits, symmetric, dtype):
    """lrmq's ``ct_pack_quantized_export`` == compressed-tensors' ``PackedQuantizationCompressor.compress`` of the
    same values (weight ``(q - z) * s`` in float32 with the scale in the export dtype, signed int8 zero point),
    for every scale dtype and with K*b and N*b not multiples of 32 (both packed dims end in a padded word)."""
    from lrmq.ptq import export_formats as ef

    K, N, g = 72, 35, 24
    rng = np.random.default_rng(bits + 10 * symmetric)
    hi = 2**bits - 1
    codes = rng.integers(0, hi + 1, (K, N))
    zeros = np.full((K // g, N), 2 ** (bits - 1)) if symmetric else rng.integers(0, hi + 1, (K // g, N))
    scales = rng.uniform(0.01, 0.1, (K // g, N)).astype(np.float32)
    ours = ef.ct_pack_quantized_export(codes, scales, zeros, bits=bits, symmetric=symmetric, dtype=dtype)
    tdt = getattr(torch, dtype)
    s_t = torch.from_numpy(scales.T.copy()).to(tdt)
    w = (torch.from_numpy(codes.T - np.repeat(zeros, g, 0).T).float() * s_t.float().repeat_interleave(g, 1))
    sd = {"weight": w, "weight_scale": s_t,
          "weight_zero_point": torch.from_numpy((zeros.T - 2 ** (bits - 1)).astype(np.int8))}
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=g))
    theirs = PackedQuantizationCompressor.compress(sd, scheme)
    assert sorted(theirs) == sorted(ours)
    for k, v in theirs.items():
        o = torch.from_numpy(np.asarray(ours[k]).view(np.int16) if v.dtype == torch.bfloat16 else ours[k])
        if v.dtype == torch.bfloat16:
            v = v.view(torch.int16)
        assert tuple(o.shape) == tuple(v.shape) and o.dtype == v.dtype, (k, o.shape, v.shape, o.dtype, v.dtype)
        assert torch.equal(o, v), k


def _llmc_python():
    """A python with llmcompressor: $LLMC_PYTHON or benchmarks/ptq_vs_llmcompressor.py's default side venv
    (/work/llmcvenv), else None (llmcompressor is never an lrmq dependency)."""
    import subprocess

    for py in (os.environ.get("LLMC_PYTHON"), "/work/llmcvenv/bin/python"):
        if py and os.path.exists(py) and subprocess.run([py, "-c", "import llmcompressor"], capture_output=True,
                                                        timeout=300).returncode == 0:
            return py
    return None


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_ct_export_equals_llmcompressor(rtn_tiny, ct_pair, tmp_path, bits, symmetric):
    """llmcompressor's own output for the same quantized values (``ct_llmcompressor_worker.py write`` in a side
    venv: oneshot with a data-free QuantizationModifier, lrmq's values injected, save_compressed=True) equals
    lrmq's export tensor for tensor, and its quantization_config key for key but for LLMC_ONLY_KEYS; transformers
    loads lrmq's export exactly where it loads llmcompressor's, in this venv (transformers 5.24, compressed-tensors
    0.20.1) and in llmcompressor's (transformers 5.17, compressed-tensors 0.19.0), with the same logits."""
    import subprocess

    py = _llmc_python()
    if py is None:
        pytest.skip("llmcompressor not installed (set LLMC_PYTHON to a side venv's python that has it)")
    _, _, ref = rtn_tiny(bits, symmetric)
    d = ct_pair(bits, symmetric)
    llmc = str(tmp_path / "llmc")
    p = subprocess.run([py, worker.__file__, "write", d["fake_quant"], d["values"], llmc], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    c = worker.compare_dirs(d["lrmq"], llmc)
    assert c["tensors_identical"], (c["only_in_a"], c["only_in_b"], c["mismatched"][:5])
    assert not c["config_differ"] and not c["config_only_in_a"], c
    assert set(c["config_only_in_b"]) == LLMC_ONLY_KEYS, c["config_only_in_b"]
    np.save(tmp_path / "toks.npy", TOKS)
    p = subprocess.run([py, worker.__file__, "load", str(tmp_path / "toks.npy"), str(tmp_path / "load.json"),
                        d["lrmq"], llmc], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    side = json.load(open(tmp_path / "load.json"))["loads"]
    for mode in ("dequantize", "compressed"):
        a, b = side[d["lrmq"]][mode], side[llmc][mode]
        assert a["ok"] == b["ok"], (mode, a, b)
        if a["ok"]:
            np.testing.assert_array_equal(np.load(a["logits"]), np.load(b["logits"]))
            np.testing.assert_allclose(np.load(a["logits"]), ref, rtol=0, atol=LOGIT_ATOL)
    failed = []
    for dequantize in (True, False):
        got, want = _hf_load(d["lrmq"], dequantize), _hf_load(llmc, dequantize)
        assert isinstance(got, Exception) == isinstance(want, Exception), (dequantize, got, want)
        if isinstance(got, Exception):
            failed.append(dequantize)
            continue
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(got, ref, rtol=0, atol=LOGIT_ATOL)
    assert failed == ([] if symmetric else [False])  # ASYM_COMPRESSED_XFAIL, for both


def test_autoawq_export_read_by_compressed_tensors_converter(rtn_tiny, tmp_path):
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    from lrmq.ptq.exports import _hf_prefixes, save_autoawq

    m, r, _ = rtn_tiny(4, False)
    out = str(tmp_path / "awq")
    save_autoawq(m, r, out)
    awq_cfg = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    conv = AutoAWQConverter.from_autoawq_config(awq_cfg)
    t = conv.process(load_file(os.path.join(out, "model.safetensors")))
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=awq_cfg["group_size"]))
    prefixes = _hf_prefixes(m)
    for path, qw in r.packed.items():
        w = _ct_decompress(t, prefixes[path], scheme)
        _bits_equal(w, _lrmq_dequant(qw, "float16").to(torch.float16).T)


def _gptqmodel_python():
    """A python that has gptqmodel (transformers' AWQ backend): this one, or $LRMQ_GPTQMODEL_PYTHON (a side
    virtualenv; gptqmodel is never an lrmq dependency), else None."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("gptqmodel") is not None:
        return sys.executable
    side = os.environ.get("LRMQ_GPTQMODEL_PYTHON")
    if side and os.path.exists(side) and subprocess.run([side, "-c", "import gptqmodel, transformers"],
                                                        capture_output=True, timeout=300).returncode == 0:
        return side
    return None


def test_autoawq_export_loaded_by_transformers_awq_path(rtn_tiny, tmp_path):
    """transformers' own AWQ path (gptqmodel backend, CPU) loads the AutoAWQ export: every dequantized weight
    equals lrmq's (scales rounded to fp16 as stored) bit for bit, and the logits match lrmq's forward.

    Logit tolerances: the export stores every float tensor in fp16 (embeddings, norms, scales), lrmq's
    reference forward is float32, so the float32 dequantize path differs by that rounding (observed 2.8e-3
    at logit magnitude ~8); gptqmodel's default CPU kernel also runs bf16 activations (observed 3.6e-2)."""
    import subprocess

    py = _gptqmodel_python()
    if py is None:
        pytest.skip("gptqmodel not installed (set LRMQ_GPTQMODEL_PYTHON to a side venv's python that has it)")
    from lrmq.ptq.exports import _hf_prefixes, save_autoawq

    m, r, ref = rtn_tiny(4, False)
    out = str(tmp_path / "awq")
    save_autoawq(m, r, out)
    np.save(tmp_path / "toks.npy", TOKS)
    worker = os.path.join(os.path.dirname(__file__), "scripts", "awq_gptqmodel_worker.py")
    p = subprocess.run([py, worker, out, str(tmp_path / "toks.npy"), str(tmp_path / "res.npz")],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = np.load(tmp_path / "res.npz")
    prefixes = _hf_prefixes(m)
    assert len(r.packed) == 14 and sorted("w:" + prefixes[k] for k in r.packed) == sorted(
        k for k in res.files if k.startswith("w:"))
    for path, qw in r.packed.items():
        got = torch.from_numpy(res["w:" + prefixes[path]])
        _bits_equal(got, _lrmq_dequant(qw, "float16").to(torch.float16))
    d_dequant = float(np.abs(res["logits_dequant"] - ref).max())
    d_kernel = float(np.abs(res["logits_kernel"] - ref).max())
    print(f"AWQ via transformers+gptqmodel ({res['kernel']}): max |logit diff| dequant path {d_dequant:.2e}, "
          f"kernel {d_kernel:.2e}, |logits| max {np.abs(ref).max():.2f}")
    assert d_dequant < 1e-2 and d_kernel < 1e-1


def test_autoawq_moe_export_read_by_compressed_tensors_converter(hf_checkpoint, tmp_path):
    """A Qwen3-MoE whose every layer is sparse, RTN W4 per expert, written as AutoAWQ GEMM: one qweight / qzeros /
    scales per expert under its HF name (`model.layers.N.mlp.experts.E.gate_proj`), the routers float with
    modules_to_not_convert ["mlp.gate"]; compressed-tensors' AutoAWQ reader decompresses every expert's weight to
    lrmq's dequantized one bit for bit."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.ptq.exports import save_autoawq
    from lrmq.ptq.rtn import rtn_quantize_model
    from lrmq.quant.qweight import expert_slice

    path = hf_checkpoint("qwen3_moe_ties")[0]
    m = load_hf_model(path)
    r = rtn_quantize_model(m, bits=4, group_size=32, symmetric=False)
    out = str(tmp_path / "awq")
    save_autoawq(m, r, out)
    awq_cfg = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert awq_cfg["modules_to_not_convert"] == ["mlp.gate"]
    raw = load_file(os.path.join(out, "model.safetensors"))
    assert "model.layers.0.mlp.gate.weight" in raw and not any(k.startswith("model.layers.0.mlp.gate.q") for k in raw)
    t = AutoAWQConverter.from_autoawq_config(awq_cfg).process(raw)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=awq_cfg["group_size"]))
    n = 0
    for lpath, qw in r.packed.items():
        if qw.num_experts is None:
            continue
        i, proj = lpath.split(".")[1], lpath.rsplit(".", 1)[1]
        for e in range(qw.num_experts):
            w = _ct_decompress(t, f"model.layers.{i}.mlp.experts.{e}.{proj}", scheme)
            _bits_equal(w, _lrmq_dequant(expert_slice(qw, e), "float16").to(torch.float16).T)
            n += 1
    assert n == 3 * m.cfg.num_experts * len(m.cfg.moe_layers)
    # and lrmq reads it back (each expert's GEMM tensors stacked into the layer's packed experts): the same logits
    import jax.numpy as jnp

    from lrmq.checkpoint.load import load_model

    back = load_model(out, dtype="float32")
    assert type(back.layers[0].mlp.experts.gate_proj.kernel).__name__ == "QuantizedExpertKernel"
    toks = jnp.asarray(TOKS % m.cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(back(toks)), np.asarray(m(toks)), atol=2e-2)
