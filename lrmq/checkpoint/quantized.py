"""Quantized Hugging Face checkpoints in: the formats `lrmq.ptq.exports` writes (and llmcompressor / AutoAWQ
write), read back as the packed model they hold.

The format comes from the checkpoint's ``config.json`` ``quantization_config`` (`hf_quantization`), never from
the user:

* compressed-tensors ``pack-quantized`` (``quant_method: compressed-tensors``; llmcompressor's W4A16 / W8A16
  ...): int weights, 2..8 bits, symmetric or asymmetric, ``strategy`` ``channel`` or ``group``; each targeted
  Linear's ``weight_packed`` / ``weight_scale`` / ``weight_zero_point`` / ``weight_shape`` (/ ``weight_g_idx``)
  are unpacked by `lrmq.ptq.export_formats.ct_pack_quantized_import`, the exact inverse of the writer.
* compressed-tensors ``dense`` (``quantization_status: frozen``; llmcompressor's ``save_compressed=False``):
  fake-quant float weights next to their ``weight_scale`` / ``weight_zero_point``; the float weights are
  read, the quantization parameters skipped.
* AutoAWQ GEMM (``quant_method: awq``, ``version: gemm``, 4-bit): ``qweight`` / ``qzeros`` / ``scales``,
  unpacked by `export_formats.awq_gemm_import` (AutoAWQ's interleaved nibble order reversed).
* lrmq's own ``fake_quant`` export (and any float checkpoint) has no ``quantization_config``: it is an ordinary
  Hugging Face checkpoint and never comes here.

`load_quantized_hf` builds the model with every quantized Linear's kernel a `QuantizedKernel` holding the same
codes, scales (widened exactly from the stored fp16 / bf16) and zero points: 4- and 8-bit weights run through
lrmq's Pallas kernels (`lrmq.quant.formats.PACKINGS`), other widths are dequantized by XLA at each matmul, as in
lrmq's own ``packed`` checkpoints. A weight a `QuantizedWeight` cannot hold (act-order ``weight_g_idx`` with
groups out of order, a K the packing does not divide) is dequantized once into a float kernel. Every other tensor
is read by `lrmq.checkpoint.hf.fill_hf_params`, so a bucket checkpoint (``gs://``, `lrmq.checkpoint.remote`) is
streamed the same way.

A mixture-of-experts model (Qwen3-MoE) holds its experts as llmcompressor writes them, one Linear per expert
(``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight_packed`` ...): each expert is read as a Linear alone and
the E `QuantizedWeight`s are stacked (`lrmq.quant.qweight.stack_experts`) into the layer's `QuantizedExpertKernel`
(the grouped dequant-matmul). By the dense rule, a projection whose experts do not all fit one `QuantizedWeight`
format (an expert left float, groups out of order) is dequantized once into the float [E, K, N] kernel. A missing
expert tensor is one line naming it and its file.

`quantized_format(path)` names the format of any quantized checkpoint (these, or an lrmq ``packed`` one) in one
line; `refuse_quantized` is the one-line refusal of a command or mode that needs float weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

import numpy as np
from flax import nnx

from lrmq import paths
from lrmq.checkpoint import remote
from lrmq.checkpoint.hf import (CheckpointError, _checked, _place, _remote, fill_hf_params, flat_params,
                              tensor_index)
from lrmq.checkpoint.hf_names import expand
from lrmq.checkpoint.orbax_io import STATE_FILE, is_lrmq_checkpoint, read_weight_formats
from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder
from lrmq.ptq import export_formats as ef
from lrmq.quant import packing
from lrmq.quant.qweight import QuantizedWeight, stack_experts
from lrmq.quant.transforms import module_at, set_packed_expert_kernel, set_packed_kernel
from lrmq.sharding import LOGICAL_AXES_KEY

CT_FORMATS = ("pack-quantized", "dense")
AWQ_TENSORS = ("qweight", "qzeros", "scales")
CT_TENSORS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
CT_QPARAMS = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_global_scale")  # beside a dense weight


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """One group of a checkpoint's quantized weights: `bits`, `group_size` (-1 per output channel),
    `symmetric`."""

    bits: int
    group_size: int
    symmetric: bool

    def describe(self) -> str:
        g = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"int{self.bits} {'sym' if self.symmetric else 'asym'} {g}"


@dataclasses.dataclass(frozen=True)
class HFQuantization:
    """A quantized Hugging Face checkpoint's format, from its config.json (`source`).

    method: "compressed-tensors" or "awq"; fmt: compressed-tensors' "pack-quantized" / "dense", or "gemm";
    groups: ((targets, WeightScheme), ...) in config order; ignore: module names (or ``re:`` patterns) left
    in float."""

    method: str
    fmt: str
    groups: tuple
    ignore: tuple
    source: str

    def describe(self) -> str:
        """E.g. ``compressed-tensors pack-quantized int4 asym g128``, ``AutoAWQ GEMM int4 asym g128``."""
        schemes = ", ".join(dict.fromkeys(s.describe() for _, s in self.groups))
        head = "AutoAWQ GEMM" if self.method == "awq" else f"compressed-tensors {self.fmt}"
        return f"{head} {schemes}" + (" (fake-quant float weights)" if self.fmt == "dense" else "")

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of HF module `module` ('model.layers.0.self_attn.q_proj'), None when it is ignored or no
        group targets it (compressed-tensors' matching: a name, ``re:<pattern>``, or the class ``Linear``)."""
        if any(_matches(t, module) for t in self.ignore):
            return None
        return next((s for targets, s in self.groups if any(_matches(t, module) for t in targets)), None)


