"""`python -m lrmq.quantize`: post-RL (post-training) quantization of a checkpoint into packed weights.

    python -m lrmq.quantize --checkpoint DIR --method rtn|nf4|int8 [--bits B] [--group-size G]
        [--symmetric] [--targets REGEX] --out OUT [--export-hf-fake OUT2] [--overwrite]

Writes OUT, an lrmq checkpoint whose targeted Linears hold packed `QuantizedKernel`s (orbax, restores
straight onto a mesh; `python -m lrmq.generate --checkpoint OUT` runs it through the quantized matmul
kernels), and optionally OUT2, a Hugging Face checkpoint with the same weights dequantized
("fake-quantized"), e.g. for HF/vLLM evaluation of exactly the quantized model.

Methods live in the `PTQ_METHODS` registry: `fn(model, opts: PTQOptions, *, checkpoint: str) ->
{module path: QuantizedWeight}` over the float model (calibration-based methods read data themselves).
Exit status 2 with a message naming the flag or file on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from lrmq.registry import Registry
from lrmq.quant.transforms import DEFAULT_TARGETS

PTQ_METHODS: Registry[Callable] = Registry("ptq method")


@dataclass
class PTQOptions:
    bits: Optional[int] = None  # None: the method's default
    group_size: Optional[int] = None  # None: the method's default; -1: per output channel
    symmetric: bool = False
    targets: str = DEFAULT_TARGETS


class UsageError(ValueError):
    """Bad user input: reported as `error: ...` with exit status 2."""


def _linears(model, opts: PTQOptions):
    from lrmq.quant.transforms import iter_linears

    found = iter_linears(model, opts.targets)
    if not found:
        raise UsageError(f"--targets {opts.targets!r} matches no Linear module")
    return found


def _check_group(path, k, g, flag="--group-size"):
    if g != -1 and (g <= 0 or k % g):
        raise UsageError(f"{flag} {g} does not divide {path}'s input size K={k} (use a divisor or -1)")


@PTQ_METHODS.register("rtn")
def ptq_rtn(model, opts: PTQOptions, *, checkpoint: str):
    """Round-to-nearest int (default 4 bits, group 128, asymmetric like llm-awq; --symmetric)."""
    from lrmq.quant.qweight import quantize_weight
    from lrmq.quant.quantizers import check_bits

    bits = opts.bits if opts.bits is not None else 4
    try:
        check_bits(bits)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--bits {bits}: {e}") from None
    g = opts.group_size if opts.group_size is not None else 128
    out = {}
    for path, lin in _linears(model, opts):
        _check_group(path, lin.in_features, g)
        out[path] = quantize_weight(lin.float_weight(), fmt="int", bits=bits, group_size=g, symmetric=opts.symmetric)
    return out


@PTQ_METHODS.register("int8")
def ptq_int8(model, opts: PTQOptions, *, checkpoint: str):
    """int8 RTN, symmetric, per output channel by default (--group-size G for groups)."""
    if opts.bits not in (None, 8):
        raise UsageError(f"--bits {opts.bits}: method int8 is 8-bit (use --method rtn for other widths)")
    g = opts.group_size if opts.group_size is not None else -1
    return ptq_rtn(model, PTQOptions(bits=8, group_size=g, symmetric=True, targets=opts.targets), checkpoint=checkpoint)


@PTQ_METHODS.register("nf4")
def ptq_nf4(model, opts: PTQOptions, *, checkpoint: str):
    """bitsandbytes NF4 with double quantization (block --group-size, default 64)."""
    from lrmq.quant.qweight import quantize_weight

    if opts.bits not in (None, 4):
        raise UsageError(f"--bits {opts.bits}: NF4 is 4-bit")
    bs = opts.group_size if opts.group_size is not None else 64
    if bs <= 0:
        raise UsageError(f"--group-size {bs}: the NF4 block size must be positive")
    return {path: quantize_weight(lin.float_weight(), fmt="nf4", bits=4, block_size=bs, double_quant=True)
            for path, lin in _linears(model, opts)}


def _register_calibrated_methods() -> None:
    """awq / gptq / quantlrm from lrmq.ptq, configured by the calibration flags below."""
    from lrmq.ptq.config import registry_method

    for name in ("awq", "gptq", "quantlrm"):
        if name not in PTQ_METHODS:
            PTQ_METHODS.register(name)(_CalibratedMethod(name, registry_method))


class _CalibratedMethod:
    """Builds the lrmq.ptq QuantizeConfig from the CLI flags at call time (they are parsed after import)."""

    flags: dict = {}

    def __init__(self, name, factory):
        self.name, self.factory = name, factory

    def __call__(self, model, opts, *, checkpoint: str):
        import dataclasses

        from lrmq.ptq.config import QuantizeConfig

        cfg = QuantizeConfig()
        f = self.flags
        if f.get("calibration"):
            cfg = dataclasses.replace(cfg, calibration=dataclasses.replace(cfg.calibration, path=f["calibration"],
                                                                           source=f.get("calibration_source", "text")))
        if self.name == "quantlrm":
            cfg = dataclasses.replace(cfg, quantlrm=dataclasses.replace(cfg.quantlrm, base=f.get("base"),
                                                                        run_dir=f.get("run_dir")))
        return self.factory(self.name, cfg)(model, opts, checkpoint=checkpoint)


_register_calibrated_methods()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lrmq.quantize", description=__doc__.splitlines()[0],
                                 epilog="Or: python -m lrmq.quantize --config configs/ptq/NAME.yaml [key=value ...] "
                                        "for the full PTQ pipeline (calibration, AWQ/GPTQ/QuantLRM, exports).")
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
    args = ap.parse_args(argv)
    _CalibratedMethod.flags = {"calibration": args.calibration, "calibration_source": args.calibration_source,
                               "base": args.base, "run_dir": args.run_dir}
    return args


def run(args) -> dict:
    """Quantize per `args`; returns a small summary. Raises UsageError / FileNotFoundError on bad input."""
    from lrmq.checkpoint.hf import save_hf_model
    from lrmq.checkpoint.load import checkpoint_kind, load_model
    from lrmq.checkpoint.orbax_io import save_lrmq
    from lrmq.quant.qweight import dequantize
    from lrmq.quant.training import param_bytes, quantize_linears, restore_float_kernel
    from lrmq.quant.transforms import module_at

    if args.method not in PTQ_METHODS:
        raise UsageError(f"--method {args.method!r} is not registered; known: {PTQ_METHODS.names()}")
    for flag, path in (("--out", args.out), ("--export-hf-fake", args.export_hf_fake)):
        if path and os.path.exists(path) and not args.overwrite:
            raise UsageError(f"{flag} {path} already exists (pass --overwrite to replace it)")
    if args.export_hf_fake and os.path.abspath(args.export_hf_fake) == os.path.abspath(args.out):
        raise UsageError("--out and --export-hf-fake must be different directories")
    try:
        checkpoint_kind(args.checkpoint)
    except Exception as e:
        raise UsageError(f"--checkpoint: {e}") from None
    model = load_model(args.checkpoint)
    from lrmq.quant.transforms import iter_linears

    packed_already = [p for p, lin in iter_linears(model, None) if hasattr(lin.kernel.get_value(), "codes")]
    if packed_already:
        raise UsageError(f"--checkpoint {args.checkpoint} is already quantized ({packed_already[0]} is packed)")
    opts = PTQOptions(bits=args.bits, group_size=args.group_size, symmetric=args.symmetric, targets=args.targets)
    qweights = PTQ_METHODS.get(args.method)(model, opts, checkpoint=args.checkpoint)
    before = param_bytes(model)
    float_kernels = {p: module_at(model, p).kernel.get_value() for p in qweights}
    quantize_linears(model, qweights)
    save_lrmq(model, args.out, tokenizer_from=args.checkpoint, overwrite=args.overwrite)
    after = param_bytes(model)
    if args.export_hf_fake:
        for p, qw in qweights.items():
            lin = module_at(model, p)
            restore_float_kernel(model, lin, dequantize(qw), dtype=float_kernels[p].dtype)
        save_hf_model(model, args.export_hf_fake, tokenizer_from=args.checkpoint, overwrite=args.overwrite)
    return {"method": args.method, "quantized": len(qweights), "bytes_before": before["total"],
            "bytes_after": after["total"], "out": args.out, "hf_fake": args.export_hf_fake}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--config" in argv:  # the full pipeline (calibration, AWQ/GPTQ/QuantLRM, all export formats)
        from lrmq.ptq.config import main as config_main

        return config_main(argv)
    args = parse_args(argv)
    try:
        s = run(args)
    except (UsageError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"quantized {s['quantized']} linears with {s['method']}: {s['bytes_before'] / 2**20:.2f} MiB -> "
          f"{s['bytes_after'] / 2**20:.2f} MiB; wrote {s['out']}" + (f" and {s['hf_fake']}" if s["hf_fake"] else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
