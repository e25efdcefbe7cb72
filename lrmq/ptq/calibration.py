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

Text files: ``.jsonl``/``.json``/``.parquet`` (a ``text_field`` column, default ``text``) or plain text
(``.txt``, ``.md``: one document per non-empty line), read by ``lrmq.data.text``.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from lrmq.data.prompts import format_prompt, load_prompt_dataset
from lrmq.data.text import TextFileError, label, read_documents


class CalibrationError(ValueError):
    """Calibration data that cannot be used; the message names the file."""


def _require(path: str, what: str, option: str | None = None) -> str:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{label(path, option or what)}: {what} does not exist")
    return path


def _prompt_hint(columns) -> str:
    """The pointer to the prompts recipe when a text file turns out to be a prompt dataset."""
    return (" (a prompt dataset such as lrmq's data JSONL: calibration.source=prompts, flag "
            "--calibration-source prompts)" if "problem" in columns else "")


def load_documents(path: str, *, text_field: str = "text", option: str | None = "calibration file") -> list[str]:
    """The documents' texts, in file order (`lrmq.data.text.read_documents`: a plain-text file's non-blank
    lines, or the ``text_field`` of each record of a .jsonl / .json / .parquet file; no ``datasets`` import:
    it costs 1-2 s of every quantize start). Errors name ``option`` (the flag or key the path came from),
    the file and the line."""
    try:
        return read_documents(path, option, field=text_field, what="documents", hint=_prompt_hint)
    except TextFileError as e:
        raise CalibrationError(str(e)) from None


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
                  answer_field: str = "answer", solution_field: str | None = "solution",
                  option: str | None = "calibration prompt dataset") -> np.ndarray:
    path = _require(path, "calibration prompt dataset", option)
    ds = load_prompt_dataset(path, problem_field=problem_field, answer_field=answer_field,
                             solution_field=solution_field, option=option)
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
    return _blocks(samples, block_size, label(path, option))


def calibration_blocks(source: str, path: str, tokenizer, *, option: str | None = None, **kw) -> np.ndarray:
    """Dispatch on ``source`` in {"text" (AWQ recipe), "reasoning", "prompts"}; ``option``: the flag or key
    the path came from (``--calibration``, ``calibration.path``), for the messages."""
    if source == "prompts":
        return prompt_blocks(path, tokenizer, option=option or "calibration prompt dataset", **kw)
    text_field = kw.pop("text_field", "text")
    docs = load_documents(path, text_field=text_field, option=option or "calibration file")
    if source == "text":
        return awq_blocks(docs, tokenizer, source=label(path, option), **kw)
    if source == "reasoning":
        return reasoning_blocks(docs, tokenizer, source=label(path, option), **kw)
    raise CalibrationError(f"unknown calibration source {source!r}; known: text, reasoning, prompts")
