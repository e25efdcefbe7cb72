"""Model-level exports of a PTQ result (every writer is atomic: a failure leaves no directory).

Inputs: the model after PTQ (its Linears hold the fake-quant float weights, norms hold folded AWQ
scales) and the :class:`lrmq.ptq.result.PTQResult` whose ``packed`` maps ``layers.i.attn.q_proj`` to the
``QuantizedWeight`` with the same codes.

* ``packed`` -- lrmq checkpoint whose Linears hold ``QuantizedKernel``s (``load_model`` reads it;
  ``lrmq.generate`` runs it through ``lrmq.quant.qmatmul``: Pallas int4/int8 kernels, XLA dequant for 3-bit),
  in the safetensors storage layout (``params.safetensors`` shards, ``lrmq.checkpoint.orbax_io.LrmqWriter``).
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

Embeddings, norms, biases and lm_head are written as in ``save_hf_model`` (the same names, orientation, dtype).
Every format has one writer, ``StreamedExport`` (layer by layer, safetensors shards with an index); the
whole-model functions feed it an in-memory model (``stream_model``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import ml_dtypes
import numpy as np
from flax import nnx

from lrmq.atomic import atomic_dir
from lrmq.checkpoint.hf import copy_tokenizer_files, flat_params, hf_config_dict
from lrmq.checkpoint.hf_names import expand
from lrmq.checkpoint.orbax_io import LrmqWriter
from lrmq.checkpoint.shards import DEFAULT_MAX_SHARD_BYTES, ShardWriter
from lrmq.model.decoder import Decoder
from lrmq.model.params import LOGICAL_AXES_KEY
from lrmq.ptq import export_formats as ef
from lrmq.ptq import layer_fn as lf
from lrmq.ptq.stream import LayerOut
from lrmq.quant import packing
from lrmq.quant.qkernel import QuantizedKernel
from lrmq.quant.qweight import expert_slice
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
    return _export(model, result, out_dir, ["packed"], dtype={"packed": None}, tokenizer_from=tokenizer_from,
                   overwrite=overwrite, root=True)


def save_fake_quant(model, out_dir: str, *, dtype: str = "float16", tokenizer_from: str | None = None,
                    overwrite: bool = False) -> str:
    return _export(model, None, out_dir, ["fake_quant"], dtype={"fake_quant": dtype}, tokenizer_from=tokenizer_from,
                   overwrite=overwrite, root=True)


def _hf_prefixes(model) -> dict[str, str]:
    """lrmq Linear path ('layers.0.attn.q_proj') -> HF module prefix ('model.layers.0.self_attn.q_proj')."""
    out = {}
    for hf, slot in expand(set(flat_params(model)), model.cfg).items():
        if slot.path.endswith(".kernel") and hf.endswith(".weight") and slot.expert is None:
            out[slot.path[: -len(".kernel")]] = hf[: -len(".weight")]
    return out


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


def check_result(formats, result) -> None:
    """What a whole PTQ result must be for ``formats`` (ExportError before any file is written): AutoAWQ 4-bit,
    compressed-tensors 2..8 bit, packed weights with monotone groups for every format but fake_quant."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ExportError(f"unknown output formats {unknown}; known: {list(FORMATS)}")
    if "autoawq" in formats and result.bits != 4:
        raise ExportError(f"AutoAWQ GEMM export is 4-bit only; this result is {result.bits}-bit "
                          "(use compressed_tensors for W3)")
    if any(f != "fake_quant" for f in formats):
        _check_packable(result, "export " + ", ".join(f for f in formats if f != "fake_quant"))
    bad = sorted({qw.bits for qw in result.packed.values()} - set(ef.CT_BITS))
    if "compressed_tensors" in formats and bad:
        raise ExportError(f"compressed-tensors pack-quantized export supports {ef.CT_BITS.start}.."
                          f"{ef.CT_BITS.stop - 1}-bit weights, this result has {bad}-bit")


