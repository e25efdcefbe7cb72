"""Rollout/learner mismatch correction (algo.rollout_correction): the weights against their formulas, the mismatch
metrics against theirs, the loss with a correction against the hand-weighted loss for every aggregation, the step
with `none` bit for bit against the step without the feature, and TRL 1.16's own correction (loss and gradient,
tests/fixtures/trl_rollout_correction_reference.json by tools/trl_rollout_correction_reference.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrmq.rl.losses import AGGREGATIONS, ROLLOUT_CORRECTIONS, LossBatch, LossConfig, grpo_loss, rollout_mismatch_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(REPO, "tests", "fixtures", "trl_rollout_correction_reference.json")

RNG = np.random.default_rng(0)
LOG_RATIO = RNG.normal(0, 0.8, (5, 6)).astype(np.float32)  # learner_old - sampler
MASK = (np.arange(6)[None] < np.array([6, 3, 1, 0, 5])[:, None]).astype(np.float32)  # row 3: padding


def _np_weights(name, lr, mask, cap, cap_min):
    """The modes written out in NumPy (TRL 1.16's for token_* / sequence_*)."""
    lr = np.where(mask > 0, lr, 0.0)
    if name.startswith("token"):
        r = np.exp(lr)
    elif name.startswith("sequence"):
        r = np.exp(lr.sum(-1, keepdims=True))
    else:
        r = np.exp(lr.sum(-1, keepdims=True) / np.maximum(mask.sum(-1, keepdims=True), 1))
    out = (r > cap) | (r < cap_min)
    w = np.clip(r, cap_min, cap) if name.endswith("truncate") else np.where(out, 0.0, r)
    return w, out


def test_registered_modes():
    assert ROLLOUT_CORRECTIONS.names() == ["geometric_mask", "geometric_truncate", "sequence_mask",
                                           "sequence_truncate", "token_mask", "token_truncate"]


@pytest.mark.parametrize("name", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                                  "geometric_truncate", "geometric_mask"])
@pytest.mark.parametrize("cap,cap_min", [(3.0, 0.0), (1.5, 1 / 1.5)])
def test_weights_match_their_formula(name, cap, cap_min):
    w, c = ROLLOUT_CORRECTIONS.get(name)(jnp.asarray(LOG_RATIO), jnp.asarray(MASK), cap=cap, cap_min=cap_min)
    want_w, want_c = _np_weights(name, LOG_RATIO, MASK, cap, cap_min)
    assert w.shape == want_w.shape == ((5, 6) if name.startswith("token") else (5, 1))
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(c) > 0, want_c)


def test_hand_values():
    lr = jnp.log(jnp.array([[0.2, 1.0, 4.0], [2.0, 2.0, 1.0]]))
    m = jnp.array([[1, 1, 1], [1, 1, 0]], jnp.float32)
    w = lambda n: np.asarray(ROLLOUT_CORRECTIONS.get(n)(lr, m, cap=3.0, cap_min=0.25)[0])
    np.testing.assert_allclose(w("token_truncate"), [[0.25, 1, 3], [2, 2, 1]], rtol=1e-6)
    np.testing.assert_allclose(w("token_mask"), [[0, 1, 0], [2, 2, 1]], rtol=1e-6)
    np.testing.assert_allclose(w("sequence_truncate"), [[0.8], [3.0]], rtol=1e-6)  # products 0.8 and 4
    np.testing.assert_allclose(w("sequence_mask"), [[0.8], [0.0]], rtol=1e-6)
    np.testing.assert_allclose(w("geometric_truncate"), [[0.8 ** (1 / 3)], [2.0]], rtol=1e-6)
    np.testing.assert_allclose(w("geometric_mask"), [[0.8 ** (1 / 3)], [2.0]], rtol=1e-6)


def test_nan_sampler_logprob_counts_as_no_mismatch():
    """TRL: a token the sampler could not score (NaN) gets ratio 1; padding never matters."""
    lr = jnp.array([[jnp.nan, 0.5], [0.1, jnp.inf]])
    m = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    for name in ROLLOUT_CORRECTIONS.names():
        w, _ = ROLLOUT_CORRECTIONS.get(name)(lr, m, cap=3.0)
        assert np.all(np.isfinite(np.asarray(w))), name
    w, _ = ROLLOUT_CORRECTIONS.get("token_truncate")(lr, m, cap=3.0)
    assert float(w[0, 0]) == 1.0


