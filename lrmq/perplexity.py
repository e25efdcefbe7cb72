"""`python -m lrmq.perplexity --checkpoint DIR --text-file F [--window N] [--max-windows N] [--no-bos]`.

WikiText-2 protocol (GPTQ / llm-awq / QuantLRM ``eval``): documents joined with ``"\\n\\n"``, tokenized
once *with* special tokens as ``tokenizer(text)`` does (the tokenizer.json post-processor: one BOS in
front of the whole text for Llama-style tokenizers, nothing for Qwen-style ones and lrmq's tiny
tokenizer, which have no BOS; ``--no-bos`` tokenizes without special tokens, the old lrmq behaviour),
cut into ``n = len // window`` non-overlapping windows (the tail is dropped); each window is scored
independently (position t predicts token t+1, ``window - 1`` predictions per window);
``ppl = exp(mean NLL over all predicted tokens)`` (equal to the reference's
``exp(sum_i mean_i * window / (n * window))``). Float, fake-quantized (``--fake-quant rtn_asym`` etc.,
any ``lrmq.quant.QUANTIZERS`` entry applied to the seven projections) and packed lrmq checkpoints.
Prints one JSON object. ``--window`` defaults to 2048 (the reference's), or the model's
``max_position_embeddings`` when that is smaller; a window past the limit is refused (past it RoPE runs on untrained positions: a finite but meaningless perplexity). Bad
input is one line ``lrmq.perplexity: error: ...`` and exit status 2.
"""

from __future__ import annotations

import json
import math
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from lrmq.checkpoint.load import check_checkpoint, load_model, load_tokenizer
from lrmq.checkpoint.quantized import refuse_quantized
from lrmq.cli import ArgumentParser, number, run_main, select_platforms, tune_gc
from lrmq.model.config import check_position_limit
from lrmq.data.text import label, read_documents
from lrmq.ptq.qat_export import refuse_float_qat_policy
from lrmq.quant.quantizers import QUANTIZERS
from lrmq.ptq.rtn import targeted
from lrmq.quant.transforms import DEFAULT_TARGETS

DEFAULT_WINDOW = 2048  # the seqlen of GPTQ / llm-awq / QuantLRM's WikiText-2 evaluation


def read_text(path: str, text_field: str = "text", option: str | None = "--text-file") -> str:
    """The evaluation text: a plain-text file (.txt, .md, no suffix) as is, or the ``text_field`` rows of
    jsonl/json/parquet joined by "\\n\\n" (``lrmq.data.text``; errors name ``option`` and the file)."""
    return "\n\n".join(read_documents(path, option, field=text_field, whole=True, what="text"))


def windows(ids, window: int, max_windows: int | None = None, source: str | None = None) -> np.ndarray:
    ids = np.asarray(ids, np.int32)
    n = len(ids) // window
    if max_windows:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"{source + ': ' if source else ''}{len(ids)} tokens are fewer than one window of "
                         f"{window}" + (" (--window)" if source else ""))
    return ids[: n * window].reshape(n, window)


