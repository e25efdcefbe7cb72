"""Generation engine: HF greedy parity, per-sequence stops, log-probs, determinism, sampling filters, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import REPO_ROOT, TINY_MODEL_DIR
from lrmq.checkpoint.hf import load_hf_model
from lrmq.generation.engine import Generator, bucket_length, generate, left_pad
from lrmq.generation.sampling import SamplingConfig, _top_p_mask, sample
from lrmq.model.decoder import positions_from_mask

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [3]]


@pytest.mark.parametrize("variant", ["qwen3", "qwen2", "llama3", "olmo3", "qwen3_window"])
def test_greedy_matches_transformers_generate(hf_checkpoint, variant):
    path, hf = hf_checkpoint(variant)
    model = load_hf_model(path)
    res = generate(model, PROMPTS, max_new_tokens=12, eos_ids=[127], pad_id=0, sampling=SamplingConfig(greedy=True))
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=127,
                              pad_token_id=0)[0, len(p):].numpy()
        ours = res.tokens[i, : res.lengths[i]]
        np.testing.assert_array_equal(ours, ref[: len(ours)])
        assert len(ours) == len(ref)


def test_logprobs_match_full_forward_and_stops_per_sequence(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    model = load_hf_model(path)
    sampling = SamplingConfig(temperature=0.7)
    res = generate(model, PROMPTS, max_new_tokens=10, eos_ids=[7, 11, 42], pad_id=0, sampling=sampling, seed=1)
    for i, p in enumerate(PROMPTS):
        n = int(res.lengths[i])
        gen = res.tokens[i, :n]
        # stops at the first EOS (kept), pads after
        eos_pos = [j for j, t in enumerate(gen) if t in (7, 11, 42)]
        assert eos_pos == ([] if n == 10 else [n - 1])
        assert (res.tokens[i, n:] == 0).all() and (res.logprobs[i, n:] == 0).all()
        seq = jnp.asarray([list(p) + gen.tolist()])
        logits = model(seq)[0, len(p) - 1: len(p) - 1 + n] / 0.7
        ref = jax.nn.log_softmax(logits.astype(jnp.float32), -1)[jnp.arange(n), gen]
        np.testing.assert_allclose(res.logprobs[i, :n], np.asarray(ref), atol=2e-5)


def test_deterministic_for_a_seed_and_seed_matters(hf_checkpoint):
    path, _ = hf_checkpoint("llama3")
    model = load_hf_model(path)
    gen = Generator(model, eos_ids=[127], pad_id=0)
    s = SamplingConfig(temperature=1.0, top_p=0.9, top_k=20)
    a = gen.generate(model, PROMPTS, max_new_tokens=16, sampling=s, seed=3)
    b = gen.generate(model, PROMPTS, max_new_tokens=16, sampling=s, seed=3)
    c = gen.generate(model, PROMPTS, max_new_tokens=16, sampling=s, seed=4)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    assert len(gen._fns) == 1  # one compiled program reused across calls


def test_top_k_top_p_filters():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    masked = _top_p_mask(jax.nn.log_softmax(logits), 0.7)
    assert np.isfinite(np.asarray(masked)).tolist() == [[True, True, False, False]]
    masked = _top_p_mask(jax.nn.log_softmax(logits), 0.01)
    assert np.isfinite(np.asarray(masked)).sum() == 1  # the top token always survives
    toks = [int(sample(jax.random.key(i), logits, SamplingConfig(top_k=2))[0][0]) for i in range(50)]
    assert set(toks) <= {0, 1} and len(set(toks)) == 2
    greedy, lp = sample(jax.random.key(0), logits, SamplingConfig(greedy=True))
    assert int(greedy[0]) == 0 and np.isclose(float(lp[0]), np.log(0.5), atol=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=0.0)


def test_padding_helpers():
    toks, mask = left_pad([[1, 2], [3]], 4, 0)
    np.testing.assert_array_equal(toks, [[0, 0, 1, 2], [0, 0, 0, 3]])
    np.testing.assert_array_equal(np.asarray(positions_from_mask(jnp.asarray(mask))), [[-1, -1, 0, 1], [-1, -1, -1, 0]])
    assert bucket_length(5) == 16 and bucket_length(17) == 32
    with pytest.raises(ValueError, match="prompt 0"):
        left_pad([[1] * 5], 4, 0)


def test_generate_cli_json():
    cmd = [sys.executable, "-m", "lrmq.generate", "--checkpoint", TINY_MODEL_DIR, "--prompt", "Compute 2+3. Answer:",
           "--prompt", "Compute 4*5-1. Answer:", "--max-new-tokens", "24", "--greedy", "--json"]
    r = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(l) for l in r.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert set(row) >= {"token_ids", "text", "logprobs"}
        assert len(row["token_ids"]) == len(row["logprobs"]) > 0
        assert all(lp <= 0 for lp in row["logprobs"])
    assert "tokens/s" in r.stderr