def test_mismatch_metric_formulas():
    learner = RNG.normal(-2, 1, (5, 6)).astype(np.float32)
    sampler = (learner - LOG_RATIO).astype(np.float32)
    got = {k: float(s / c) for k, (s, c) in rollout_mismatch_metrics(learner, sampler, MASK).items()}
    v = MASK > 0
    d = (learner - sampler)[v].astype(np.float64)
    rows = MASK.sum(-1) > 0
    dseq = np.where(MASK > 0, learner - sampler, 0).sum(-1)[rows].astype(np.float64)
    dmean = dseq / MASK.sum(-1)[rows]
    want = {"mismatch/kl_k1": np.mean(-d), "mismatch/kl_k3": np.mean(np.exp(d) - 1 - d),
            "mismatch/chi2_token": np.mean(np.exp(d) ** 2) - 1, "mismatch/chi2_seq": np.mean(np.exp(dseq) ** 2) - 1,
            "mismatch/ppl_ratio": np.mean(np.exp(-dmean)), "mismatch/logp_diff": np.mean(np.abs(d))}
    assert set(got) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    zero = {k: float(s / c) for k, (s, c) in rollout_mismatch_metrics(learner, learner, MASK).items()}
    assert zero == {"mismatch/kl_k1": 0.0, "mismatch/kl_k3": 0.0, "mismatch/chi2_token": 0.0,
                    "mismatch/chi2_seq": 0.0, "mismatch/ppl_ratio": 1.0, "mismatch/logp_diff": 0.0}


@pytest.mark.parametrize("aggregation", ["sequence-mean-token-mean", "token-mean", "drgrpo-constant"])
@pytest.mark.parametrize("name", ["token_mask", "sequence_truncate", "geometric_mask"])
def test_loss_is_the_weighted_policy_term_plus_unweighted_kl(aggregation, name):
    """Weight x policy loss per token (stop-gradient), KL added after, then any aggregation; the gradient is the
    weighted policy gradient."""
    logp = jnp.asarray(RNG.normal(-2, 0.5, (5, 6)), jnp.float32)
    old = logp + jnp.asarray(RNG.normal(0, 0.2, (5, 6)), jnp.float32)
    sampler = old - jnp.asarray(LOG_RATIO)
    ref = logp + 0.3
    adv = jnp.asarray([1.0, -0.5, 0.7, 0.2, -1.2])
    kw = dict(aggregation=aggregation, beta=0.04, max_len=6)

    def with_correction(lp):
        s, c, m = grpo_loss(lp, LossBatch(adv, MASK, old_logp=old, behaviour_logp=sampler, ref_logp=ref),
                            LossConfig(rollout_correction=name, rollout_correction_cap=1.5,
                                       rollout_correction_min=0.5, **kw))
        return s / c, m

    def by_hand(lp):
        from lrmq.rl.losses import KL_ESTIMATORS, policy_loss_terms
        w, _ = _np_weights(name, np.asarray(old - sampler), MASK, 1.5, 0.5)
        pol, _, _ = policy_loss_terms(lp, old, adv, MASK)
        per = pol * jnp.asarray(w, jnp.float32) + 0.04 * jnp.where(MASK > 0, KL_ESTIMATORS.get("k3")(lp, ref), 0.0)
        s, c = AGGREGATIONS.get(aggregation)(per, MASK, max_len=6)
        return s / c

    (loss, m), g = jax.value_and_grad(with_correction, has_aux=True)(logp)
    want, g_want = jax.value_and_grad(by_hand)(logp)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_want), rtol=1e-5, atol=1e-8)
    w, out = _np_weights(name, np.asarray(old - sampler), MASK, 1.5, 0.5)
    wt = np.broadcast_to(w, MASK.shape)
    assert float(m["mismatch/weight_mean"][0] / m["mismatch/weight_mean"][1]) == pytest.approx(
        wt[MASK > 0].mean(), rel=1e-5)
    assert float(m["mismatch/corrected_frac"][0] / m["mismatch/corrected_frac"][1]) == pytest.approx(
        np.broadcast_to(out, MASK.shape)[MASK > 0].mean())


