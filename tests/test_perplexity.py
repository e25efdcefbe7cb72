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


def _bos_tokenizer(path, texts):
    """A byte-level BPE whose tokenizer.json adds a BOS in front (Llama style TemplateProcessing)."""
    import os

    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, processors, trainers

    t = HFTok(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=96, special_tokens=["<s>", "</s>"]))
    bos = t.token_to_id("<s>")
    t.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                     special_tokens=[("<s>", bos)])
    t.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}, f)
    return bos


def test_bos_follows_reference_protocol(hf_checkpoint, tmp_path, capsys, monkeypatch):
    """llm-awq / QuantLRM eval: ``enc("\\n\\n".join(texts), return_tensors="pt").input_ids`` (special
    tokens: BOS once, in front), ``n = numel // seqlen`` windows, ``exp(sum(loss_i * seqlen) / (n * seqlen))``."""
    import torch
    from transformers import AutoTokenizer

    import lrmq.perplexity as P
    from lrmq.tokenizer import Tokenizer

    d, tm = hf_checkpoint("llama3")
    texts = [f"Compute {i}+{i * 3}. Answer: {i * 4}" for i in range(60)]
    tok = tmp_path / "tok"
    tok.mkdir()
    bos = _bos_tokenizer(str(tok), texts)
    f = tmp_path / "eval.jsonl"
    f.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    window = 64

    # the reference protocol, with transformers' tokenizer
    enc = AutoTokenizer.from_pretrained(str(tok))
    ref_ids = enc("\n\n".join(texts), return_tensors="pt").input_ids
    n = ref_ids.numel() // window
    ref_blocks = [ref_ids[:, i * window:(i + 1) * window] for i in range(n)]
    with torch.no_grad():
        losses = [tm(b, labels=b).loss.float() * window for b in ref_blocks]
    ref_ppl = torch.exp(torch.stack(losses).sum() / (n * window)).item()
    assert int(ref_ids[0, 0]) == bos and Tokenizer.from_dir(str(tok)).bos_id == bos

    seen = []
    real = P.perplexity
    monkeypatch.setattr(P, "perplexity", lambda model, blocks, **kw: seen.append(blocks) or real(model, blocks, **kw))
    args = ["--checkpoint", d, "--text-file", str(f), "--tokenizer", str(tok), "--window", str(window)]
    assert P.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    np.testing.assert_array_equal(seen[-1], torch.cat(ref_blocks).numpy())  # same windows, BOS first
    assert seen[-1][0, 0] == bos and out["starts_with_bos"] and out["special_tokens"]
    assert out["windows"] == n and out["tokens"] == n * (window - 1)
    assert out["ppl"] == pytest.approx(ref_ppl, rel=1e-4)

    # --no-bos: the old protocol, every window shifted by one token
    assert P.main(args + ["--no-bos"]) == 0
    old = json.loads(capsys.readouterr().out)
    no_bos = enc("\n\n".join(texts), add_special_tokens=False).input_ids
    np.testing.assert_array_equal(seen[-1].reshape(-1), no_bos[: len(no_bos) // window * window])
    assert not old["starts_with_bos"] and not old["special_tokens"] and seen[-1][0, 0] != bos
    assert old["ppl"] != out["ppl"]


def test_tiny_tokenizer_has_no_bos():
    """lrmq's shipped tiny tokenizer (Qwen style) has no BOS: with or without special tokens the ids agree."""
    from conftest import TINY_MODEL_DIR

    from lrmq.perplexity import eval_ids
    from lrmq.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(TINY_MODEL_DIR)
    assert tok.bos_id is None
    text = "Compute 1+3. Answer: 4\n\nCompute 2+6. Answer: 8"
    assert eval_ids(tok, text) == eval_ids(tok, text, add_special_tokens=False) == tok.encode(text)


def test_fake_quant_reaches_every_expert_and_never_the_router():
    """`--fake-quant` on a mixture-of-experts model: each expert's kernel is the quantizer of that expert alone,
    the dense projections as before, the router untouched."""
    import numpy as np

    from lrmq.checkpoint.load import TINY_MOE_DIR, load_model
    from lrmq.perplexity import apply_fake_quant
    from lrmq.quant.quantizers import QUANTIZERS

    model = load_model(TINY_MOE_DIR)
    experts, router = model.layers[0].mlp.experts.down_proj, model.layers[0].mlp.router
    w, r = np.asarray(experts.kernel.get_value()), np.asarray(router.kernel.get_value())
    q_proj = np.asarray(model.layers[0].attn.q_proj.kernel.get_value())
    apply_fake_quant(model, "rtn_asym", 4, 32)
    fn = QUANTIZERS.get("rtn_asym")
    np.testing.assert_array_equal(np.asarray(experts.kernel.get_value())[3], np.asarray(fn(w[3], bits=4, group_size=32)))
    np.testing.assert_array_equal(np.asarray(router.kernel.get_value()), r)
    assert not np.array_equal(np.asarray(model.layers[0].attn.q_proj.kernel.get_value()), q_proj)
