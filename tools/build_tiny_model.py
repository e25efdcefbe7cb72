"""Build lrmq's embedded default tiny reasoning model (lrmq/assets/tiny).

    .venv/bin/python tools/build_tiny_model.py [--out lrmq/assets/tiny] [--seed 0] [--steps N]

1. A hand-built byte-level BPE tokenizer (Qwen-style, GPT-2 byte alphabet): every byte is a token, so
   every digit is a single token; the only merges spell the fixed words "Compute", "Answer" and
   "boxed". Special tokens <|endoftext|> (eos + pad), <|im_start|>, <|im_end|>; a Qwen chat template.
2. A tiny Qwen3 config (`ModelConfig.from_hf_dict`) and `Decoder(cfg, nnx.Rngs(seed))`.
3. SFT with AdamW on `lrmq.data.synthetic.make_splits` (default `ArithDifficulty`): input is
   `format_prompt("arith", problem)` + " " + solution + <|endoftext|>, loss on the completion only.
   Training is stopped early on purpose: the model solves only a fraction of held-out problems, so
   GRPO has reward signal and room to improve.
4. Saves atomically (config.json, model.safetensors, tokenizer files, build_info.json), reloads the
   saved checkpoint from disk and measures held-out accuracy (greedy, and sampled at T=1.0) with a
   KV-cached jitted decoding loop. The accuracies are written into build_info.json.

Deterministic for a given --seed on a given machine/JAX version (CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from lrmq.atomic import atomic_dir  # noqa: E402
from lrmq.checkpoint.hf import load_hf_model, save_hf_model  # noqa: E402
from lrmq.data.prompts import format_prompt  # noqa: E402
from lrmq.data.synthetic import ArithDifficulty, make_splits  # noqa: E402
from lrmq.model.config import ModelConfig  # noqa: E402
from lrmq.generation.engine import Engine, EngineConfig  # noqa: E402
from lrmq.generation.sampling import SamplingConfig  # noqa: E402
from lrmq.model.decoder import Decoder  # noqa: E402
from lrmq.grading.answers import extract_last_boxed  # noqa: E402
from lrmq.tokenizer import Tokenizer  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "lrmq", "assets", "tiny")
TEMPLATE = "arith"
EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
WORDS = ("Compute", "Answer", "boxed")

# Qwen2.5/Qwen3-style ChatML template (no tools, no thinking blocks).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Tiny Qwen3. vocab_size is filled in from the tokenizer (rounded up to a multiple of 64).
BASE_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "torch_dtype": "float32",
    "bos_token_id": None,
    "eos_token_id": None,
}
# Larger shapes for studies that ask whether a finding holds beyond the default tiny model (--arch).
ARCHS = {
    "tiny": {},  # 0.43M parameters: lrmq/assets/tiny
    "small": {"hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 6,
              "num_key_value_heads": 2},  # 1.24M parameters, 3 layers
    # Qwen3-MoE: 3 layers, sparse / dense / sparse (mlp_only_layers), 8 experts of width 64, top-2, renormalised
    # as Qwen3-30B-A3B (norm_topk_prob): lrmq/assets/tiny-moe
    "moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "intermediate_size": 256,
            "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1], "router_aux_loss_coef": 0.001},
}
# Where each shipped arch goes by default (--out); the others need --out.
ASSET_DIRS = {"tiny": DEFAULT_OUT, "moe": os.path.join(REPO, "lrmq", "assets", "tiny-moe")}


# ----------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char map (what ByteLevel pre-tokenization uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer():
    """Byte-level BPE: ids 0..255 are the bytes (in byte order), then the word merges, then specials."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    merges = []
    for w in WORDS:
        cur = w[0]
        for ch in w[1:]:
            merges.append((cur, ch))
            cur += ch
            if cur not in vocab:
                vocab[cur] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (EOS, IM_START, IM_END)])
    return tok