def test_on_policy_first_update_weights_by_its_own_logprobs():
    """old_logp=None (a batch's first update): the learner side of the weight is this forward, stop-gradient."""
    logp = jnp.asarray(RNG.normal(-2, 0.5, (5, 6)), jnp.float32)
    sampler = logp - jnp.asarray(LOG_RATIO)
    adv = jnp.asarray([1.0, -0.5, 0.7, 0.2, -1.2])
    f = lambda lp, old: grpo_loss(lp, LossBatch(adv, MASK, old_logp=old, behaviour_logp=sampler),
                                  LossConfig(rollout_correction="token_truncate", rollout_correction_cap=1.5))[0]
    g_none = jax.grad(f)(logp, None)
    g_old = jax.grad(f)(logp, jax.lax.stop_gradient(logp))
    np.testing.assert_array_equal(np.asarray(g_none), np.asarray(g_old))
    w, _ = _np_weights("token_truncate", LOG_RATIO, MASK, 1.5, 0.0)
    # ratio 1: d loss_sum / d logp = -A * w / |o_i|
    n = MASK.sum(-1, keepdims=True)
    want = np.where(MASK > 0, -np.asarray(adv)[:, None] * w / np.maximum(n, 1), 0)
    np.testing.assert_allclose(np.asarray(g_none), want, rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------------------- TRL 1.16's own correction

AGGREGATION = {"grpo": "sequence-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
               "dr_grpo": "drgrpo-constant"}


@pytest.fixture(scope="module")
def reference():
    with open(REFERENCE) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def model():
    from lrmq.checkpoint.load import load_model, resolve_checkpoint
    return load_model(resolve_checkpoint("tiny"), dtype="float32", param_dtype="float32")


def _lrmq_loss(model, batch, case):
    from flax import nnx

    from lrmq.checkpoint.hf import hf_tensors
    from lrmq.rl.step import completion_logprobs
    b = {k: jnp.asarray(np.asarray(v)) for k, v in batch.items()}
    tokens = jnp.concatenate([b["prompt_ids"], b["completion_ids"]], 1).astype(jnp.int32)
    mask = jnp.concatenate([b["prompt_mask"], b["completion_mask"]], 1).astype(jnp.int32)
    cmask = b["completion_mask"].astype(jnp.float32)
    old = jnp.asarray(case["old_per_token_logps"], jnp.float32) if case["old"] == "stale" else None
    sampler = jnp.asarray(case["sampling_per_token_logps"], jnp.float32)
    ref = jnp.asarray(case["ref_per_token_logps"], jnp.float32) if case["beta"] else None
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params):
        m = nnx.merge(graphdef, params, rest)
        logp, _ = completion_logprobs(m, tokens, mask, b["completion_ids"].astype(jnp.int32), case["temperature"])
        s, c, metrics = grpo_loss(logp, LossBatch(b["advantages"], cmask, old_logp=old, behaviour_logp=sampler,
                                                  ref_logp=ref), LossConfig(
            eps_low=case["epsilon_low"], eps_high=case["epsilon_high"], aggregation=AGGREGATION[case["loss_type"]],
            beta=case["beta"], kl_bias_correction=case["use_bias_correction_kl"],
            importance_level=case["importance_sampling_level"], max_len=cmask.shape[1],
            rollout_correction=case["mode"], rollout_correction_cap=case["clip_max"],
            rollout_correction_min=case["clip_min"] or 0.0))
        return s / c, metrics

    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    return float(loss), metrics, dict(hf_tensors(nnx.merge(graphdef, grads, rest), "float32"))


def _cases():
    if not os.path.exists(REFERENCE):
        return []
    with open(REFERENCE) as f:
        return list(json.load(f)["cases"])


@pytest.mark.parametrize("name", _cases())
def test_loss_and_gradient_equal_trl(reference, model, name):
    from test_trl_parity import direction
    case = reference["cases"][name]
    loss, metrics, grads = _lrmq_loss(model, reference["batch"], case)
    assert loss == pytest.approx(case["loss"], rel=1e-4, abs=2e-6)
    # TRL's weight, as lrmq computes it from the same log-probs
    cmask = np.asarray(reference["batch"]["completion_mask"], np.float32)
    trl_w = np.broadcast_to(np.asarray(case["importance_sampling_ratio"], np.float32), cmask.shape)
    assert float(metrics["mismatch/weight_mean"][0] / metrics["mismatch/weight_mean"][1]) == pytest.approx(
        trl_w[cmask > 0].mean(), rel=1e-4)
    for k, g in grads.items():
        want = case["grad_norm"][k]
        assert float(np.linalg.norm(g)) == pytest.approx(want, rel=2e-4, abs=1e-7), k
        proj = float((g.astype(np.float64) * direction(k, g.shape)).sum())
        assert proj == pytest.approx(case["grad_projection"][k], rel=2e-3, abs=2e-6 + 1e-3 * want), k
    for k, v in case["grad_small"].items():
        np.testing.assert_allclose(grads[k], np.asarray(v, np.float32), rtol=2e-3, atol=1e-7 + 1e-4 * np.abs(v).max())


