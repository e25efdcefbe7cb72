"""`python -m lrmq.generate --checkpoint DIR (--prompt TEXT | --prompts-file F) [...]`.

Accepts an HF checkpoint directory (converted in memory) or an lrmq checkpoint, including packed
quantized ones. Prints completions (or one JSON object per prompt with --json) to stdout and
throughput to stderr.

Bad input (a number out of range, a prompt whose tokens plus --max-new-tokens exceed the model's
max_position_embeddings, non-finite weights, an unreadable prompts file) is one line
`lrmq.generate: error: ...` and exit status 2, before anything is generated.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from lrmq import aot, compile_cache
from lrmq.checkpoint.load import check_checkpoint, load_model, load_tokenizer, read_model_config
from lrmq.cli import ArgumentParser, UsageError, number, run_main, select_platforms, tune_gc
from lrmq.data.text import read_documents
from lrmq.generation.engine import Engine, EngineConfig
from lrmq.generation.attention import DECODE_ATTENTION
from lrmq.generation.kv_format import KV_CACHE_FORMATS
from lrmq.generation.sampling import SamplingConfig
from lrmq.generation.scheduler import check_kv_pages, pages_for_one_sequence
from lrmq.model.config import check_position_limit
from lrmq.model.presets import preset_config
from lrmq.ptq.qat_export import refuse_float_qat_policy
from lrmq.sharding import make_mesh


def parse_args(argv=None):
    ap = ArgumentParser("generate", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="HF or lrmq checkpoint directory ('tiny' = the shipped model)")
    ap.add_argument("--float-qat-policy", action="store_true",
                    help="use a QAT run's float master weights (RUN/final_policy); refused otherwise, the model the run "
                         "trained being its quantized export RUN/final_policy_quantized/packed")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    src.add_argument("--prompts-file", help="plain-text file, one prompt per line, or .jsonl/.json/.parquet with a "
                                            "'prompt' field")
    ap.add_argument("--max-new-tokens", type=number(int, ge=1), default=128,
                    help="tokens generated per prompt at most (fewer when EOS comes first)")
    ap.add_argument("--greedy", action="store_true", help="argmax decoding (--temperature/--top-p/--top-k unused)")
    ap.add_argument("--temperature", type=number(float, gt=0), default=1.0, help="sampling temperature")
    ap.add_argument("--top-p", type=number(float, gt=0, le=1), default=1.0,
                    help="nucleus sampling: keep the smallest set of tokens with this much probability (1 = off)")
    ap.add_argument("--top-k", type=number(int, ge=0), default=0, help="0 = off")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed gives the same tokens)")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt with the model's chat template")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="compute dtype")
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt: token_ids, text, logprobs")
    ap.add_argument("--kv-pages", type=number(int, ge=0), default=0,
                    help="pages of the engine's KV pool (0 = enough that no sequence is ever preempted; with "
                         "--compile-only for a TPU topology: what fits, 0.9 of HBM less the programs' other memory)")
    ap.add_argument("--kv-cache", choices=list(KV_CACHE_FORMATS), default="auto",
                    help="format of the KV cache pages: auto (the model's dtype), bf16, or quantized with float32 "
                         "scales: fp8_e4m3 / fp8_e5m2 (per layer and KV head) or int8 (per token and KV head); "
                         "docs/generation.md, 'Quantized KV cache'")
    ap.add_argument("--decode-attention", choices=["auto", *DECODE_ATTENTION], default="auto",
                    help="decode attention: auto (the compile target's kernel: JAX's ragged paged attention on TPU, "
                         "Triton on GPU, where it takes the shapes; else xla), or xla / tpu / gpu given explicitly. "
                         "xla runs fp8 KV pages at 1 KV head per TPU chip, which auto refuses")
    aot_args = ap.add_argument_group("ahead-of-time compile (no weights are read or allocated)")
    aot_args.add_argument("--compile-only", action="store_true",
                     help="compile generation for --topology (default: this machine) and print per-device memory")
    aot_args.add_argument("--topology", default=None, help=aot.TOPOLOGY_HELP + " (default: this machine)")
    aot_args.add_argument("--platform", choices=["tpu", "gpu"], default="tpu", help=aot.PLATFORM_HELP)
    aot_args.add_argument("--shapes", default=None, help="architecture preset (lrmq/model/presets.py) instead of "
                                                      "--checkpoint's config.json")
    aot_args.add_argument("--batch", type=number(int, ge=1), default=8, help="decode slots: sequences decoded at once")
    aot_args.add_argument("--prompt-len", type=number(int, ge=1), default=512, help="left-padded prompt length")
    aot_args.add_argument("--pack", choices=["int4", "int8", "nf4"], default=None,
                     help="compile with every linear packed in this format (the Pallas kernels serve them)")
    args = ap.parse_args(argv)
    if args.compile_only:
        if not (args.checkpoint or args.shapes):
            ap.error("--compile-only needs --checkpoint or --shapes")
    elif not args.checkpoint or not (args.prompt or args.prompts_file):
        ap.error("--checkpoint and one of --prompt / --prompts-file are required")
    return args


def read_prompts(args) -> list[str]:
    """--prompt texts, or --prompts-file: one prompt per non-blank line of a plain-text file, or the 'prompt'
    field of each record of a .jsonl / .json / .parquet file (lrmq.data.text)."""
    if args.prompt:
        return list(args.prompt)
    return read_documents(args.prompts_file, "--prompts-file", field="prompt", what="prompts")


def compile_only(args) -> int:
    """--compile-only: per-device memory, FLOPs and compile time of one generate call."""
    mcfg = (preset_config(args.shapes, dtype=args.dtype) if args.shapes
            else read_model_config(args.checkpoint, dtype=args.dtype))
    check_position_limit(mcfg, args.prompt_len + args.max_new_tokens, "--prompt-len + --max-new-tokens")
    devices = aot.target_devices(args.topology, args.platform)
    mesh = make_mesh(None, devices=devices)
    graphdef, state = aot.abstract_model(mcfg, mesh, pack=args.pack)
    sampling = SamplingConfig(greedy=args.greedy, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    print(f"target: {args.topology or 'local devices'} ({len(mesh.devices.flat)} devices); {args.batch} decode "
          f"slots, prompt {args.prompt_len} + {args.max_new_tokens} new tokens; weights {args.pack or mcfg.param_dtype}",
          flush=True)
    report, line = aot.check_generate(graphdef, state, mesh, model_cfg=mcfg,
                                      engine=EngineConfig(slots=args.batch, pages=args.kv_pages,
                                                          kv_cache=args.kv_cache, attention=args.decode_attention),
                                      requests=args.batch, prompt_len=args.prompt_len, max_new=args.max_new_tokens,
                                      sampling=sampling, slots_option="--batch", pages_option="--kv-pages",
                                      log=lambda m: print(m, file=sys.stderr, flush=True))
    print(report.table())
    print(aot.pool_line(report.pool, "--kv-pages"))
    note = aot.memory_note(report, devices)
    if note:
        print(note)
    print(line)
    return 0 if report.fits else 3


def main(argv=None) -> int:
    select_platforms()  # before JAX starts a backend (lrmq.cli)
    args = parse_args(argv)
    compile_cache.enable()  # a rerun loads its compiled programs (lrmq.compile_cache)
    if args.compile_only:
        return run_main("generate", lambda: compile_only(args))
    return run_main("generate", lambda: generate(args))


def generate(args) -> int:
    # a QAT run's float weights: refused in one line before anything is read (lrmq.ptq.qat_export)
    refuse_float_qat_policy(args.checkpoint, action="generate with", allowed=args.float_qat_policy)
    ckpt = check_checkpoint(args.checkpoint)  # the model first: a missing one is not "a missing tokenizer"
    prompts = read_prompts(args)
    sampling = SamplingConfig(greedy=args.greedy, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    tok = load_tokenizer(ckpt)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p for p in prompts]
    ids = [tok.encode(t) for t in texts]
    empty = [i + 1 for i, x in enumerate(ids) if not x]
    if empty:
        raise UsageError(f"prompt {empty[0]} has no tokens")
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    if args.kv_pages:  # a pool too small for the prompt that needs the most pages: said before the model is built
        ec = EngineConfig()
        big = max(range(len(ids)), key=lambda i: pages_for_one_sequence(len(ids[i]), args.max_new_tokens,
                                                                        ec.page_size, ec.sync_steps))
        check_kv_pages(args.kv_pages, "--kv-pages", prompt_tokens=len(ids[big]), max_new=args.max_new_tokens,
                       page_size=ec.page_size, sync_steps=ec.sync_steps, prompt_note=f" (prompt {big + 1})")
    model = load_model(ckpt, dtype=args.dtype)
    check_position_limit(model.cfg, len(ids[longest]) + args.max_new_tokens,
                         f"prompt {longest + 1} ({len(ids[longest])} tokens) + --max-new-tokens "
                         f"({args.max_new_tokens})")
    gen = Engine(model, eos_ids=tok.eos_ids, pad_id=tok.pad_id,
                 config=EngineConfig(pages=args.kv_pages, kv_cache=args.kv_cache, attention=args.decode_attention))
    t0 = time.perf_counter()
    res = gen.generate(model, ids, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed)
    dt = time.perf_counter() - t0
    for i in range(len(prompts)):
        lp = np.asarray(res.logprobs[i, :int(res.lengths[i])], np.float32)
        bad = np.isnan(lp) | np.isposinf(lp)
        if bad.any():
            raise UsageError(f"prompt {i + 1}: the model produced non-finite logits (NaN/Inf) at completion token "
                             f"{int(np.argmax(bad))}; nothing is printed")
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
    tune_gc()
    sys.exit(main())
