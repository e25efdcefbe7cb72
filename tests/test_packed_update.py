"""The packed update layout (rollout.update_padding=pack): several sequences per row, attention kept within
each, only needed tokens computed; it must give the padded layout's update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from conftest import assert_adam_step_close
from test_train_modes import grpo_config, make_trainer, scratch_ckpt  # noqa: F401 (fixture)

from lrmq.model.decoder import positions_from_mask
from lrmq.rl.batch import RolloutBatch, ladder_choice, mask_rows, packed_batch, packed_ladder, row_bucket


def test_row_bucket_quarter_octaves():
    assert [row_bucket(n) for n in (0, 1, 7, 8, 9, 10, 11, 16, 17, 21, 33, 100)] == \
        [1, 1, 7, 8, 10, 10, 12, 16, 20, 24, 40, 112]
    assert all(row_bucket(n) >= n and row_bucket(n) <= 1.25 * n + 1 for n in range(1, 2000))


def test_packed_ladder_is_fixed_and_holds_every_batch():
    """The trainer's packed shapes: a fixed set from the worst case down in steps of sqrt(2) (slots aligned
    to 128), the smallest that holds a batch chosen; the worst case holds any batch."""
    ladder = packed_ladder(128, 128 * 64, 5)
    assert ladder == [(128, 8192), (91, 5888), (64, 4096), (46, 2944), (32, 2048)]
    choose = ladder_choice(ladder)
    assert choose(30, 1000) == (32, 2048)  # below the smallest: the smallest
    assert choose(33, 1000) == (46, 2944)
    assert choose(20, 3000) == (64, 4096)  # the slots decide
    assert choose(128, 8192) == (128, 8192)
    with pytest.raises(ValueError, match="no packed shape"):
        choose(129, 1)
    assert packed_ladder(4, 40, 5) == [(4, 40), (3, 29), (2, 20), (2, 15), (1, 10)]  # small: no alignment
    assert packed_ladder(4, 256, 6) == [(4, 256), (3, 256), (2, 128), (1, 128)]  # repeats dropped
    assert packed_ladder(64, 4096, 1) == [(64, 4096)]


@pytest.mark.parametrize("n_micro,groups", [(1, 1), (2, 2)])
def test_packed_layout_at_a_fixed_width_and_ladder_shape(n_micro, groups):
    """The trainer packs into rows of max_prompt_len + max_new_tokens (wider than a batch whose prompts are
    short) with a shape from its ladder: the same tokens, positions and targets as at the batch's own width."""
    rb = _random_batch(np.random.default_rng(7), s=12)
    s, n = rb.completion.shape
    k_loc = s // n_micro // groups
    ladder = packed_ladder(k_loc, k_loc * n, 3)
    own = packed_batch(rb, n_micro=n_micro, groups=groups)
    wide = packed_batch(rb, n_micro=n_micro, groups=groups, choose_shape=ladder_choice(ladder), width=40)
    assert wide.tokens.shape[1] == 40
    r, t = wide.tokens.shape[0] // (n_micro * groups), wide.src.shape[1]
    assert (r, t) in ladder
    # every needed (sequence, position) -> target appears once in both layouts
    pairs = lambda a: sorted((int(d) + g * 10_000, int(x)) for g in range(a.dest.shape[0])
                             for d, x in zip(a.dest[g], a.target[g]) if d != k_loc * n)
    assert pairs(own) == pairs(wide)
    with pytest.raises(ValueError, match="packed width"):
        packed_batch(rb, width=rb.tokens.shape[1] - 1)


