"""Calibration documents read without `datasets` (.jsonl/.txt) are the rows `datasets` reads, in the order its
seeded shuffle gives (llm-awq's recipe shuffles with `Dataset.shuffle(seed=42)`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lrmq.ptq.calibration import CalibrationError, load_documents, shuffled

DOCS = ["plain", "  padded  ", "ünïcödé ∑ 1+1=2", "", "x" * 500, "line\twith\ttabs", "42",
        "quote \" and \\ slash"]


def test_jsonl_and_txt_read_as_datasets_reads_them(tmp_path):
    from lrmq.data.prompts import _datasets

    ds_lib = _datasets()
    rows = [{"text": d, "n": i} for i, d in enumerate(DOCS * 5)]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n", encoding="utf-8")
    ref = ds_lib.load_dataset("json", data_files={"train": [str(path)]}, split="train")
    docs = load_documents(str(path))
    assert docs == list(ref["text"])
    for seed in (0, 42, 1234):
        assert shuffled(docs, seed) == list(ref.shuffle(seed=seed)["text"])
    txt = tmp_path / "c.txt"
    txt.write_text("a\n\n b \nc\n", encoding="utf-8")
    assert load_documents(str(txt)) == ["a", " b ", "c"]


def test_bad_jsonl_names_file_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": \n')
    with pytest.raises(CalibrationError, match=r"bad.jsonl line 3: not valid JSON"):
        load_documents(str(path))
    path.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(CalibrationError, match=r"bad.jsonl line 2 has no field 'text'; it has: \['body'\]"):
        load_documents(str(path))
    path.write_text("\n")
    with pytest.raises(CalibrationError, match="no documents"):
        load_documents(str(path))


def test_text_calibration_does_not_import_datasets(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    code = ("import sys; from lrmq.ptq.calibration import load_documents, shuffled; "
            f"shuffled(load_documents({str(path)!r}), 42); assert 'datasets' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
