"""Model-level exports of a PTQ result (every writer is atomic: a failure leaves no directory).

Inputs: the model after PTQ (its Linears hold the fake-quant float weights, norms hold folded AWQ
scales) and the :class:`lrmq.ptq.result.PTQResult` whose ``packed`` maps ``layers.i.attn.q_proj`` to the
``QuantizedWeight`` with the same codes.

* ``packed`` -- lrmq checkpoint whose Linears hold ``QuantizedKernel``s (``load_model`` reads it;
  ``lrmq.generate`` runs it through ``lrmq.quant.qmatmul``: Pallas int4/int8 kernels, XLA dequant for 3-bit).
* ``fake_quant`` -- Hugging Face checkpoint with dequantized weights in bf16/fp16/fp32 (QuantLRM's
  released format: vLLM / transformers load it as an ordinary model). Note that bf16 rounds the
  dequantized values (fp16 is exact for 3/4-bit grids of ordinary magnitude, not guaranteed).
* ``autoawq`` -- AutoAWQ GEMM (4-bit only): per Linear ``<hf prefix>.qweight`` int32 [K, N/8],
  ``.qzeros`` int32 [K/g, N/8], ``.scales`` fp16 [K/g, N] (``lrmq.ptq.export_formats``), other tensors
  fp16, ``config.json`` with AutoAWQ's ``quantization_config`` and ``torch_dtype: float16``.
* ``compressed_tensors`` -- ``pack-quantized`` (2..8 bit, densely packed as compressed-tensors 0.19+
  reads it): ``.weight_packed``, ``.weight_scale`` (model dtype), ``.weight_zero_point`` (asymmetric),
  ``.weight_shape``; ``quantization_config`` with ``ignore: [lm_head, <unquantized Linears>]`` (lm_head
  even when tied: transformers builds it as an ``nn.Linear``). Tensor for tensor what llmcompressor /
  compressed-tensors write for the same quantized values (tests/test_exports_consumers.py,
  benchmarks/ct_export_vs_llmcompressor.py).

Embeddings, norms, biases and lm_head are written as in ``save_hf_model``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from lrmq.atomic import atomic_dir
from lrmq.checkpoint.hf import copy_tokenizer_files, flat_params, save_hf_model
from lrmq.checkpoint.hf_names import expand
from lrmq.checkpoint.orbax_io import save_lrmq
from lrmq.model.params import LOGICAL_AXES_KEY
from lrmq.ptq import export_formats as ef
from lrmq.quant import packing
from lrmq.quant.qkernel import QuantizedKernel
from lrmq.quant.transforms import module_at

FORMATS = ("packed", "fake_quant", "autoawq", "compressed_tensors")


class ExportError(ValueError):
    pass


def _np_dtype(name: str):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _check_packable(result, what: str):
    if result.g_idx:
        some = sorted(result.g_idx)[:3]
        raise ExportError(f"{what}: {len(result.g_idx)} Linears ({', '.join(some)}, ...) were GPTQ-quantized with "
                          "act_order and dynamic groups (non-monotone g_idx); rerun with gptq.static_groups=true "
                          "or export fake_quant")
    if not result.packed:
        raise ExportError(f"{what}: the PTQ result holds no packed weights")


@contextlib.contextmanager
def packed_kernels(model, result):
    """Temporarily swap every quantized Linear's kernel for a ``QuantizedKernel``."""
    _check_packable(result, "packed export")
    swapped = []
    try:
        for path, qw in result.packed.items():
            lin = module_at(model, path)
            old = lin.kernel
            axes = old.get_metadata().get(LOGICAL_AXES_KEY)
            meta = {LOGICAL_AXES_KEY: tuple(axes)} if axes is not None else {}
            qw = dataclasses.replace(qw, dtype=model.cfg.param_dtype)
            lin.kernel = QuantizedKernel(qw, **meta)
            swapped.append((lin, old))
        yield model
    finally:
        for lin, old in reversed(swapped):
            lin.kernel = old