def _random_batch(rng, s=12, p=10, n=9):
    prompt_len = rng.integers(1, p + 1, s)
    lengths = rng.integers(0, n + 1, s)
    tokens = np.zeros((s, p + n), np.int32)
    mask = np.zeros_like(tokens)
    for i in range(s):
        tokens[i, p - prompt_len[i]:p] = rng.integers(1, 50, prompt_len[i])
        mask[i, p - prompt_len[i]:p] = 1
        tokens[i, p:p + lengths[i]] = rng.integers(1, 50, lengths[i])
        mask[i, p:p + lengths[i]] = 1
    cmask = (np.arange(n)[None] < lengths[:, None]).astype(np.float32)
    rb = RolloutBatch(tokens=tokens, mask=mask, completion=tokens[:, p:].copy(), completion_mask=cmask,
                      behaviour_logp=-cmask, advantages=rng.normal(size=s).astype(np.float32), rewards=np.zeros(s, np.float32))
    return mask_rows(rb, rng.random(s) < 0.2)  # some rows masked out (truncated completions)


@pytest.mark.parametrize("n_micro,groups", [(1, 1), (2, 1), (1, 3), (2, 2)])
def test_packed_layout_holds_every_needed_token_once(n_micro, groups):
    rng = np.random.default_rng(n_micro * 10 + groups)
    rb = _random_batch(rng)
    p, (s, n) = 10, rb.completion.shape
    a = packed_batch(rb, n_micro=n_micro, groups=groups)
    w = a.tokens.shape[1]
    r = a.tokens.shape[0] // (n_micro * groups)
    k_loc = s // n_micro // groups
    assert a.tokens.shape[0] == n_micro * groups * r and a.src.shape[0] == groups * n_micro
    # positions restart at 0 in each segment and run contiguously; padding has position -1 and segment 0
    assert np.all((a.positions < 0) == (a.segments == 0))
    seen = np.zeros((s, n), int)
    for i in range(n_micro):
        for d in range(groups):
            rows = [(d * r + q) * n_micro + i for q in range(r)]
            flat_tok = a.tokens[rows].ravel()
            flat_seg, flat_pos = a.segments[rows].ravel(), a.positions[rows].ravel()
            g = d * n_micro + i
            for src, tgt, dst in zip(a.src[g], a.target[g], a.dest[g]):
                if dst == k_loc * n:
                    continue
                local, j = divmod(int(dst), n)
                x = (d * k_loc + local) * n_micro + i  # the sequence the slot belongs to
                assert tgt == rb.completion[x, j]
                prompt = rb.tokens[x][rb.mask[x][:p].astype(bool).nonzero()[0]]
                # the hidden state at src sees exactly the prompt and completion[:j] of its own segment
                seg = flat_seg[src]
                ctx = flat_tok[(flat_seg == seg) & (np.arange(len(flat_seg)) // w == src // w)]
                ctx = ctx[: flat_pos[src] + 1]
                np.testing.assert_array_equal(ctx, np.concatenate([prompt, rb.completion[x, :j]]))
                seen[x, j] += 1
    np.testing.assert_array_equal(seen, (rb.completion_mask > 0).astype(int))  # each needed token once


def test_packed_layout_rejects_uneven_groups():
    rb = _random_batch(np.random.default_rng(0), s=12)
    with pytest.raises(ValueError, match="12 sequences"):
        packed_batch(rb, n_micro=5)


def _flat(tree):
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(tree)])