def test_the_trl_cases_correct_something(reference):
    """Each case truncates or masks some tokens and keeps others (so the fixture tests the bounds), and TRL's
    weights are our formula's."""
    cmask = np.asarray(reference["batch"]["completion_mask"], np.float32)
    for name, c in reference["cases"].items():
        lr = np.asarray(c["old_per_token_logps"], np.float32) - np.asarray(c["sampling_per_token_logps"], np.float32)
        w, out = _np_weights(c["mode"], lr, cmask, c["clip_max"], c["clip_min"] or 0.0)
        np.testing.assert_allclose(w, np.asarray(c["importance_sampling_ratio"]), rtol=1e-5, err_msg=name)
        rows = np.broadcast_to(out, cmask.shape)[cmask > 0]
        assert 0 < rows.mean() < 1, name


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (pip install -e '.[bench]')")
def test_reference_is_what_trl_computes_now(tmp_path, reference):
    out = tmp_path / "ref.json"
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "trl_rollout_correction_reference.py"),
                    "--out", str(out)], check=True, timeout=600)
    fresh = json.loads(out.read_text())
    for name, c in reference["cases"].items():
        assert fresh["cases"][name]["loss"] == pytest.approx(c["loss"], rel=1e-5, abs=1e-7)


# ----------------------------------------------------------------------------- the step


def _legacy_loss_fn(trainable, rest, graphdef, mb, total_count, ref_logp, cfg, old_from):
    """lrmq.rl.step._loss_fn as it was before the rollout correction existed (commit 9974a22), in today's types."""
    from flax import nnx

    from lrmq.rl.step import batch_logprobs
    model = nnx.merge(graphdef, trainable, rest)
    a = cfg.algo
    logp, ent, _ = batch_logprobs(model, mb, cfg.rollout.temperature, remat=cfg.model.remat,
                               chunk=cfg.model.logits_chunk, scan=cfg.model.scan_layers)
    old = {"behaviour_logp": mb.behaviour_logp, "own": None, "old_logp": mb.old_logp}[old_from]
    loss_sum, _, metrics = grpo_loss(logp, LossBatch(mb.advantages, mb.completion_mask, old_logp=old, ref_logp=ref_logp),
                                     LossConfig(eps_low=a.eps_low, eps_high=a.eps_high, aggregation=a.loss_aggregation,
                                                beta=a.beta, kl_estimator=a.kl_estimator,
                                                kl_bias_correction=a.kl_bias_correction,
                                                importance_level=a.importance_sampling,
                                                max_len=cfg.rollout.max_new_tokens, policy_loss=a.policy_loss))
    m = mb.completion_mask
    metrics["entropy"] = ((jax.lax.stop_gradient(ent) * m).sum(), m.sum())
    return loss_sum / total_count, (loss_sum, metrics, jax.lax.stop_gradient(logp))


def _step_setup(tmp_path, **algo):
    from flax import nnx

    from conftest import tiny_train_config
    from lrmq.checkpoint.load import load_model, resolve_checkpoint
    from lrmq.rl.batch import RolloutBatch, padded_batch
    from lrmq.rl.step import make_optimizer
    cfg = tiny_train_config(str(tmp_path), rollout={"prompts_per_step": 2, "group_size": 2, "max_prompt_len": 8,
                                                    "max_new_tokens": 8, "update_padding": "max"},
                            optim={"micro_batch_size": 2}, algo=algo)
    model = load_model(resolve_checkpoint("tiny"), dtype="float32", param_dtype="float32")
    graphdef, trainable, rest = nnx.split(model, nnx.Param, ...)
    tx, _ = make_optimizer(cfg)
    rng = np.random.default_rng(3)
    s, p, n = 4, 8, 8
    tokens = rng.integers(1, 50, (s, p + n)).astype(np.int32)
    lengths = np.array([8, 3, 5, 1])
    cmask = (np.arange(n)[None] < lengths[:, None]).astype(np.float32)
    mask = np.concatenate([np.ones((s, p), np.int32), cmask.astype(np.int32)], 1)
    rb = RolloutBatch(tokens=tokens, mask=mask, completion=tokens[:, p:].copy(), completion_mask=cmask,
                      behaviour_logp=(-3.0 + rng.normal(0, 0.5, (s, n)).astype(np.float32)) * cmask,
                      advantages=np.array([1.0, -1.0, 0.5, -0.5], np.float32), rewards=np.zeros(s, np.float32))
    batch = jax.tree.map(jnp.asarray, padded_batch(rb))
    return cfg, graphdef, trainable, rest, tx, batch


