"""RL on mixture-of-experts models (docs/moe.md, "RL on MoE"): the load-balancing loss (algo.router_aux_coef) against
transformers', the moe/* metrics of the update, and the refusal of MoE options on a dense model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from conftest import tiny_train_config
from lrmq.checkpoint.load import load_model
from lrmq.configlib import ConfigError
from lrmq.model.decoder import positions_from_mask
from lrmq.model.moe import UNRECORDED, load_balancing_loss
from lrmq.rl.losses import LossBatch, LossConfig, grpo_loss


def _padded_batch(vocab: int, s: int = 4, p: int = 6, n: int = 5, seed: int = 0):
    """Tokens [S, P + N] with left-padded prompts and completions of unequal lengths, and their mask."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, (s, p + n)).astype(np.int32)
    mask = np.ones_like(tokens)
    for i in range(s):
        mask[i, :i] = 0  # left padding
        mask[i, p + n - i:] = 0  # completion ends
    return tokens * mask, mask


@nnx.jit(static_argnums=3)
def _routing(model, tokens, positions, scan: bool):
    return model.hidden(tokens, positions, scan=scan)[1]


def test_load_balancing_loss_is_transformers(hf_checkpoint):
    path, hf_model = hf_checkpoint("qwen3_moe")  # layers 0 and 2 sparse, 1 dense
    model = load_model(path, dtype="float32", param_dtype="float32")
    tokens, mask = _padded_batch(model.cfg.vocab_size)
    with torch.no_grad():
        out = hf_model(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask),
                       output_router_logits=True)
    positions = positions_from_mask(jnp.asarray(mask))
    routing = _routing(model, jnp.asarray(tokens), positions, False)
    assert routing.load.shape == (2, 4) and routing.experts.shape == (2,) + tokens.shape + (2,)
    np.testing.assert_allclose(np.asarray(routing.load).sum(-1), 2 * mask.sum())  # k slots per real token
    np.testing.assert_allclose(float(load_balancing_loss(routing)), float(out.aux_loss), rtol=1e-5)
    # the scanned forward returns the same routing
    scanned = _routing(model, jnp.asarray(tokens), positions, True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), scanned, routing)
    # no routing from a dense model
    dense = load_model(hf_checkpoint("qwen3")[0], dtype="float32", param_dtype="float32")
    assert _routing(dense, jnp.asarray(tokens), positions, False) is None


def test_router_aux_term_is_added_per_aggregation_unit():
    rng = np.random.default_rng(1)
    logp = jnp.asarray(rng.normal(-2, 0.3, (3, 4)), jnp.float32)
    batch = LossBatch(jnp.asarray([1.0, -1.0, 0.5]), jnp.asarray([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], jnp.float32))
    base, count, _ = grpo_loss(logp, batch, LossConfig())
    with_aux, count2, metrics = grpo_loss(logp, batch, LossConfig(router_aux_coef=0.25), router_aux=jnp.float32(2.2))
    assert count == count2 == 3.0
    np.testing.assert_allclose(float(with_aux - base), 0.25 * 2.2 * 3.0, rtol=1e-6)
    np.testing.assert_allclose(metrics["moe/aux_loss"][0] / metrics["moe/aux_loss"][1], 2.2, rtol=1e-6)
    with pytest.raises(ValueError, match="router_aux"):
        grpo_loss(logp, batch, LossConfig(router_aux_coef=0.25))


