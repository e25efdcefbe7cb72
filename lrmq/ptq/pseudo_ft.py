"""Pseudo-fine-tuning: a (before, after) checkpoint pair for QuantLRM when the LRM has no
pre-fine-tuning checkpoint.

QuantLRM's paper names the idea but publishes neither data nor hyper-parameters. lrmq's version: a
short full-parameter SFT of the model on supplied reasoning traces; ``before/`` is the model as given
(re-saved as HF), ``after/`` the briefly fine-tuned one. Then run QuantLRM with
``model=<out>/after``, ``quantlrm.base=<out>/before`` and ``quantlrm.quantize=base``: |dW| = |W_after -
W_before| ranks the channels of the original model, which is the one quantized.

    python -m lrmq.ptq.pseudo_ft --checkpoint DIR --traces traces.jsonl --out OUT [--steps 100 ...]

Traces: jsonl with ``text`` (loss on every token) or ``prompt`` + ``completion`` (loss on the
completion tokens only). Defaults: 100 steps, AdamW lr 1e-5 (constant, no weight decay), batch 8,
sequence length 512 (longer sequences are truncated, shorter right-padded and masked), float32.

Alternative with real RL signal: a short lrmq GRPO run writes ``initial_policy/`` and
``final_policy/`` (``python -m lrmq.train --config configs/tiny_demo.yaml run.steps=20
run.out_dir=runs/pft``), then ``quantlrm.run_dir=runs/pft`` (with ``quantlrm.quantize=base`` to
quantize the original).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lrmq.atomic import atomic_dir
from lrmq.checkpoint.hf import save_hf_model
from lrmq.checkpoint.load import (check_checkpoint, checkpoint_kind, load_model, load_tokenizer, read_model_config,
                                  resolve_checkpoint)
from lrmq.cli import USER_ERRORS, ArgumentParser, check_disjoint, number, run_main, select_platforms, tune_gc
from lrmq.data.text import label, read_records
from lrmq.paths import kind_of


@dataclasses.dataclass(frozen=True)
class PseudoFTOptions:
    steps: int = 100
    lr: float = 1e-5
    batch_size: int = 8
    seq_len: int = 512
    seed: int = 0
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.0


def load_traces(path: str, tokenizer, seq_len: int, option: str | None = "--traces") -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [n, seq_len], loss mask float32 [n, seq_len]) with the mask on predicted tokens. The file is
    read by lrmq.data.text (.jsonl / .json / .parquet records): errors name `option`, the file and the line."""
    where = label(path, option)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{where}: traces file does not exist")
    records = read_records(path, option)
    if not records:
        raise ValueError(f"{where}: no traces")
    for at, row in records:
        if not isinstance(row, dict):
            raise ValueError(f"{where} {at}: expected a JSON object with 'text' or 'prompt' + 'completion', "
                             f"found a {kind_of(row)}")
        bad = [k for k in ("text", "prompt", "completion") if k in row and not isinstance(row[k], str)]
        if bad:
            raise ValueError(f"{where} {at}: field {bad[0]!r} is a {kind_of(row[bad[0]])}, expected text")
    rows = [row for _, row in records]
    try:
        pad = tokenizer.pad_id
    except ValueError:  # no pad/eos token: any id will do, padding is masked out of the loss
        pad = 0
    toks = np.full((len(rows), seq_len), pad, np.int32)
    mask = np.zeros((len(rows), seq_len), np.float32)
    for r, row in enumerate(rows):
        if "text" in row:
            ids = tokenizer.encode(row["text"])
            start = 0
        elif "prompt" in row and "completion" in row:
            p = tokenizer.encode(row["prompt"])
            ids = p + tokenizer.encode(row["completion"])
            start = len(p)
        else:
            raise ValueError(f"{where} {records[r][0]} needs 'text' or 'prompt' + 'completion'; has {sorted(row)}")
        ids = ids[:seq_len]
        toks[r, : len(ids)] = ids
        mask[r, max(start, 1): len(ids)] = 1.0  # token t is predicted from t-1
    if mask.sum() == 0:
        raise ValueError(f"{where}: no completion tokens to train on within seq_len={seq_len}")
    return toks, mask


def _loss(model, tokens, mask):
    logits = model(tokens).astype(jnp.float32)[:, :-1]
    logp = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    m = mask[:, 1:]
    return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)


