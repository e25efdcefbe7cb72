"""`python -m lrmq.quantize`: post-RL (post-training) quantization of a checkpoint.

    python -m lrmq.quantize --checkpoint DIR --method rtn|int8|nf4|awq|gptq|quantlrm [--bits B]
        [--group-size G] [--symmetric] [--targets REGEX] [--calibration FILE] [--base DIR]
        --out OUT [--format packed|fake_quant|compressed_tensors|autoawq] [--export-hf-fake OUT2] [--overwrite]
    python -m lrmq.quantize --run-dir RUN --method quantlrm --calibration FILE --out OUT [...]
    python -m lrmq.quantize --config configs/ptq/NAME.yaml [dotted.key=value ...]
    python -m lrmq.quantize --compile-only --shapes NAME --method awq|gptq|quantlrm [--bits B] [--group-size G]
        [--topology v5p:2x2x1 | --platform gpu --topology h200:1] [--calibration-blocks N] [--block-size T]
        [--batch-size U] [--host-memory-gib GIB] [--report FILE.json]

Both forms build one `lrmq.ptq.config.QuantizeConfig` and run one pipeline (`lrmq.ptq.pipeline`:
inputs checked and read first, then the method of the one registry `PTQ_METHODS`). The flag form
writes OUT in one `--format` (default packed: an lrmq checkpoint whose quantized Linears hold packed
`QuantizedKernel`s, orbax, restores straight onto a mesh; `python -m lrmq.generate --checkpoint OUT`
runs it through the quantized matmul kernels; compressed_tensors / autoawq: a Hugging Face checkpoint
in that quantization format, for transformers, compressed-tensors and vLLM; fake_quant: HF with the
weights dequantized), and optionally OUT2, the fake-quantized HF checkpoint beside it. The config form
writes `outputs.dir` (several formats, report, QuantLRM importance; see docs/ptq.md).

awq, gptq and quantlrm need calibration data (`--calibration FILE`; there is no built-in default set):
documents (.txt, or .jsonl/.json/.parquet with a `text` field) or a prompt dataset such as lrmq's own
data JSONL (a `problem` field: the flag form detects it and renders each problem with the model's chat
template, the QuantLRM paper's recipe; `--calibration-source` forces a recipe).

`--compile-only` quantizes nothing: it compiles the run's per-layer programs at a preset's shapes for a TPU
topology (libtpu) or GPUs (JAX's CUDA plugin) and prints per-chip memory, host RSS and an estimated time
(`lrmq.ptq_aot`); exit 0 when it fits, 3 when it does not (the verdict names the setting that makes it fit).

Exit status 2 with one line `lrmq.quantize: error: ...` naming the flag, key or file on bad input
(numbers out of range, options that conflict or that the method ignores, an output that is, contains
or lies inside an input, a full disk); nothing is written then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys

import jax
import numpy as np

from lrmq import aot, ptq_aot
from lrmq.atomic import atomic_write_text
from lrmq.checkpoint.hf import hf_config_dict, save_hf_model
from lrmq.checkpoint.load import check_checkpoint
from lrmq.cli import (USER_ERRORS, ArgumentParser, UsageError, check_disjoint, number, run_main, select_platforms,
                      tune_gc)
from lrmq.configlib import add_config_args, dump_config
from lrmq.paths import check_dir_path, check_file_path
from lrmq.ptq.config import QuantizeConfig, load_quantize_config
from lrmq.ptq.exports import FORMATS, StreamedExport, save_format
from lrmq.ptq.methods import LAYERWISE_METHODS, PTQ_METHODS, check_method_config, needs_calibration
from lrmq.ptq.pipeline import (check_moe, load_float_model, model_config, open_float_source, prepare,
                               resolve_model_path, run_quantize)
from lrmq.ptq.qat_export import refuse_float_qat_policy
from lrmq.quant.quantizers import check_bits
from lrmq.ptq.rtn import targeted
from lrmq.quant.training import param_bytes
from lrmq.quant.transforms import DEFAULT_TARGETS

# (bits, group_size) of a method when the flags leave them unset; otherwise QuantizeConfig's 4 / 128
FLAG_DEFAULTS = {"int8": (8, -1), "nf4": (4, 64)}
# what a bad input raises (CheckpointError, CalibrationError, ExportError, QuantLRMError and
# ConfigError are ValueErrors; an unknown registry name is a KeyError; a full disk: DiskFullError)
INPUT_ERRORS = USER_ERRORS
CALIBRATION_SOURCES = ("text", "reasoning", "prompts")
# what the flag form's messages call the QuantizeConfig keys
FLAG_NAMES = {"model": "--checkpoint", "calibration.path": "--calibration", "quantlrm.base": "--base",
              "quantlrm.run_dir": "--run-dir", "group_size": "--group-size", "method": "--method"}


def parse_args(argv=None):
    ap = ArgumentParser("quantize", description=__doc__.splitlines()[0],
                                 epilog="Or: python -m lrmq.quantize --config configs/ptq/NAME.yaml [key=value ...] "
                                        "for the full PTQ pipeline (calibration, AWQ/GPTQ/QuantLRM, exports); "
                                        "--help-config lists its options. Or: python -m lrmq.quantize --compile-only "
                                        "--shapes NAME --method M [--topology T] to check a run against a TPU or GPU "
                                        "target without weights (--compile-only --help lists its flags).")
    ap.add_argument("--checkpoint", default=None,
                    help="float HF or lrmq checkpoint directory ('tiny' = the shipped model; required unless "
                         "--run-dir gives it: RUN/final_policy)")
    ap.add_argument("--float-qat-policy", action="store_true",
                    help="quantize a QAT run's float master weights (RUN/final_policy); refused otherwise, naming "
                         "the run's quantized export and the lrmq.quantize command that writes its scheme's format")
    ap.add_argument("--method", required=True, help=f"one of {PTQ_METHODS.names()}")
    ap.add_argument("--bits", type=int, default=None,
                    help="weight bits, 2..8 (default: 4; int8: 8; nf4 and --format autoawq take 4 only)")
    ap.add_argument("--group-size", type=number(int, ge=1, also=(-1, 0)), default=None,
                    help="input rows per scale group (default: 128; nf4: 64; int8: -1); -1 = per output channel; "
                         "0 = one scale per tensor (rtn, int8)")
    ap.add_argument("--symmetric", action="store_true",
                    help="symmetric quantization: no zero point (default: asymmetric, a zero point per group)")
    ap.add_argument("--targets", default=DEFAULT_TARGETS, help="regex over module paths (lm_head excluded)")
    ap.add_argument("--out", required=True, help="the checkpoint to write, in --format")
    ap.add_argument("--format", default="packed", choices=FORMATS,
                    help="what --out holds: packed (lrmq checkpoint, default), fake_quant (HF, dequantized), "
                         "compressed_tensors (HF pack-quantized: transformers / vLLM; vLLM takes 4/8-bit, and "
                         "zero points only at 4/8 bits), autoawq (HF AutoAWQ GEMM, 4-bit)")
    ap.add_argument("--export-hf-fake", default=None, metavar="OUT2", help="also write a fake-quantized HF checkpoint")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace --out (and --export-hf-fake) when it exists (default: refuse)")
    ap.add_argument("--calibration", default=None,
                    help="awq/gptq/quantlrm (required there): documents (.txt, or .jsonl/.json/.parquet with a "
                         "'text' field) or a prompt dataset (a 'problem' field, e.g. lrmq's data JSONL)")
    ap.add_argument("--calibration-source", default=None, choices=CALIBRATION_SOURCES,
                    help="calibration recipe (default: prompts for a file whose records have a 'problem' and no "
                         "'text' field, else text)")
    ap.add_argument("--base", default=None, help="quantlrm: the pre-fine-tuning checkpoint")
    ap.add_argument("--run-dir", default=None, help="quantlrm: a GRPO run dir (final_policy + initial_policy)")
    ap.add_argument("--devices", type=number(int, ge=1), default=None,
                    help="awq/gptq/quantlrm: local devices (chips) the calibration passes run over (default: all; "
                         "the result is the same bytes for any count; mesh.devices)")
    return ap.parse_args(argv)


def config_from_flags(args):
    """The QuantizeConfig of a flag-form run (the importance plot is a config-form output: off)."""
    bits, group = FLAG_DEFAULTS.get(args.method, (4, 128))
    model = args.checkpoint or (os.path.join(args.run_dir, "final_policy") if args.run_dir else None)
    cfg = QuantizeConfig(model=model, method=args.method, bits=bits if args.bits is None else args.bits,
                         group_size=group if args.group_size is None else args.group_size,
                         symmetric=args.symmetric, targets=args.targets)
    calib = dataclasses.replace(cfg.calibration, path=args.calibration,
                                source=args.calibration_source or sniff_calibration_source(args.calibration))
    qlrm = dataclasses.replace(cfg.quantlrm, base=args.base, run_dir=args.run_dir, plot=False)
    outputs = dataclasses.replace(cfg.outputs, formats=[args.format])
    mesh = dataclasses.replace(cfg.mesh, devices=args.devices)
    return dataclasses.replace(cfg, calibration=calib, quantlrm=qlrm, outputs=outputs, mesh=mesh,
                               float_qat_policy=args.float_qat_policy)


def sniff_calibration_source(path: str | None) -> str:
    """"prompts" for a JSONL / JSON file whose first record has a `problem` and no `text` field (lrmq's own
    data files), else "text"."""
    if not path or not os.path.isfile(path) or os.path.splitext(path)[1].lower() not in (".jsonl", ".json"):
        return "text"
    try:
        with open(path, encoding="utf-8") as f:
            if path.lower().endswith(".jsonl"):
                first = next((line for line in f if line.strip()), "")
                rec = json.loads(first) if first else {}
            else:
                data = json.load(f)
                rec = data[0] if isinstance(data, list) and data else data
    except (OSError, ValueError, UnicodeDecodeError):
        return "text"  # the calibration reader reports what is wrong with the file
    if isinstance(rec, dict) and "problem" in rec and "text" not in rec:
        return "prompts"
    return "text"


def check_paths(outputs: dict, cfg) -> None:
    """No output is, contains or lies inside an input (the checkpoint, the QuantLRM pair, the calibration
    file, the tokenizer) or another output: replacing it would delete that input (UsageError)."""
    flag = "outputs.dir" in outputs
    inputs = {("model" if flag else "--checkpoint"): resolve_model_path(cfg.model) if cfg.model else None,
              ("quantlrm.base" if flag else "--base"): resolve_model_path(cfg.quantlrm.base) if cfg.quantlrm.base else None,
              ("quantlrm.run_dir" if flag else "--run-dir"): cfg.quantlrm.run_dir,
              ("calibration.path" if flag else "--calibration"): cfg.calibration.path,
              "tokenizer": resolve_model_path(cfg.tokenizer) if cfg.tokenizer else None}
    check_disjoint(outputs, inputs)


def check_flags(args, cfg) -> None:
    """Flag errors found without reading any checkpoint (UsageError)."""
    if args.method not in PTQ_METHODS:
        raise UsageError(f"--method {args.method!r} is not registered; known: {PTQ_METHODS.names()}")
    if not args.checkpoint and not (args.run_dir and args.method == "quantlrm"):
        raise UsageError("--checkpoint DIR is required (the checkpoint to quantize)")
    if args.run_dir and args.checkpoint and args.method == "quantlrm":
        ft = os.path.join(args.run_dir, "final_policy")
        if os.path.realpath(resolve_model_path(args.checkpoint)) != os.path.realpath(ft):
            raise UsageError(f"--run-dir quantizes {ft}; --checkpoint {args.checkpoint} conflicts with it (drop "
                             "--checkpoint, or use --checkpoint with --base instead of --run-dir)")
    if args.base and args.run_dir:
        raise UsageError("--base and --run-dir both name the base checkpoint; give one (--run-dir: its "
                         "initial_policy and final_policy)")
    if args.method != "quantlrm":
        for flag, value in (("--base", args.base), ("--run-dir", args.run_dir)):
            if value:
                raise UsageError(f"{flag} is used by --method quantlrm only; --method {args.method} ignores it")
    if not needs_calibration(args.method):
        for flag, value in (("--calibration", args.calibration), ("--calibration-source", args.calibration_source)):
            if value:
                raise UsageError(f"{flag} is used by awq, gptq and quantlrm only; --method {args.method} "
                                 "ignores it")
    elif not args.calibration:
        raise UsageError(f"--method {args.method} needs --calibration FILE: documents (.txt, or .jsonl/.json/"
                         ".parquet with a 'text' field) or a prompt dataset such as lrmq's data JSONL")
    try:
        re.compile(args.targets)
    except re.error as e:
        raise UsageError(f"--targets {args.targets!r} is not a regular expression ({e})") from None
    if args.bits is not None:
        try:
            check_bits(args.bits)
        except (ValueError, TypeError) as e:
            raise UsageError(f"--bits {args.bits}: {e}") from None
    try:
        check_method_config(cfg)
    except ValueError as e:
        raise UsageError(str(e).replace("outputs.formats", "--format").replace("mesh.devices", "--devices")) from None
    if args.format == "autoawq" and cfg.bits != 4:
        raise UsageError(f"--format autoawq is 4-bit only (AutoAWQ GEMM), --bits is {cfg.bits}; use --format "
                         "compressed_tensors for other widths")
    if args.format == "fake_quant" and args.export_hf_fake:
        raise UsageError("--export-hf-fake writes the fake_quant format, which --format fake_quant already "
                         "writes to --out; drop one")
    check_paths({"--out": args.out, "--export-hf-fake": args.export_hf_fake}, cfg)
    for flag, path in (("--out", args.out), ("--export-hf-fake", args.export_hf_fake)):
        if path:
            check_dir_path(path, flag)  # a file there: a sentence, before any work
        if path and os.path.exists(path) and not args.overwrite:
            raise UsageError(f"{flag} {path} already exists (pass --overwrite to replace it)")


def check_targets(model, cfg) -> None:
    """--targets matches a Linear, and (int methods) --group-size divides each one's K."""
    if cfg.method in LAYERWISE_METHODS:
        return
    found = targeted(model, cfg.targets)
    if not found:
        raise UsageError(f"--targets {cfg.targets!r} matches no Linear module")
    g = cfg.group_size
    if cfg.method != "nf4":
        for path, lin in found:  # an ExpertLinear's in_features: each expert's K
            if g not in (-1, 0) and (g <= 0 or lin.in_features % g):
                raise UsageError(f"--group-size {g} does not divide {path}'s input size K={lin.in_features} "
                                 "(use a divisor or -1)")