def save_packed(model, result, out_dir: str, *, tokenizer_from: str | None = None, overwrite: bool = False) -> str:
    with packed_kernels(model, result):
        return save_lrmq(model, out_dir, tokenizer_from=tokenizer_from, overwrite=overwrite,
                         weight_formats=result.formats())


def save_fake_quant(model, out_dir: str, *, dtype: str = "float16", tokenizer_from: str | None = None,
                    overwrite: bool = False) -> str:
    return save_hf_model(model, out_dir, dtype=dtype, tokenizer_from=tokenizer_from, overwrite=overwrite)


def _hf_prefixes(model) -> dict[str, str]:
    """lrmq Linear path ('layers.0.attn.q_proj') -> HF module prefix ('model.layers.0.self_attn.q_proj')."""
    out = {}
    for hf, (ours, tr) in expand(set(flat_params(model)), model.cfg).items():
        if ours.endswith(".kernel") and hf.endswith(".weight"):
            out[ours[: -len(".kernel")]] = hf[: -len(".weight")]
    return out


def _plain_tensors(model, skip: set[str], dtype: str):
    """(HF name, array) of every parameter except the kernels of the quantized Linears."""
    params = flat_params(model)
    npd = _np_dtype(dtype)
    for hf, (ours, tr) in expand(set(params), model.cfg).items():
        if ours in skip:
            continue
        arr = np.asarray(params[ours].get_value())
        if tr == "T":
            arr = arr.T
        yield hf, np.ascontiguousarray(arr.astype(npd))


def _unpacked(qw):
    return packing.unpack(np.asarray(qw.codes), qw.bits, qw.K), np.asarray(qw.scales), np.asarray(qw.zeros)


def _write(tmp: str, tensors: dict, model, quant_config: dict, dtype: str, tokenizer_from: str | None):
    # safetensors writes a numpy array's buffer: transposed views must be made contiguous first
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    hf = model.cfg.to_hf_dict()
    key = "torch_dtype" if "torch_dtype" in hf and "dtype" not in hf else "dtype"
    hf[key] = dtype
    hf["quantization_config"] = quant_config
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if tokenizer_from:
        copy_tokenizer_files(tokenizer_from, tmp)


def save_autoawq(model, result, out_dir: str, *, tokenizer_from: str | None = None, overwrite: bool = False) -> str:
    _check_packable(result, "AutoAWQ export")
    if result.bits != 4:
        raise ExportError(f"AutoAWQ GEMM export is 4-bit only; this result is {result.bits}-bit "
                          "(use compressed_tensors for W3)")
    prefixes = _hf_prefixes(model)
    tensors = {}
    skip = {p + ".kernel" for p in result.packed}
    for path, qw in result.packed.items():
        codes, scales, zeros = _unpacked(qw)
        for k, v in ef.awq_gemm_export(codes, scales, zeros).items():
            tensors[f"{prefixes[path]}.{k}"] = v
    tensors.update(_plain_tensors(model, skip, "float16"))
    group = next(iter(result.packed.values())).group_size
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        _write(tmp, tensors, model, ef.awq_quantization_config(4, group), "float16", tokenizer_from)
    return out_dir


def ct_ignore(model, result) -> list[str]:
    """compressed-tensors ``ignore``: ``lm_head`` always (as llmcompressor writes it, tied or not -- with
    tied embeddings transformers still builds ``lm_head`` as an ``nn.Linear``, which ``targets: [Linear]``
    would otherwise try to load as packed), then every other Linear left unquantized."""
    rest = {hf for path, hf in _hf_prefixes(model).items() if path not in result.packed and hf != "lm_head"}
    return ["lm_head", *sorted(rest)]


