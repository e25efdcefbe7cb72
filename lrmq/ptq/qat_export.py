"""A QAT-in-RL policy in the format it was trained to run in.

A QAT run trains float master weights through a fake-quantized forward (`lrmq.quant.qat`); the model it means
is that forward. `qat_result(model)` turns every QAT Linear's weight into the integers and scales of *its own*
scheme's quantizer, exactly as the forward rounds them:

* ``paper_int8``: per-tensor symmetric int8 with the scale frozen from the base weights at load (the
  `FrozenScale` the run trained with, not one recomputed from the final weights), q in [-128, 127];
* ``int8`` / ``int4``: AQT's symmetric absmax per output channel (`qat_group_size` 0) or per group, q in
  [-qmax, qmax], scale = absmax / qmax, rounded as AQT rounds (multiply by the reciprocal);
* ``int4_asym`` / ``int8_asym``: lrmq's asymmetric round-to-nearest (min-max, a zero point per group): the codes,
  scales and zero points `lrmq.quantize --method rtn` writes for the same weights.

Each is stored as lrmq's int `QuantizedWeight` (symmetric: code = q + 2^(b-1), zero 2^(b-1), the scale per
group; a per-tensor scale is the same scale in every column; asymmetric: RTN's own codes and zeros), so
``(code - zero) * scale`` is bit for bit the weight the QAT forward multiplies by. The format (bits, grouping,
symmetric, scale dtype, scheme) is recorded as `qat_policy.json`'s ``weight_format`` (`WeightFormat.to_dict`)
and in the packed checkpoint's metadata. The result is a `PTQResult`, written by the PTQ exporters: ``packed``
(lrmq's kernels: `lrmq.evaluate`, `generate`, `perplexity`) and ``compressed_tensors`` (W8A16 / W4A16
symmetric: transformers, and the formats vLLM's kernels take).

``w8a8`` also quantizes activations per token at run time, which neither lrmq's packed kernels nor a
weight-only export do: it has no quantized export (`QATExportError`).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from lrmq import paths
from lrmq.ptq.exports import write_outputs
from lrmq.ptq.result import PTQResult
from lrmq.quant import packing
from lrmq.quant.formats import WeightFormat
from lrmq.model.linear import ExpertLinear
from lrmq.quant.qat import (ASYM_SCHEMES, AqtDotGeneral, AsymSTEDotGeneral, ExpertSTERaggedDot,
                            PerExpertTensorSTERaggedDot, PerTensorSTEDotGeneral, is_qat, qat_weight_format,
                            remove_qat, scheme_bits, sym_weight_codes)
from lrmq.ptq.rtn import quantize_linear
from lrmq.quant.quantizers import per_tensor_codes
from lrmq.quant.qweight import QuantizedWeight, stack_experts
from lrmq.quant.transforms import iter_expert_linears, iter_linears

QUANTIZED_POLICY = "final_policy_quantized"  # beside final_policy in a QAT run's directory
FORMATS = ("packed", "compressed_tensors")
INFO_FILE = "qat_policy.json"


class QATExportError(ValueError):
    pass


def _rounding(fn, path: str):
    """How a QAT forward rounds a weight, from its dot_general / ragged_dot `fn`: ("asym", bits, group) (lrmq's RTN),
    ("tensor", bits, scales) (a frozen per-tensor scale; an expert projection's: one per expert) or ("sym", bits,
    group) (AQT's absmax); w8a8 (activations too) has no weight-only export."""
    if isinstance(fn, AsymSTEDotGeneral):
        return "asym", fn.bits, fn.group_size
    if isinstance(fn, PerTensorSTEDotGeneral):
        return "tensor", fn.bits, fn.scale[...]
    if isinstance(fn, PerExpertTensorSTERaggedDot):
        return "tensor", fn.bits, fn.scale[...]
    act_bits = getattr(fn, "act_bits", None)
    if isinstance(fn, (AqtDotGeneral, ExpertSTERaggedDot)) and act_bits:
        raise QATExportError(f"{path}: QAT scheme w8a8 also quantizes activations per token, which lrmq's packed "
                             "kernels and weight-only exports do not; it has no quantized export")
    if isinstance(fn, AqtDotGeneral):
        return "sym", fn.weight_bits, fn.group_size
    if isinstance(fn, ExpertSTERaggedDot):
        if fn.scheme in ASYM_SCHEMES:
            return "asym", ASYM_SCHEMES[fn.scheme], fn.group_size
        return "sym", scheme_bits(fn.scheme), fn.group_size
    raise QATExportError(f"{path}: not a QAT projection ({type(fn).__name__})")


def _codes(w, kind: str, bits: int, arg) -> tuple[np.ndarray, np.ndarray]:
    """(q int32 [K, N], scale f32 [K/g, N]) of a symmetric rounding (`_rounding`'s "tensor" / "sym") of w [K, N]."""
    if kind == "tensor":  # what fake_quant_per_tensor multiplies out
        q, s = per_tensor_codes(w, bits, scale=arg)
        return np.asarray(q, np.int32), np.full((1, w.shape[1]), np.float32(s))
    q, s = sym_weight_codes(w, bits, arg)
    return np.asarray(q), np.asarray(s, np.float32)


def _weight(w, kind: str, bits: int, arg) -> tuple[np.ndarray, QuantizedWeight]:
    """(the fake-quantized float32 weight, its packed `QuantizedWeight`) of a [K, N] weight rounded as `kind`."""
    if kind == "asym":  # lrmq's RTN: the same function computes the forward's weight
        fq, qw = quantize_linear(w, bits, arg or -1, symmetric=False)
        return np.asarray(fq, np.float32), qw
    q, s = _codes(w, kind, bits, arg)
    k, n = q.shape
    g = k // s.shape[0]
    half = 2 ** (bits - 1)
    codes = (q + half).astype(np.uint8)
    qw = QuantizedWeight(codes=jnp.asarray(packing.pack(codes, bits)), scales=jnp.asarray(s),
                         zeros=jnp.full(s.shape, half, jnp.uint8), fmt="int", bits=bits, group_size=g,
                         shape=(k, n), dtype="float32", symmetric=True, double_quant=False)
    fq = (q.reshape(k // g, g, n).astype(np.float32) * s[:, None, :]).reshape(k, n)
    return fq, qw


def qat_codes(lin, path: str = "") -> tuple[np.ndarray, np.ndarray, int]:
    """(q int32 [K, N], scale f32 [K/g, N], bits) of a Linear with a symmetric QAT dot_general, as its forward
    rounds."""
    kind, bits, arg = _rounding(lin.dot_general, path)
    if kind == "asym":
        raise QATExportError(f"{path}: an asymmetric QAT scheme has zero points (qat_weight)")
    q, s = _codes(jnp.asarray(lin.float_weight(), jnp.float32), kind, bits, arg)
    return q, s, bits


def qat_weight(lin, path: str = "") -> tuple[np.ndarray, QuantizedWeight]:
    """(the fake-quantized float32 weight, its packed `QuantizedWeight`) of one QAT Linear, or of one QAT expert
    projection (an ExpertLinear: each expert's [K, N] rounded as the forward rounds it, stacked [E, K, N])."""
    if isinstance(lin, ExpertLinear):
        kind, bits, arg = _rounding(lin.ragged_dot, path)
        w = jnp.asarray(lin.float_weight(), jnp.float32)
        per = [_weight(w[e], kind, bits, arg[e] if kind == "tensor" else arg) for e in range(w.shape[0])]
        return np.stack([fq for fq, _ in per]), stack_experts([qw for _, qw in per])
    kind, bits, arg = _rounding(lin.dot_general, path)
    return _weight(jnp.asarray(lin.float_weight(), jnp.float32), kind, bits, arg)


def qat_result(model) -> PTQResult:
    """The model's QAT projections (Linears, and a mixture-of-experts model's expert projections) as a PTQ result (in
    place: their kernels set to the fake-quantized weights, their dot_generals / ragged_dots reset to the plain ones,
    so the float model computes what the QAT forward computed)."""
    linears = [(p, lin) for p, lin in iter_linears(model, None) + iter_expert_linears(model, None) if is_qat(lin)]
    if not linears:
        raise QATExportError("the model has no QAT Linears (quant.mode is not qat)")
    packed, widths, groups = {}, set(), set()
    for path, lin in linears:
        fq, packed[path] = qat_weight(lin, path)
        lin.kernel.set_value(jnp.asarray(fq).astype(lin.kernel.get_value().dtype))
        widths.add(packed[path].bits)
        groups.add(packed[path].group_size if packed[path].scales.shape[-2] > 1 else -1)
    remove_qat(model)
    sym = {bool(qw.symmetric) for qw in packed.values()}
    return PTQResult(method="qat", packed=packed, bits=widths.pop(), group_size=groups.pop() if len(groups) == 1 else 0,
                     symmetric=sym.pop() if len(sym) == 1 else True)


def export_qat_policy(model, out_dir: str, *, scheme: str, group_size: int, tokenizer_from: str | None = None,
                      formats=FORMATS, overwrite: bool = True) -> str:
    """`out_dir`/{packed, compressed_tensors}/ and `out_dir`/qat_policy.json, written atomically (`write_outputs`).
    `model` is changed in place (`qat_result`). qat_policy.json's ``weight_format`` is the scheme's format and
    ``same_format_ptq`` the `lrmq.quantize` command that writes that format from the float policy."""
    fmt = qat_weight_format(scheme, group_size)
    result = qat_result(model)
    result.weight_format = fmt
    info = {"quant_mode": "qat", "qat_scheme": scheme, "qat_group_size": group_size, "bits": result.bits,
            "symmetric": fmt.symmetric, "weight_format": fmt.to_dict(),
            "same_format_ptq": fmt.quantize_command(),
            "formats": list(formats), "linears": len(result.packed),
            "note": "weights quantized by the scheme's own quantizer: what the QAT forward multiplied by"}
    return write_outputs(model, result, out_dir, formats=formats, dtype="float32", tokenizer_from=tokenizer_from,
                         overwrite=overwrite, extra_files={INFO_FILE: json.dumps(info, indent=2)})


def quantized_policy_of(checkpoint: str) -> tuple[str, str] | None:
    """For RUN/final_policy of a run trained with quant.mode=qat (its RUN/config.yaml says so; local or URL):
    (the quantized policy to use instead, the scheme); None for anything else."""
    import yaml

    ckpt = str(checkpoint).rstrip("/")
    run, _, name = ckpt.rpartition("/")
    if name != "final_policy":
        return None
    cfg_file = paths.epath_of(paths.join(run or ".", "config.yaml"))
    try:
        if not cfg_file.exists():
            return None
        quant = (yaml.safe_load(cfg_file.read_text()) or {}).get("quant") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    if quant.get("mode") != "qat":
        return None
    return paths.join(run or ".", QUANTIZED_POLICY, "packed"), str(quant.get("qat_scheme", "paper_int8"))


FLOAT_POLICY_FLAG = "--float-qat-policy"  # the one opt-in, in evaluate, generate, perplexity and quantize


class FloatQATPolicyError(ValueError):
    """A QAT run's float master weights given where the model the run trained was meant (one line)."""


def refuse_float_qat_policy(checkpoint: str | None, *, action: str = "score", allowed: bool = False,
                            flag: str = FLOAT_POLICY_FLAG) -> None:
    """The one rule for a QAT run's RUN/final_policy (`quantized_policy_of`): the model the run trained is its
    quantized export RUN/final_policy_quantized/packed, so a command given the float master weights refuses them
    in one line naming that export, unless `allowed` (the command's `flag`, e.g. --float-qat-policy, asks for
    the float weights by name). `action` is the command's verb ("score", "generate with", "quantize");
    "quantize" also names the scheme's own weight format and the `lrmq.quantize` command that writes it from
    the float weights (`WeightFormat.quantize_command`). Reads only RUN/config.yaml: call it before any model
    is built."""
    if allowed or not checkpoint:
        return
    found = quantized_policy_of(checkpoint)
    if not found:
        return
    quantized, scheme = found
    ckpt = str(checkpoint).rstrip("/")
    use = (f"{action} the model it trained: --checkpoint {quantized}" if scheme != "w8a8" else
           "w8a8 quantizes activations at run time and has no quantized export")
    if action == "quantize":
        if scheme != "w8a8":
            use = f"the model it trained is already quantized: {quantized}"
        fmt = run_weight_format(ckpt.rpartition("/")[0] or ".")
        if fmt is not None:
            use += (f"; the scheme's own format is {fmt.describe()}, which "
                    f"`{fmt.quantize_command(ckpt, 'OUT')} {flag}` writes from the float weights")
    raise FloatQATPolicyError(f"{ckpt} is the float master weights of a QAT run (quant.qat_scheme={scheme}); "
                              f"{use} (or pass {flag} to {action} the float weights)")


def run_weight_format(run_dir: str) -> WeightFormat | None:
    """The weight format a run trained in (its RUN/config.yaml `quant` section: `qat_weight_format` of its
    qat_scheme / qat_group_size), or None when the run is not a QAT run or has no readable config."""
    import yaml

    cfg_file = paths.epath_of(paths.join(str(run_dir).rstrip("/") or ".", "config.yaml"))
    try:
        if not cfg_file.exists():
            return None
        quant = (yaml.safe_load(cfg_file.read_text()) or {}).get("quant") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    if quant.get("mode") != "qat":
        return None
    return qat_weight_format(str(quant.get("qat_scheme", "paper_int8")), int(quant.get("qat_group_size") or 0))
