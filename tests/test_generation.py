"""Generation engine: HF greedy parity, per-sequence stops, log-probs, determinism, scheduling independence,
shared prompts, preemption, paged decode attention, sampling filters, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from conftest import REPO_ROOT, TINY_MODEL_DIR
from lrmq.checkpoint.hf import load_hf_model
from lrmq.generation.engine import Engine, EngineConfig, bucket_length, generate, left_pad
from lrmq.generation.attention.xla import decode_attention_xla
from lrmq.generation.kv_pool import interleave
from lrmq.generation.sampling import SamplingConfig, _top_p_mask, sample
from lrmq.model.decoder import attend, positions_from_mask


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


@pytest.mark.slow(reason="engine compiles plus the full forward to compare the log-probs against")
def test_logprobs_match_full_forward_and_stops_per_sequence(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    model = load_hf_model(path)
    sampling = SamplingConfig(temperature=0.7)
    res = generate(model, PROMPTS, max_new_tokens=10, eos_ids=[7, 11, 42], pad_id=0, sampling=sampling, seed=1)
    seqs = [list(p) + res.tokens[i, :int(res.lengths[i])].tolist() for i, p in enumerate(PROMPTS)]
    # the full forward of every prompt + completion at once, right-padded (causal: padding after a position
    # does not change its logits), as one jitted program
    width = max(map(len, seqs))
    full = nnx.jit(lambda m, x: jax.nn.log_softmax(m(x).astype(jnp.float32) / 0.7, -1))(
        model, jnp.asarray([q + [0] * (width - len(q)) for q in seqs]))
    for i, p in enumerate(PROMPTS):
        n = int(res.lengths[i])
        gen = res.tokens[i, :n]
        # stops at the first EOS (kept), pads after
        eos_pos = [j for j, t in enumerate(gen) if t in (7, 11, 42)]
        assert eos_pos == ([] if n == 10 else [n - 1])
        assert (res.tokens[i, n:] == 0).all() and (res.logprobs[i, n:] == 0).all()
        ref = np.asarray(full[i, len(p) - 1: len(p) - 1 + n])[np.arange(n), gen]
        np.testing.assert_allclose(res.logprobs[i, :n], ref, atol=2e-5)


def test_deterministic_for_a_seed_and_seed_matters(hf_checkpoint):
    path, _ = hf_checkpoint("llama3")
    model = load_hf_model(path)
    gen = Engine(model, eos_ids=[127], pad_id=0)
    s = SamplingConfig(temperature=1.0, top_p=0.9, top_k=20)
    a = gen.generate(model, PROMPTS, max_new_tokens=16, sampling=s, seed=3)
    b = gen.generate(model, PROMPTS, max_new_tokens=16, sampling=s, seed=3)
    c = gen.generate(model, PROMPTS, max_new_tokens=16, sampling=s, seed=4)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    assert len(gen._decode) == 1  # one decode program reused across calls
    assert gen._decode[s, "xla"]._cache_size() == 1


SCHEDULES = [
    EngineConfig(),
    EngineConfig(slots=2, page_size=8, sync_steps=3, block_pages=1),
    EngineConfig(slots=3, page_size=4, pages=12, sync_steps=4),  # a pool this small preempts
]


@pytest.mark.parametrize("variant", ["olmo3"])  # sliding and full layers, post-norm
@pytest.mark.slow(reason="the engine compiled at many slot, page and steps-per-call settings")
def test_results_do_not_depend_on_scheduling(hf_checkpoint, variant):
    """The same per-sequence keys give the same tokens whatever the slots, pages, page size, steps per call,
    preemption or request order; duplicated prompts (a GRPO group) equal the same prompts run alone."""
    path, _ = hf_checkpoint(variant)
    model = load_hf_model(path)
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1], [4, 5, 6, 7, 8, 9, 10, 11, 12]]
    budgets = [14, 9, 14, 5, 11, 14]
    s = SamplingConfig(temperature=1.3)
    keys = np.asarray(jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(jax.random.key(7), i)))(
        jnp.arange(len(prompts))))
    runs = []
    for cfg in SCHEDULES:
        eng = Engine(model, eos_ids=[127, 3], pad_id=0, config=cfg)
        runs.append(eng.generate(model, prompts, max_new_tokens=budgets, sampling=s, keys=keys))
        assert (runs[-1].stats["preempted"] > 0) == bool(cfg.pages)
    order = [5, 3, 0, 4, 1, 2]
    eng = Engine(model, eos_ids=[127, 3], pad_id=0)
    permuted = eng.generate(model, [prompts[i] for i in order], max_new_tokens=[budgets[i] for i in order],
                            sampling=s, keys=keys[order])
    # PROMPTS[1] three times: prefilled once, its pages shared; PROMPTS[2] has one token: nothing to prefill
    assert permuted.stats["prefilled_prompts"] == 3
    alone = [eng.generate(model, [p], max_new_tokens=[b], sampling=s, keys=keys[i:i + 1])
             for i, (p, b) in enumerate(zip(prompts, budgets))]
    ref = runs[0]
    assert (ref.lengths > 1).all() and len({tuple(ref.tokens[i]) for i in (0, 2, 4)}) > 1
    for res in runs[1:]:
        np.testing.assert_array_equal(res.tokens, ref.tokens)
        np.testing.assert_array_equal(res.lengths, ref.lengths)
        np.testing.assert_allclose(res.logprobs, ref.logprobs, atol=2e-5)
    np.testing.assert_array_equal(permuted.tokens, ref.tokens[order])
    for i, a in enumerate(alone):
        np.testing.assert_array_equal(a.tokens[0, :a.lengths[0]], ref.tokens[i, :ref.lengths[i]])
        np.testing.assert_allclose(a.logprobs[0, :a.lengths[0]], ref.logprobs[i, :ref.lengths[i]], atol=2e-5)
    for i, b in enumerate(budgets):  # each row stops at its own budget or at an EOS
        n = ref.lengths[i]
        assert n == b or ref.tokens[i, n - 1] in (127, 3)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_decode_attention_equals_dense(window):
    """Pages scattered over the pool, uneven lengths, an idle slot: equals dense attention over the
    same keys, and idle slots give zeros."""
    rng = np.random.default_rng(0)
    s, h, kvh, d, ps, width = 4, 4, 2, 8, 4, 6
    lengths = np.array([1, 7, 23, 0])
    perm = rng.permutation(np.arange(1, 1 + s * width)).reshape(s, width).astype(np.int32)
    pool = np.zeros((1, 1 + s * width, ps, 2 * kvh, d), np.float32)
    k = rng.normal(size=(s, width * ps, kvh, d)).astype(np.float32)
    v = rng.normal(size=(s, width * ps, kvh, d)).astype(np.float32)
    for i in range(s):
        for j in range(width):
            pool[0, perm[i, j]] = np.asarray(interleave(k[i, j * ps:(j + 1) * ps], v[i, j * ps:(j + 1) * ps]))
    q = rng.normal(size=(s, h, d)).astype(np.float32)
    out = decode_attention_xla(jnp.asarray(q), jnp.asarray(pool), 0, jnp.asarray(perm), jnp.asarray(lengths),
                               window, block_pages=2)
    k_pos = np.where(np.arange(width * ps)[None] < lengths[:, None], np.arange(width * ps)[None], -1)
    ref = attend(jnp.asarray(q[:, None]), jnp.asarray(k), jnp.asarray(v), jnp.asarray((lengths - 1)[:, None]),
                 jnp.asarray(k_pos), window)[:, 0]
    np.testing.assert_allclose(np.asarray(out)[:3], np.asarray(ref)[:3], atol=1e-5)
    assert np.all(np.asarray(out)[3] == 0)


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