def test_update_logs_expert_load_and_adds_the_aux_loss(tmp_path, hf_checkpoint):
    from lrmq.rl.batch import RolloutBatch, padded_batch
    from lrmq.rl.step import batch_logprobs, make_optimizer, make_train_step

    path, _ = hf_checkpoint("qwen3_moe")
    coef = 0.5
    cfg = tiny_train_config(str(tmp_path), model={"checkpoint": path}, algo={"router_aux_coef": coef},
                            rollout={"prompts_per_step": 2, "group_size": 2, "max_prompt_len": 6,
                                     "max_new_tokens": 5, "update_padding": "max"})
    model = load_model(path, dtype="float32", param_dtype="float32")
    cfg.check_model(model.cfg)  # a MoE model takes algo.router_aux_coef
    tokens, mask = _padded_batch(model.cfg.vocab_size)
    cmask = mask[:, 6:].astype(np.float32)
    rb = RolloutBatch(tokens=tokens, mask=mask, completion=tokens[:, 6:], completion_mask=cmask,
                      behaviour_logp=-2.0 * cmask, advantages=np.array([1.0, -1.0, 0.5, -0.5], np.float32),
                      rewards=np.zeros(4, np.float32))
    batch = jax.tree.map(jnp.asarray, padded_batch(rb))
    routing = _routing(model, batch.tokens, positions_from_mask(batch.mask), False)
    # the sampler's record (a MoE rollout records it with or without replay): the learner's own routing, but row 0's
    # tokens in the first sparse layer ran the two experts the learner leaves out, padding unrecorded
    record = np.moveaxis(np.asarray(routing.experts), 0, 2).astype(np.uint8)  # [S, T, L, k]
    record[0, :, 0] = [np.setdiff1d(np.arange(4), e) for e in record[0, :, 0]]
    record[mask == 0] = UNRECORDED
    want_route = 2 * mask[0].sum() / (2 * 2 * mask.sum())  # k slots differ on row 0's real tokens, of L x k per token
    batch = batch.replace(experts=jnp.asarray(record))  # routing_replay off: compared, not replayed
    graphdef, trainable, rest = nnx.split(model, nnx.Param, ...)
    tx, _ = make_optimizer(cfg)
    step = make_train_step(graphdef, cfg, tx)
    _, _, out = step(jax.tree.map(jnp.copy, trainable), rest, tx.init(trainable), batch, None)
    np.testing.assert_allclose(float(out["moe/route_mismatch"]), want_route, rtol=1e-6)
    load = np.asarray(routing.load)
    expected_max = 4 * (load / load.sum(-1, keepdims=True)).max()  # E x the largest share of a layer's slots
    assert 1.0 < expected_max <= 2.0  # E / k at most
    np.testing.assert_allclose(float(out["moe/expert_load_max"]), expected_max, rtol=1e-6)
    aux = float(load_balancing_loss(routing))
    np.testing.assert_allclose(float(out["moe/aux_loss"]), aux, rtol=1e-5)
    # the loss is the policy loss (behaviour log-probs as pi_old, one micro-batch) + coef x aux
    logp = nnx.jit(lambda m, b: batch_logprobs(m, b, 1.0)[0])(model, batch.replace(experts=None))
    loss_sum, count, _ = grpo_loss(logp, LossBatch(batch.advantages, batch.completion_mask,
                                                   old_logp=batch.behaviour_logp), LossConfig())
    np.testing.assert_allclose(float(out["loss"]), float(loss_sum / count) + coef * aux, rtol=1e-5, atol=1e-6)


def test_moe_options_are_refused_for_a_dense_model(tmp_path, hf_checkpoint):
    cfg = tiny_train_config(str(tmp_path), algo={"router_aux_coef": 0.001})
    dense = load_model(hf_checkpoint("qwen3")[0], dtype="float32", param_dtype="float32")
    with pytest.raises(ConfigError, match=r"^algo.router_aux_coef=0.001: .* dense model"):
        cfg.check_model(dense.cfg)
    tiny_train_config(str(tmp_path)).check_model(dense.cfg)  # the defaults pass


# ----------------------------------------------------------------------------- routing replay


