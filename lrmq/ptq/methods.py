"""The one registry of PTQ methods, used by both forms of ``python -m lrmq.quantize``.

A method is a small function ``fn(model, cfg: QuantizeConfig, inputs: MethodInputs) -> PTQResult``
registered by name in :data:`PTQ_METHODS`. It quantizes ``model`` in place (each targeted kernel
becomes its fake-quant weight; AWQ also folds scales into the norms) and returns the packed
weights with the same codes. ``inputs`` carries what the pipeline read before loading the model:
calibration token blocks for the methods registered with ``calibrated=True``, and QuantLRM's
per-channel importances.

    rtn       round-to-nearest int (llm-awq asymmetric; ``symmetric``), any Linear matching ``targets``
    int8      rtn at 8 bits, symmetric
    nf4       bitsandbytes NF4 + double quant, ``group_size`` = block size
    awq       llm-awq scale search + clip            (calibrated)
    gptq      IST-DASLab GPTQ                         (calibrated)
    quantlrm  AWQ with fine-tuning importance         (calibrated; needs the importance pass)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from lrmq.ptq.awq import AWQOptions, awq_quantize_model
from lrmq.ptq.gptq_model import GPTQOptions, gptq_quantize_model
from lrmq.ptq.quantlrm import quantlrm_quantize_model
from lrmq.ptq.rtn import nf4_quantize_model, rtn_quantize_model
from lrmq.ptq.shard import ptq_mesh
from lrmq.quant.transforms import DEFAULT_TARGETS
from lrmq.registry import Registry

PTQ_METHODS: Registry[Callable] = Registry("ptq method")
_CALIBRATED: set[str] = set()
# methods that quantize the seven projections of every layer (layer by layer), not a `targets` regex
LAYERWISE_METHODS = ("awq", "gptq", "quantlrm")


@dataclasses.dataclass(frozen=True)
class MethodInputs:
    tokens: np.ndarray | None = None  # int32 [n_blocks, T] calibration blocks (calibrated methods)
    importances: dict | None = None  # QuantLRM: module path -> [K] float32 importance


def register(name: str, *, calibrated: bool = False):
    """``@register("awq", calibrated=True)``: add a method; ``calibrated`` ones get ``inputs.tokens``."""

    def deco(fn):
        if calibrated:
            _CALIBRATED.add(name)
        return PTQ_METHODS.register(name)(fn)

    return deco


def needs_calibration(name: str) -> bool:
    return name in _CALIBRATED


def check_method_config(cfg) -> None:
    """What a method requires of the config, checked before anything is loaded (ValueError)."""
    try:
        PTQ_METHODS.get(cfg.method)
    except KeyError as e:
        raise ValueError(e.args[0]) from None
    if needs_calibration(cfg.method) and not cfg.calibration.path:
        raise ValueError(f"method {cfg.method} needs calibration.path (flag --calibration): a local text/prompt file")
    if cfg.group_size == 0 and cfg.method not in ("rtn", "int8"):
        raise ValueError(f"group_size 0 (one scale per tensor) is for methods rtn and int8; method {cfg.method} "
                         "takes -1 (per output channel) or a group size")
    if cfg.method == "int8" and cfg.bits != 8:
        raise ValueError(f"method int8 is 8-bit, got bits={cfg.bits} (use method rtn for other widths)")
    if cfg.method == "nf4":
        if cfg.bits != 4:
            raise ValueError(f"method nf4 is 4-bit, got bits={cfg.bits}")
        if cfg.group_size < 1:
            raise ValueError(f"method nf4: group_size is the NF4 block size and must be positive, got {cfg.group_size}")
        int_only = [f for f in cfg.outputs.formats if f in ("autoawq", "compressed_tensors")]
        if int_only:
            raise ValueError(f"method nf4 cannot be exported as outputs.formats {int_only} (int formats); use packed or "
                             "fake_quant")
    if cfg.mesh.devices is not None and cfg.method not in LAYERWISE_METHODS:
        raise ValueError(f"mesh.devices is for the calibrated layer-by-layer methods {list(LAYERWISE_METHODS)}; "
                         f"method {cfg.method} runs on one device")
    if (cfg.method == "gptq" and cfg.gptq.act_order and not cfg.gptq.static_groups
            and any(f != "fake_quant" for f in cfg.outputs.formats)):
        raise ValueError("gptq.act_order without gptq.static_groups gives non-monotone groups (g_idx) that packed, "
                         "autoawq and compressed_tensors outputs cannot hold: set gptq.static_groups=true or export "
                         "outputs.formats=[fake_quant]")
    if cfg.method in LAYERWISE_METHODS and cfg.targets != DEFAULT_TARGETS:
        raise ValueError(f"method {cfg.method} quantizes every projection of every layer; targets applies to "
                         "rtn, int8 and nf4 only")


# ----------------------------------------------------------------------------- options from the config


def awq_options(cfg):
    a = cfg.awq
    return AWQOptions(bits=cfg.bits, group_size=cfg.group_size, symmetric=cfg.symmetric, n_grid=a.n_grid,
                      normalize=a.normalize, scale=a.scale, clip=a.clip, max_shrink=a.max_shrink,
                      n_sample_token=a.n_sample_token, gqa_vo=a.gqa_vo, oc_batch=a.oc_batch, propagate=a.propagate,
                      batch_size=cfg.calibration.batch_size, moe_calibration=cfg.calibration.moe_experts)


def gptq_options(cfg):
    g = cfg.gptq
    return GPTQOptions(bits=cfg.bits, group_size=cfg.group_size, symmetric=cfg.symmetric, block_size=g.block_size,
                       percdamp=g.percdamp, act_order=g.act_order, static_groups=g.static_groups,
                       true_sequential=g.true_sequential, propagate=g.propagate,
                       batch_size=cfg.calibration.batch_size, moe_calibration=cfg.calibration.moe_experts)


# ----------------------------------------------------------------------------- methods


@register("rtn")
def rtn(model, cfg, inputs: MethodInputs):
    return rtn_quantize_model(model, bits=cfg.bits, group_size=cfg.group_size, symmetric=cfg.symmetric,
                              targets=cfg.targets)


@register("int8")
def int8(model, cfg, inputs: MethodInputs):
    return rtn_quantize_model(model, bits=8, group_size=cfg.group_size, symmetric=True, targets=cfg.targets,
                              method="int8")


@register("nf4")
def nf4(model, cfg, inputs: MethodInputs):
    return nf4_quantize_model(model, block_size=cfg.group_size, targets=cfg.targets)


# the layer-by-layer methods take a source (an in-memory model, quantized in place, or a checkpoint read layer by
# layer, lrmq.ptq.source) and an ``emit`` receiving each finished layer (None: back into the model)


def ptq_mesh_of(cfg):
    return ptq_mesh(cfg.mesh.devices)


@register("awq", calibrated=True)
def awq(source, cfg, inputs: MethodInputs, emit=None):
    return awq_quantize_model(source, inputs.tokens, awq_options(cfg), progress=cfg.progress, emit=emit,
                              mesh=ptq_mesh_of(cfg))


@register("gptq", calibrated=True)
def gptq(source, cfg, inputs: MethodInputs, emit=None):
    return gptq_quantize_model(source, inputs.tokens, gptq_options(cfg), progress=cfg.progress, emit=emit,
                               mesh=ptq_mesh_of(cfg))


@register("quantlrm", calibrated=True)
def quantlrm(source, cfg, inputs: MethodInputs, emit=None):
    if inputs.importances is None:
        raise ValueError("method quantlrm needs the importance pass (lrmq.ptq.pipeline.prepare runs it)")
    opts = dataclasses.replace(awq_options(cfg), normalize=cfg.quantlrm.normalize, gqa_vo=cfg.quantlrm.gqa_vo)
    return quantlrm_quantize_model(source, inputs.tokens, inputs.importances, opts, progress=cfg.progress, emit=emit,
                                   mesh=ptq_mesh_of(cfg))
