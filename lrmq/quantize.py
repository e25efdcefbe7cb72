"""`python -m lrmq.quantize`: post-RL (post-training) quantization of a checkpoint.

    python -m lrmq.quantize --checkpoint DIR --method rtn|int8|nf4|awq|gptq|quantlrm [--bits B]
        [--group-size G] [--symmetric] [--targets REGEX] [--calibration FILE] [--base DIR | --run-dir DIR]
        --out OUT [--export-hf-fake OUT2] [--overwrite]
    python -m lrmq.quantize --config configs/ptq/NAME.yaml [dotted.key=value ...]

Both forms build one `lrmq.ptq.config.QuantizeConfig` and run one pipeline (`lrmq.ptq.pipeline`:
inputs checked and read first, then the method of the one registry `PTQ_METHODS`). The flag form
writes OUT, an lrmq checkpoint whose quantized Linears hold packed `QuantizedKernel`s (orbax,
restores straight onto a mesh; `python -m lrmq.generate --checkpoint OUT` runs it through the
quantized matmul kernels), and optionally OUT2, a Hugging Face checkpoint with the same weights
dequantized ("fake-quantized"), e.g. for HF/vLLM evaluation of exactly the quantized model. The
config form writes `outputs.dir` (formats, report, QuantLRM importance; see docs/ptq.md).

Exit status 2 with a message naming the flag, key or file on bad input; nothing is written then.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from lrmq.checkpoint.hf import save_hf_model
from lrmq.checkpoint.load import checkpoint_kind
from lrmq.checkpoint.orbax_io import save_lrmq
from lrmq.configlib import add_config_args, dump_config
from lrmq.ptq.config import QuantizeConfig, load_quantize_config
from lrmq.ptq.exports import packed_kernels
from lrmq.ptq.methods import LAYERWISE_METHODS, PTQ_METHODS, check_method_config
from lrmq.ptq.pipeline import load_float_model, prepare, resolve_model_path, run_quantize
from lrmq.quant.quantizers import check_bits
from lrmq.quant.training import param_bytes
from lrmq.quant.transforms import DEFAULT_TARGETS, iter_linears

# (bits, group_size) of a method when the flags leave them unset; otherwise QuantizeConfig's 4 / 128
FLAG_DEFAULTS = {"int8": (8, -1), "nf4": (4, 64)}
# what a bad input raises (CheckpointError, CalibrationError, ExportError, QuantLRMError and
# ConfigError are ValueErrors; an unknown registry name is a KeyError)
INPUT_ERRORS = (FileNotFoundError, FileExistsError, KeyError, ValueError)


class UsageError(ValueError):
    """Bad user input: reported as `error: ...` with exit status 2."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lrmq.quantize", description=__doc__.splitlines()[0],
                                 epilog="Or: python -m lrmq.quantize --config configs/ptq/NAME.yaml [key=value ...] "
                                        "for the full PTQ pipeline (calibration, AWQ/GPTQ/QuantLRM, exports); "
                                        "--help-config lists its options.")
    ap.add_argument("--checkpoint", required=True, help="float HF or lrmq checkpoint directory")
    ap.add_argument("--method", required=True, help=f"one of {PTQ_METHODS.names()}")
    ap.add_argument("--bits", type=int, default=None)
    ap.add_argument("--group-size", type=int, default=None, help="-1: per output channel")
    ap.add_argument("--symmetric", action="store_true")
    ap.add_argument("--targets", default=DEFAULT_TARGETS, help="regex over module paths (lm_head excluded)")
    ap.add_argument("--out", required=True, help="packed lrmq checkpoint to write")
    ap.add_argument("--export-hf-fake", default=None, metavar="OUT2", help="also write a fake-quantized HF checkpoint")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--calibration", default=None, help="awq/gptq/quantlrm: calibration text file (jsonl/txt/parquet)")
    ap.add_argument("--calibration-source", default="text", choices=["text", "reasoning", "prompts"])
    ap.add_argument("--base", default=None, help="quantlrm: the pre-fine-tuning checkpoint")
    ap.add_argument("--run-dir", default=None, help="quantlrm: a GRPO run dir (final_policy + initial_policy)")
    return ap.parse_args(argv)


def config_from_flags(args):
    """The QuantizeConfig of a flag-form run (the importance plot is a config-form output: off)."""
    bits, group = FLAG_DEFAULTS.get(args.method, (4, 128))
    cfg = QuantizeConfig(model=args.checkpoint, method=args.method, bits=bits if args.bits is None else args.bits,
                         group_size=group if args.group_size is None else args.group_size,
                         symmetric=args.symmetric, targets=args.targets)
    calib = dataclasses.replace(cfg.calibration, path=args.calibration, source=args.calibration_source)
    qlrm = dataclasses.replace(cfg.quantlrm, base=args.base, run_dir=args.run_dir, plot=False)
    return dataclasses.replace(cfg, calibration=calib, quantlrm=qlrm)