def _moe_rollout(model, *, seed: int = 0):
    """A rollout of the tiny MoE through the paged engine recording experts (one slot: one compile per program; the
    sequences decode in turn, the shared prompt prefilled again): the RolloutBatch with `experts`."""
    from lrmq.generation.engine import Engine, EngineConfig, left_pad
    from lrmq.generation.sampling import SamplingConfig
    from lrmq.rl.batch import build_batch, replay_experts

    rng = np.random.default_rng(seed)
    vocab = model.cfg.vocab_size
    prompts = [rng.integers(1, vocab, n).tolist() for n in (5, 9, 1)]
    prompts.append(prompts[1])  # the same prompt twice
    engine = Engine(model, eos_ids=[vocab - 1], pad_id=0,
                    config=EngineConfig(slots=1, page_size=4, sync_steps=4, record_experts=True))
    out = engine.generate(model, prompts, max_new_tokens=7, sampling=SamplingConfig(temperature=1.0), seed=seed)
    tokens, mask = left_pad(prompts, 12, 0)
    s = len(prompts)
    rb = build_batch(tokens, mask, out.tokens, out.lengths, out.logprobs, np.linspace(-1, 1, s).astype(np.float32),
                     np.zeros(s, np.float32))
    return rb.__class__(**{**rb.__dict__, "experts": replay_experts(mask, out.lengths, out.tokens.shape[1],
                                                                     out.experts)})


def _loud_moe(path):
    """The tiny random MoE with its experts' outputs scaled up (x40), so that the experts a token runs move its
    log-probs visibly (at init they barely touch the residual stream)."""
    model = load_model(path, dtype="float32", param_dtype="float32")
    for i in model.cfg.moe_layers:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            kernel = getattr(model.layers[i].mlp.experts, proj).kernel
            kernel.set_value(LOUD * kernel.get_value())
    return model


LOUD = 10.0


def test_replayed_update_scores_what_the_sampler_sampled(hf_checkpoint):
    from lrmq.model.moe import UNRECORDED
    from lrmq.rl.batch import packed_batch, padded_batch
    from lrmq.rl.losses import rollout_mismatch_metrics
    from lrmq.rl.step import batch_logprobs, route_mismatch

    model = _loud_moe(hf_checkpoint("qwen3_moe")[0])
    rb = _moe_rollout(model)
    assert rb.experts.dtype == np.uint8 and rb.experts.shape == rb.tokens.shape + (2, 2)
    recorded = rb.experts[..., 0, 0] != UNRECORDED
    # every real token but each completion's last was recorded
    last = rb.tokens.shape[1] - rb.completion.shape[1] + rb.completion_mask.sum(1).astype(int) - 1
    expect = rb.mask.astype(bool).copy()
    expect[np.arange(len(last)), last] = False
    np.testing.assert_array_equal(recorded, expect)
    @nnx.jit
    def score(m, b):  # the update's log-probs of the sampled tokens, and the experts its forward ran
        logp, _, routing = batch_logprobs(m, b, 1.0)
        return logp, routing.experts

    # the full forward (no cache) routes the recorded tokens as the paged engine did
    plain = jax.tree.map(jnp.asarray, padded_batch(rb)).replace(experts=None)
    own = np.moveaxis(np.asarray(score(model, plain)[1]), 0, 2)
    np.testing.assert_array_equal(own[recorded], rb.experts[recorded])

    cmask = jnp.asarray(rb.completion_mask)
    batch = jax.tree.map(jnp.asarray, padded_batch(rb))
    for layout in (batch, jax.tree.map(jnp.asarray, packed_batch(rb))):  # equal weights: the sampler's log-probs
        logp = score(model, layout)[0]
        np.testing.assert_allclose(np.asarray(logp * cmask), rb.behaviour_logp, atol=2e-5, err_msg=layout.layout)

    # a sampler whose routing differs from the learner's (as a sampler's numerics flip near-ties): its records of
    # the completion tokens in the first sparse layer name the two experts the learner's top-2 leaves out, and its
    # log-probs are the ones that routing gives. The learner (equal weights) routing by itself shows the mismatch
    # (mismatch/*); replaying the sampler's record removes it.
    flipped = rb.experts.copy()
    completion = np.zeros_like(recorded)
    completion[:, rb.tokens.shape[1] - rb.completion.shape[1]:] = True
    at = recorded & completion
    first = flipped[at, 0]
    flipped[at, 0] = np.stack([np.setdiff1d(np.arange(4), e) for e in first])
    sampler_batch = batch.replace(experts=jnp.asarray(flipped))
    sampler_logp = score(model, sampler_batch)[0] * cmask
    diff = {}
    for name, b in (("routed", plain), ("replayed", sampler_batch)):
        logp, ran = score(model, b)
        metrics = rollout_mismatch_metrics(logp, sampler_logp, cmask)
        metrics["moe/route_mismatch"] = route_mismatch(ran, jnp.asarray(flipped))
        diff[name] = {k: float(v[0] / v[1]) for k, v in metrics.items()}
    assert diff["routed"]["mismatch/logp_diff"] > 1e-2, diff
    assert diff["replayed"]["mismatch/logp_diff"] < 1e-6 and abs(diff["replayed"]["mismatch/kl_k3"]) < 1e-9, diff
    # moe/route_mismatch: both slots of every flipped token-layer differ from what the learner ran by itself, of
    # the recorded tokens' 2 layers x 2 slots; none when it replays the record
    np.testing.assert_allclose(diff["routed"]["moe/route_mismatch"], at.sum() / (2 * recorded.sum()), rtol=1e-6)
    assert diff["replayed"]["moe/route_mismatch"] == 0.0