def write_flag_outputs(model, result, args, tokenizer_from: str) -> tuple[int, int]:
    """OUT (in --format) and OUT2 (fake-quant HF); returns the model's bytes before (in memory) / after (OUT's
    tensor files on disk, every format: safetensors shards)."""
    before = param_bytes(model)["total"]
    save_format(args.format, model, result, args.out, tokenizer_from=tokenizer_from, overwrite=args.overwrite)
    after = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out)
                if f.endswith(".safetensors"))
    if args.export_hf_fake:  # the model holds the fake-quant kernels: the packed codes, dequantized
        save_hf_model(model, args.export_hf_fake, tokenizer_from=tokenizer_from, overwrite=args.overwrite)
    return before, after


def linear_count(qws) -> int:
    """Quantized projections: a Linear's weight counts one, a stacked-experts weight one per expert."""
    return sum(qw.num_experts or 1 for qw in qws)


def run(args) -> dict:
    """Quantize per the flags; returns a small summary. Raises UsageError (or another INPUT_ERRORS) on bad input."""
    cfg = config_from_flags(args)
    check_flags(args, cfg)
    # a QAT run's float weights: refused before anything is read, naming its scheme's format (lrmq.ptq.qat_export)
    refuse_float_qat_policy(cfg.model, action="quantize", allowed=cfg.float_qat_policy)
    check_checkpoint(cfg.model, "--checkpoint" if args.checkpoint else "--run-dir")
    if args.base:
        check_checkpoint(args.base, "--base")
    # the flag form has no block-size flag: calibration blocks fit the model's positions
    limit = model_config(resolve_model_path(cfg.model)).max_position_embeddings
    c = cfg.calibration
    cfg = dataclasses.replace(cfg, calibration=dataclasses.replace(
        c, block_size=min(c.block_size, limit), max_doc_tokens=min(c.max_doc_tokens, limit)))
    prep = prepare(cfg, FLAG_NAMES)
    if cfg.method in LAYERWISE_METHODS:
        return run_streamed(args, cfg, prep)
    model = load_float_model(prep.model_path)
    check_targets(model, cfg)
    result = PTQ_METHODS.get(cfg.method)(model, cfg, prep.inputs)
    before, after = write_flag_outputs(model, result, args, prep.model_path)
    return {"method": args.method, "quantized": linear_count(result.packed.values()),
            "weight_format": result.describe_format(),
            "bytes_before": before, "bytes_after": after,
            "out": args.out, "format": args.format, "hf_fake": args.export_hf_fake}