def save_compressed_tensors(model, result, out_dir: str, *, dtype: str = "bfloat16", tokenizer_from: str | None = None,
                            overwrite: bool = False) -> str:
    _check_packable(result, "compressed-tensors export")
    bad = sorted({qw.bits for qw in result.packed.values()} - set(ef.CT_BITS))
    if bad:
        raise ExportError(f"compressed-tensors pack-quantized export supports {ef.CT_BITS.start}.."
                          f"{ef.CT_BITS.stop - 1}-bit weights, this result has {bad}-bit")
    prefixes = _hf_prefixes(model)
    tensors = {}
    skip = {p + ".kernel" for p in result.packed}
    groups = {qw.group_size for qw in result.packed.values()}
    if all(np.shape(qw.scales)[0] == 1 for qw in result.packed.values()):
        groups = {-1}  # one group per output row everywhere (group_size -1 resolves to each K): "channel"
    for path, qw in result.packed.items():
        codes, scales, zeros = _unpacked(qw)
        out = ef.ct_pack_quantized_export(codes, scales, zeros, bits=qw.bits, symmetric=qw.symmetric, dtype=dtype)
        for k, v in out.items():
            tensors[f"{prefixes[path]}.{k}"] = v
    tensors.update(_plain_tensors(model, skip, dtype))
    if len(groups) != 1:
        raise ExportError(f"compressed-tensors export needs one group size, found {sorted(groups)}")
    bits = {qw.bits for qw in result.packed.values()}
    sym = {bool(qw.symmetric) for qw in result.packed.values()}
    if len(bits) != 1 or len(sym) != 1:
        raise ExportError(f"compressed-tensors export writes one config group: found bits {sorted(bits)}, "
                          f"symmetric {sorted(sym)}")
    qc = ef.ct_quantization_config(bits.pop(), groups.pop(), sym.pop(), ignore=ct_ignore(model, result))
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        _write(tmp, tensors, model, qc, dtype, tokenizer_from)
    return out_dir


def save_format(fmt: str, model, result, out_dir: str, *, dtype: str = "float16", tokenizer_from: str | None = None,
                overwrite: bool = False) -> str:
    """One export format of a PTQ result, written atomically to ``out_dir`` (the one dispatch over FORMATS:
    ``write_outputs`` writes several as subdirectories, ``lrmq.quantize --format`` one as ``--out``). ``dtype``
    is the fake_quant weights' and compressed_tensors' float dtype (float32 -> bfloat16 there); packed keeps
    the model's and autoawq is float16."""
    kw = dict(tokenizer_from=tokenizer_from, overwrite=overwrite)
    if fmt == "packed":
        return save_packed(model, result, out_dir, **kw)
    if fmt == "fake_quant":
        return save_fake_quant(model, out_dir, dtype=dtype, **kw)
    if fmt == "autoawq":
        return save_autoawq(model, result, out_dir, **kw)
    if fmt == "compressed_tensors":
        return save_compressed_tensors(model, result, out_dir, dtype=dtype if dtype != "float32" else "bfloat16", **kw)
    raise ExportError(f"unknown output format {fmt!r}; known: {list(FORMATS)}")


def write_outputs(model, result, out_dir: str, *, formats=("fake_quant",), dtype: str = "float16",
                  tokenizer_from: str | None = None, overwrite: bool = False, extra_files: dict | None = None,
                  before_rename=None) -> str:
    """All requested formats as subdirectories of ``out_dir`` (``packed/``, ``fake_quant/``,
    ``autoawq/``, ``compressed_tensors/``) plus ``extra_files`` ({name: bytes|str}); the whole tree is
    written into a temporary sibling and renamed at the end. ``before_rename(tmp)`` may add files."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ExportError(f"unknown output formats {unknown}; known: {list(FORMATS)}")
    if "autoawq" in formats and result.bits != 4:
        raise ExportError(f"AutoAWQ GEMM export is 4-bit only; this result is {result.bits}-bit")
    if any(f != "fake_quant" for f in formats):
        _check_packable(result, "export " + ", ".join(f for f in formats if f != "fake_quant"))
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        for f in formats:
            save_format(f, model, result, os.path.join(tmp, f), dtype=dtype, tokenizer_from=tokenizer_from)
        for name, data in (extra_files or {}).items():
            mode = "wb" if isinstance(data, bytes) else "w"
            with open(os.path.join(tmp, name), mode) as fh:
                fh.write(data)
        if before_rename is not None:
            before_rename(tmp)
    return out_dir
