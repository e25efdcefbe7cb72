"""Convert checkpoints between Hugging Face safetensors and the lrmq (orbax) format.

    python -m lrmq.convert [--from hf|lrmq] --to hf|lrmq SRC DST [--dtype bfloat16] [--overwrite]

The source kind is detected when --from is omitted; SRC may be the alias "tiny" (the shipped model). Tokenizer files travel along. Output is atomic:
on any error DST is not created (or, with --overwrite, left as it was), a full disk included. DST may not
be, contain or lie inside SRC. Errors about the input are one line-group on stderr
(`lrmq.convert: error: ...`) and exit code 2, without a traceback.
"""

from __future__ import annotations

import os
import sys

from lrmq.checkpoint.hf import CheckpointError, save_hf_model
from lrmq import paths
from lrmq.checkpoint.load import check_checkpoint, checkpoint_kind, load_model
from lrmq.checkpoint.orbax_io import save_lrmq
from lrmq.checkpoint.quantized import refuse_quantized
from lrmq.cli import USER_ERRORS, ArgumentParser, check_disjoint, number, run_main, select_platforms, tune_gc
from lrmq.model.config import DTYPES

KINDS = ("hf", "lrmq")


def convert(src: str, dst: str, *, to: str, src_kind: str | None = None, dtype: str | None = None,
            overwrite: bool = False, max_shard_bytes: int = 2 * 1024**3) -> str:
    """Convert `src` into `dst` of kind `to`; `dtype` re-types the stored parameters (default: keep)."""
    if to not in KINDS:
        raise ValueError(f"unknown target kind {to!r}; known: {KINDS}")
    src = check_checkpoint(src, "SRC")  # the alias "tiny" too
    kind = checkpoint_kind(src)
    if src_kind is not None and src_kind != kind:
        raise CheckpointError(f"{src}: --from {src_kind} given, but this is an {kind} checkpoint")
    # Fail before the (possibly long) load rather than after it.
    check_disjoint({"DST": dst}, {"SRC": src})  # also DST inside SRC or SRC inside DST
    paths.check_dir_path(dst, "DST")  # a file where the output directory belongs
    if os.path.exists(dst) and not overwrite:
        raise FileExistsError(f"output directory {os.path.abspath(dst)} already exists (pass --overwrite)")

    if to == "hf":  # float safetensors: a packed model has no such form (before the load, not after it)
        refuse_quantized(src, "convert --to hf", "convert it --to lrmq (a packed lrmq checkpoint)")
    # a quantized HF checkpoint (compressed-tensors, AutoAWQ) loads as its packed model: --to lrmq keeps it packed
    model = load_model(src, dtype=dtype, param_dtype=dtype)
    if to == "hf":
        return save_hf_model(model, dst, dtype=dtype, tokenizer_from=src, max_shard_bytes=max_shard_bytes,
                             overwrite=overwrite)
    return save_lrmq(model, dst, tokenizer_from=src, overwrite=overwrite)


def main(argv: list[str] | None = None) -> int:
    select_platforms()  # before JAX starts a backend (lrmq.cli)
    ap = ArgumentParser("convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src_kind", choices=KINDS, help="source kind (default: detect)")
    ap.add_argument("--to", required=True, choices=KINDS, help="target kind")
    ap.add_argument("--dtype", choices=tuple(DTYPES), help="store parameters in this dtype (default: keep)")
    ap.add_argument("--max-shard-gb", type=number(float, gt=0), default=2.0, help="HF output: safetensors shard size")
    ap.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    ap.add_argument("src", metavar="SRC", help="checkpoint directory to read (HF or lrmq; local or gs://)")
    ap.add_argument("dst", metavar="DST", help="directory to write, in --to's format")
    args = ap.parse_args(argv)

    def body() -> int:
        convert(args.src, args.dst, to=args.to, src_kind=args.src_kind, dtype=args.dtype,
                overwrite=args.overwrite, max_shard_bytes=max(1, int(args.max_shard_gb * 1024**3)))
        print(f"wrote {args.to} checkpoint {args.dst}")
        return 0

    return run_main("convert", body, USER_ERRORS)


if __name__ == "__main__":
    tune_gc()
    sys.exit(main())