def _matches(target: str, module: str) -> bool:
    if target == "Linear":
        return True  # every module lrmq reads a weight scheme for is a Linear
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def _fail(source: str, what: str) -> CheckpointError:
    return CheckpointError(f"{source}: quantization_config: {what}")


def _int(v, source, key, lo=None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
        raise _fail(source, f"{key} must be an integer{f' >= {lo}' if lo is not None else ''}, found {v!r}")
    return v


def _ct_scheme(w: dict, source: str, name: str) -> WeightScheme:
    where = f"config_groups.{name}.weights"
    if not isinstance(w, dict):
        raise _fail(source, f"{where} must be a mapping of the weight quantization, found {w!r}")
    if w.get("type", "int") != "int":
        raise _fail(source, f"{where}.type {w.get('type')!r}: lrmq reads integer weight quantization only")
    bits = _int(w.get("num_bits"), source, f"{where}.num_bits")
    if bits not in ef.CT_BITS:
        raise _fail(source, f"{where}.num_bits {bits}: lrmq reads {ef.CT_BITS.start}..{ef.CT_BITS.stop - 1}-bit weights")
    strategy = w.get("strategy")
    if strategy == "channel":
        g = -1
    elif strategy == "group":
        g = _int(w.get("group_size"), source, f"{where}.group_size", 1)
    else:
        raise _fail(source, f"{where}.strategy {strategy!r}: lrmq reads 'channel' and 'group'")
    if w.get("dynamic"):
        raise _fail(source, f"{where}.dynamic is set: lrmq reads static weight quantization only")
    return WeightScheme(bits, g, bool(w.get("symmetric", True)))


def _version(v) -> tuple | None:
    m = re.match(r"(\d+)\.(\d+)", str(v)) if v else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def _parse(qc, source: str) -> HFQuantization:
    if not isinstance(qc, dict):
        raise _fail(source, f"expected a mapping, found {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _fail(source, f"AutoAWQ version {version!r}: lrmq reads the GEMM layout only")
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise _fail(source, f"AutoAWQ bits {bits!r}: the GEMM layout is 4-bit")
        g = _int(qc.get("group_size", qc.get("q_group_size")), source, "group_size")
        if not qc.get("zero_point", True):
            raise _fail(source, "AutoAWQ zero_point false: lrmq reads AutoAWQ's zero-point (asymmetric) GEMM layout")
        ignore = tuple(qc.get("modules_to_not_convert") or ())
        return HFQuantization("awq", "gemm", ((("Linear",), WeightScheme(4, g if g > 0 else -1, False)),),
                              ("lm_head", *ignore), source)
    if method == "compressed-tensors":
        fmt = qc.get("format")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise _fail(source, "config_groups is missing or empty")
        parsed = []
        for name, grp in groups.items():
            if not isinstance(grp, dict):
                raise _fail(source, f"config_groups.{name} must be a mapping, found {grp!r}")
            gfmt = grp.get("format") or fmt
            if gfmt not in CT_FORMATS:
                raise _fail(source, f"format {gfmt!r}: lrmq reads compressed-tensors {' and '.join(CT_FORMATS)}")
            for act in ("input_activations", "output_activations"):
                if grp.get(act):
                    raise _fail(source, f"config_groups.{name}.{act} is set: lrmq reads weight-only quantization "
                                        "(W<n>A16), not quantized activations")
            targets = grp.get("targets") or []
            if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
                raise _fail(source, f"config_groups.{name}.targets must be a list of names")
            parsed.append((tuple(targets), _ct_scheme(grp.get("weights"), source, name)))
            fmt = gfmt
        version = _version(qc.get("version"))
        odd = sorted({s.bits for _, s in parsed} - {2, 4, 8})
        if version and version < (0, 19) and odd and fmt == "pack-quantized":
            raise _fail(source, f"written by compressed-tensors {qc['version']}, whose {odd[0]}-bit packing (whole "
                                "values per int32 word) predates the dense bit stream lrmq reads (0.19+); "
                                "2-, 4- and 8-bit checkpoints are the same in both")
        if qc.get("kv_cache_scheme"):
            raise _fail(source, "kv_cache_scheme is set: lrmq does not read a quantized KV cache from a checkpoint")
        if (qc.get("sparsity_config") or {}).get("format") not in (None, "dense"):
            raise _fail(source, f"sparsity_config format {qc['sparsity_config']['format']!r}: lrmq reads dense "
                                "(unsparsified) checkpoints")
        return HFQuantization("compressed-tensors", fmt, tuple(parsed), tuple(qc.get("ignore") or ()), source)
    raise _fail(source, f"quant_method {method!r} is not read by lrmq; it reads compressed-tensors "
                        f"({', '.join(CT_FORMATS)}) and AutoAWQ GEMM checkpoints")


def hf_quantization(path: str) -> HFQuantization | None:
    """The quantization of the Hugging Face checkpoint directory `path` (a local view for a bucket), None
    for a float checkpoint; CheckpointError naming config.json for one lrmq cannot read."""
    cfg_path = os.path.join(path, "config.json")
    try:
        hf = paths.read_json(cfg_path, what="model config")
    except (OSError, paths.FileFormatError):
        return None  # reported by the config reader
    qc = hf.get("quantization_config") if isinstance(hf, dict) else None
    if qc is None:
        return None
    return _parse(qc, cfg_path)


def quantized_format(path: str) -> str | None:
    """A one-line description of the quantized checkpoint at `path` (resolved), None for a float one: a
    quantized Hugging Face checkpoint's `HFQuantization.describe`, or an lrmq ``packed`` checkpoint's."""

    if not os.path.isdir(path):
        return None
    if is_lrmq_checkpoint(path):
        try:  # the format it was written with (lrmq.quant.formats.WeightFormat), else what its arrays say
            recorded = read_weight_formats(path)
        except CheckpointError:
            recorded = []
        if recorded:
            return "lrmq packed " + ", ".join(f.describe() for f in recorded)
        try:
            variables = paths.read_json(os.path.join(path, STATE_FILE), what="lrmq state manifest").get("variables")
        except (OSError, paths.FileFormatError, AttributeError):
            return None  # reported by the loader
        statics = [e.get("static") or {} for e in (variables or {}).values()
                   if isinstance(e, dict) and e.get("type") == "QuantizedKernel"]
        if not statics:
            return None
        kinds = dict.fromkeys("nf4" if s.get("fmt") == "nf4" else
                              f"int{s.get('bits')} {'sym' if s.get('symmetric') else 'asym'} g{s.get('group_size')}"
                              for s in statics)
        return f"lrmq packed {', '.join(kinds)}"
    q = hf_quantization(path)
    return q.describe() if q else None


def refuse_quantized(path: str, what: str, hint: str = "") -> None:
    """`what` (a command or mode) needs float weights: a one-line CheckpointError naming the checkpoint's
    config.json and its format when `path` (resolved) holds a quantized model."""
    desc = quantized_format(path)
    if desc:
        raise CheckpointError(f"{os.path.join(path, 'config.json')}: {what} needs float weights, this checkpoint is "
                              f"already quantized ({desc}){'; ' + hint if hint else ''}")


class _Tensors:
    """Reads whole tensors of a checkpoint's `tensor_index`, local (safetensors) or in a bucket."""

    def __init__(self, index: dict[str, str]):
        self.index = index
        self._stack = contextlib.ExitStack()
        self._open: dict = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def get(self, name: str) -> np.ndarray:
        f = self.index[name]
        if paths.is_url(f):
            return np.asarray(_remote(f).tensor(name))
        if f not in self._open:
            from safetensors import safe_open

            self._open[f] = self._stack.enter_context(safe_open(f, framework="numpy"))
        return self._open[f].get_tensor(name)


def _linear_prefixes(abstract: Decoder) -> dict[str, str]:
    """HF module prefix ('model.layers.0.self_attn.q_proj') -> lrmq Linear path ('layers.0.attn.q_proj')."""
    return {hf[: -len(".weight")]: slot.path[: -len(".kernel")]
            for hf, slot in expand(set(flat_params(abstract)), abstract.cfg).items()
            if slot.path.endswith(".kernel") and hf.endswith(".weight") and slot.expert is None}


def _expert_prefixes(abstract: Decoder) -> dict[str, list[str]]:
    """lrmq ExpertLinear path ('layers.0.mlp.experts.gate_proj') -> its experts' HF module prefixes in expert order
    ('model.layers.0.mlp.experts.{e}.gate_proj'): the per-expert Linears llmcompressor quantizes one by one."""
    out: dict[str, list[str]] = {}
    for hf, slot in expand(set(flat_params(abstract)), abstract.cfg).items():
        if slot.path.endswith(".kernel") and hf.endswith(".weight") and slot.expert is not None:
            out.setdefault(slot.path[: -len(".kernel")], []).append(hf[: -len(".weight")])
    return out


def _codes(q: HFQuantization, prefix: str, scheme: WeightScheme, names: set[str], reader: _Tensors):
    """(codes [K, N], scales [K/g, N] f32, zeros [K/g, N], g_idx | None, tensor names read) of one Linear."""
    keys = AWQ_TENSORS if q.method == "awq" else CT_TENSORS
    got = {k: reader.get(f"{prefix}.{k}") for k in keys if f"{prefix}.{k}" in names}
    if q.method == "awq":
        missing = [f"{prefix}.{k}" for k in AWQ_TENSORS if k not in got]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        codes, scales, zeros = ef.awq_gemm_import(got["qweight"], got["qzeros"], got["scales"])
        g_idx = None
    else:
        codes, scales, zeros, g_idx = ef.ct_pack_quantized_import(got, bits=scheme.bits, symmetric=scheme.symmetric)
    if not np.isfinite(scales).all():
        raise ValueError(f"{'scales' if q.method == 'awq' else 'weight_scale'} has non-finite values (NaN or Inf)")
    return codes, scales, zeros, g_idx, {f"{prefix}.{k}" for k in got}


def _qweight(codes, scales, zeros, g_idx, scheme: WeightScheme, dtype: str) -> QuantizedWeight | None:
    """The `QuantizedWeight` of these codes, None when it cannot hold them (groups out of order, or a K the
    packing does not divide)."""
    K, N = codes.shape
    g = K // scales.shape[0]
    if g * scales.shape[0] != K or (g_idx is not None and not np.array_equal(g_idx, np.arange(K) // g)):
        return None
    try:
        packed = packing.pack(codes, scheme.bits)
    except ValueError:
        return None
    return QuantizedWeight(codes=packed, scales=scales, zeros=zeros.astype(np.uint8), fmt="int", bits=scheme.bits,
                           group_size=g, shape=(K, N), dtype=dtype, symmetric=scheme.symmetric)


def load_quantized_hf(path: str, q: HFQuantization, *, mesh=None, dtype: str | None = None,
                      param_dtype: str | None = None) -> Decoder:
    """The model of quantized Hugging Face checkpoint `path` (see the module docstring), optionally straight
    onto `mesh`; its config drops ``quantization_config`` (the model's packed kernels carry the format)."""

    cfg = ModelConfig.from_hf_file(path, dtype=dtype, param_dtype=param_dtype)
    hf = {k: v for k, v in (cfg.hf_config or {}).items() if k != "quantization_config"}
    cfg = cfg.replace(hf_config=hf)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    index = tensor_index(path)
    names = set(index)
    where = remote.remote_url(path) or path
    consumed: set[str] = set()
    with _Tensors(index) as reader:
        for prefix, mod in _linear_prefixes(abstract).items():
            scheme = q.scheme_for(prefix)
            if q.fmt == "dense":  # fake-quant: the float weight is read below, its quantization parameters skipped
                consumed |= {f"{prefix}.{k}" for k in CT_QPARAMS} & names
                continue
            quantized = any(f"{prefix}.{k}" in names for k in (AWQ_TENSORS if q.method == "awq" else CT_TENSORS))
            if scheme is None or not quantized:
                if scheme is not None and f"{prefix}.weight" not in names:
                    raise CheckpointError(f"{where}: {prefix} is targeted by quantization_config ({scheme.describe()}) "
                                          "but has neither its packed tensors nor a float weight")
                continue  # a float Linear, read with the other tensors
            try:
                codes, scales, zeros, g_idx, read = _codes(q, prefix, scheme, names, reader)
            except ValueError as e:
                raise CheckpointError(f"{where}: {prefix} ({q.describe()}): {e}") from None
            lin = module_at(abstract, mod)
            if codes.shape != (lin.in_features, lin.out_features):
                raise CheckpointError(f"{where}: {prefix} holds a [{codes.shape[1]}, {codes.shape[0]}] weight, the "
                                      f"config needs [{lin.out_features}, {lin.in_features}]")
            qw = _qweight(codes, scales, zeros, g_idx, scheme, cfg.param_dtype)
            if qw is not None:
                set_packed_kernel(lin, qw, mesh)
            else:  # dequantized once into a float kernel
                w = ef.dequantize(codes, scales, zeros, dtype="float32", g_idx=g_idx).astype(lin.kernel.get_value().dtype)
                lin.kernel.set_value(_place(w, lin.kernel.get_metadata().get(LOGICAL_AXES_KEY), mesh))
            consumed |= read
        for mod, prefixes in _expert_prefixes(abstract).items():
            if q.fmt == "dense":
                consumed |= {f"{p}.{k}" for p in prefixes for k in CT_QPARAMS} & names
                continue
            consumed |= _read_experts(q, module_at(abstract, mod), mod, prefixes, names, index, reader, where,
                                      cfg.param_dtype, mesh)
    return fill_hf_params(abstract, path, index, mesh=mesh, consumed=frozenset(consumed))


def _read_experts(q: HFQuantization, el, mod: str, prefixes: list[str], names: set[str], index: dict[str, str],
                  reader: _Tensors, where: str, dtype: str, mesh) -> set[str]:
    """Set ExpertLinear `el` (lrmq path `mod`) from its experts' per-expert tensors (HF module `prefixes[e]`, e.g.
    llmcompressor's ``model.layers.0.mlp.experts.3.gate_proj.weight_packed``); the tensor names read. As a dense
    Linear: every expert quantized into `QuantizedWeight`s of one format -> `stack_experts` into a
    `QuantizedExpertKernel`; otherwise (an expert left float, or one a `QuantizedWeight` cannot hold) every expert
    dequantized once into the float [E, K, N] kernel. No expert quantized: the float tensors are read with the
    others (`fill_hf_params`)."""
    keys = AWQ_TENSORS if q.method == "awq" else CT_TENSORS
    schemes = [q.scheme_for(p) for p in prefixes]
    quantized = [s is not None and any(f"{p}.{k}" in names for k in keys) for p, s in zip(prefixes, schemes)]
    for e, (p, s, qd) in enumerate(zip(prefixes, schemes, quantized)):
        if s is not None and not qd and f"{p}.weight" not in names:
            raise CheckpointError(f"{_files_of(index, where)}: missing {p}.{keys[0]} (expert {e} of {mod}, targeted "
                                  f"by quantization_config: {s.describe()}; no float {p}.weight either)")
    if not any(quantized):
        return set()
    read: set[str] = set()
    per: list = []
    for e, (p, s, qd) in enumerate(zip(prefixes, schemes, quantized)):
        if not qd:
            per.append(None)
            continue
        need = keys if q.method == "awq" else keys[:2] + ("weight_shape",) + (() if s.symmetric else keys[2:3])
        missing = [f"{p}.{k}" for k in need if f"{p}.{k}" not in names]
        if missing:
            raise CheckpointError(f"{_files_of(index, where, p, keys)}: missing {', '.join(missing)} (expert {e} of "
                                  f"{mod}, {q.describe()})")
        try:
            codes, scales, zeros, g_idx, got = _codes(q, p, s, names, reader)
        except ValueError as err:
            raise CheckpointError(f"{_files_of(index, where, p, keys)}: {p} (expert {e} of {mod}, {q.describe()}): "
                                  f"{err}") from None
        if codes.shape != (el.in_features, el.out_features):
            raise CheckpointError(f"{where}: {p} holds a [{codes.shape[1]}, {codes.shape[0]}] weight, the config "
                                  f"needs [{el.out_features}, {el.in_features}] (expert {e} of {mod})")
        per.append((codes, scales, zeros, g_idx, s))
        read |= got
    qws = [_qweight(*x, dtype) if x is not None else None for x in per]
    if all(w is not None for w in qws) and all(w.static() == qws[0].static() for w in qws):
        set_packed_expert_kernel(el, stack_experts(qws), mesh)
        return read
    target = el.kernel.get_value()  # dequantized once (the experts' float tensors read beside them)
    stacked = np.empty(target.shape, target.dtype)
    for e, (p, x) in enumerate(zip(prefixes, per)):
        if x is None:
            w = reader.get(f"{p}.weight").T
            read.add(f"{p}.weight")
        else:
            codes, scales, zeros, g_idx, _ = x
            w = ef.dequantize(codes, scales, zeros, dtype="float32", g_idx=g_idx)
        if tuple(w.shape) != tuple(target.shape[1:]):
            raise CheckpointError(f"{where}: {p}.weight has shape {list(w.T.shape)}, the config needs "
                                  f"{[target.shape[2], target.shape[1]]} (expert {e} of {mod})")
        stacked[e] = _checked(np.asarray(w), target.dtype, where, p)
    el.kernel.set_value(_place(stacked, el.kernel.get_metadata().get(LOGICAL_AXES_KEY), mesh))
    return read


def _files_of(index: dict[str, str], where: str, prefix: str | None = None, keys=()) -> str:
    """The safetensors file holding `prefix`'s other tensors (`keys`), else the checkpoint's tensor list: the file a
    missing tensor is named against."""
    held = [index[f"{prefix}.{k}"] for k in keys if prefix and f"{prefix}.{k}" in index]
    if held:
        return held[0]
    idx = os.path.join(where, "model.safetensors.index.json")
    return idx if os.path.exists(idx) else os.path.join(where, "model.safetensors")
