"""``QuantizeConfig``: the typed config of an offline PTQ run, and :func:`run_quantize` that executes it.

    python -m lrmq.quantize --config configs/ptq/awq_w4_qwen3.yaml [dotted.key=value ...]

Methods implemented here: ``awq``, ``gptq``, ``quantlrm`` (calibration based) and ``rtn`` (none).
Each is a function ``(model, cfg, tokens, ctx) -> PTQResult`` in :data:`METHODS`; :func:`ptq_method`
adapts one to a ``(model, cfg) -> PTQResult`` callable for a CLI registry.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Literal, Optional

from lrmq.configlib import ConfigError, dump_config, load_config


@dataclasses.dataclass
class CalibrationSection:
    source: Literal["text", "reasoning", "prompts"] = "text"
    path: Optional[str] = None  # jsonl/json/parquet/txt (text, reasoning) or a prompt dataset (prompts)
    text_field: str = "text"
    n_samples: int = 128
    block_size: int = 512
    max_doc_tokens: int = 512
    seed: Optional[int] = 42  # AWQ recipe shuffle; None keeps file order
    max_tokens: int = 262144  # reasoning: first 128*2048 tokens
    add_special_tokens: bool = True  # AWQ recipe: HF tokenizer.encode default
    template: str = "chat"  # prompts: lrmq.data.prompts template
    problem_field: str = "problem"
    answer_field: str = "answer"
    max_blocks: Optional[int] = None  # cap after cutting (quick runs)
    batch_size: int = 8  # blocks per forward chunk

    def validate(self):
        for f in ("n_samples", "block_size", "max_doc_tokens", "max_tokens", "batch_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"calibration.{f} must be >= 1")


@dataclasses.dataclass
class AWQSection:
    n_grid: int = 20
    normalize: bool = True
    scale: bool = True
    clip: bool = True
    max_shrink: float = 0.5
    n_sample_token: int = 512
    gqa_vo: Literal["skip", "downsample"] = "skip"
    propagate: Literal["fp", "quantized"] = "fp"
    oc_batch: int = 1024


@dataclasses.dataclass
class GPTQSection:
    block_size: int = 128
    percdamp: float = 0.01
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = True
    propagate: Literal["fp", "quantized"] = "quantized"


@dataclasses.dataclass
class QuantLRMSection:
    base: Optional[str] = None  # pre-fine-tuning checkpoint (model = the fine-tuned one)
    run_dir: Optional[str] = None  # or a GRPO run dir: final_policy (model) + initial_policy (base)
    targets: Optional[list[str]] = None
    stats_targets: Optional[list[str]] = None
    mapping: Literal["u_shape", "inverted_u", "increasing", "decreasing", "constant"] = "u_shape"
    R: float = 10.0
    precision: Literal["fp16", "fp32"] = "fp16"
    zero_chunks: int = 1
    quantize: Literal["finetuned", "base"] = "finetuned"
    plot: bool = True
    # QuantLRM's AWQ differences (defaults = the reference)
    normalize: bool = False
    gqa_vo: Literal["skip", "downsample"] = "downsample"


@dataclasses.dataclass
class OutputsSection:
    dir: str = "ptq_out"
    formats: list[str] = dataclasses.field(default_factory=lambda: ["fake_quant"])
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"  # fake_quant / compressed-tensors scale dtype
    overwrite: bool = False

    def validate(self):
        from lrmq.ptq.exports import FORMATS

        bad = [f for f in self.formats if f not in FORMATS]
        if bad:
            raise ValueError(f"outputs.formats: unknown {bad}; known: {list(FORMATS)}")
        if not self.formats:
            raise ValueError("outputs.formats is empty")


@dataclasses.dataclass
class QuantizeConfig:
    model: Optional[str] = None  # checkpoint dir (HF or lrmq); "tiny" = the shipped tiny model
    method: Literal["rtn", "awq", "gptq", "quantlrm"] = "awq"
    bits: int = 4
    group_size: int = 128  # -1: per output channel
    symmetric: bool = False
    tokenizer: Optional[str] = None  # default: the model dir
    progress: bool = True
    calibration: CalibrationSection = dataclasses.field(default_factory=CalibrationSection)
    awq: AWQSection = dataclasses.field(default_factory=AWQSection)
    gptq: GPTQSection = dataclasses.field(default_factory=GPTQSection)
    quantlrm: QuantLRMSection = dataclasses.field(default_factory=QuantLRMSection)
    outputs: OutputsSection = dataclasses.field(default_factory=OutputsSection)

    def validate(self):
        if self.bits not in (3, 4, 8):
            raise ValueError(f"bits must be 3, 4 or 8, got {self.bits}")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"group_size must be -1 or positive, got {self.group_size}")
        if self.method == "quantlrm" and not (self.quantlrm.run_dir or (self.model and self.quantlrm.base)):
            raise ValueError("method quantlrm needs quantlrm.run_dir, or model (fine-tuned) + quantlrm.base")
        if self.method != "quantlrm" and not self.model:
            raise ValueError("model (checkpoint directory) is required")
        if self.method in ("awq", "gptq", "quantlrm") and not self.calibration.path:
            raise ValueError(f"method {self.method} needs calibration.path (a local text/prompt file)")
        if "autoawq" in self.outputs.formats and self.bits != 4:
            raise ValueError("outputs.formats autoawq is 4-bit only (AutoAWQ GEMM); use compressed_tensors for W3")


def load_quantize_config(path: str | None, overrides=()) -> QuantizeConfig:
    return load_config(QuantizeConfig, path, list(overrides))


# ----------------------------------------------------------------------------- methods


def awq_options(cfg: QuantizeConfig):
    from lrmq.ptq.awq import AWQOptions

    a = cfg.awq
    return AWQOptions(bits=cfg.bits, group_size=cfg.group_size, symmetric=cfg.symmetric, n_grid=a.n_grid,
                      normalize=a.normalize, scale=a.scale, clip=a.clip, max_shrink=a.max_shrink,
                      n_sample_token=a.n_sample_token, gqa_vo=a.gqa_vo, oc_batch=a.oc_batch, propagate=a.propagate,
                      batch_size=cfg.calibration.batch_size)


def gptq_options(cfg: QuantizeConfig):
    from lrmq.ptq.gptq_model import GPTQOptions

    g = cfg.gptq
    return GPTQOptions(bits=cfg.bits, group_size=cfg.group_size, symmetric=cfg.symmetric, block_size=g.block_size,
                       percdamp=g.percdamp, act_order=g.act_order, static_groups=g.static_groups,
                       true_sequential=g.true_sequential, propagate=g.propagate,
                       batch_size=cfg.calibration.batch_size)


def calibration_tokens(cfg: QuantizeConfig, tokenizer_dir: str):
    from lrmq.ptq.calibration import calibration_blocks
    from lrmq.tokenizer import Tokenizer

    c = cfg.calibration
    if not os.path.exists(c.path):
        raise FileNotFoundError(f"calibration file not found: {c.path}")
    tok = Tokenizer.from_dir(tokenizer_dir)
    if c.source == "text":
        kw = dict(text_field=c.text_field, n_samples=c.n_samples, block_size=c.block_size,
                  max_doc_tokens=c.max_doc_tokens, seed=c.seed, add_special_tokens=c.add_special_tokens)
    elif c.source == "reasoning":
        kw = dict(text_field=c.text_field, max_tokens=c.max_tokens, block_size=c.block_size)
    else:
        kw = dict(template=c.template, n_samples=c.n_samples, block_size=c.block_size,
                  max_doc_tokens=c.max_doc_tokens, problem_field=c.problem_field, answer_field=c.answer_field)
    blocks = calibration_blocks(c.source, c.path, tok, **kw)
    return blocks[: c.max_blocks] if c.max_blocks else blocks


def _m_rtn(model, cfg, tokens, ctx):
    from lrmq.ptq.awq import rtn_quantize_model

    return rtn_quantize_model(model, bits=cfg.bits, group_size=cfg.group_size, symmetric=cfg.symmetric)


def _m_awq(model, cfg, tokens, ctx):
    from lrmq.ptq.awq import awq_quantize_model

    return awq_quantize_model(model, tokens, awq_options(cfg), progress=cfg.progress)


def _m_gptq(model, cfg, tokens, ctx):
    from lrmq.ptq.gptq_model import gptq_quantize_model

    return gptq_quantize_model(model, tokens, gptq_options(cfg), progress=cfg.progress)


def _m_quantlrm(model, cfg, tokens, ctx):
    from lrmq.ptq.quantlrm import quantlrm_quantize_model

    opts = dataclasses.replace(awq_options(cfg), normalize=cfg.quantlrm.normalize, gqa_vo=cfg.quantlrm.gqa_vo)
    return quantlrm_quantize_model(model, tokens, ctx["importances"], opts, progress=cfg.progress)


METHODS = {"rtn": _m_rtn, "awq": _m_awq, "gptq": _m_gptq, "quantlrm": _m_quantlrm}
NEEDS_CALIBRATION = ("awq", "gptq", "quantlrm")


def _resolve_model_path(p: str) -> str:
    from lrmq.rl.trainer import resolve_checkpoint

    return resolve_checkpoint(p)


def run_quantize(cfg: QuantizeConfig) -> dict:
    """Load, calibrate, quantize, export (atomically into ``cfg.outputs.dir``). Returns the report dict.

    Every input is checked (checkpoints, calibration file, QuantLRM pair) before anything is written;
    on any error the output directory is not created.
    """
    from lrmq.checkpoint.load import checkpoint_kind, load_model
    from lrmq.ptq.exports import write_outputs

    out_dir = cfg.outputs.dir
    if os.path.exists(out_dir) and not cfg.outputs.overwrite:
        raise FileExistsError(f"output directory {os.path.abspath(out_dir)} already exists (outputs.overwrite=true)")
    ctx: dict = {}
    extra: dict = {}
    model_path = _resolve_model_path(cfg.model) if cfg.model else None
    if cfg.method == "quantlrm":
        from lrmq.ptq.quantlrm import (QuantLRMOptions, TensorSource, check_pair, compute_importance,
                                       importance_artifacts, resolve_pair)

        q = cfg.quantlrm
        ft_dir, base_dir = resolve_pair(model_path, q.base, q.run_dir)
        ft, base = TensorSource(ft_dir), TensorSource(base_dir)
        check_pair(ft, base)
        qopts = QuantLRMOptions(targets=tuple(q.targets) if q.targets else None,
                                stats_targets=tuple(q.stats_targets) if q.stats_targets else None, mapping=q.mapping,
                                R=q.R, precision=q.precision, zero_chunks=q.zero_chunks, quantize=q.quantize)
        imps, stats, targets, stats_targets = compute_importance(ft, base, qopts)
        ctx["importances"] = imps
        model_path = ft_dir if q.quantize == "finetuned" else base_dir
        if q.plot:
            extra.update(importance_artifacts(ft, base, imps, stats, q.mapping, q.R))
        else:
            import io

            import numpy as np

            buf = io.BytesIO()
            np.savez(buf, **imps)
            extra["importance.npz"] = buf.getvalue()
        ctx["importance_stats"] = dict(stats._asdict(), targets=list(targets), stats_targets=list(stats_targets))
        del ft, base
    checkpoint_kind(model_path)  # clear error for a missing / non-checkpoint dir
    tok_dir = cfg.tokenizer or model_path
    tokens = calibration_tokens(cfg, tok_dir) if cfg.method in NEEDS_CALIBRATION else None
    model = load_model(model_path)
    result = METHODS[cfg.method](model, cfg, tokens, ctx)
    report = {"method": cfg.method, "model": model_path, "bits": cfg.bits, "group_size": cfg.group_size,
              "symmetric": cfg.symmetric, "calibration_blocks": None if tokens is None else list(tokens.shape),
              "formats": list(cfg.outputs.formats), "info": _jsonable(result.info)}
    if "importance_stats" in ctx:
        report["importance_stats"] = ctx["importance_stats"]
    extra["report.json"] = json.dumps(report, indent=2)
    extra["quantize_config.yaml"] = dump_config(cfg)
    tok_from = tok_dir if os.path.isdir(tok_dir) else None
    write_outputs(model, result, out_dir, formats=cfg.outputs.formats, dtype=cfg.outputs.dtype,
                  tokenizer_from=tok_from, overwrite=cfg.outputs.overwrite, extra_files=extra)
    report["out_dir"] = out_dir
    return report


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item"):
        return x.item()
    return x


def ptq_method(name: str):
    """Adapter for a CLI registry: ``PTQ_METHODS.register(name)(ptq_method(name))`` gives a
    ``(model, cfg: QuantizeConfig) -> PTQResult`` that loads calibration itself."""
    fn = METHODS[name]

    def run(model, cfg: QuantizeConfig, tokenizer_dir: str | None = None):
        tokens = calibration_tokens(cfg, tokenizer_dir or cfg.tokenizer or cfg.model) if name in NEEDS_CALIBRATION \
            else None
        return fn(model, cfg, tokens, {})

    return run


def main(argv=None) -> int:
    """``python -m lrmq.ptq.config --config F [k=v ...]`` (the same as ``lrmq.quantize --config``)."""
    import argparse
    import sys

    from lrmq.configlib import add_config_args

    ap = argparse.ArgumentParser(prog="python -m lrmq.ptq.config", description="Offline PTQ from a YAML config")
    add_config_args(ap, required=True)
    args = ap.parse_args(argv)
    from lrmq.checkpoint.hf import CheckpointError
    from lrmq.ptq.calibration import CalibrationError
    from lrmq.ptq.exports import ExportError
    from lrmq.ptq.quantlrm import QuantLRMError

    try:
        cfg = load_quantize_config(args.config, args.overrides)
        report = run_quantize(cfg)
    except (ConfigError, CheckpointError, CalibrationError, ExportError, QuantLRMError, FileNotFoundError,
            FileExistsError, KeyError, ValueError) as e:
        print(f"lrmq.quantize: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: report[k] for k in ("method", "bits", "group_size", "out_dir", "calibration_blocks")}))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())


def registry_method(name: str, cfg: QuantizeConfig | None = None):
    """Adapter to ``lrmq.quantize.PTQ_METHODS``' signature ``fn(model, opts, *, checkpoint) -> {path: QuantizedWeight}``:

        PTQ_METHODS.register("awq")(registry_method("awq"))

    bits / group_size / symmetric come from ``opts`` when set, everything else (calibration file,
    method sections) from ``cfg`` (default ``QuantizeConfig()``: the AWQ recipe needs
    ``calibration.path``). The model is modified in place (folded norm scales, fake-quant kernels),
    so the caller's packing of the returned weights keeps the folded norms. ``quantlrm`` needs
    ``cfg.quantlrm.base`` or ``run_dir``.
    """
    fn = METHODS[name]

    def run(model, opts, *, checkpoint: str):
        c = dataclasses.replace(cfg or QuantizeConfig(), model=checkpoint, method=name)
        kw = {k: getattr(opts, k) for k in ("bits", "group_size") if getattr(opts, k, None) is not None}
        c = dataclasses.replace(c, symmetric=bool(getattr(opts, "symmetric", c.symmetric)), **kw)
        ctx: dict = {}
        if name == "quantlrm":
            from lrmq.ptq.quantlrm import QuantLRMOptions, TensorSource, check_pair, compute_importance, resolve_pair

            ft_dir, base_dir = resolve_pair(checkpoint, c.quantlrm.base, c.quantlrm.run_dir)
            ft, base = TensorSource(ft_dir), TensorSource(base_dir)
            check_pair(ft, base)
            ctx["importances"] = compute_importance(ft, base, QuantLRMOptions(mapping=c.quantlrm.mapping))[0]
        tokens = calibration_tokens(c, c.tokenizer or checkpoint) if name in NEEDS_CALIBRATION else None
        res = fn(model, c, tokens, ctx)
        if res.g_idx:
            raise ValueError("GPTQ act_order without static_groups cannot be packed; set gptq.static_groups")
        return res.packed

    return run