def eval_ids(tok, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of the evaluation text as the reference tokenizes it: ``tokenizer(text).input_ids``
    (special tokens added, i.e. BOS first when the tokenizer has one). ``add_special_tokens=False`` is
    the old lrmq protocol (``--no-bos``), which scores one token less when the tokenizer adds a BOS."""
    return tok.encode(text, add_special_tokens=add_special_tokens)


def _window_nll(graphdef, state, tokens):
    from flax import nnx

    model = nnx.merge(graphdef, state)
    logits = model(tokens).astype(jnp.float32)[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    tgt = tokens[:, 1:]
    nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    return jnp.sum(nll, axis=1)


def perplexity(model, blocks: np.ndarray, *, batch_size: int = 1) -> dict:
    """Mean NLL and perplexity of ``model`` over int [n, window] blocks."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    fn = jax.jit(partial(_window_nll, graphdef))  # graphdefs holding config dicts are not hashable
    total, count = 0.0, 0
    for s in range(0, blocks.shape[0], batch_size):
        b = jnp.asarray(blocks[s:s + batch_size])
        total += float(jnp.sum(fn(state, b)))
        count += b.shape[0] * (b.shape[1] - 1)
    nll = total / count
    return {"nll": nll, "ppl": math.exp(nll), "tokens": count, "windows": int(blocks.shape[0]),
            "window": int(blocks.shape[1])}


def apply_fake_quant(model, method: str, bits: int, group_size: int) -> None:
    """Replace the seven projections' kernels by ``QUANTIZERS[method]`` fake-quant weights, in place; a
    mixture-of-experts layer's expert kernels [E, in, out] each expert alone (routers stay float)."""
    fn = QUANTIZERS.get(method)
    for _, lin in targeted(model, DEFAULT_TARGETS):
        w = lin.kernel.get_value()
        q = (jnp.stack([fn(w[e], bits=bits, group_size=group_size) for e in range(w.shape[0])]) if w.ndim == 3
             else fn(w, bits=bits, group_size=group_size))
        lin.kernel.set_value(q.astype(w.dtype))


def main(argv=None) -> int:
    select_platforms()  # before JAX starts a backend (lrmq.cli)
    ap = ArgumentParser("perplexity", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="HF or lrmq checkpoint (float, fake-quant or packed; "
                                                         "'tiny' = the shipped model)")
    ap.add_argument("--float-qat-policy", action="store_true",
                    help="use a QAT run's float master weights (RUN/final_policy); refused otherwise, the model the run "
                         "trained being its quantized export RUN/final_policy_quantized/packed")
    ap.add_argument("--text-file", required=True, help="plain text (.txt, .md), or .jsonl/.json/.parquet with a "
                                                        "text field (--text-field)")
    ap.add_argument("--text-field", default="text", help="the record field holding the text (.jsonl/.json/.parquet)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir or checkpoint ('tiny' = the shipped model; "
                                                       "default: the checkpoint)")
    ap.add_argument("--window", type=number(int, ge=2), default=None,
                    help=f"tokens per window (default: {DEFAULT_WINDOW}, the reference protocol's, or the model's "
                         "max_position_embeddings when smaller; a larger window is refused)")
    ap.add_argument("--max-windows", type=number(int, ge=1), default=None,
                    help="score only the first N windows (default: every whole window of the text)")
    ap.add_argument("--batch-size", type=number(int, ge=1), default=1, help="windows per forward pass")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="compute dtype")
    ap.add_argument("--fake-quant", default=None, help="apply a QUANTIZERS entry (rtn_asym, rtn_sym, int8, nf4)")
    ap.add_argument("--bits", type=number(int, ge=2, le=8), default=4, help="--fake-quant: weight bits")
    ap.add_argument("--group-size", type=number(int, ge=1, also=(-1,)), default=128,
                    help="--fake-quant: input rows per scale group (-1 = per output channel)")
    ap.add_argument("--no-bos", action="store_true",
                    help="tokenize without special tokens (no BOS; lrmq before 2026-12): not the reference "
                         "protocol, scores one token less when the tokenizer adds a BOS")
    a = ap.parse_args(argv)
    return run_main("perplexity", lambda: _run(a))


def _run(a) -> int:
    # a QAT run's float weights: refused in one line before anything is read (lrmq.ptq.qat_export)
    refuse_float_qat_policy(a.checkpoint, action="score", allowed=a.float_qat_policy)
    ckpt = check_checkpoint(a.checkpoint)  # the model first: a missing one is not "a missing tokenizer"
    text = read_text(a.text_file, a.text_field)
    tok = load_tokenizer(a.tokenizer, "--tokenizer") if a.tokenizer else load_tokenizer(ckpt)
    if a.fake_quant:  # fake-quantizes float kernels: a packed checkpoint has none
        refuse_quantized(ckpt, "--fake-quant")
    model = load_model(ckpt, dtype=a.dtype)
    window = a.window or min(DEFAULT_WINDOW, model.cfg.max_position_embeddings)
    check_position_limit(model.cfg, window, "--window")
    if a.fake_quant:
        apply_fake_quant(model, a.fake_quant, a.bits, a.group_size)
    ids = eval_ids(tok, text, add_special_tokens=not a.no_bos)
    blocks = windows(ids, window, a.max_windows, source=label(a.text_file, "--text-file"))
    res = perplexity(model, blocks, batch_size=a.batch_size)
    bos = tok.bos_id
    res.update(checkpoint=a.checkpoint, text_file=a.text_file, fake_quant=a.fake_quant,
               special_tokens=not a.no_bos, starts_with_bos=bos is not None and bool(blocks[0, 0] == bos))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    tune_gc()
    sys.exit(main())