def test_compile_only_batch_carries_the_replayed_experts(tmp_path):
    """`--compile-only` lowers the update on the batch the trainer passes: a mixture-of-experts run's carries the
    sampler's recorded experts [S, P+N, sparse layers, k] uint8 (`precompile.replay_shape`), as the Learner's programs
    take them (replayed with rollout.routing_replay, else read by moe/route_mismatch); a dense model's none (no
    compile: the abstract batch only)."""
    from lrmq import aot
    from lrmq.checkpoint.load import TINY_MODEL_DIR, TINY_MOE_DIR, read_model_config

    mcfg = read_model_config(TINY_MOE_DIR)
    mesh = aot.make_mesh(aot.MeshConfig(1, 1, 1))
    for replay in (True, False):
        cfg = tiny_train_config(str(tmp_path), model={"checkpoint": "tiny-moe"}, rollout={"routing_replay": replay})
        batch = aot.abstract_batch(cfg, mesh, model_cfg=mcfg)
        assert batch.experts is not None and batch.experts.dtype == jnp.uint8
        assert batch.experts.shape[-2:] == (len(mcfg.moe_layers), mcfg.num_experts_per_tok) == (2, 2)
    dense = tiny_train_config(str(tmp_path))
    assert aot.abstract_batch(dense, mesh, model_cfg=read_model_config(TINY_MODEL_DIR)).experts is None


def test_compile_only_rollout_records_the_experts_as_the_trainer_does(tmp_path, monkeypatch):
    """The rollout programs `--compile-only` lowers are the trainer's: a mixture-of-experts policy's engine records
    each token's experts even without routing replay (moe/route_mismatch reads them), a dense policy's does not."""
    from lrmq import aot
    from lrmq.checkpoint.load import TINY_MODEL_DIR, TINY_MOE_DIR, read_model_config

    seen = []
    monkeypatch.setattr(aot, "compile_generate", lambda *a, engine, **k: seen.append(engine))
    for ckpt, mdir in (("tiny-moe", TINY_MOE_DIR), ("tiny", TINY_MODEL_DIR)):
        cfg = tiny_train_config(str(tmp_path), model={"checkpoint": ckpt}, rollout={"routing_replay": False})
        aot._rollout_programs(cfg, None, None, None, read_model_config(mdir))
    assert [e.record_experts for e in seen] == [True, False]