def check_flags(args, cfg) -> None:
    """Flag errors found without reading any checkpoint (UsageError)."""
    if args.method not in PTQ_METHODS:
        raise UsageError(f"--method {args.method!r} is not registered; known: {PTQ_METHODS.names()}")
    if args.bits is not None:
        try:
            check_bits(args.bits)
        except (ValueError, TypeError) as e:
            raise UsageError(f"--bits {args.bits}: {e}") from None
    try:
        check_method_config(cfg)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for flag, path in (("--out", args.out), ("--export-hf-fake", args.export_hf_fake)):
        if path and os.path.exists(path) and not args.overwrite:
            raise UsageError(f"{flag} {path} already exists (pass --overwrite to replace it)")
    if args.export_hf_fake and os.path.abspath(args.export_hf_fake) == os.path.abspath(args.out):
        raise UsageError("--out and --export-hf-fake must be different directories")


def check_targets(model, cfg) -> None:
    """--targets matches a Linear, and (int methods) --group-size divides each one's K."""
    if cfg.method in LAYERWISE_METHODS:
        return
    found = iter_linears(model, cfg.targets)
    if not found:
        raise UsageError(f"--targets {cfg.targets!r} matches no Linear module")
    g = cfg.group_size
    if cfg.method != "nf4":
        for path, lin in found:
            if g != -1 and (g <= 0 or lin.in_features % g):
                raise UsageError(f"--group-size {g} does not divide {path}'s input size K={lin.in_features} "
                                 "(use a divisor or -1)")


def write_flag_outputs(model, result, args, tokenizer_from: str) -> tuple[int, int]:
    """OUT (packed lrmq checkpoint) and OUT2 (fake-quant HF); returns the model's bytes before / after packing."""
    before = param_bytes(model)["total"]
    with packed_kernels(model, result):
        after = param_bytes(model)["total"]
        save_lrmq(model, args.out, tokenizer_from=tokenizer_from, overwrite=args.overwrite)
    if args.export_hf_fake:  # the model holds the fake-quant kernels: the packed codes, dequantized
        save_hf_model(model, args.export_hf_fake, tokenizer_from=tokenizer_from, overwrite=args.overwrite)
    return before, after


def run(args) -> dict:
    """Quantize per the flags; returns a small summary. Raises UsageError (or another INPUT_ERRORS) on bad input."""
    cfg = config_from_flags(args)
    check_flags(args, cfg)
    try:
        checkpoint_kind(resolve_model_path(args.checkpoint))
    except Exception as e:
        raise UsageError(f"--checkpoint: {e}") from None
    prep = prepare(cfg)
    model = load_float_model(prep.model_path)
    check_targets(model, cfg)
    result = PTQ_METHODS.get(cfg.method)(model, cfg, prep.inputs)
    before, after = write_flag_outputs(model, result, args, prep.model_path)
    return {"method": args.method, "quantized": len(result.packed), "bytes_before": before, "bytes_after": after,
            "out": args.out, "hf_fake": args.export_hf_fake}


def config_main(argv) -> int:
    """`--config F [key=value ...]`: lrmq.ptq.pipeline.run_quantize; prints a JSON summary."""
    ap = argparse.ArgumentParser(prog="python -m lrmq.quantize", description="Offline PTQ from a YAML config")
    add_config_args(ap, QuantizeConfig, required=True)  # also --help-config and --print-config
    args = ap.parse_args(argv)
    try:
        cfg = load_quantize_config(args.config, args.overrides)
        if args.print_config:
            print(dump_config(cfg, comments=True))
            return 0
        report = run_quantize(cfg)
    except INPUT_ERRORS as e:
        print(f"lrmq.quantize: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: report[k] for k in ("method", "bits", "group_size", "out_dir", "calibration_blocks")}))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--config" in argv or "--help-config" in argv:  # the full pipeline (calibration, AWQ/GPTQ/QuantLRM, exports)
        return config_main(argv)
    args = parse_args(argv)
    try:
        s = run(args)
    except INPUT_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"quantized {s['quantized']} linears with {s['method']}: {s['bytes_before'] / 2**20:.2f} MiB -> "
          f"{s['bytes_after'] / 2**20:.2f} MiB; wrote {s['out']}" + (f" and {s['hf_fake']}" if s["hf_fake"] else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