def sft(model, tokens: np.ndarray, mask: np.ndarray, opts: PseudoFTOptions = PseudoFTOptions(),
        log_every: int = 0) -> list[float]:
    """Full-parameter SFT in place; returns the loss per step."""
    tx = optax.adamw(opts.lr, b1=opts.b1, b2=opts.b2, weight_decay=opts.weight_decay)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tb, mb):
        def f(p):
            return _loss(nnx.merge(graphdef, p, rest), tb, mb)

        loss, g = jax.value_and_grad(f)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    rng = np.random.default_rng(opts.seed)
    losses = []
    for s in range(opts.steps):
        idx = rng.choice(tokens.shape[0], size=opts.batch_size, replace=tokens.shape[0] < opts.batch_size)
        params, opt_state, loss = step(params, opt_state, jnp.asarray(tokens[idx]), jnp.asarray(mask[idx]))
        losses.append(float(loss))
        if log_every and s % log_every == 0:
            print(f"[pseudo_ft] step {s} loss {losses[-1]:.4f}", file=sys.stderr)
    nnx.update(model, params)
    return losses


def _stored_param_dtype(path: str) -> str:
    checkpoint_kind(path)  # a clear error for a missing / broken checkpoint
    return read_model_config(path).param_dtype


def pseudo_finetune(checkpoint: str, traces: str, out_dir: str, opts: PseudoFTOptions = PseudoFTOptions(), *,
                    tokenizer: str | None = None, dtype: str | None = None, overwrite: bool = False) -> dict:
    """Write ``out_dir/before`` (the model as given) and ``out_dir/after`` (after SFT), atomically."""
    checkpoint = check_checkpoint(checkpoint)
    tok_dir = resolve_checkpoint(tokenizer) if tokenizer else checkpoint
    tok = load_tokenizer(tok_dir, "--tokenizer" if tokenizer else None)
    tokens, mask = load_traces(traces, tok, opts.seq_len)
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"output directory {os.path.abspath(out_dir)} already exists")
    model = load_model(checkpoint, dtype="float32", param_dtype="float32")
    save_dtype = dtype or _stored_param_dtype(checkpoint)
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        save_hf_model(model, os.path.join(tmp, "before"), dtype=save_dtype, tokenizer_from=tok_dir)
        losses = sft(model, tokens, mask, opts)
        save_hf_model(model, os.path.join(tmp, "after"), dtype=save_dtype, tokenizer_from=tok_dir)
        with open(os.path.join(tmp, "pseudo_ft.json"), "w") as f:
            json.dump({"options": dataclasses.asdict(opts), "losses": losses, "checkpoint": checkpoint,
                       "traces": traces}, f, indent=1)
    return {"before": os.path.join(out_dir, "before"), "after": os.path.join(out_dir, "after"), "losses": losses}


def main(argv=None) -> int:
    select_platforms()  # before JAX starts a backend (lrmq.cli)
    ap = ArgumentParser("ptq.pseudo_ft", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True,
                    help="the model to fine-tune (HF or lrmq; 'tiny' = the shipped model)")
    ap.add_argument("--traces", required=True, help="jsonl: text, or prompt + completion")
    ap.add_argument("--out", required=True, help="directory to write: OUT/before and OUT/after (HF checkpoints)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir or checkpoint (default: --checkpoint's)")
    d = PseudoFTOptions()
    ap.add_argument("--steps", type=number(int, ge=1), default=d.steps, help="SFT optimizer steps")
    ap.add_argument("--lr", type=number(float, gt=0), default=d.lr, help="AdamW learning rate (constant)")
    ap.add_argument("--batch-size", type=number(int, ge=1), default=d.batch_size, help="traces per step")
    ap.add_argument("--seq-len", type=number(int, ge=2), default=d.seq_len,
                    help="tokens per trace (longer ones truncated, shorter right-padded and masked)")
    ap.add_argument("--seed", type=int, default=d.seed, help="seed of the traces drawn for each batch")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="dtype of the saved pair (default: the checkpoint's)")
    ap.add_argument("--overwrite", action="store_true", help="replace --out when it exists")
    a = ap.parse_args(argv)
    opts = PseudoFTOptions(steps=a.steps, lr=a.lr, batch_size=a.batch_size, seq_len=a.seq_len, seed=a.seed)
    def body() -> int:
        check_disjoint({"--out": a.out}, {"--checkpoint": resolve_checkpoint(a.checkpoint), "--traces": a.traces,
                                          "--tokenizer": resolve_checkpoint(a.tokenizer) if a.tokenizer else None})
        r = pseudo_finetune(a.checkpoint, a.traces, a.out, opts, tokenizer=a.tokenizer, dtype=a.dtype,
                            overwrite=a.overwrite)
        print(json.dumps({"before": r["before"], "after": r["after"], "first_loss": r["losses"][0],
                          "last_loss": r["losses"][-1]}))
        return 0

    return run_main("ptq.pseudo_ft", body, USER_ERRORS)


if __name__ == "__main__":
    tune_gc()
    sys.exit(main())