def run_streamed(args, cfg, prep) -> dict:
    """awq / gptq / quantlrm: the checkpoint read layer by layer, each finished layer written straight into OUT (and
    OUT2); neither the model nor its quantized copy is held whole (lrmq.ptq.pipeline, lrmq.ptq.exports)."""
    source = open_float_source(prep.model_path)
    before = sum(int(np.prod(source.reader.shape(n))) * source.param_dtype.itemsize for n in source.reader.names())
    kw = dict(tokenizer_from=prep.model_path, overwrite=args.overwrite, root=True)
    exports = [StreamedExport(args.out, source.cfg, [args.format], **kw)]
    if args.export_hf_fake:  # the fake-quant weights in the checkpoint's own dtype, as save_hf_model writes them
        exports.append(StreamedExport(args.export_hf_fake, source.cfg, ["fake_quant"],
                                      dtype=hf_config_dict(source.cfg)[1], **kw))
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(e) for e in exports]
        others = source.others()
        for e in opened:
            e.write_other(others)
        del others
        packed = []

        def emit(out):
            packed.extend(out.packed.values())
            for e in opened:
                e.write_layer(out)

        result = PTQ_METHODS.get(cfg.method)(source, cfg, prep.inputs, emit=emit)
        for e in opened:
            e.finish(result)
    after = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out) if f.endswith(".safetensors"))
    return {"method": args.method, "quantized": linear_count(packed), "weight_format": result.describe_format(),
            "bytes_before": before, "bytes_after": after, "out": args.out, "format": args.format,
            "hf_fake": args.export_hf_fake}