def _export(model, result, out_dir: str, formats, *, dtype, tokenizer_from: str | None, overwrite: bool,
            root: bool = False, extra_files: dict | None = None, before_rename=None,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """The whole-model writers: the in-memory model fed layer by layer (``stream_model``) into the one streamed
    writer of each format (``StreamedExport``)."""
    if result is not None:
        check_result(formats, result)
    with StreamedExport(out_dir, model.cfg, formats, dtype=dtype, tokenizer_from=tokenizer_from,
                        overwrite=overwrite, root=root, max_shard_bytes=max_shard_bytes) as export:
        stream_model(model, result, export)
        export.finish(result, extra_files=extra_files)
        if before_rename is not None:
            before_rename(export.tmp)
    return out_dir


def save_autoawq(model, result, out_dir: str, *, tokenizer_from: str | None = None, overwrite: bool = False) -> str:
    return _export(model, result, out_dir, ["autoawq"], dtype={"autoawq": "float16"}, tokenizer_from=tokenizer_from,
                   overwrite=overwrite, root=True)


def save_compressed_tensors(model, result, out_dir: str, *, dtype: str = "bfloat16", tokenizer_from: str | None = None,
                            overwrite: bool = False) -> str:
    return _export(model, result, out_dir, ["compressed_tensors"], dtype={"compressed_tensors": dtype},
                   tokenizer_from=tokenizer_from, overwrite=overwrite, root=True)


def format_dtype(fmt: str, dtype: str) -> str | None:
    """The float dtype ``fmt`` is written in for a run's ``outputs.dtype``: fake_quant's weights in ``dtype``,
    compressed_tensors' in ``dtype`` (float32 -> bfloat16), autoawq float16, packed the model's own (None)."""
    return {"fake_quant": dtype, "autoawq": "float16", "packed": None,
            "compressed_tensors": dtype if dtype != "float32" else "bfloat16"}[fmt]


def save_format(fmt: str, model, result, out_dir: str, *, dtype: str = "float16", tokenizer_from: str | None = None,
                overwrite: bool = False) -> str:
    """One export format of a PTQ result, written atomically to ``out_dir`` (``write_outputs`` writes several as
    subdirectories, ``lrmq.quantize --format`` one as ``--out``). ``dtype``: ``format_dtype``."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown output format {fmt!r}; known: {list(FORMATS)}")
    return _export(model, result, out_dir, [fmt], dtype=dtype, tokenizer_from=tokenizer_from, overwrite=overwrite,
                   root=True)


def write_outputs(model, result, out_dir: str, *, formats=("fake_quant",), dtype: str = "float16",
                  tokenizer_from: str | None = None, overwrite: bool = False, extra_files: dict | None = None,
                  before_rename=None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """All requested formats as subdirectories of ``out_dir`` (``packed/``, ``fake_quant/``,
    ``autoawq/``, ``compressed_tensors/``) plus ``extra_files`` ({name: bytes|str}); the whole tree is
    written into a temporary sibling and renamed at the end. ``before_rename(tmp)`` may add files. Each format's
    tensors in shards of at most ``max_shard_bytes`` (``StreamedExport``)."""
    return _export(model, result, out_dir, list(formats), dtype=dtype, tokenizer_from=tokenizer_from,
                   overwrite=overwrite, extra_files=extra_files, before_rename=before_rename,
                   max_shard_bytes=max_shard_bytes)


# ----------------------------------------------------------------------------- streamed, layer by layer


class _HFWriter:
    """One Hugging Face format directory (fake_quant, compressed_tensors, autoawq) written layer by layer into
    shards (``lrmq.checkpoint.shards.ShardWriter``): each tensor as the whole-model writers above make it."""

    def __init__(self, fmt: str, directory: str, cfg, names: dict, dtype: str, max_shard_bytes: int):
        self.fmt, self.directory, self.cfg, self.names = fmt, directory, cfg, names
        self.param_dtype = _np_dtype(cfg.param_dtype)
        self.dtype = dtype  # of the plain (float) tensors (format_dtype)
        self.shards = ShardWriter(directory, max_shard_bytes)
        self.groups: set = set()
        self.bits: set = set()
        self.sym: set = set()
        self.per_channel = True
        self.unquantized: list[str] = []  # HF prefixes of Linears left float

    def plain(self, flat: str, value) -> None:
        """A float tensor: through the model's param dtype (as a model written back holds it), then the export
        dtype, in HF orientation (stacked experts: one tensor per expert)."""
        arr = np.asarray(value).astype(self.param_dtype, copy=False).astype(_np_dtype(self.dtype))
        for hf, tr, e in self.names[flat]:
            a = arr if e is None else arr[e]
            self.shards.add(hf, a.T if tr == "T" else a)
            if flat.endswith(".kernel") and hf.endswith(".weight") and hf != "lm_head.weight":
                self.unquantized.append(hf[: -len(".weight")])

    def quantized(self, flat_kernel: str, qw) -> None:
        """A packed weight (stacked experts: each expert's slice under its own per-expert HF name)."""
        for hf, _, e in self.names[flat_kernel]:
            self._quantized_one(hf[: -len(".weight")], qw if e is None else expert_slice(qw, e))

    def _quantized_one(self, prefix: str, qw) -> None:
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

    def finish(self, tokenizer_from: str | None, result=None) -> None:
        self.shards.close()
        if self.fmt == "fake_quant":
            hf, _ = hf_config_dict(self.cfg, self.dtype)
            with open(os.path.join(self.directory, "config.json"), "w") as f:
                json.dump(hf, f, indent=2)
            if tokenizer_from:
                copy_tokenizer_files(tokenizer_from, self.directory)
            return
        if not self.bits:
            raise ExportError(f"{self.fmt} export: no Linear was given packed weights (the PTQ result holds none)")
        if self.fmt == "autoawq":
            # a mixture-of-experts model's routers stay float (pipeline.check_moe: every layer sparse, so the key
            # names the routers alone under AutoAWQ's and vLLM's substring match too)
            qc = ef.awq_quantization_config(4, next(iter(self.groups)),
                                            ["mlp.gate"] if self.cfg.num_experts else None)
        else:
            groups = {-1} if self.per_channel else self.groups
            if len(groups) != 1:
                raise ExportError(f"compressed-tensors export needs one group size, found {sorted(groups)}")
            if len(self.bits) != 1 or len(self.sym) != 1:
                raise ExportError(f"compressed-tensors export writes one config group: found bits {sorted(self.bits)}, "
                                  f"symmetric {sorted(self.sym)}")
            qc = ef.ct_quantization_config(next(iter(self.bits)), groups.pop(), next(iter(self.sym)),
                                           ignore=ct_ignore(self.unquantized),
                                           actorder=getattr(result, "actorder", None))
        _write_config(self.directory, self.cfg, qc, self.dtype, tokenizer_from)


def ct_ignore(unquantized) -> list[str]:
    """compressed-tensors' ``ignore`` (``unquantized``: the float Linears' HF prefixes in write order, layer by
    layer). Dense models: ``lm_head`` first, then the others sorted (lrmq's order before MoE, kept). A
    mixture-of-experts model: what llmcompressor 0.14 / compressed-tensors 0.19 write for a recipe ignoring
    ``lm_head`` and ``re:.*mlp.gate$`` (its Qwen3-MoE example) -- every unquantized Linear by name in the model's
    module order (the routers ``model.layers.N.mlp.gate``), ``lm_head`` last."""
    if any(m.endswith(".mlp.gate") for m in unquantized):
        return [*unquantized, "lm_head"]
    return ["lm_head", *sorted(unquantized)]


class _PackedWriter:
    """The ``packed`` format (an lrmq checkpoint) written layer by layer: ``lrmq.checkpoint.orbax_io.LrmqWriter``,
    the safetensors storage layout (``params.safetensors`` shards + index, the lrmq_state.json manifest); float
    variables in the model's param dtype, packed kernels as ``packed_kernels`` stores them."""

    def __init__(self, directory: str, cfg, max_shard_bytes: int):
        self.param_dtype = _np_dtype(cfg.param_dtype)
        self.writer = LrmqWriter(directory, cfg, max_shard_bytes=max_shard_bytes)

    def plain(self, flat: str, value) -> None:
        self.writer.add_param(flat, np.asarray(value).astype(self.param_dtype, copy=False))

    def quantized(self, flat_kernel: str, qw) -> None:
        self.writer.add_quantized(flat_kernel, qw)

    def finish(self, tokenizer_from: str | None, result=None) -> None:
        self.writer.close(weight_formats=result.formats() if result is not None else None,
                          tokenizer_from=tokenizer_from)


class StreamedExport:
    """Every requested format of a PTQ run, written layer by layer as the driver finishes each layer, into
    ``out_dir`` atomically (a temporary sibling renamed at the end; an exception removes it)::

        with StreamedExport(out_dir, cfg, ["compressed_tensors"]) as export:
            export.write_other(source.others())          # embedding, final norm, untied head
            result = method(source, qcfg, inputs, emit=export.write_layer)
            export.finish(result, extra_files={...})

    Each format is a subdirectory (as ``write_outputs``; ``root``: the one format at the top), its tensors in
    shards of at most ``max_shard_bytes`` with an index. The whole-model writers (``write_outputs``,
    ``save_compressed_tensors`` ...) are this writer fed by ``stream_model``: one implementation of each format.
    ``dtype``: the run's ``outputs.dtype`` (each format's float dtype by ``format_dtype``), or {format: dtype}.
    Every float tensor goes f32 -> the config's param dtype -> the format's dtype, as a model written back and then
    exported does. ``finish`` refuses an export where a tensor of the model was never written. Host memory: one
    shard per format and the layer being written."""

    def __init__(self, out_dir: str, cfg, formats, *, dtype: str | dict = "float16", tokenizer_from: str | None = None,
                 overwrite: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, root: bool = False):
        unknown = [f for f in formats if f not in FORMATS]
        if unknown:
            raise ExportError(f"unknown output formats {unknown}; known: {list(FORMATS)}")
        if root and len(formats) != 1:
            raise ExportError(f"one format is written at the top of {out_dir}, got {list(formats)}")
        self.root = root  # the one format at the top of out_dir (lrmq.quantize's --out), not in a subdirectory
        self.out_dir, self.cfg, self.formats = out_dir, cfg, list(formats)
        self.dtypes = {f: dtype[f] if isinstance(dtype, dict) else format_dtype(f, dtype) for f in formats}
        self.tokenizer_from, self.overwrite = tokenizer_from, overwrite
        self.max_shard_bytes = max_shard_bytes
        # lrmq parameter -> its HF tensors [(name, transform, expert row or None)]: one per expert for the stacked
        # expert kernels of a mixture-of-experts layer (expert order), one otherwise
        self.names: dict[str, list] = {}
        for hf, slot in expand(set(flat_params(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))), cfg).items():
            self.names.setdefault(slot.path, []).append((hf, slot.transform, slot.expert))
        self._ctx = None
        self._writers: dict[str, _HFWriter | _PackedWriter] = {}
        self._seen: set[str] = set()  # flat lrmq names written
        self._finished = False

    def __enter__(self):
        self._ctx = atomic_dir(self.out_dir, overwrite=self.overwrite)
        tmp = self._ctx.__enter__()
        self.tmp = tmp
        for f in self.formats:
            d = tmp if self.root else os.path.join(tmp, f)
            os.makedirs(d, exist_ok=True)
            self._writers[f] = (_PackedWriter(d, self.cfg, self.max_shard_bytes) if f == "packed" else
                                _HFWriter(f, d, self.cfg, self.names, self.dtypes[f], self.max_shard_bytes))
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
            self._mark(flat)
            for w in self._writers.values():
                w.plain(flat, arr)

    def _mark(self, flat: str) -> None:
        if flat not in self.names:
            raise ExportError(f"{flat}: not a parameter of this model's config")
        if flat in self._seen:
            raise ExportError(f"{flat}: written twice")
        self._seen.add(flat)

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
            self._mark(flat)
            for fmt, w in self._writers.items():
                if key in out.packed and fmt != "fake_quant":
                    w.quantized(flat, out.packed[key])
                else:
                    w.plain(flat, value)

    def finish(self, result=None, extra_files: dict | None = None) -> None:
        """Close every format (last shards, indexes, config.json with its quantization_config, tokenizer files)
        and add ``extra_files`` ({name: bytes | str}) at the top; the rename happens when the ``with`` exits."""
        missing = sorted(set(self.names) - self._seen) if self._writers else []
        if missing:
            raise ExportError(f"{self.out_dir}: {len(missing)} tensors of the model were never written "
                              f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})")
        for w in self._writers.values():
            w.finish(self.tokenizer_from, result)
        for name, data in (extra_files or {}).items():
            with open(os.path.join(self.tmp, name), "wb" if isinstance(data, bytes) else "w") as fh:
                fh.write(data)
        self._finished = True


def stream_model(model, result, export: StreamedExport) -> None:
    """Feed an in-memory quantized model (and its ``result``) into ``export`` layer by layer, as the streamed
    driver does: the non-layer tensors, then each layer's weights and packed Linears."""
    params = flat_params(model)
    export.write_other({n: np.asarray(v.get_value()) for n, v in params.items() if not n.startswith("layers.")})
    packed_all = result.packed if result is not None else {}
    g_idx_all = result.g_idx if result is not None else {}
    for i, layer in enumerate(model.layers):
        moe = model.cfg.is_moe_layer(i)
        paths = {name: f"layers.{i}.{lf.module_path(name, moe)}" for name in lf.LINEARS}
        export.write_layer(LayerOut(
            index=i, params={k: np.asarray(v) for k, v in lf.get_layer_params(layer).items()},
            packed={n: packed_all[p] for n, p in paths.items() if p in packed_all},
            g_idx={n: np.asarray(g_idx_all[p]) for n, p in paths.items() if p in g_idx_all}))
