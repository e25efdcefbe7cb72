"""lrmq's GRPO loss against TRL's own (`GRPOTrainer._compute_loss`, trl 1.16) on one fixed batch of the shipped
tiny model: loss, TRL's logged metrics and the gradient, for GRPO / BNPO / DAPO / Dr.GRPO, GSPO, and the KL term
with and without TRL's bias correction. The TRL side is committed (tests/fixtures/trl_grpo_reference.json, made
by tools/trl_reference.py in a venv with trl); where trl is installed the script is also run live."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lrmq.checkpoint.hf import hf_tensors
from lrmq.checkpoint.load import load_model, resolve_checkpoint
from lrmq.rl.losses import LossBatch, LossConfig, grpo_loss
from lrmq.rl.step import completion_logprobs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(REPO, "tests", "fixtures", "trl_grpo_reference.json")
# TRL loss_type -> lrmq algo.loss_aggregation (dapo's normaliser is the batch's token count: token-mean)
AGGREGATION = {"grpo": "sequence-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
               "dr_grpo": "drgrpo-constant"}
# TRL metric -> lrmq metric
METRICS = {"clip_ratio/low_mean": "clip_ratio/low_mean", "clip_ratio/high_mean": "clip_ratio/high_mean",
           "clip_ratio/region_mean": "clip_ratio/region_mean", "kl": "kl", "entropy": "entropy"}


def direction(name: str, shape: tuple) -> np.ndarray:  # as tools/trl_reference.py
    return np.random.default_rng(zlib.crc32(name.encode())).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def reference():
    with open(REFERENCE) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def model():
    return load_model(resolve_checkpoint("tiny"), dtype="float32", param_dtype="float32")


def lrmq_loss(model, batch, case):
    b = {k: jnp.asarray(np.asarray(v)) for k, v in batch.items()}
    tokens = jnp.concatenate([b["prompt_ids"], b["completion_ids"]], 1).astype(jnp.int32)
    mask = jnp.concatenate([b["prompt_mask"], b["completion_mask"]], 1).astype(jnp.int32)
    cmask = b["completion_mask"].astype(jnp.float32)
    old = jnp.asarray(case["old_per_token_logps"], jnp.float32)
    ref = jnp.asarray(case["ref_per_token_logps"], jnp.float32) if case["beta"] else None
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params):
        m = nnx.merge(graphdef, params, rest)
        logp, ent = completion_logprobs(m, tokens, mask, b["completion_ids"].astype(jnp.int32),
                                        case["temperature"])
        s, c, metrics = grpo_loss(logp, LossBatch(b["advantages"], cmask, old_logp=old, ref_logp=ref), LossConfig(
            eps_low=case["epsilon_low"], eps_high=case["epsilon_high"], aggregation=AGGREGATION[case["loss_type"]],
            beta=case["beta"], kl_bias_correction=case["use_bias_correction_kl"],
            importance_level=case["importance_sampling_level"], max_len=cmask.shape[1]))
        metrics["entropy"] = ((ent * cmask).sum(), cmask.sum())
        return s / c, metrics

    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    grad_model = nnx.merge(graphdef, grads, rest)
    hf_grads = dict(hf_tensors(grad_model, "float32"))
    return float(loss), {k: float(s / c) for k, (s, c) in metrics.items()}, hf_grads


CASES = ["grpo", "grpo_kl", "grpo_kl_bias_corrected", "bnpo", "dapo_clip_higher", "dr_grpo", "gspo",
         "gspo_kl_bias_corrected"]


@pytest.mark.parametrize("name", CASES)
def test_loss_metrics_and_gradient_equal_trl(reference, model, name):
    case = reference["cases"][name]
    loss, metrics, grads = lrmq_loss(model, reference["batch"], case)
    # float32 noise: both sides compute the same forward in a different summation order
    assert loss == pytest.approx(case["loss"], rel=1e-4, abs=2e-6)
    for trl_name, ours in METRICS.items():
        if trl_name in case["metrics"]:
            assert metrics[ours] == pytest.approx(case["metrics"][trl_name], rel=1e-4, abs=1e-6), trl_name
    assert set(grads) == set(case["grad_norm"])
    for k, g in grads.items():
        want = case["grad_norm"][k]
        assert float(np.linalg.norm(g)) == pytest.approx(want, rel=2e-4, abs=1e-7), k
        proj = float((g.astype(np.float64) * direction(k, g.shape)).sum())
        assert proj == pytest.approx(case["grad_projection"][k], rel=2e-3, abs=2e-6 + 1e-3 * want), k
    for k, v in case["grad_small"].items():
        np.testing.assert_allclose(grads[k], np.asarray(v, np.float32), rtol=2e-3, atol=1e-7 + 1e-4 * np.abs(v).max())


def test_the_cases_differ(reference):
    """The fixture exercises what it claims: clipping happens, KL correction changes the loss, GSPO differs."""
    c = reference["cases"]
    assert c["grpo"]["metrics"]["clip_ratio/region_mean"] > 0
    assert c["grpo_kl_bias_corrected"]["loss"] != pytest.approx(c["grpo_kl"]["loss"], rel=1e-3)
    assert len({round(c[k]["loss"], 6) for k in CASES}) == len(CASES)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (pip install -e '.[bench]')")
def test_reference_is_what_trl_computes_now(tmp_path, reference):
    out = tmp_path / "ref.json"
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "trl_reference.py"), "--out", str(out)], check=True,
                   timeout=600)
    fresh = json.loads(out.read_text())
    for name in CASES:
        assert fresh["cases"][name]["loss"] == pytest.approx(reference["cases"][name]["loss"], rel=1e-5, abs=1e-7)
