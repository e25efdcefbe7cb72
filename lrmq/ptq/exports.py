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
from flax import nnx
from safetensors.numpy import save_file

from lrmq.atomic import atomic_dir
from lrmq.checkpoint.hf import copy_tokenizer_files, flat_params, hf_config_dict, save_hf_model
from lrmq.checkpoint.hf_names import expand
from lrmq.checkpoint.orbax_io import save_lrmq
from lrmq.checkpoint.shards import DEFAULT_MAX_SHARD_BYTES, ShardWriter
from lrmq.model.decoder import Decoder
from lrmq.model.params import LOGICAL_AXES_KEY
from lrmq.ptq import export_formats as ef
from lrmq.ptq import layer_fn as lf
from lrmq.ptq.stream import LayerOut
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


def _write_config(directory: str, cfg, quant_config: dict, dtype: str, tokenizer_from: str | None) -> None:
    """config.json of a quantized HF export (its dtype field and ``quantization_config``), tokenizer files."""
    hf = cfg.to_hf_dict()
    key = "torch_dtype" if "torch_dtype" in hf and "dtype" not in hf else "dtype"
    hf[key] = dtype
    hf["quantization_config"] = quant_config
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if tokenizer_from:
        copy_tokenizer_files(tokenizer_from, directory)


def _write(tmp: str, tensors: dict, model, quant_config: dict, dtype: str, tokenizer_from: str | None):
    # safetensors writes a numpy array's buffer: transposed views must be made contiguous first
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    _write_config(tmp, model.cfg, quant_config, dtype, tokenizer_from)


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


# ----------------------------------------------------------------------------- streamed, layer by layer


class _HFWriter:
    """One Hugging Face format directory (fake_quant, compressed_tensors, autoawq) written layer by layer into
    shards (``lrmq.checkpoint.shards.ShardWriter``): each tensor as the whole-model writers above make it."""

    def __init__(self, fmt: str, directory: str, cfg, names: dict, dtype: str, max_shard_bytes: int):
        self.fmt, self.directory, self.cfg, self.names = fmt, directory, cfg, names
        self.param_dtype = _np_dtype(cfg.param_dtype)
        # the dtype of the plain (float) tensors: fake_quant's --dtype, AutoAWQ's float16, compressed-tensors' dtype
        self.dtype = {"fake_quant": dtype, "autoawq": "float16",
                      "compressed_tensors": dtype if dtype != "float32" else "bfloat16"}[fmt]
        self.shards = ShardWriter(directory, max_shard_bytes)
        self.groups: set = set()
        self.bits: set = set()
        self.sym: set = set()
        self.per_channel = True
        self.unquantized: list[str] = []  # HF prefixes of Linears left float

    def plain(self, flat: str, value) -> None:
        """A float tensor: through the model's param dtype (as a model written back holds it), then the export
        dtype, in HF orientation."""
        hf, tr = self.names[flat]
        arr = np.asarray(value).astype(self.param_dtype, copy=False).astype(_np_dtype(self.dtype))
        self.shards.add(hf, arr.T if tr == "T" else arr)
        if flat.endswith(".kernel") and hf.endswith(".weight") and hf != "lm_head.weight":
            self.unquantized.append(hf[: -len(".weight")])

    def quantized(self, flat_kernel: str, qw) -> None:
        prefix = self.names[flat_kernel][0][: -len(".weight")]
        codes, scales, zeros = _unpacked(qw)
        if self.fmt == "autoawq":
            out = ef.awq_gemm_export(codes, scales, zeros)
        else:
            out = ef.ct_pack_quantized_export(codes, scales, zeros, bits=qw.bits, symmetric=qw.symmetric,
                                              dtype=self.dtype)
        for k, v in out.items():
            self.shards.add(f"{prefix}.{k}", v)
        self.groups.add(qw.group_size)
        self.bits.add(qw.bits)
        self.sym.add(bool(qw.symmetric))
        self.per_channel &= np.shape(qw.scales)[0] == 1

    def finish(self, tokenizer_from: str | None) -> None:
        self.shards.close()
        if self.fmt == "fake_quant":
            hf, _ = hf_config_dict(self.cfg, self.dtype)
            with open(os.path.join(self.directory, "config.json"), "w") as f:
                json.dump(hf, f, indent=2)
            if tokenizer_from:
                copy_tokenizer_files(tokenizer_from, self.directory)
            return
        if self.fmt == "autoawq":
            qc = ef.awq_quantization_config(4, next(iter(self.groups)))
        else:
            groups = {-1} if self.per_channel else self.groups
            if len(groups) != 1:
                raise ExportError(f"compressed-tensors export needs one group size, found {sorted(groups)}")
            if len(self.bits) != 1 or len(self.sym) != 1:
                raise ExportError(f"compressed-tensors export writes one config group: found bits {sorted(self.bits)}, "
                                  f"symmetric {sorted(self.sym)}")
            qc = ef.ct_quantization_config(next(iter(self.bits)), groups.pop(), next(iter(self.sym)),
                                           ignore=["lm_head", *sorted(self.unquantized)])
        _write_config(self.directory, self.cfg, qc, self.dtype, tokenizer_from)


