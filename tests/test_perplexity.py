"""lrmq.perplexity: WikiText-2 protocol, checked against transformers' loss on the same windows."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest


def test_matches_transformers(hf_checkpoint):
    import torch

    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.perplexity import perplexity, windows

    d, tm = hf_checkpoint("qwen3")
    ids = np.random.default_rng(0).integers(0, 128, 3 * 40 + 17)
    blocks = windows(ids, 40)
    assert blocks.shape == (3, 40)  # tail dropped
    assert windows(ids, 40, max_windows=2).shape == (2, 40)
    ours = perplexity(load_hf_model(d), blocks, batch_size=2)
    with torch.no_grad():
        losses = [tm(torch.tensor(b[None], dtype=torch.long), labels=torch.tensor(b[None], dtype=torch.long)).loss.item()
                  for b in blocks]
    ref = math.exp(sum(l * 40 for l in losses) / (3 * 40))  # llm-awq / GPTQ eval formula
    assert ours["tokens"] == 3 * 39 and ours["windows"] == 3
    assert ours["ppl"] == pytest.approx(ref, rel=1e-4)
    with pytest.raises(ValueError, match="fewer than one window"):
        windows(ids[:10], 40)


def test_cli(hf_checkpoint, tmp_path, capsys):
    from lrmq.perplexity import main
    from test_awq import _tokenizer

    d, _ = hf_checkpoint("llama3")
    texts = [f"Compute {i}+{i * 3}. Answer: {i * 4}" for i in range(200)]
    tok = tmp_path / "tok"
    tok.mkdir()
    _tokenizer(str(tok), texts)
    f = tmp_path / "eval.jsonl"
    f.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    args = ["--checkpoint", d, "--text-file", str(f), "--tokenizer", str(tok), "--window", "64", "--max-windows", "4"]
    assert main(args) == 0
    fp = json.loads(capsys.readouterr().out)
    assert fp["windows"] == 4 and fp["tokens"] == 4 * 63 and math.isfinite(fp["ppl"])
    assert main(args + ["--fake-quant", "rtn_asym", "--bits", "2", "--group-size", "32"]) == 0
    q = json.loads(capsys.readouterr().out)
    assert q["ppl"] != fp["ppl"]
    assert main(["--checkpoint", d, "--text-file", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
