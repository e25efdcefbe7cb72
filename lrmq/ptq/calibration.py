"""Calibration token blocks for PTQ, from local files only.

Three recipes, each returning int32 ``[n_blocks, block_size]``:

* :func:`awq_blocks` -- llm-awq / AutoAWQ ``get_calib_dataset`` (pile-val): shuffle the documents
  in ``datasets.Dataset.shuffle(seed=42)``'s order (:func:`shuffled`), strip each, encode it
  (``add_special_tokens=True``, as HF ``tokenizer.encode``), skip documents longer than
  ``max_doc_tokens`` (512) or empty, keep the first ``n_samples`` (128), concatenate and cut into
  ``block_size`` (512) blocks (the tail is dropped, so usually far fewer than 128 blocks).
* :func:`reasoning_blocks` -- QuantLRM ``--calib_data reasoning``: the documents joined in file order
  (``"\\n\\n"``), encoded once, the first ``max_tokens`` (128*2048) tokens cut into ``block_size`` blocks.
* :func:`prompt_blocks` -- paper 1's AWQ calibration: the problems of a training set rendered with a
  prompt template (``lrmq.data.prompts``; ``chat`` = the model's chat template), the first
  ``n_samples`` (128) with <= ``max_doc_tokens`` (512) tokens. llm-compressor runs each prompt as its
  own sequence; the layer-wise pipeline needs equal blocks, so here the prompts are concatenated and
  cut like the AWQ recipe (documented difference).

Text files: ``.jsonl``/``.json``/``.parquet`` (a ``text_field`` column, default ``text``) or ``.txt``
(one document per non-empty line).
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from lrmq.data.prompts import _datasets, format_prompt, load_prompt_dataset
from lrmq.data.synthetic import read_jsonl


class CalibrationError(ValueError):
    """Calibration data that cannot be used; the message names the file."""


_TABLE = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _require(path: str, what: str) -> str:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} not found: {path}")
    return path


def _prompt_hint(columns) -> str:
    """The pointer to the prompts recipe when a text file turns out to be a prompt dataset."""
    return (" (a prompt dataset such as lrmq's data JSONL: calibration.source=prompts, flag "
            "--calibration-source prompts)" if "problem" in columns else "")


def load_documents(path: str, *, text_field: str = "text") -> list[str]:
    """The documents' texts, in file order. ``.txt`` and ``.jsonl`` are read directly (no ``datasets``
    import: it costs 1-2 s of every quantize start); ``.json`` / ``.parquet`` go through ``datasets``."""
    path = _require(path, "calibration file")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".txt":
        with open(path, encoding="utf-8") as f:
            docs = [l.rstrip("\n") for l in f if l.strip()]
    elif ext == ".jsonl":
        try:
            rows = read_jsonl(path)
        except (ValueError, UnicodeDecodeError) as e:
            raise CalibrationError(f"cannot read calibration file: {e}") from None
        docs = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or text_field not in row:
                cols = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise CalibrationError(f"{path}: record {i + 1} has no text field {text_field!r}; "
                                       f"it has: {cols}{_prompt_hint(row if isinstance(row, dict) else ())}")
            docs.append(str(row[text_field]))
    elif ext in _TABLE:
        ds_lib = _datasets()
        try:
            ds = ds_lib.load_dataset(_TABLE[ext], data_files={"train": [path]}, split="train")
        except Exception as e:  # datasets raises many types for bad/empty files
            raise CalibrationError(f"{path}: cannot read calibration file ({type(e).__name__}: {e})") from None
        if text_field not in ds.column_names:
            raise CalibrationError(f"{path}: no text field {text_field!r}; columns: {ds.column_names}"
                                   f"{_prompt_hint(ds.column_names)}")
        docs = [str(t) for t in ds[text_field]]
    else:
        raise CalibrationError(f"{path}: unsupported calibration file type {ext!r}; use .jsonl, .json, .parquet or .txt")
    if not docs:
        raise CalibrationError(f"{path}: calibration file has no documents")
    return docs


def shuffled(docs: Sequence[str], seed: int) -> list[str]:
    """``datasets.Dataset.shuffle(seed=seed)``'s order: ``np.random.default_rng(seed).permutation(n)``."""
    return [docs[i] for i in np.random.default_rng(seed).permutation(len(docs))]


def _blocks(ids: Sequence[int], block_size: int, source: str) -> np.ndarray:
    n = len(ids) // block_size
    if n == 0:
        raise CalibrationError(f"{source}: only {len(ids)} calibration tokens, fewer than one block of {block_size}")
    return np.asarray(ids[: n * block_size], np.int32).reshape(n, block_size)


def awq_blocks(docs: Sequence[str], tokenizer, *, n_samples: int = 128, block_size: int = 512,
               max_doc_tokens: int = 512, seed: int | None = 42, add_special_tokens: bool = True,
               source: str = "calibration") -> np.ndarray:
    """llm-awq ``get_calib_dataset`` on the documents' texts (see module doc)."""
    if seed is not None:
        docs = shuffled(docs, seed)
    samples: list[int] = []
    n_run = 0
    for text in docs:
        line = text.strip()
        enc = tokenizer.encode(line, add_special_tokens=add_special_tokens)
        if len(enc) > max_doc_tokens or len(enc) == 0:
            continue
        samples.extend(enc)
        n_run += 1
        if n_run == n_samples:
            break
    return _blocks(samples, block_size, source)


def reasoning_blocks(docs: Sequence[str], tokenizer, *, max_tokens: int = 128 * 2048, block_size: int = 512,
                     add_special_tokens: bool = False, source: str = "calibration") -> np.ndarray:
    text = "\n\n".join(docs)
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)[:max_tokens]
    return _blocks(ids, block_size, source)


def prompt_blocks(path: str, tokenizer, *, template: str = "chat", n_samples: int = 128, block_size: int = 512,
                  max_doc_tokens: int = 512, seed: int | None = None, problem_field: str = "problem",
                  answer_field: str = "answer", solution_field: str | None = "solution") -> np.ndarray:
    path = _require(path, "calibration prompt dataset")
    ds = load_prompt_dataset(path, problem_field=problem_field, answer_field=answer_field,
                             solution_field=solution_field)
    if seed is not None:
        ds = ds.shuffle(seed=seed)
    samples: list[int] = []
    n = 0
    for row in ds:
        enc = tokenizer.encode(format_prompt(template, row["problem"], tokenizer))
        if len(enc) > max_doc_tokens or not enc:
            continue
        samples.extend(enc)
        n += 1
        if n == n_samples:
            break
    return _blocks(samples, block_size, path)


def calibration_blocks(source: str, path: str, tokenizer, **kw) -> np.ndarray:
    """Dispatch on ``source`` in {"text" (AWQ recipe), "reasoning", "prompts"}."""
    if source == "prompts":
        return prompt_blocks(path, tokenizer, **kw)
    text_field = kw.pop("text_field", "text")
    docs = load_documents(path, text_field=text_field)
    if source == "text":
        return awq_blocks(docs, tokenizer, source=path, **kw)
    if source == "reasoning":
        return reasoning_blocks(docs, tokenizer, source=path, **kw)
    raise CalibrationError(f"unknown calibration source {source!r}; known: text, reasoning, prompts")
