"""`python -m lrmq.studies.heldout`: held-out accuracy of one checkpoint, and the memory of its model.

    python -m lrmq.studies.heldout --checkpoint DIR --train-config CONFIG.yaml --out RESULT.json
        [--size N] [--samples K] [--no-greedy] [--seed S] [--qat-scheme S [--qat-group-size G]]
        [--train-memory RUN_CONFIG.yaml]

Evaluates exactly as the GRPO trainer's own held-out evaluation (`GRPOTrainer.evaluate`): the first N
held-out problems of CONFIG's data (the synthetic split, or data.eval_files), rendered with its template,
left-padded to rollout.max_prompt_len, rollout.max_new_tokens new tokens, scored with algo.reward; greedy and
sampled at the rollout temperature with key(seed + 7919) (sample k > 0: folded with k). So the float
policy of a train arm scores what the trainer logged at its last step.

CHECKPOINT is any checkpoint lrmq loads (HF float or fake-quant, a packed lrmq checkpoint run through the
quantized kernels). `--qat-scheme` evaluates the float weights through that QAT forward (a QAT-in-RL
policy is meant to run quantized; paper_int8's per-tensor scale is taken from these weights).

Memory (bytes, in the result): `weight_bytes`, the variables of the evaluated model (packed codes + scales
for a packed checkpoint; for `--qat-scheme` the weights packed in the scheme's format, int8 or int4);
`--train-memory RUN_CONFIG` (a run's config.yaml) adds the training-time parameters (float, or packed base +
adapters for QLoRA) and the AdamW state (`train_param_bytes`, `train_opt_bytes`), computed abstractly.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import numpy as np
from flax import nnx

from lrmq import compile_cache
from lrmq.atomic import atomic_write_text
from lrmq.checkpoint.load import load_model, resolve_checkpoint
from lrmq.cli import ArgumentParser, number, run_main, select_platforms, tune_gc
from lrmq.configlib import load_config
from lrmq.data.prompts import format_prompt
from lrmq.generation.engine import Engine
from lrmq.generation.sampling import SamplingConfig
from lrmq.quant.qat import apply_qat
from lrmq.quant.training import pack_linears, param_bytes, trainable_filter, tree_bytes
from lrmq.rl.batch import truncate_left
from lrmq.rl.config import TrainConfig
from lrmq.rl.rewards import score_completions
from lrmq.rl.step import make_optimizer
from lrmq.rl.setup import build_model, load_datasets
from lrmq.tokenizer import Tokenizer

QAT_PACKING = {"paper_int8": "int8", "int8": "int8", "w8a8": "int8", "int4": "int4", "int4_asym": "int4",
               "int8_asym": "int8"}


def evaluate_heldout(model, tok: Tokenizer, cfg: TrainConfig, *, size: int, samples: int = 1, greedy: bool = True,
                     seed: int = 0) -> dict:
    """{greedy_,sampled_}{accuracy,reward,format_rate} on the first `size` held-out problems of `cfg`."""
    _, held = load_datasets(cfg)
    rows = held[:size]
    if not rows:
        raise ValueError("the train config has no held-out problems (data.eval_files is empty and "
                         "data.synthetic_eval_size is 0)")
    r = cfg.rollout
    ids = [truncate_left(tok.encode(format_prompt(cfg.data.template, x["problem"], tok)), r.max_prompt_len)
           for x in rows]
    answers = [str(x["answer"]) for x in rows]
    gen = Engine(model, eos_ids=tok.eos_ids, pad_id=tok.pad_id, config=r.engine_config())
    state = nnx.state(model)
    key = jax.random.key(seed + 7919)
    modes = [("greedy", SamplingConfig(greedy=True), 1)] if greedy else []
    modes.append(("sampled", SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k), samples))
    out: dict = {"problems": len(rows), "samples": samples}
    for name, sampling, k_max in modes:
        correct, rewards, formatted, lengths = [], [], [], []
        for k in range(k_max):
            res = gen.generate(state, ids, max_new_tokens=r.max_new_tokens, sampling=sampling,
                               seed=key if k == 0 else jax.random.fold_in(key, k))
            texts = [tok.decode(res.tokens[i, :int(res.lengths[i])].tolist()) for i in range(len(rows))]
            rew, info = score_completions(texts, answers, cfg.algo.reward, timeout_s=cfg.algo.reward_timeout_s)
            correct.append(np.asarray(info["correct"], np.float64))
            rewards.append(np.asarray(rew, np.float64))
            formatted.append(np.asarray(info["formatted"], np.float64))
            lengths.append(np.asarray(res.lengths, np.float64))
        per_problem = np.mean(correct, axis=0)
        out[f"{name}_accuracy"] = float(per_problem.mean())
        out[f"{name}_accuracy_se"] = float(per_problem.std(ddof=1) / np.sqrt(len(rows))) if len(rows) > 1 else 0.0
        out[f"{name}_reward"] = float(np.mean(rewards))
        out[f"{name}_format_rate"] = float(np.mean(formatted))
        out[f"{name}_tokens"] = float(np.mean(lengths))
    return out


def train_memory(cfg: TrainConfig) -> dict:
    """Training-time bytes of `cfg`'s recipe: parameters (as the trainer holds them) and the AdamW state of
    what it trains; the model is built abstractly (no weights are read)."""
    model = nnx.eval_shape(lambda: build_model(cfg, None))
    trainable = nnx.state(model, trainable_filter(cfg.quant.mode))
    tx, _ = make_optimizer(cfg)
    opt = jax.eval_shape(tx.init, trainable)
    pb = param_bytes(model)
    return {"train_param_bytes": pb["total"], "train_trainable_bytes": tree_bytes(trainable),
            "train_opt_bytes": tree_bytes(opt), "train_mode": cfg.quant.mode}


def parse_args(argv=None):
    ap = ArgumentParser("studies.heldout", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="HF or lrmq checkpoint ('tiny' = the shipped model)")
    ap.add_argument("--train-config", required=True, help="train config whose held-out problems and rollout "
                                                          "settings are used")
    ap.add_argument("--out", required=True, help="result JSON to write")
    ap.add_argument("--size", type=number(int, ge=1), default=256, help="the first N held-out problems")
    ap.add_argument("--samples", type=number(int, ge=1), default=1,
                    help="sampled completions per problem (at the train config's rollout temperature)")
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy evaluation (sampled only)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--qat-scheme", choices=sorted(QAT_PACKING), default=None,
                    help="evaluate with this QAT scheme's fake quantization (a QAT arm's float policy)")
    ap.add_argument("--qat-group-size", type=number(int, ge=0), default=0,
                    help="--qat-scheme int8/int4: input rows per scale group (0 = per output channel)")
    ap.add_argument("--train-memory", default=None, help="a run's config.yaml: add training-time memory")
    ap.add_argument("--memory-only", action="store_true", help="no evaluation: the memory figures only")
    return ap.parse_args(argv)


def run(args) -> dict:
    t0 = time.perf_counter()
    cfg = load_config(TrainConfig, args.train_config)
    ckpt = resolve_checkpoint(args.checkpoint)
    model = load_model(ckpt, dtype=cfg.model.dtype)
    tok = Tokenizer.from_dir(ckpt)
    if args.qat_scheme:
        apply_qat(model, args.qat_scheme, pattern=cfg.quant.targets, group_size=args.qat_group_size)
    result = {"checkpoint": args.checkpoint, "qat_scheme": args.qat_scheme}
    if not args.memory_only:
        result.update(evaluate_heldout(model, tok, cfg, size=args.size, samples=args.samples,
                                       greedy=not args.no_greedy, seed=args.seed))
    if args.qat_scheme:
        pack_linears(model, QAT_PACKING[args.qat_scheme], cfg.quant.targets)
    pb = param_bytes(model)
    result.update(weight_bytes=pb["total"], linear_bytes=pb["linears"])
    if args.train_memory:
        mem = train_memory(load_config(TrainConfig, args.train_memory))
        result.update(mem)
        if mem["train_mode"] == "qlora":  # the deployed model is the packed base + the adapters
            result["weight_bytes"] = mem["train_param_bytes"]
    result["seconds"] = time.perf_counter() - t0
    atomic_write_text(args.out, json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result


def main(argv=None) -> int:
    select_platforms()  # before JAX starts a backend (lrmq.cli)
    args = parse_args(argv)
    compile_cache.enable()  # every job of a study compiles the same generation programs: load them from disk

    def body() -> int:
        r = run(args)
        keys = [k for k in ("greedy_accuracy", "sampled_accuracy") if k in r]
        print(", ".join(f"{k} {r[k]:.4f}" for k in keys) + f"; wrote {args.out}", file=sys.stderr)
        return 0

    return run_main("studies.heldout", body)


if __name__ == "__main__":
    tune_gc()
    sys.exit(main())