def config_main(argv) -> int:
    """`--config F [key=value ...]`: lrmq.ptq.pipeline.run_quantize; prints a JSON summary."""
    ap = ArgumentParser("quantize", description="Offline PTQ from a YAML config")
    add_config_args(ap, QuantizeConfig, required=True)  # also --help-config and --print-config
    args = ap.parse_args(argv)

    def body() -> int:
        cfg = load_quantize_config(args.config, args.overrides)
        check_paths({"outputs.dir": cfg.outputs.dir}, cfg)
        if args.print_config:
            print(dump_config(cfg, comments=True))
            return 0
        report = run_quantize(cfg)
        print(json.dumps({k: report[k] for k in ("method", "bits", "group_size", "weight_format", "out_dir",
                                                 "calibration_blocks")}))
        return 0

    return run_main("quantize", body, INPUT_ERRORS)


# ----------------------------------------------------------------------------- --compile-only
def compile_only_args(argv):
    ap = ArgumentParser("quantize", description="Compile a PTQ run's per-layer programs for a TPU topology or GPUs "
                                                "without a weight or a chip; exit 0 when it fits, 3 when it does not")
    ap.add_argument("--compile-only", action="store_true", required=True,
                    help="compile, print per-chip memory, host RSS and an estimated time, quantize nothing")
    ap.add_argument("--shapes", required=True,
                    help=f"the architecture: a preset of lrmq.model.presets (the papers' models: "
                         f"{', '.join(ptq_aot.PAPER_SHAPES)}) or a checkpoint directory (its config.json)")
    ap.add_argument("--method", required=True, help=f"one of {', '.join(ptq_aot.COMPILE_METHODS)}")
    ap.add_argument("--bits", type=int, default=4, help="weight bits, 2..8 (default 4)")
    ap.add_argument("--group-size", type=number(int, ge=1, also=(-1,)), default=128,
                    help="input rows per scale group (default 128; -1 = per output channel)")
    ap.add_argument("--symmetric", action="store_true", help="symmetric quantization (no zero point)")
    ap.add_argument("--topology", default=None, help=aot.TOPOLOGY_HELP + " (default: this machine's devices)")
    ap.add_argument("--platform", choices=["tpu", "gpu"], default="tpu", help=aot.PLATFORM_HELP)
    ap.add_argument("--calibration-blocks", type=number(int, ge=1), default=128,
                    help="calibration blocks (default 128, the AWQ recipe's; calibration.max_blocks caps a run's)")
    ap.add_argument("--block-size", type=number(int, ge=2), default=None,
                    help="tokens per calibration block (calibration.block_size; default 512, or the model's "
                         "max_position_embeddings when shorter, as the flag form of a run)")
    ap.add_argument("--batch-size", type=number(int, ge=1), default=8,
                    help="calibration blocks per chip step (calibration.batch_size, default 8)")
    ap.add_argument("--host-memory-gib", type=number(float, gt=0), default=None,
                    help="the target host's memory: compare the host RSS with it (default: RSS stated only)")
    ap.add_argument("--report", default=None, help="also write the report as JSON here")
    return ap.parse_args(argv)


