"""Text inputs of the commands, read one way: `lrmq.perplexity --text-file`, PTQ calibration documents
(`lrmq.quantize --calibration`, `calibration.path`), `lrmq.generate --prompts-file`, a prompt dataset's
JSON Lines when `datasets` refuses it.

Every problem is one line that names the option the path came from, the file and, where the file has
lines, the line: `--text-file notes.md line 3: not UTF-8 text (byte 0xff at column 7)`. A missing file is a
FileNotFoundError, anything else a TextFileError (`lrmq.paths.FileFormatError`, a ValueError); both are user
errors of every command (`lrmq.cli.USER_ERRORS`).

Kinds, by suffix: `.jsonl` (one JSON object per line), `.json` (a list of objects, an object of equal-length
columns, `{"examples": [...]}`, or JSON Lines), `.parquet`; plain text: `.txt`, `.md`, `.text` or no
suffix. Anything else is refused by name (a checkpoint passed by mistake is not read as text).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

from lrmq import paths
from lrmq.paths import FileFormatError, kind_of

TABLE_SUFFIXES = (".jsonl", ".json", ".parquet")
PLAIN_SUFFIXES = (".txt", ".md", ".text", "")


# a text input that cannot be used; the message names the option, the file and the line
TextFileError = FileFormatError


def label(path: str, option: str | None) -> str:
    """How messages name an input: `--text-file notes.txt`, `calibration.path data.jsonl`, or the path."""
    return f"{option} {path}" if option else os.fspath(path)


def suffix(path: str) -> str:
    return os.path.splitext(os.fspath(path))[1].lower()


def read_bytes(path: str, option: str | None = None, what: str = "file") -> bytes:
    """The file's bytes; a missing path, a directory or an unreadable file is one line naming it."""
    return paths.read_bytes(path, what, label(path, option))


def read_text(path: str, option: str | None = None) -> str:
    """The whole file as UTF-8 text."""
    return paths.decode_utf8(read_bytes(path, option), label(path, option))


def read_lines(path: str, option: str | None = None) -> list[tuple[int, str]]:
    """(line number, text) of every non-blank line, newline removed."""
    text = read_text(path, option)
    return [(i, l.rstrip("\r")) for i, l in enumerate(text.split("\n"), 1) if l.strip()]


def _json_lines(text: str, where: str) -> list[tuple[str, Any]]:
    out = []
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            out.append((f"line {i}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise paths.json_error(where, e, i) from None
    return out


def read_records(path: str, option: str | None = None) -> list[tuple[str, Any]]:
    """(where, record) of a .jsonl / .json / .parquet file; `where` is "line N" or "record N" for messages."""
    path = os.fspath(path)
    where = label(path, option)
    ext = suffix(path)
    if ext == ".parquet":
        data = read_bytes(path, option)  # missing / directory / unreadable: the same messages as the others
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(pa.BufferReader(data)).to_pylist()
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for files that are not Parquet
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise TextFileError(f"{where}: not a readable Parquet file ({first})") from None
        return [(f"record {i}", r) for i, r in enumerate(rows, 1)]
    if ext not in (".jsonl", ".json"):
        raise TextFileError(f"{where}: expected a .jsonl, .json or .parquet file, found {ext or 'no suffix'!r}")
    text = paths.decode_utf8(read_bytes(path, option), where)
    if ext == ".jsonl":
        return _json_lines(text, where)
    if not text.strip():
        return []
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON Lines in a .json file (datasets reads those too)
            return _json_lines(text, where)
        raise paths.json_error(where, e) from None
    if isinstance(obj, dict) and isinstance(obj.get("examples"), list):  # BIG-Bench task files
        obj = obj["examples"]
    if isinstance(obj, dict) and obj and all(isinstance(v, list) for v in obj.values()):  # columns
        n = {len(v) for v in obj.values()}
        if len(n) != 1:
            raise TextFileError(f"{where}: columns of different lengths {sorted(n)}")
        obj = [dict(zip(obj, vals)) for vals in zip(*obj.values())]
    if not isinstance(obj, list):
        raise TextFileError(f"{where}: expected a list of records (or columns of equal length), found a "
                            f"{kind_of(obj)}")
    return [(f"record {i}", r) for i, r in enumerate(obj, 1)]


def read_field(path: str, field: str, option: str | None = None, *,
               hint: Callable[[Sequence[str]], str] | None = None) -> list[str]:
    """The `field` text of every record; a record that is not an object, lacks the field or holds something
    other than text (a number is taken as its text) is one line naming it. `hint(columns)`: extra words for
    a missing field (e.g. "this looks like a prompt dataset")."""
    where = label(path, option)
    out = []
    for at, rec in read_records(path, option):
        if not isinstance(rec, dict):
            raise TextFileError(f"{where} {at}: expected a JSON object with a {field!r} field, found a "
                                f"{kind_of(rec)}")
        if field not in rec:
            extra = hint(sorted(rec)) if hint else ""
            raise TextFileError(f"{where} {at} has no field {field!r}; it has: {sorted(rec)}{extra}")
        v = rec[field]
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise TextFileError(f"{where} {at}: field {field!r} is a {kind_of(v)}, expected text")
        out.append(str(v))
    return out


def read_documents(path: str, option: str | None = None, *, field: str = "text", whole: bool = False,
                   what: str = "documents", hint: Callable[[Sequence[str]], str] | None = None) -> list[str]:
    """The texts of a file: the `field` of each record of a table file; of a plain-text file, each non-blank
    line (`whole=False`) or the whole text (`whole=True`, one document). None at all is an error (`what`
    names them in it)."""
    path = os.fspath(path)
    where = label(path, option)
    ext = suffix(path)
    if ext in TABLE_SUFFIXES:
        docs = read_field(path, field, option, hint=hint)
    elif ext in PLAIN_SUFFIXES:
        docs = [read_text(path, option)] if whole else [l for _, l in read_lines(path, option)]
        docs = [d for d in docs if d.strip()]
    else:
        read_bytes(path, option)  # a missing file is reported as missing, not as the wrong type
        raise TextFileError(f"{where}: unsupported file type {ext!r}; use plain text (.txt, .md), .jsonl, .json "
                            f"or .parquet")
    if not docs:
        raise TextFileError(f"{where}: the file has no {what}")
    return docs