def test_packed_update_equals_padded(scratch_ckpt, tmp_path, scan=True):
    """One update (2 micro-batches, KL to a reference, so the reference log-probs take the packed path too,
    layers scanned as in the paper recipes) from the packed layout equals the bucketed one: parameters,
    loss, KL and the returned log-probs. The unrolled loop with segments: the last test here, and every
    trainer test (pack is the default)."""
    import lrmq.rl.sampler as trainer_mod
    from test_train_modes import digit_reward

    cfg = grpo_config(scratch_ckpt, str(tmp_path / "run"), prompts=4, lr=1e-3)
    cfg.optim.micro_batch_size = 4
    cfg.algo.beta, cfg.model.scan_layers = 0.05, scan
    cfg.rollout.max_new_tokens = 16
    trainer = make_trainer(cfg)
    orig, trainer_mod.score_completions = trainer_mod.score_completions, digit_reward
    try:
        rb = trainer.rollout(next(trainer.pipeline), jax.random.key(1)).batch
    finally:
        trainer_mod.score_completions = orig
    rb = mask_rows(rb, np.arange(rb.num_sequences) == 3)
    start = (jax.tree.map(jnp.copy, trainer.learner.trainable), jax.tree.map(jnp.copy, trainer.learner.opt_state))
    out = {}
    for layout in ("bucket", "pack"):
        trainer.cfg.rollout.update_padding = layout
        arrays = trainer.learner.update_batch(rb)
        assert arrays.layout == layout and (arrays.segments is not None) == (layout == "pack")
        batch = jax.tree.map(jnp.asarray, arrays)
        ref = trainer.learner.updates.reference_fn(trainer.learner.ref_trainable, trainer.learner.rest, batch)
        tr, _, m = trainer.learner.updates.steps["own"](jax.tree.map(jnp.copy, start[0]), trainer.learner.rest,
                                              jax.tree.map(jnp.copy, start[1]), batch, ref)
        n = rb.completion.shape[1]
        cm = rb.completion_mask
        pad = lambda x: np.pad(np.asarray(x), ((0, 0), (0, n - x.shape[1])))  # bucket cuts the completion width
        out[layout] = (_flat(tr), {k: np.asarray(v) for k, v in m.items()}, pad(ref) * cm, pad(m["logp"]) * cm)
    pk, bk = out["pack"], out["bucket"]
    assert pk[1]["logp"].shape == (rb.num_sequences, rb.completion.shape[1])
    np.testing.assert_allclose(pk[2], bk[2], atol=2e-5)  # reference log-probs
    np.testing.assert_allclose(pk[3], bk[3], atol=2e-5)  # the on-policy log-probs handed to later iterations
    for k in ("loss", "grad_norm", "kl", "entropy", "ratio"):
        assert float(pk[1][k]) == pytest.approx(float(bk[1][k]), rel=1e-4, abs=1e-6), k
    # parameters after one AdamW step of lr 1e-3: an element whose gradient is near zero moves by the float noise
    # of the two attention tilings (packed rows vs padded ones) scaled up by Adam: 1 of 94,592 elements differed
    # by 7e-6 on one CPU, by 1.6e-5 (1.6% of a step) on an AVX-512 one
    assert_adam_step_close(pk[0], bk[0], lr=1e-3, atol=1e-5)
    assert np.abs(pk[0] - _flat(start[0])).max() > 1e-4  # the update moved the parameters


def test_packed_attention_segments_match_separate_rows(scratch_ckpt):
    """Two sequences in one row with segment ids give each one's hidden states as if alone."""
    from lrmq.checkpoint.hf import load_hf_model

    model = load_hf_model(scratch_ckpt)
    rng = np.random.default_rng(0)
    a, b = rng.integers(1, 100, 7), rng.integers(1, 100, 5)
    row = jnp.asarray(np.concatenate([a, b, [0, 0]])[None], jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(7), np.arange(5), [-1, -1]])[None], jnp.int32)
    seg = jnp.asarray(np.array([1] * 7 + [2] * 5 + [0, 0])[None], jnp.int32)
    # compiled: run op by op, the three forwards compile ~200 one-op programs
    hidden = nnx.jit(lambda m, tokens, positions, segments=None: m.hidden(tokens, positions, segments=segments))
    h, _ = hidden(model, row, pos, segments=seg)
    for x, sl in ((a, slice(0, 7)), (b, slice(7, 12))):
        t = jnp.asarray(x[None], jnp.int32)
        alone, _ = hidden(model, t, positions_from_mask(jnp.ones_like(t)))
        np.testing.assert_allclose(np.asarray(h[0, sl]), np.asarray(alone[0]), atol=2e-5)