def compile_only_config(args) -> QuantizeConfig:
    """The QuantizeConfig a --compile-only check compiles (the flags; every other option its default)."""
    if args.method not in ptq_aot.COMPILE_METHODS:
        raise UsageError(f"--method {args.method!r}: --compile-only covers {', '.join(ptq_aot.COMPILE_METHODS)}")
    try:
        check_bits(args.bits)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--bits {args.bits}: {e}") from None
    cfg = QuantizeConfig(model=args.shapes, method=args.method, bits=args.bits, group_size=args.group_size,
                         symmetric=args.symmetric)
    return dataclasses.replace(cfg, calibration=dataclasses.replace(cfg.calibration, batch_size=args.batch_size))


def compile_only_model(shapes: str):
    """The architecture --shapes names: a preset (`lrmq.model.presets`), or a checkpoint directory (its config.json;
    "tiny" = the shipped model); UsageError naming both kinds otherwise."""
    if shapes in ptq_aot.PRESETS:
        return ptq_aot.preset_config(shapes)
    path = resolve_model_path(shapes)
    if os.path.isfile(os.path.join(path, "config.json")):
        return model_config(path)
    raise UsageError(f"--shapes {shapes!r} is neither a known architecture ({', '.join(sorted(ptq_aot.PRESETS))}) "
                     "nor a checkpoint directory with a config.json")