def write_tokenizer_files(tok, d: str, model_max_length: int) -> None:
    tok.save(os.path.join(d, "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in (EOS, IM_START, IM_END)
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    gen = {"eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(IM_END)], "pad_token_id": tok.token_to_id(EOS)}
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)


# ----------------------------------------------------------------------------- data


def encode_rows(tok: Tokenizer, rows: list[dict], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens [N, seq_len] (right-padded with eos) and loss mask [N, seq_len] (1 on completion + eos)."""
    prompts = tok.batch_encode([format_prompt(TEMPLATE, r["problem"], tok) for r in rows])
    comps = tok.batch_encode([" " + r["solution"] for r in rows])
    eos = tok.eos_ids[0]
    toks = np.full((len(rows), seq_len), tok.pad_id, np.int32)
    mask = np.zeros((len(rows), seq_len), np.float32)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        ids = p + c + [eos]
        if len(ids) > seq_len:
            raise ValueError(f"row {i} has {len(ids)} tokens > seq_len {seq_len}")
        toks[i, : len(ids)] = ids
        mask[i, len(p) : len(ids)] = 1.0
    return toks, mask


# ----------------------------------------------------------------------------- training


def make_train_step(graphdef):
    def loss_fn(params, rest, tokens, mask):
        model = nnx.merge(graphdef, params, rest)
        inp, tgt, m = tokens[:, :-1], tokens[:, 1:], mask[:, 1:]
        pos = jnp.broadcast_to(jnp.arange(inp.shape[1], dtype=jnp.int32), inp.shape)
        logits = model(inp, pos).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)

    def step(params, rest, opt_state, tx_update, tokens, mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, tokens, mask)
        updates, opt_state = tx_update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, optax.global_norm(grads)

    return loss_fn, step


def train(model: Decoder, toks: np.ndarray, mask: np.ndarray, *, steps: int, batch_size: int, lr: float,
          warmup: int, weight_decay: float, seed: int, log_every: int, pad_id: int, eval_fn=None, eval_every: int = 0):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.1)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=weight_decay))
    opt_state = tx.init(params)
    _, step_fn = make_train_step(graphdef)
    jstep = jax.jit(lambda p, r, o, t, m: step_fn(p, r, o, tx.update, t, m), donate_argnums=(0, 2))

    rng = np.random.default_rng(seed)
    n = len(toks)
    order, cursor = rng.permutation(n), 0
    t0 = time.perf_counter()
    window_t, window_tokens = t0, 0
    history = []
    for s in range(1, steps + 1):
        if cursor + batch_size > n:
            order, cursor = rng.permutation(n), 0
        idx = order[cursor : cursor + batch_size]
        cursor += batch_size
        params, opt_state, loss, gnorm = jstep(params, rest, opt_state, jnp.asarray(toks[idx]), jnp.asarray(mask[idx]))
        window_tokens += int((toks[idx] != pad_id).sum())  # real (non-pad) tokens
        if s % log_every == 0 or s == 1 or s == steps:
            loss = float(loss)
            now = time.perf_counter()
            tps = window_tokens / (now - window_t)
            print(f"step {s:5d}/{steps}  loss {loss:.4f}  gnorm {float(gnorm):.3f}  lr {float(sched(s)):.2e}  "
                  f"tokens/s {tps:,.0f}  elapsed {now - t0:.1f}s", flush=True)
            history.append({"step": s, "loss": round(loss, 5)})
            window_t, window_tokens = now, 0
        if eval_fn is not None and eval_every and s % eval_every == 0 and s != steps:
            nnx.update(model, params)
            eval_fn(model, s)
    nnx.update(model, params)
    return time.perf_counter() - t0, history


# ----------------------------------------------------------------------------- evaluation


_ENGINES: dict = {}


def engine_for(model: Decoder, tok: Tokenizer, batch_size: int) -> Engine:
    """One generation engine per model object: repeated evaluations during training reuse its programs."""
    key = (id(model), batch_size)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(model, eos_ids=tok.eos_ids, pad_id=tok.pad_id, config=EngineConfig(slots=batch_size))
    return _ENGINES[key]


def evaluate(model: Decoder, tok: Tokenizer, rows: list[dict], *, temperature: float, samples: int, seed: int,
             max_new: int, batch_size: int = 512) -> dict:
    state = nnx.state(model)
    gen = engine_for(model, tok, min(batch_size, len(rows)))
    sampling = SamplingConfig(greedy=True) if temperature == 0.0 else SamplingConfig(temperature=temperature)
    prompts = tok.batch_encode([format_prompt(TEMPLATE, r["problem"], tok) for r in rows])
    key = jax.random.key(seed)
    correct = np.zeros((len(rows), samples), bool)
    formatted = np.zeros((len(rows), samples), bool)
    examples = []
    for k in range(samples):
        for s in range(0, len(rows), batch_size):
            key, sub = jax.random.split(key)
            res = gen.generate(state, prompts[s: s + batch_size], max_new_tokens=max_new, sampling=sampling, seed=sub)
            for j in range(len(res.lengths)):
                ids = [int(t) for t in res.tokens[j, :res.lengths[j]]]
                stop = next((n for n, t in enumerate(ids) if t in tok.eos_ids), len(ids))
                text = tok.decode(ids[:stop])
                pred = extract_last_boxed(text)
                r = rows[s + j]
                formatted[s + j, k] = pred is not None
                correct[s + j, k] = pred is not None and pred.strip() == r["answer"]
                if k == 0 and len(examples) < 4:
                    examples.append({"problem": r["problem"], "completion": text, "answer": r["answer"]})
    n_ops = np.array([r["solution"].count("=") for r in rows])
    by_ops = {str(o): round(float(correct[n_ops == o].mean()), 4) for o in sorted(set(n_ops.tolist()))}
    return {"temperature": temperature, "samples_per_problem": samples, "problems": len(rows),
            "accuracy": round(float(correct.mean()), 4), "formatted": round(float(formatted.mean()), 4),
            "pass_at_k": round(float(correct.any(1).mean()), 4), "accuracy_by_num_ops": by_ops,
            "examples": examples}


def check_reload(model: Decoder, out: str, tokens: np.ndarray) -> None:
    """The saved checkpoint + tokenizer load back through lrmq and give the same logits."""
    re_model = load_hf_model(out)
    Tokenizer.from_dir(out)
    t = jnp.asarray(tokens)
    diff = float(jnp.max(jnp.abs(model(t) - re_model(t))))
    if diff > 1e-5:
        raise RuntimeError(f"reloaded model differs from the trained one (max |dlogits| = {diff})")


# ----------------------------------------------------------------------------- main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output directory (replaced atomically); default "
                    "lrmq/assets/tiny (--arch tiny) or lrmq/assets/tiny-moe (--arch moe)")
    ap.add_argument("--seed", type=int, default=0, help="seed for data splits, init, batch order and sampling")
    ap.add_argument("--steps", type=int, default=500, help="SFT steps (stopped early on purpose: see docs)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--n-train", type=int, default=50_000)
    ap.add_argument("--n-eval", type=int, default=500)
    ap.add_argument("--eval-samples", type=int, default=4, help="T=1.0 samples per held-out problem")
    ap.add_argument("--eval-every", type=int, default=0, help="greedy held-out eval every N steps (tuning)")
    ap.add_argument("--seq-len", type=int, default=128, help="max tokens per row (batches use the longest row)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--no-save", action="store_true", help="train and evaluate only (tuning)")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="tiny",
                    help="model shape: tiny (the shipped asset), small (~3x the parameters, 3 layers) or moe "
                         "(the shipped Qwen3-MoE asset tiny-moe)")
    a = ap.parse_args(argv)
    if a.out is None and not a.no_save:
        if a.arch not in ASSET_DIRS:
            ap.error(f"--arch {a.arch} is not shipped: give --out")
        a.out = ASSET_DIRS[a.arch]

    t_start = time.perf_counter()
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device(s))", flush=True)

    # Tokenizer: written to a scratch dir and read back through lrmq.tokenizer, like every user will.
    scratch = tempfile.mkdtemp(prefix="tiny-tok-")
    hf_tok = build_tokenizer()
    write_tokenizer_files(hf_tok, scratch, BASE_CONFIG["max_position_embeddings"])
    tok = Tokenizer.from_dir(scratch)
    vocab = tok.vocab_size
    print(f"tokenizer: {vocab} tokens; eos/pad {tok.eos_ids}/{tok.pad_id}", flush=True)

    # Data.
    difficulty = ArithDifficulty()
    train_rows, eval_rows = make_splits(a.n_train, a.n_eval, a.seed, difficulty)
    toks, mask = encode_rows(tok, train_rows, a.seq_len)
    lens = (toks != tok.pad_id).sum(1) + 1
    # One static shape for the jitted step: the longest row rounded up to 8.
    seq_len = int(math.ceil(lens.max() / 8) * 8)
    toks, mask = toks[:, :seq_len], mask[:, :seq_len]
    print(f"data: {len(train_rows)} train / {len(eval_rows)} held-out; {difficulty}; "
          f"max train length {int(lens.max())} tokens", flush=True)
    ex = train_rows[0]
    print("example:", repr(format_prompt(TEMPLATE, ex["problem"], tok) + " " + ex["solution"]), flush=True)

    # Model.
    hf = dict(BASE_CONFIG, **ARCHS[a.arch], vocab_size=int(math.ceil(vocab / 64) * 64),
              bos_token_id=None, eos_token_id=tok.eos_ids[0])
    cfg = ModelConfig.from_hf_dict(hf)
    model = Decoder(cfg, nnx.Rngs(a.seed))
    n_params = sum(int(np.prod(v.get_value().shape)) for v in jax.tree.leaves(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)))
    moe = (f", {cfg.num_experts} experts of {cfg.moe_intermediate_size} top-{cfg.num_experts_per_tok} "
           f"(dense layers {[i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]}), "
           f"{cfg.num_params(active=True):,} active" if cfg.num_experts else "")
    print(f"model: {hf['model_type']} hidden {cfg.hidden_size} x {cfg.num_layers} layers, {cfg.num_heads}/"
          f"{cfg.num_kv_heads} heads of {cfg.head_dim}, mlp {cfg.intermediate_size}, vocab {cfg.vocab_size}"
          f"{moe}: {n_params:,} params", flush=True)

    def quick_eval(m, step):
        r = evaluate(m, tok, eval_rows[:200], temperature=0.0, samples=1, seed=a.seed, max_new=a.max_new_tokens)
        s = evaluate(m, tok, eval_rows[:200], temperature=1.0, samples=1, seed=a.seed, max_new=a.max_new_tokens)
        print(f"  [eval @ {step}] greedy {r['accuracy']:.3f} {r['accuracy_by_num_ops']}  "
              f"T=1 {s['accuracy']:.3f} {s['accuracy_by_num_ops']}", flush=True)

    train_s, history = train(model, toks, mask, steps=a.steps, batch_size=a.batch_size, lr=a.lr, warmup=a.warmup,
                             weight_decay=a.weight_decay, seed=a.seed, log_every=50, pad_id=tok.pad_id,
                             eval_fn=quick_eval, eval_every=a.eval_every)
    print(f"training: {a.steps} steps in {train_s:.1f}s", flush=True)

    greedy = evaluate(model, tok, eval_rows, temperature=0.0, samples=1, seed=a.seed, max_new=a.max_new_tokens)
    sampled = evaluate(model, tok, eval_rows, temperature=1.0, samples=a.eval_samples, seed=a.seed + 1,
                       max_new=a.max_new_tokens)
    for name, r in (("greedy", greedy), ("T=1.0", sampled)):
        print(f"held-out {name}: accuracy {r['accuracy']:.3f} (formatted {r['formatted']:.3f}, pass@{r['samples_per_problem']} "
              f"{r['pass_at_k']:.3f}) by #ops {r['accuracy_by_num_ops']}", flush=True)
    for e in greedy["examples"][:3]:
        print(f"  {e['problem']} -> {e['completion']!r} (gold {e['answer']})")

    if not a.no_save:
        info = {
            "built": datetime.date.today().isoformat(),
            "command": "tools/build_tiny_model.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "versions": {"jax": jax.__version__, "flax": __import__("flax").__version__, "optax": optax.__version__,
                         "tokenizers": __import__("tokenizers").__version__},
            "data": {
                "generator": "lrmq.data.synthetic.make_splits(n_train, n_held_out, seed, ArithDifficulty(**difficulty))",
                "difficulty": dataclasses.asdict(difficulty),
                "seed": a.seed,
                "train_seed": a.seed * 2,
                "held_out_seed": a.seed * 2 + 1,
                "n_train": a.n_train,
                "n_held_out": a.n_eval,
                "held_out_excluded_from_train": True,
                "prompt_template": TEMPLATE,
                "sequence": "format_prompt('arith', problem) + ' ' + solution + '<|endoftext|>' (loss on completion + eos)",
            },
            "model": {"config": cfg.to_hf_dict(), "num_params": n_params, "init_seed": a.seed,
                      **({"active_params": cfg.num_params(active=True)} if cfg.num_experts else {})},
            "training": {"steps": a.steps, "batch_size": a.batch_size, "examples_seen": a.steps * a.batch_size,
                         "optimizer": "clip_by_global_norm(1.0) + adamw(b1=0.9, b2=0.98)", "lr": a.lr,
                         "schedule": f"warmup_cosine_decay(0 -> {a.lr}, warmup {a.warmup}, end {a.lr * 0.1})",
                         "weight_decay": a.weight_decay, "seconds": round(train_s, 1),
                         "backend": jax.default_backend(), "loss_history": history},
            "eval": {"held_out": f"the {a.n_eval} held-out problems", "greedy": greedy, "sampled": sampled,
                     "max_new_tokens": a.max_new_tokens, "metric": "last \\boxed{} content == gold answer (string)"},
        }
        out = os.path.abspath(a.out)
        # One atomic replace of the whole directory: weights, config, tokenizer files and build_info.
        with atomic_dir(out, overwrite=True) as tmp:
            save_hf_model(model, tmp, overwrite=True, tokenizer_from=scratch)
            with open(os.path.join(tmp, "build_info.json"), "w") as f:
                json.dump(info, f, indent=2)
                f.write("\n")
            os.chmod(tmp, 0o755)  # temp files/dirs are created private; ship them world-readable
            for name in os.listdir(tmp):
                os.chmod(os.path.join(tmp, name), 0o644)
        check_reload(model, out, toks[:8])
        print(f"saved {out}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"done in {time.perf_counter() - t_start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