class StreamedExport:
    """Every requested format of a PTQ run, written layer by layer as the driver finishes each layer, into
    ``out_dir`` atomically (a temporary sibling renamed at the end; an exception removes it)::

        with StreamedExport(out_dir, cfg, ["compressed_tensors"]) as export:
            export.write_other(source.others())          # embedding, final norm, untied head
            result = method(source, qcfg, inputs, emit=export.write_layer)
            export.finish(result, extra_files={...})

    Each format is a subdirectory (as ``write_outputs``; ``root``: the one format at the top), its tensors in shards of at most ``max_shard_bytes``
    with an index, the same tensors as the whole-model writers (``save_compressed_tensors`` ...) write for the
    same result. Host memory: one shard per format and the layer being written."""

    def __init__(self, out_dir: str, cfg, formats, *, dtype: str = "float16", tokenizer_from: str | None = None,
                 overwrite: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, root: bool = False):
        unknown = [f for f in formats if f not in FORMATS]
        if unknown:
            raise ExportError(f"unknown output formats {unknown}; known: {list(FORMATS)}")
        if root and len(formats) != 1:
            raise ExportError(f"one format is written at the top of {out_dir}, got {list(formats)}")
        self.root = root  # the one format at the top of out_dir (lrmq.quantize's --out), not in a subdirectory
        if "packed" in formats:
            raise ExportError("outputs.formats packed is not written layer by layer yet; the streamed run writes "
                              "compressed_tensors (read back by every lrmq command), autoawq or fake_quant")
        self.out_dir, self.cfg, self.formats = out_dir, cfg, list(formats)
        self.dtype, self.tokenizer_from, self.overwrite = dtype, tokenizer_from, overwrite
        self.max_shard_bytes = max_shard_bytes
        self.names = {ours: (hf, tr) for hf, (ours, tr) in expand(set(flat_params(
            nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))), cfg).items()}
        self._ctx = None
        self._writers: dict[str, _HFWriter] = {}
        self._finished = False

    def __enter__(self):
        self._ctx = atomic_dir(self.out_dir, overwrite=self.overwrite)
        tmp = self._ctx.__enter__()
        self.tmp = tmp
        for f in self.formats:
            d = tmp if self.root else os.path.join(tmp, f)
            os.makedirs(d, exist_ok=True)
            self._writers[f] = _HFWriter(f, d, self.cfg, self.names, self.dtype, self.max_shard_bytes)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and not self._finished:
            exc_type, exc = RuntimeError, RuntimeError("StreamedExport left without finish(): nothing written")
            try:
                return self._ctx.__exit__(exc_type, exc, tb)
            finally:
                raise exc
        return self._ctx.__exit__(exc_type, exc, tb)

    def write_other(self, tensors: dict) -> None:
        """The non-layer tensors ({flat lrmq name: array in the param dtype}): embedding, final norm, head."""
        for flat, arr in tensors.items():
            for w in self._writers.values():
                w.plain(flat, arr)

    def write_layer(self, out) -> None:
        """One finished decoder layer (``lrmq.ptq.stream.LayerOut``)."""
        if out.g_idx and any(f != "fake_quant" for f in self.formats):
            raise ExportError(f"layer {out.index}: {sorted(out.g_idx)} were GPTQ-quantized with act_order and dynamic "
                              "groups (non-monotone g_idx); rerun with gptq.static_groups=true or export fake_quant")
        if "autoawq" in self.formats and any(qw.bits != 4 for qw in out.packed.values()):
            raise ExportError("AutoAWQ GEMM export is 4-bit only (use compressed_tensors for W3)")
        paths = dict(lf.layer_spec(self.cfg, out.index).param_paths)
        for key, value in out.params.items():
            flat = f"layers.{out.index}." + ".".join(map(str, paths[key]))
            for fmt, w in self._writers.items():
                if key in out.packed and fmt != "fake_quant":
                    w.quantized(flat, out.packed[key])
                else:
                    w.plain(flat, value)

    def finish(self, result=None, extra_files: dict | None = None) -> None:
        """Close every format (last shards, indexes, config.json with its quantization_config, tokenizer files)
        and add ``extra_files`` ({name: bytes | str}) at the top; the rename happens when the ``with`` exits."""
        for w in self._writers.values():
            w.finish(self.tokenizer_from)
        for name, data in (extra_files or {}).items():
            with open(os.path.join(self.tmp, name), "wb" if isinstance(data, bytes) else "w") as fh:
                fh.write(data)
        self._finished = True


def stream_model(model, result, export: StreamedExport) -> None:
    """Feed an in-memory quantized model (and its ``result``) into ``export`` layer by layer, as the streamed
    driver does: the non-layer tensors, then each layer's weights and packed Linears."""
    params = flat_params(model)
    export.write_other({n: np.asarray(v.get_value()) for n, v in params.items() if not n.startswith("layers.")})
    for i, layer in enumerate(model.layers):
        packed = {name: qw for name in lf.LINEARS
                  if (qw := result.packed.get(f"layers.{i}.{lf.MODULE_OF[name]}.{name}")) is not None}
        export.write_layer(LayerOut(index=i, params={k: np.asarray(v) for k, v in lf.get_layer_params(layer).items()},
                                    packed=packed))