def compile_only_main(argv) -> int:
    """`--compile-only`: 0 when the run fits the target's chips (and --host-memory-gib), 3 when it does not, 2 on
    bad input (one line)."""
    args = compile_only_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)

    def body() -> int:
        qcfg = compile_only_config(args)
        mcfg = compile_only_model(args.shapes)
        check_moe(qcfg, mcfg, args.shapes, names={"group_size": "--group-size"})  # the group size the run refuses
        n, t = args.calibration_blocks, args.block_size or min(512, mcfg.max_position_embeddings)
        if t > mcfg.max_position_embeddings:
            raise UsageError(f"--block-size {t} is longer than {args.shapes}'s max_position_embeddings "
                             f"{mcfg.max_position_embeddings}")
        qcfg = dataclasses.replace(qcfg, calibration=dataclasses.replace(qcfg.calibration, block_size=t))
        if args.report:
            check_file_path(args.report, "--report")
        devices = aot.target_devices(args.topology, args.platform) or jax.devices()
        host_limit = int(args.host_memory_gib * 2 ** 30) if args.host_memory_gib else None
        target = args.topology or "local devices"
        fit = ptq_aot.check(mcfg, qcfg, devices, n_blocks=n, block_size=t, target=target, host_limit=host_limit,
                            log=log)
        print(f"target: {target} ({len(devices)} x {fit.device_kind}); {args.shapes}: {mcfg.num_layers} layers; "
              f"{args.method} W{qcfg.bits} g{qcfg.group_size}; calibration {n} blocks x {t} tokens, "
              f"{ptq_aot.unit_size(n, qcfg.calibration.batch_size)} per chip step (calibration.batch_size)")
        print(ptq_aot.table(fit))
        note = aot.gpu_memory_line(fit.device_kind, fit.peak, aot.HEADROOM)
        if note:
            print(note)
        print(ptq_aot.host_line(fit))
        print(ptq_aot.estimate_line(fit, mcfg))
        print(ptq_aot.verdict(fit))
        if args.report:
            rep = ptq_aot.report_dict(fit, mcfg, qcfg, args.shapes, n, t)
            atomic_write_text(args.report, json.dumps(rep, indent=1) + "\n")
        return 0 if fit.fits else 3

    return run_main("quantize", body, INPUT_ERRORS)


def main(argv=None) -> int:
    select_platforms()  # before JAX starts a backend (lrmq.cli)
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--compile-only" in argv:  # compiles for a target, quantizes nothing (lrmq.ptq_aot)
        return compile_only_main(argv)
    if "--config" in argv or "--help-config" in argv:  # the full pipeline (calibration, AWQ/GPTQ/QuantLRM, exports)
        return config_main(argv)
    args = parse_args(argv)

    def body() -> int:
        s = run(args)
        print(f"quantized {s['quantized']} linears to {s['weight_format']}: {s['bytes_before'] / 2**20:.2f} MiB -> "
              f"{s['bytes_after'] / 2**20:.2f} MiB; wrote {s['out']} ({s['format']})"
              + (f" and {s['hf_fake']}" if s["hf_fake"] else ""), file=sys.stderr)
        return 0

    return run_main("quantize", body, INPUT_ERRORS)


if __name__ == "__main__":
    tune_gc()
    sys.exit(main())
