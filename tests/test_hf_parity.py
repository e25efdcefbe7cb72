"""lrmq vs transformers, every family variant: logits on a left-padded batch, greedy decoding, bf16; Qwen3-MoE
(`MOE_VARIANTS`: dense layers among sparse ones, norm_topk_prob both ways, tied router scores)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from hf_fixtures import MOE_VARIANTS, VARIANTS
from lrmq.checkpoint.load import load_model
from lrmq.model.decoder import positions_from_mask

PAD = 0
NEW_TOKENS = 8


def padded_batch(batch=3, length=12, seed=0):
    """Random tokens; row 0 full, later rows left-padded by 3 and 5 tokens."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(1, 128, (batch, length))
    mask = np.ones((batch, length), np.int64)
    for row, pad in zip(range(1, batch), (3, 5)):
        mask[row, :pad] = 0
        tokens[row, :pad] = PAD
    return tokens, mask


def hf_logits(hf_model, tokens, mask):
    # HF's default position_ids ignore padding; pass the same positions lrmq uses (padding clamped to 0).
    pos = np.maximum(np.asarray(positions_from_mask(jnp.asarray(mask))), 0)
    with torch.no_grad():
        out = hf_model(torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos))
    return out.logits.float().numpy()


def lrmq_logits(model, tokens, mask):
    out = model(jnp.asarray(tokens), positions_from_mask(jnp.asarray(mask)))
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("variant", sorted(VARIANTS) + sorted(MOE_VARIANTS))
def test_logits_match_transformers_f32(variant, hf_checkpoint):
    path, hf_model = hf_checkpoint(variant)
    model = load_model(path)
    tokens, mask = padded_batch()
    ref, ours = hf_logits(hf_model, tokens, mask), lrmq_logits(model, tokens, mask)
    real = mask.astype(bool)  # padded query positions are garbage in both implementations
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)
    assert np.abs(ref[real]).max() > 0.1  # the comparison is not between near-zero outputs


@nnx.jit
def _forward(model, tokens, mask):
    return model(tokens, positions_from_mask(mask))


def lrmq_greedy(model, tokens, mask, n_new):
    """Greedy decoding with the plain full forward (no KV cache) over a fixed-size buffer.

    Unfilled slots have mask 0 -> position -1, which attention masks out as keys, so one compiled shape
    serves every step.
    """
    b, p = tokens.shape
    buf = np.zeros((b, p + n_new), np.int32)
    buf_mask = np.zeros((b, p + n_new), np.int32)
    buf[:, :p], buf_mask[:, :p] = tokens, mask
    for i in range(n_new):
        logits = _forward(model, jnp.asarray(buf), jnp.asarray(buf_mask))
        buf[:, p + i] = np.asarray(jnp.argmax(logits[:, p + i - 1], axis=-1))
        buf_mask[:, p + i] = 1
    return buf[:, p:]


def hf_greedy(hf_model, tokens, mask, n_new):
    hf_model.generation_config.eos_token_id = None  # never stop early: compare exactly n_new tokens
    with torch.no_grad():
        out = hf_model.generate(torch.tensor(tokens), attention_mask=torch.tensor(mask), max_new_tokens=n_new,
                                do_sample=False, pad_token_id=PAD)
    return out[:, tokens.shape[1]:].numpy()


@pytest.mark.parametrize("variant", sorted(VARIANTS) + ["qwen3_moe"])
def test_greedy_matches_transformers_generate(variant, hf_checkpoint):
    path, hf_model = hf_checkpoint(variant)
    model = load_model(path)
    tokens, mask = padded_batch(batch=2, length=8, seed=1)  # 8 + 8 tokens crosses the window-4 layers
    ref = hf_greedy(hf_model, tokens, mask, NEW_TOKENS)
    assert ref.shape == (2, NEW_TOKENS)
    np.testing.assert_array_equal(lrmq_greedy(model, tokens, mask, NEW_TOKENS), ref)


@pytest.mark.parametrize("variant", ["qwen3", "olmo3", "qwen3_moe"])
def test_generation_engine_matches_transformers(variant, hf_checkpoint):
    from lrmq.generation import engine

    path, hf_model = hf_checkpoint(variant)
    model = load_model(path)
    tokens, mask = padded_batch(batch=2, length=8, seed=1)
    ref = hf_greedy(hf_model, tokens, mask, NEW_TOKENS)
    from lrmq.generation.sampling import SamplingConfig

    prompts = [list(t[m.astype(bool)]) for t, m in zip(tokens, mask)]
    # An out-of-vocabulary EOS never fires, matching hf_greedy (which disables EOS).
    out = engine.generate(model, prompts, max_new_tokens=NEW_TOKENS, eos_ids=(model.cfg.vocab_size,), pad_id=PAD,
                          sampling=SamplingConfig(greedy=True))
    np.testing.assert_array_equal(np.asarray(out.lengths), NEW_TOKENS)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)


@pytest.mark.parametrize("variant", sorted(VARIANTS) + ["qwen3_moe"])
def test_bf16_checkpoint_loads_and_runs(variant, hf_checkpoint):
    path, hf_model = hf_checkpoint(variant, "bfloat16")
    model = load_model(path)
    assert model.cfg.param_dtype == "bfloat16" and model.cfg.dtype == "bfloat16"
    assert model.embed.embedding.get_value().dtype == jnp.bfloat16
    tokens, mask = padded_batch()
    ref, ours = hf_logits(hf_model, tokens, mask), lrmq_logits(model, tokens, mask)
    real = mask.astype(bool)
    assert np.isfinite(ours).all()
    # bf16 rounds differently in the two implementations: a loose bound, plus argmax agreement.
    np.testing.assert_allclose(ours[real], ref[real], atol=5e-2, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1))[real].mean() >= 0.8
