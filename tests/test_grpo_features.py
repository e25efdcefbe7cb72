"""The GRPO features a TRL user reaches for: bucketed update width, the on-policy first update (no extra
forward), truncated-completion masking, weighted extra rewards, completion logs, the compile cache."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train_modes import grpo_config, make_trainer, scratch_ckpt  # noqa: F401 (fixture)

from lrmq import compile_cache
from lrmq.rl.batch import RolloutBatch, bucket, bucketed_batch, mask_rows, padded_batch, truncated_rows
from lrmq.rl.rewards import REWARDS, score_completions
from lrmq.rl.step import completion_logprobs


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _rollout(trainer):
    import lrmq.rl.sampler as trainer_mod
    from test_train_modes import digit_reward

    orig, trainer_mod.score_completions = trainer_mod.score_completions, digit_reward
    try:
        return trainer.rollout(next(trainer.pipeline), jax.random.key(0))
    finally:
        trainer_mod.score_completions = orig


def _flat(tree):
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(tree)])


# ----------------------------------------------------------------------------- update width


def test_bucket_sizes():
    assert [bucket(n, 64) for n in (0, 1, 16, 17, 33, 64, 100)] == [16, 16, 16, 32, 64, 64, 64]
    assert bucket(5, 8) == 8


@pytest.mark.slow(reason="compiles the update at bucketed and at full width to compare them")
def test_bucketed_update_equals_full_width(scratch_ckpt, tmp_path):
    cfg = grpo_config(scratch_ckpt, str(tmp_path / "run"))
    cfg.rollout.update_padding = "max"  # prompts padded to max_prompt_len (the rollout buckets them otherwise)
    trainer = make_trainer(cfg)
    rb = _rollout(trainer).batch
    full, narrow = padded_batch(rb), bucketed_batch(rb)
    assert narrow.tokens.shape[1] < full.tokens.shape[1]  # prompts of ~20 tokens in a 64 budget
    # the dropped columns are padding only
    assert narrow.mask.sum() == full.mask.sum() and narrow.completion_mask.sum() == full.completion_mask.sum()
    out = {}
    for name, arrays in (("full", full), ("bucket", narrow)):
        step = trainer.learner.updates.steps["behaviour_logp"]
        batch = jax.tree.map(jnp.asarray, arrays)
        tr, _, m = step(_copy(trainer.learner.trainable), trainer.learner.rest, _copy(trainer.learner.opt_state), batch, None)
        out[name] = (_flat(tr), {k: float(v) for k, v in m.items()})
    np.testing.assert_allclose(out["bucket"][0], out["full"][0], rtol=1e-5, atol=1e-7)
    for k in ("loss", "grad_norm", "entropy", "ratio"):
        assert out["bucket"][1][k] == pytest.approx(out["full"][1][k], rel=1e-4, abs=1e-6), k


# ----------------------------------------------------------------------------- no unneeded forward


@pytest.mark.slow(reason="compiles both update paths (on-policy reuse and the separate old-logprob forward)")
def test_on_policy_first_update_replaces_the_old_logprob_forward(scratch_ckpt, tmp_path):
    """old_logprobs=recompute, mu=2: the first update is on-policy and hands its own log-probs to the second;
    the result equals the textbook path (a separate forward for the old log-probs, then two updates)."""
    cfg = grpo_config(scratch_ckpt, str(tmp_path / "run"), lr=1e-3)
    cfg.algo.old_logprobs, cfg.algo.num_iterations = "recompute", 2
    trainer = make_trainer(cfg)
    assert trainer.learner.updates.reference_fn is None  # beta = 0: no reference and no old-log-prob program at all
    rb = _rollout(trainer).batch
    arrays = jax.tree.map(jnp.asarray, bucketed_batch(rb))

    from flax import nnx

    @jax.jit
    def old_logprobs(trainable, a):
        model = nnx.merge(trainer.learner.graphdef, trainable, trainer.learner.rest)
        return completion_logprobs(model, a.tokens, a.mask, a.completion, cfg.rollout.temperature,
                                   chunk=cfg.model.logits_chunk)[0] * a.completion_mask

    old = old_logprobs(trainer.learner.trainable, arrays)
    ref_batch = arrays.replace(old_logp=old)
    tr, opt = _copy(trainer.learner.trainable), _copy(trainer.learner.opt_state)
    for _ in range(2):
        tr, opt, want = trainer.learner.updates.steps["old_logp"](tr, trainer.learner.rest, opt, ref_batch, None)
    expected = _flat(tr)

    got = trainer.learner.update(rb)
    # Adam's g / sqrt(v) turns the ~1-ulp ratio differences of near-zero gradients into up to ~1e-5 on a
    # handful of the 95k parameters (two steps of lr 1e-3 move them ~2e-3); everywhere else they agree
    diff = np.abs(_flat(trainer.learner.trainable) - expected)
    assert diff.max() < 5e-5 and np.mean(diff > 1e-6) < 1e-3, (diff.max(), np.mean(diff > 1e-6))
    assert got["train/loss"] == pytest.approx(float(want["loss"]), rel=1e-4, abs=1e-6)
    assert got["train/ratio"] != 1.0  # the second update saw a moved policy


# ----------------------------------------------------------------------------- truncated completions


def test_truncated_rows_and_masking():
    eos = (7,)
    comp = np.array([[1, 2, 3, 4], [1, 7, 0, 0], [1, 2, 3, 7], [5, 5, 5, 5]], np.int32)
    lengths = np.array([4, 2, 4, 3])
    np.testing.assert_array_equal(truncated_rows(comp, lengths, eos), [True, False, False, False])
    s, n = 4, 4
    rb = RolloutBatch(tokens=np.ones((s, 2 + n), np.int32), mask=np.ones((s, 2 + n), np.int32), completion=comp,
                      completion_mask=np.ones((s, n), np.float32), behaviour_logp=-np.ones((s, n), np.float32),
                      advantages=np.ones(s, np.float32), rewards=np.zeros(s, np.float32))
    out = mask_rows(rb, truncated_rows(comp, lengths, eos))
    assert out.completion_mask[0].sum() == 0 and out.completion_mask[1:].sum() == 12
    assert out.behaviour_logp[0].sum() == 0 and out.mask.sum() == rb.mask.sum()  # attention untouched


def test_mask_truncated_completions_in_the_trainer(scratch_ckpt, tmp_path):
    cfg = grpo_config(scratch_ckpt, str(tmp_path / "run"))
    cfg.algo.mask_truncated_completions = True
    trainer = make_trainer(cfg)
    ro = _rollout(trainer)
    rb = ro.batch
    cut = np.array([r["truncated"] for r in ro.completions])
    assert cut.any()  # an untrained model rarely stops within 8 tokens
    assert np.all(rb.completion_mask[cut].sum(1) == 0)
    assert np.all(rb.completion_mask[~cut].sum(1) > 0)


# ----------------------------------------------------------------------------- rewards


def test_extra_reward_functions():
    texts = ["a \\boxed{3}", "<think>x</think> so \\boxed{4}", "<think>x</think></think>\\boxed{4}", "none"]
    lengths = np.array([4, 6, 8, 2])
    assert REWARDS.get("format")(texts, [""] * 4)[0].tolist() == [1, 1, 1, 0]
    assert REWARDS.get("think_format")(texts, [""] * 4)[0].tolist() == [0, 1, 0, 0]
    np.testing.assert_allclose(REWARDS.get("length_penalty")(texts, [""] * 4, lengths=lengths, max_len=8)[0],
                               [-0.5, -0.75, -1.0, -0.25])
    # DAPO overlong: 0 up to 6 (= 8 - 8/4), then linear to -1 at 8
    np.testing.assert_allclose(REWARDS.get("overlong_penalty")(texts, [""] * 4, lengths=lengths, max_len=8)[0],
                               [0.0, 0.0, -1.0, 0.0])
    np.testing.assert_allclose(REWARDS.get("overlong_penalty")(["x"], [""], lengths=[7], max_len=8)[0], [-0.5])
    r, _ = score_completions(texts, ["3", "4", "4", "1"], "boxed_exact", lengths=lengths, max_len=8)
    np.testing.assert_allclose(r, [1.1, 1.1, 1.1, 0.0])


def test_weighted_rewards_are_summed_and_logged(scratch_ckpt, tmp_path):
    cfg = grpo_config(scratch_ckpt, str(tmp_path / "run"))
    cfg.algo.reward, cfg.algo.reward_weight = "boxed_exact", 2.0
    cfg.algo.extra_rewards = {"length_penalty": 0.5, "format": 1.0}
    cfg.algo.validate()
    trainer = make_trainer(cfg)
    texts, answers, lengths = ["\\boxed{2}", "\\boxed{3}", "no"], ["2", "2", "2"], np.array([8, 4, 2])
    total, parts, info = trainer.sampler.score(texts, answers, lengths)
    np.testing.assert_allclose(parts["boxed_exact"], [1.1, 0.1, 0.0])
    np.testing.assert_allclose(total, 2 * parts["boxed_exact"] - 0.5 * lengths / 8 + parts["format"], rtol=1e-6)
    stats = trainer.rollout(next(trainer.pipeline), jax.random.key(0)).stats
    assert {"reward/boxed_exact", "reward/length_penalty", "reward/format"} <= set(stats)


def test_unknown_extra_reward_is_a_config_error():
    from lrmq.configlib import ConfigError, load_config
    from lrmq.rl.config import TrainConfig

    with pytest.raises(ConfigError, match="algo.extra_rewards.*'lenght_penalty'"):
        load_config(TrainConfig, overrides=["algo.extra_rewards={lenght_penalty: 1.0}"])


# ----------------------------------------------------------------------------- completion logs


class _RecordingWriter:
    def __init__(self):
        self.texts, self.scalars = [], {}

    def add_scalar(self, k, v, step):
        self.scalars[(k, step)] = v

    def add_text(self, tag, text, step):
        self.texts.append((tag, text, step))

    def flush(self):
        pass


@pytest.mark.slow(reason="an in-process GRPO run on the scratch checkpoint with completion logging")
def test_completions_are_logged(scratch_ckpt, tmp_path):
    from lrmq.rl.trainer import GRPOTrainer

    cfg = grpo_config(scratch_ckpt, str(tmp_path / "run"), steps=2)
    cfg.run.log_completions = 3
    cfg.run.eval_size = 2
    writer = _RecordingWriter()
    trainer = GRPOTrainer(cfg, writer_factory=lambda path: writer)
    trainer.train()
    rows = [json.loads(x) for x in open(os.path.join(trainer.run_dir, "completions.jsonl"))]
    s = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert len(rows) == 2 * s and [r["step"] for r in rows] == [1] * s + [2] * s
    assert {"prompt", "completion", "answer", "reward", "rewards", "advantage", "tokens", "truncated"} <= set(rows[0])
    assert set(rows[0]["rewards"]) == {cfg.algo.reward}
    assert [(t, step) for t, _, step in writer.texts] == [("completions", 1), ("completions", 2)]
    assert writer.texts[0][1].count("**reward") == 3
    assert ("reward/frac_zero_std", 1) in writer.scalars


# ----------------------------------------------------------------------------- compile cache


def test_compile_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "c"))
    assert compile_cache.resolve("auto") == str(tmp_path / "c")
    assert compile_cache.resolve("off") is None
    assert compile_cache.resolve(str(tmp_path / "x")) == str(tmp_path / "x")
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.resolve("auto") is None
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve("") == str(tmp_path / "xdg" / "lrmq" / "jax")


def test_enabled_cache_stores_compiled_programs(tmp_path):
    """In a fresh interpreter (the cache dir is fixed at a process's first compile): enable() makes JAX write
    compiled programs to the dir, and a second process loads them instead of compiling."""
    import subprocess
    import sys

    code = ("import jax, jax.numpy as jnp; from lrmq import compile_cache; import sys\n"
            "assert compile_cache.enable(sys.argv[1]) == sys.argv[1]\n"
            "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
            "f = jax.jit(lambda x: jnp.sin(x) @ x.T + 1.25)\n"
            "print(float(f(jnp.ones((64, 64))).sum()))")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop(compile_cache.ENV, None)
    cache = str(tmp_path / "cache")
    first = subprocess.run([sys.executable, "-c", code, cache], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    entries = os.listdir(cache)
    assert entries
    second = subprocess.run([sys.executable, "-c", code, cache], env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and second.stdout == first.stdout
    assert sorted(os.listdir(cache)) == sorted(entries)  # a hit: nothing new compiled and stored


# ----------------------------------------------------------------------------- benchmark suite in training


def test_periodic_eval_can_run_a_benchmark_suite(scratch_ckpt, tmp_path):
    fixtures = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "evals")
    cfg = grpo_config(scratch_ckpt, str(tmp_path / "run"))
    cfg.run.eval_suite, cfg.run.eval_suite_limit, cfg.run.eval_data_dir = "aime24,math500", 1, fixtures
    cfg.run.eval_size = 2
    trainer = make_trainer(cfg)
    assert [it.benchmark for it in trainer.suite_eval.items] == ["aime24", "math500"]
    out = trainer.evaluate()
    assert {"eval/paper1/aime24/accuracy", "eval/paper1/math500/reward", "eval/paper1/pooled_reward"} <= set(out)
    assert "eval/accuracy" in out  # the held-out split still runs


def test_eval_suite_errors_name_the_problem(scratch_ckpt, tmp_path):
    from lrmq.configlib import ConfigError

    cfg = grpo_config(scratch_ckpt, str(tmp_path / "run"))
    cfg.run.eval_suite = "paper2"
    with pytest.raises(ConfigError, match="run.eval_suite: unknown suite or benchmark 'paper2'"):
        make_trainer(cfg)
    cfg.run.eval_suite, cfg.run.eval_data_dir = "aime24", str(tmp_path / "no-data")
    from lrmq.evals.benchmarks import EvalDataError

    with pytest.raises(EvalDataError, match="benchmark 'aime24': dataset .* is not available"):
        make_trainer(cfg)
