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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lrmq.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="HF or lrmq checkpoint directory")
    src = ap.add_mutually_exclusive_group(required=True)
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
    return ap.parse_args(argv)


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


def main(argv=None) -> int:
    args = parse_args(argv)
    from lrmq.checkpoint.load import load_model
    from lrmq.generation.engine import Generator
    from lrmq.generation.sampling import SamplingConfig
    from lrmq.tokenizer import Tokenizer

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