@pytest.mark.parametrize("old_logprobs", ["rollout", "recompute"])
@pytest.mark.slow(reason="compiles the GRPO step with and without the feature to compare them bit for bit")
def test_none_is_bit_identical_to_the_step_without_the_feature(tmp_path, monkeypatch, old_logprobs):
    """rollout_correction none (and auto, which is none while the rollout runs the learner's weights): parameters,
    optimizer state, loss, gradient norm and every metric that existed before are bit for bit those of the step
    as it was; the only difference is the added mismatch/* metrics."""
    import lrmq.rl.step as step_mod
    from conftest import compile_with_xla_defaults
    from lrmq.rl.step import METRIC_NAMES, make_train_step, old_logprob_sources
    results, compiled = {}, {}  # one compile per distinct program (by its lowered text): mu = 2 runs one twice
    for variant in ("legacy", "none", "auto"):
        cfg, graphdef, trainable, rest, tx, batch = _step_setup(
            tmp_path, old_logprobs=old_logprobs, rollout_correction="none" if variant == "legacy" else variant,
            num_iterations=2)
        with monkeypatch.context() as mp:
            if variant == "legacy":
                mp.setattr(step_mod, "_loss_fn", _legacy_loss_fn)
                mp.setattr(step_mod, "_metric_names", lambda c: METRIC_NAMES)
            sources = old_logprob_sources(cfg)
            assert sources == (("behaviour_logp",) * 2 if old_logprobs == "rollout" else ("own", "old_logp"))
            tr, opt = trainable, tx.init(trainable)
            for old_from in sources:  # mu = 2, as the trainer runs it
                args = (jax.tree.map(jnp.copy, tr), rest, jax.tree.map(jnp.copy, opt), batch, None)
                lowered = make_train_step(graphdef, cfg, tx, old_from=old_from).lower(*args)
                text = lowered.as_text()
                if text not in compiled:
                    compiled[text] = compile_with_xla_defaults(lowered)
                step = compiled[text]
                tr, opt, out = step(*args)
                if old_from == "own":
                    batch = batch.replace(old_logp=out.pop("logp") * batch.completion_mask)
        results[variant] = (jax.tree.leaves(tr), jax.tree.leaves(opt), jax.device_get(out))
    legacy = results["legacy"]
    for variant in ("none", "auto"):
        got = results[variant]
        for a, b in zip(legacy[0] + legacy[1], got[0] + got[1]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for k, v in legacy[2].items():
            assert np.asarray(v).tobytes() == np.asarray(got[2][k]).tobytes(), k
        assert set(got[2]) - set(legacy[2]) == {"mismatch/kl_k1", "mismatch/kl_k3", "mismatch/chi2_token",
                                                "mismatch/chi2_seq", "mismatch/ppl_ratio", "mismatch/logp_diff"}


def test_correction_step_mu2(tmp_path):
    """A correction on: the first update is on-policy (no old-log-prob forward) and weighs by its own log-probs
    against the batch's behaviour_logp; the second divides by the first's log-probs and keeps the same weights, so
    the mismatch metrics of both updates agree."""
    from lrmq.rl.precompile import abstract_update, batch_key, update_shapes
    from lrmq.rl.step import make_train_step, old_logprob_sources
    from lrmq.sharding import make_mesh
    cfg, graphdef, trainable, rest, tx, batch = _step_setup(tmp_path, rollout_correction="token_truncate",
                                                            rollout_correction_cap=1.2, rollout_correction_min=0.9,
                                                            num_iterations=2)
    # old_logprobs=rollout, but the ratio's denominator is the learner's
    assert old_logprob_sources(cfg) == ("own", "old_logp")
    mesh = make_mesh()
    shape = update_shapes(cfg, 1)[0]
    assert batch_key(batch) == batch_key(abstract_update(cfg, shape, mesh)[0])
    tr, opt = trainable, tx.init(trainable)
    tr, opt, first = make_train_step(graphdef, cfg, tx, old_from="own")(tr, rest, opt, batch, None)
    assert float(first["ratio"]) == 1.0
    assert 0 < float(first["mismatch/corrected_frac"]) <= 1
    batch = batch.replace(old_logp=first.pop("logp") * batch.completion_mask)
    assert batch_key(batch) == batch_key(abstract_update(cfg, shape, mesh, old_logp=True)[0])
    tr, opt, second = make_train_step(graphdef, cfg, tx, old_from="old_logp")(tr, rest, opt, batch, None)
    assert float(second["ratio"]) != 1.0
    for k in ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/chi2_token", "mismatch/weight_mean",
              "mismatch/corrected_frac"):
        assert float(second[k]) == pytest.approx(float(first[k]), rel=1e-5, abs=1e-7), k
