"""One offline PTQ run, shared by both forms of ``python -m lrmq.quantize`` (flags and ``--config``).

    prepare(cfg)          resolve the checkpoint, QuantLRM pair + importance pass, calibration blocks:
                          every input is read and checked before the model is loaded
    load_float_model(p)   the model, refusing an already quantized checkpoint
    PTQ_METHODS.get(cfg.method)(model, cfg, prepared.inputs) -> PTQResult

:func:`run_quantize` is the ``--config`` form: the above, then ``report.json``,
``quantize_config.yaml``, QuantLRM's ``importance.npz`` / ``.png`` and the requested formats,
written atomically into ``outputs.dir`` (a failure leaves no directory). The flag form writes its
packed checkpoint and HF fake-quant copy itself (``lrmq.quantize``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from typing import Mapping

from lrmq import paths
from lrmq.checkpoint.load import checkpoint_kind, load_model, load_tokenizer, read_model_config, resolve_checkpoint
from lrmq.checkpoint.quantized import refuse_quantized
from lrmq.configlib import dump_config
from lrmq.ptq.calibration import calibration_blocks
from lrmq.model.config import ConfigError, ModelConfig, check_position_limit
from lrmq.ptq.config import QuantizeConfig
from lrmq.ptq.exports import StreamedExport, write_outputs
from lrmq.ptq.methods import LAYERWISE_METHODS, PTQ_METHODS, MethodInputs, needs_calibration
from lrmq.ptq.qat_export import refuse_float_qat_policy
from lrmq.ptq.quantlrm import (
    QuantLRMOptions,
    TensorSource,
    check_pair,
    compute_importance,
    importance_artifacts,
    resolve_pair,
)
from lrmq.ptq.source import CheckpointSource
from lrmq.quant.transforms import iter_linears


@dataclasses.dataclass
class Prepared:
    model_path: str  # the checkpoint to quantize
    tokenizer_dir: str
    inputs: MethodInputs
    files: dict = dataclasses.field(default_factory=dict)  # extra output files {name: bytes} (QuantLRM)
    report: dict = dataclasses.field(default_factory=dict)  # extra report fields (QuantLRM importance stats)


def resolve_model_path(p: str) -> str:
    return resolve_checkpoint(p)


def model_config(path: str) -> ModelConfig:
    """The ModelConfig of an HF or lrmq checkpoint, without reading its weights."""
    checkpoint_kind(path)  # a clear error for a missing / broken checkpoint
    return read_model_config(path)


def check_calibration_length(cfg: QuantizeConfig) -> None:
    """Calibration blocks longer than the model's max_position_embeddings would calibrate on positions
    the model never saw (ConfigError with both numbers). Checked before any expensive pass."""
    if not needs_calibration(cfg.method):
        return
    path = resolve_model_path(cfg.model) if cfg.model else (
        os.path.join(cfg.quantlrm.run_dir, "final_policy") if cfg.quantlrm.run_dir else None)
    if path and os.path.isdir(path):
        check_position_limit(model_config(path), cfg.calibration.block_size, "calibration.block_size")


def calibration_tokens(cfg: QuantizeConfig, tokenizer_dir: str, option: str = "calibration.path"):
    """int32 [n_blocks, block_size] from ``cfg.calibration`` (lrmq.ptq.calibration recipes); ``option``: what
    the messages call the path (the flag form: --calibration)."""
    c = cfg.calibration
    if paths.is_url(c.path):  # a bucket file: read from a per-process local copy
        c = dataclasses.replace(c, path=paths.local_copy(c.path, "calibration file", f"{option} {c.path}"))
    if not os.path.exists(c.path):
        raise FileNotFoundError(f"{option} {c.path}: calibration file does not exist")
    tok = load_tokenizer(tokenizer_dir, "tokenizer" if cfg.tokenizer else None)
    if c.source == "text":
        kw = dict(text_field=c.text_field, n_samples=c.n_samples, block_size=c.block_size,
                  max_doc_tokens=c.max_doc_tokens, seed=c.seed, add_special_tokens=c.add_special_tokens)
    elif c.source == "reasoning":
        kw = dict(text_field=c.text_field, max_tokens=c.max_tokens, block_size=c.block_size)
    else:
        kw = dict(template=c.template, n_samples=c.n_samples, block_size=c.block_size,
                  max_doc_tokens=c.max_doc_tokens, problem_field=c.problem_field, answer_field=c.answer_field)
    blocks = calibration_blocks(c.source, c.path, tok, option=option, **kw)
    return blocks[: c.max_blocks] if c.max_blocks else blocks


def quantlrm_importance(cfg: QuantizeConfig, model_path: str | None):
    """The QuantLRM pair's checks and importance pass: (model path to quantize, importances,
    output files, report fields). The pair is read lazily and released before returning."""
    q = cfg.quantlrm
    ft_dir, base_dir = resolve_pair(model_path, resolve_checkpoint(q.base) if q.base else None, q.run_dir)
    ft, base = TensorSource(ft_dir), TensorSource(base_dir)
    check_pair(ft, base)
    opts = QuantLRMOptions(targets=tuple(q.targets) if q.targets else None,
                           stats_targets=tuple(q.stats_targets) if q.stats_targets else None, mapping=q.mapping,
                           R=q.R, precision=q.precision, zero_chunks=q.zero_chunks, quantize=q.quantize)
    imps, stats, targets, stats_targets = compute_importance(ft, base, opts)
    if q.plot:
        files = importance_artifacts(ft, base, imps, stats, q.mapping, q.R)
    else:
        import numpy as np

        buf = io.BytesIO()
        np.savez(buf, **imps)
        files = {"importance.npz": buf.getvalue()}
    report = {"importance_stats": dict(stats._asdict(), targets=list(targets), stats_targets=list(stats_targets))}
    return (ft_dir if q.quantize == "finetuned" else base_dir), imps, files, report


def check_moe(cfg: QuantizeConfig, mcfg: ModelConfig, path: str, names: Mapping[str, str] | None = None) -> None:
    """A mixture-of-experts checkpoint (every method quantizes it per expert: docs/moe.md): an output format that
    writes experts, and a group size that divides every expert projection's input size (ConfigError naming both),
    before anything is read. ``names``: what the messages call a config key (the flag form:
    {"group_size": "--group-size"})."""
    if not mcfg.num_experts:
        return
    called = lambda key: (names or {}).get(key, key)  # noqa: E731
    dense = [i for i in range(mcfg.num_layers) if not mcfg.is_moe_layer(i)]
    if "autoawq" in cfg.outputs.formats and dense:
        raise ConfigError(f"{path}: a mixture-of-experts model with dense layers {dense}; the autoawq format keeps its "
                          f"routers float by modules_to_not_convert ['mlp.gate'], which AutoAWQ and vLLM match as a "
                          f"substring of a dense layer's mlp.gate_proj too; use compressed_tensors")
    g = cfg.group_size
    if cfg.method != "nf4" and g > 0:
        i = mcfg.moe_layers[0]
        for name, k in (("gate_proj", mcfg.hidden_size), ("up_proj", mcfg.hidden_size),
                        ("down_proj", mcfg.moe_intermediate_size)):
            if k % g:
                raise ConfigError(f"{called('group_size')} {g} does not divide layers.{i}.mlp.experts.{name}'s input size K={k} "
                                  "(use a divisor or -1)")


def prepare(cfg: QuantizeConfig, names: Mapping[str, str] | None = None) -> Prepared:
    """Every input of the run, read and checked (FileNotFoundError, QuantLRMError, CalibrationError, ...).
    ``names``: what the messages call a config key (the flag form: {"calibration.path": "--calibration"})."""
    model_path = resolve_model_path(cfg.model) if cfg.model else None
    check_calibration_length(cfg)
    importances, files, report = None, {}, {}
    if cfg.method == "quantlrm":
        model_path, importances, files, report = quantlrm_importance(cfg, model_path)
    checkpoint_kind(model_path)  # clear error for a missing / non-checkpoint dir
    check_moe(cfg, model_config(model_path), model_path, names)
    tok_dir = resolve_checkpoint(cfg.tokenizer) if cfg.tokenizer else model_path
    option = (names or {}).get("calibration.path", "calibration.path")
    tokens = calibration_tokens(cfg, tok_dir, option) if needs_calibration(cfg.method) else None
    return Prepared(model_path, tok_dir, MethodInputs(tokens=tokens, importances=importances), files, report)


def load_float_model(path: str):
    """The model at ``path``; a quantized checkpoint (an lrmq packed one, compressed-tensors, AutoAWQ) is refused in
    one line naming its format (`lrmq.checkpoint.quantized.refuse_quantized`), before it is loaded."""
    refuse_quantized(resolve_checkpoint(path), "PTQ", "quantize its float checkpoint")
    model = load_model(path)
    packed = [p for p, lin in iter_linears(model, None) if hasattr(lin.kernel.get_value(), "codes")]
    if packed:
        raise ValueError(f"checkpoint {path} is already quantized ({packed[0]} is packed)")
    return model


def run_quantize(cfg: QuantizeConfig) -> dict:
    """Prepare, quantize, export (atomically into ``cfg.outputs.dir``). Returns the report dict.

    The layer-by-layer methods (awq, gptq, quantlrm) are streamed: the checkpoint is read layer by layer
    (:class:`lrmq.ptq.source.CheckpointSource`) and each finished layer goes straight into the exports
    (:class:`lrmq.ptq.exports.StreamedExport`), so neither the model nor its quantized copy is ever held whole.
    rtn, int8 and nf4 quantize the loaded model in place."""
    out_dir = cfg.outputs.dir
    paths.check_dir_path(out_dir, "outputs.dir")  # a file there: a sentence, before any work
    if os.path.exists(out_dir) and not cfg.outputs.overwrite:
        raise FileExistsError(f"output directory {os.path.abspath(out_dir)} already exists (outputs.overwrite=true)")
    # a QAT run's float weights: refused before anything is read, naming its scheme's format (the flag form's rule)
    refuse_float_qat_policy(cfg.model or (os.path.join(cfg.quantlrm.run_dir, "final_policy") if cfg.quantlrm.run_dir
                                          else None), action="quantize", allowed=cfg.float_qat_policy,
                            flag="float_qat_policy=true")
    prep = prepare(cfg)
    tok_from = prep.tokenizer_dir if os.path.isdir(prep.tokenizer_dir) else None
    if cfg.method in LAYERWISE_METHODS:
        source = open_float_source(prep.model_path)
        with StreamedExport(out_dir, source.cfg, cfg.outputs.formats, dtype=cfg.outputs.dtype,
                            tokenizer_from=tok_from, overwrite=cfg.outputs.overwrite,
                            max_shard_bytes=cfg.outputs.max_shard_bytes) as export:
            export.write_other(source.others())
            result = PTQ_METHODS.get(cfg.method)(source, cfg, prep.inputs, emit=export.write_layer)
            report = _report(cfg, prep, result)
            export.finish(result, extra_files=_extra_files(cfg, prep, report))
    else:
        model = load_float_model(prep.model_path)
        result = PTQ_METHODS.get(cfg.method)(model, cfg, prep.inputs)
        report = _report(cfg, prep, result)
        write_outputs(model, result, out_dir, formats=cfg.outputs.formats, dtype=cfg.outputs.dtype,
                      tokenizer_from=tok_from, overwrite=cfg.outputs.overwrite,
                      extra_files=_extra_files(cfg, prep, report), max_shard_bytes=cfg.outputs.max_shard_bytes)
    report["out_dir"] = out_dir
    return report


def open_float_source(path: str) -> CheckpointSource:
    """The checkpoint at ``path`` read layer by layer; a quantized one is refused in one line naming its format."""
    refuse_quantized(resolve_checkpoint(path), "PTQ", "quantize its float checkpoint")
    return CheckpointSource(path)


def _report(cfg: QuantizeConfig, prep: Prepared, result) -> dict:
    tokens = prep.inputs.tokens
    return {"method": cfg.method, "model": prep.model_path, "bits": cfg.bits, "group_size": cfg.group_size,
            "symmetric": cfg.symmetric, "weight_format": result.describe_format(),
            "weight_formats": [f.to_dict() for f in result.formats()],
            "calibration_blocks": None if tokens is None else list(tokens.shape),
            "formats": list(cfg.outputs.formats), "info": _jsonable(result.info), **prep.report}


def _extra_files(cfg: QuantizeConfig, prep: Prepared, report: dict) -> dict:
    extra = dict(prep.files)
    extra["report.json"] = json.dumps(report, indent=2)
    extra["quantize_config.yaml"] = dump_config(cfg)
    return extra


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item"):
        return x.item()
    return x
