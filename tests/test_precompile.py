"""The update's shapes are fixed by the config and all compiled before the first rollout (lrmq.rl.precompile):
the host layouts only ever produce those shapes, and a run compiles no update after its first step."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from conftest import tiny_train_config
from lrmq.rl.batch import RolloutBatch, bucketed_batch, mask_rows, packed_batch, padded_batch
from lrmq.rl.precompile import abstract_update, batch_key, packed_chooser, update_shapes
from lrmq.sharding import make_mesh

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
UPDATE_PROGRAMS = ("jit(train_step)", "jit(reference_logprobs)")


def _rollout_batch(rng, s, prompt_cols, n, max_prompt):
    """A batch as the rollout returns it: prompts left-padded to `prompt_cols`, completions of any length."""
    prompt_len = rng.integers(1, max_prompt + 1, s)
    lengths = rng.integers(0, n + 1, s)
    tokens = np.zeros((s, prompt_cols + n), np.int32)
    mask = np.zeros_like(tokens)
    for i in range(s):
        tokens[i, prompt_cols - prompt_len[i]:prompt_cols] = rng.integers(1, 50, prompt_len[i])
        mask[i, prompt_cols - prompt_len[i]:prompt_cols] = 1
        tokens[i, prompt_cols:prompt_cols + lengths[i]] = rng.integers(1, 50, lengths[i])
        mask[i, prompt_cols:prompt_cols + lengths[i]] = 1
    cmask = (np.arange(n)[None] < lengths[:, None]).astype(np.float32)
    rb = RolloutBatch(tokens=tokens, mask=mask, completion=tokens[:, prompt_cols:].copy(), completion_mask=cmask,
                      behaviour_logp=-cmask, advantages=rng.normal(size=s).astype(np.float32), rewards=np.zeros(s, np.float32))
    return mask_rows(rb, rng.random(s) < 0.1)


def test_update_shapes_per_layout(tmp_path):
    # the rollout's default 5 packed shapes (tiny_train_config asks for 1 to keep the trainers' compiles few)
    cfg = lambda layout, **r: tiny_train_config(str(tmp_path), rollout={"update_padding": layout, "update_shapes": 5,
                                                                        **r})
    pack = update_shapes(cfg("pack"), 1)
    # 16 sequences of at most 32 + 40 tokens: one per row and 40 slots each at worst, then down by sqrt(2)
    assert [(s.rows, s.slots) for s in pack] == [(16, 640), (12, 512), (8, 384), (6, 256), (4, 256)]
    assert all(s.width == 32 + 40 for s in pack)
    assert len(update_shapes(cfg("pack", update_shapes=2), 1)) == 2
    bucket = update_shapes(cfg("bucket"), 1)
    assert sorted((s.prompt, s.completion) for s in bucket) == [(p, c) for p in (16, 32) for c in (16, 32, 40)]
    assert [(s.prompt, s.completion) for s in update_shapes(cfg("max"), 1)] == [(32, 40)]


@pytest.mark.parametrize("layout,micro", [("pack", 0), ("pack", 8), ("bucket", 0), ("max", 0)])
def test_host_layouts_only_make_precompiled_shapes(tmp_path, layout, micro):
    """Whatever a batch's prompt and completion lengths, the trainer's host layout has the shape of one of the
    abstract batches compiled before the first rollout (the key the compiled programs are looked up by)."""
    cfg = tiny_train_config(str(tmp_path), rollout={"update_padding": layout, "prompts_per_step": 4, "group_size": 4,
                                                              "update_shapes": 5},  # the default, not the tests' 1
                            optim={"micro_batch_size": micro}, algo={"beta": 0.04})
    mesh = make_mesh()
    shapes = update_shapes(cfg, 1)
    keys = {batch_key(*abstract_update(cfg, s, mesh)) for s in shapes}
    assert len(keys) == len(shapes)
    r = cfg.rollout
    n_micro = 16 // (micro or 16)
    rng = np.random.default_rng(0)
    for trial in range(40):
        longest = int(rng.integers(1, r.max_prompt_len + 1))
        cols = r.max_prompt_len if layout == "max" else min(max(16, 1 << (longest - 1).bit_length()), r.max_prompt_len)
        rb = _rollout_batch(rng, 16, cols, r.max_new_tokens, longest)
        if layout == "pack":
            arrays = packed_batch(rb, n_micro=n_micro, choose_shape=packed_chooser(shapes),
                                   width=r.max_prompt_len + r.max_new_tokens)
            ref = np.zeros((16, r.max_new_tokens), np.float32)
        else:
            arrays = bucketed_batch(rb) if layout == "bucket" else padded_batch(rb)
            ref = np.zeros(arrays.completion.shape, np.float32)
        assert batch_key(arrays, ref) in keys, (trial, arrays.shapes())


@pytest.mark.slow(reason="the shapes are the point: every update shape compiled, then tiny-model steps checked to compile none")
def test_no_update_compiles_after_the_first_step(tmp_path):
    """20 steps of a demo-like run (the tiny model, arithmetic prompts, the default packed layout): every update
    shape and the rollout engine's programs compile before the first rollout, and no program compiles after step 1. Compiles are
    counted from JAX's own compile events (`jax.monitoring`), cache hits included."""
    from lrmq.rl.trainer import GRPOTrainer

    cfg = tiny_train_config(str(tmp_path), run={"steps": 20, "save_every": 1000, "eval_size": 0,
                                                "compile_cache": "off"}, rollout={"update_shapes": 5},
                            data={"synthetic_train_size": 400, "synthetic_eval_size": 8})
    trainer = GRPOTrainer(cfg)
    events: list[tuple[int, str, bool]] = []  # (trainer.step when it compiled, program, after the first rollout)
    started = []
    orig_rollout = trainer.rollout

    def rollout(*a, **kw):
        started.append(True)
        return orig_rollout(*a, **kw)

    def on_event(event, duration, **kw):
        if event == COMPILE_EVENT:
            events.append((trainer.step, kw.get("fun_name", "?"), bool(started)))

    trainer.rollout = rollout
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        trainer.train()
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert trainer.step == 20
    before = [name for _, name, after_rollout in events if not after_rollout]
    # the counter sees compiles: every update shape, before the first rollout
    assert before.count("jit(train_step)") == len(trainer.learner.updates.shapes) == 5, before
    late = [(step, name) for step, name, _ in events if step >= 1 and name in UPDATE_PROGRAMS]
    assert not late, f"update compiles after step 1: {late}"
    assert not [e for e in events if e[2] and e[1] in UPDATE_PROGRAMS], "an update compiled after the first rollout"
    assert not trainer.learner.updates.missed
    # nor anything else: the rollout engine's programs (every row bucket) compiled before the first rollout too
    assert not [(step, name) for step, name, _ in events if step >= 1], "a program compiled after step 1"
    assert any("decode" in name for name in before) and any("prefill" in name for name in before), before
    # the batches did take different shapes (else this would prove little)
    rows = [json.loads(line).get("perf/update_rows") for line in open(trainer.metrics_path)]
    assert len({r for r in rows if r}) > 1, rows
