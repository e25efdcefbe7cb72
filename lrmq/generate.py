"""`python -m lrmq.generate --checkpoint DIR (--prompt TEXT | --prompts-file F) [...]`.

Accepts an HF checkpoint directory (converted in memory) or an lrmq checkpoint, including packed
quantized ones. Prints completions (or one JSON object per prompt with --json) to stdout and
throughput to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from lrmq import aot
from lrmq.checkpoint.load import load_model
from lrmq.configlib import ConfigError
from lrmq.generation.engine import Generator
from lrmq.generation.sampling import SamplingConfig
from lrmq.model.config import ModelConfig
from lrmq.model.presets import preset_config
from lrmq.sharding import make_mesh
from lrmq.tokenizer import Tokenizer


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lrmq.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="HF or lrmq checkpoint directory")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    src.add_argument("--prompts-file", help="text file, one prompt per line (or .jsonl with a 'prompt' field)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="wrap each prompt with the model's chat template")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="compute dtype")
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt: token_ids, text, logprobs")
    aot = ap.add_argument_group("ahead-of-time compile (no weights are read or allocated)")
    aot.add_argument("--compile-only", action="store_true",
                     help="compile generation for --topology (default: this machine) and print per-device memory")
    aot.add_argument("--topology", default=None, help="TPU topology, e.g. v5e:2x4")
    aot.add_argument("--shapes", default=None, help="architecture preset (lrmq/model/presets.py) instead of "
                                                      "--checkpoint's config.json")
    aot.add_argument("--batch", type=int, default=8, help="sequences per generate call")
    aot.add_argument("--prompt-len", type=int, default=512, help="left-padded prompt length")
    aot.add_argument("--pack", choices=["int4", "int8", "nf4"], default=None,
                     help="compile with every linear packed in this format (the Pallas kernels serve them)")
    args = ap.parse_args(argv)
    if args.compile_only:
        if not (args.checkpoint or args.shapes):
            ap.error("--compile-only needs --checkpoint or --shapes")
    elif not args.checkpoint or not (args.prompt or args.prompts_file):
        ap.error("--checkpoint and one of --prompt / --prompts-file are required")
    return args


def read_prompts(args) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    try:
        with open(args.prompts_file) as f:
            lines = [l.rstrip("\n") for l in f if l.strip()]
    except FileNotFoundError:
        raise SystemExit(f"error: prompts file {args.prompts_file} does not exist")
    if args.prompts_file.endswith(".jsonl"):
        out = []
        for i, l in enumerate(lines):
            rec = json.loads(l)
            if "prompt" not in rec:
                raise SystemExit(f"error: {args.prompts_file} line {i + 1} has no 'prompt' field")
            out.append(rec["prompt"])
        return out
    return lines


def compile_only(args) -> int:
    """--compile-only: per-device memory, FLOPs and compile time of one generate call."""
    try:
        mcfg = (preset_config(args.shapes, dtype=args.dtype) if args.shapes
                else ModelConfig.from_hf_file(args.checkpoint, dtype=args.dtype))
        devices = list(aot.topology_devices(args.topology)) if args.topology else None
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mesh = make_mesh(None, devices=devices)
    graphdef, state = aot.abstract_model(mcfg, mesh, pack=args.pack)
    sampling = SamplingConfig(greedy=args.greedy, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    compiled, secs = aot.compile_generate(graphdef, state, mesh, batch=args.batch, prompt_len=args.prompt_len,
                                          max_new=args.max_new_tokens, sampling=sampling)
    hbm = aot.hbm_bytes(mesh.devices.flat[0])
    report = aot.FitReport([{"name": "generate", "memory": aot.memory_report(compiled), "flops": aot._flops(compiled),
                             "seconds": secs}], hbm, True)
    report.fits = not hbm or report.rows[0]["memory"]["total"] <= hbm * (1 - aot.HEADROOM)
    kernels = "Pallas TPU kernels" if "tpu_custom_call" in compiled.as_text() else "no custom kernels"
    print(f"target: {args.topology or 'local devices'} ({len(mesh.devices.flat)} devices); batch {args.batch}, "
          f"prompt {args.prompt_len} + {args.max_new_tokens} new tokens; weights {args.pack or mcfg.param_dtype} "
          f"({kernels})")
    print(report.table())
    total = report.rows[0]["memory"]["total"] / aot.GIB
    print(f"{'fits' if report.fits else 'does not fit'}: {total:.2f} GiB per device"
          + (f" of {hbm * (1 - aot.HEADROOM) / aot.GIB:.1f} GiB usable" if hbm else ""))
    return 0 if report.fits else 3


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_only:
        return compile_only(args)
    prompts = read_prompts(args)
    try:
        model = load_model(args.checkpoint, dtype=args.dtype)
        tok = Tokenizer.from_dir(args.checkpoint)
        sampling = SamplingConfig(greedy=args.greedy, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p for p in prompts]
    ids = [tok.encode(t) for t in texts]
    gen = Generator(model, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
    t0 = time.perf_counter()
    res = gen.generate(model, ids, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed)
    dt = time.perf_counter() - t0
    for i in range(len(prompts)):
        n = int(res.lengths[i])
        token_ids = [int(t) for t in res.tokens[i, :n]]
        text = tok.decode(token_ids)
        if args.json:
            print(json.dumps({"prompt": prompts[i], "token_ids": token_ids, "text": text,
                              "logprobs": [float(x) for x in res.logprobs[i, :n]]}))
        else:
            print(text)
    total = int(res.lengths.sum())
    print(f"[lrmq.generate] {len(prompts)} prompts, {total} new tokens in {dt:.2f}s "
          f"({total / max(dt, 1e-9):.1f} tokens/s, includes compilation of the new length bucket)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
