"""The rollout -> update hand-off: the old-log-prob protocol (`step.old_logprob_sources`, one table of config
cases), and `UpdateBatch`, whose host layouts are exactly the abstract batches compiled ahead of time (fields,
shapes and dtypes). Host-side only: nothing here compiles."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import tiny_train_config
from lrmq.generation.engine import left_pad
from lrmq.rl.batch import UpdateBatch, build_batch, bucketed_batch, mask_rows, packed_batch, padded_batch
from lrmq.rl.precompile import abstract_update, batch_key, packed_chooser, update_shapes
from lrmq.rl.step import micro_batch_count, old_logprob_sources, rollout_quant_warning
from lrmq.sharding import make_mesh

# config -> pi_old of each update of a batch (the ratio's denominator: the sampler's behaviour_logp, the update's
# own forward, or the first update's log-probs handed over as old_logp) and the correction weighing them against
# the sampler's
PROTOCOL = [
    # (algo, rollout, sources, correction)
    ({}, {}, ("behaviour_logp",), "none"),  # the defaults: old_logprobs=rollout (Tunix)
    ({"num_iterations": 2}, {}, ("behaviour_logp", "behaviour_logp"), "none"),
    ({"old_logprobs": "recompute"}, {}, ("own",), "none"),  # TRL at mu=1: no extra forward
    ({"old_logprobs": "recompute", "num_iterations": 3}, {}, ("own", "old_logp", "old_logp"), "none"),
    ({"rollout_correction": "token_truncate"}, {}, ("own",), "token_truncate"),  # whatever old_logprobs says
    ({"rollout_correction": "geometric_mask", "num_iterations": 2}, {}, ("own", "old_logp"), "geometric_mask"),
    ({"num_iterations": 2}, {"quant": "int8"}, ("own", "old_logp"), "sequence_mask"),  # auto, quantized rollout
    ({"rollout_correction": "none", "num_iterations": 2}, {"quant": "int4"}, ("behaviour_logp",) * 2, "none"),
    ({"rollout_correction": "none", "old_logprobs": "recompute"}, {"quant": "int4"}, ("own",), "none"),
]


@pytest.mark.parametrize("algo,rollout,sources,correction", PROTOCOL)
def test_old_logprob_protocol(tmp_path, algo, rollout, sources, correction):
    cfg = tiny_train_config(str(tmp_path), algo=algo, rollout=rollout)
    assert old_logprob_sources(cfg) == sources
    assert cfg.loss_config().rollout_correction == correction
    # the only uncorrected ratio against a quantized sampler is the one the trainer warns about
    warned = rollout_quant_warning(cfg) is not None
    assert warned == (cfg.quantized_rollout and sources[0] == "behaviour_logp")


def _rollout_batch(rng, s: int, prompt_cols: int, n: int):
    """A RolloutBatch as the trainer builds it (`build_batch` from left-padded prompts and the sampler's output)."""
    prompts = [rng.integers(1, 50, rng.integers(1, prompt_cols + 1)).tolist() for _ in range(s)]
    tokens, mask = left_pad(prompts, prompt_cols, 0)
    lengths = rng.integers(0, n + 1, s)
    comp = rng.integers(1, 50, (s, n)).astype(np.int32)
    logp = -rng.random((s, n)).astype(np.float32)
    rb = build_batch(tokens, mask, comp, lengths, logp, rng.normal(size=s).astype(np.float32), np.zeros(s))
    return mask_rows(rb, rng.random(s) < 0.2)


@pytest.mark.parametrize("layout", ["pack", "bucket", "max"])
def test_host_batch_is_one_of_the_abstract_batches(tmp_path, layout):
    """The host batch of every layout has the fields, shapes and dtypes of the abstract batch compiled for its
    shape (`UpdateBatch.field_shapes`), the same pytree structure, and no old_logp (the first update's own)."""
    cfg = tiny_train_config(str(tmp_path), rollout={"update_padding": layout, "update_shapes": 5},
                            optim={"micro_batch_size": 8})
    r = cfg.rollout
    s = r.prompts_per_step * r.group_size
    mesh = make_mesh()
    shapes = update_shapes(cfg, 1)
    abstract = {batch_key(b): b for b in (abstract_update(cfg, sh, mesh)[0] for sh in shapes)}
    rng = np.random.default_rng(5)
    for _ in range(5):
        cols = r.max_prompt_len if layout == "max" else int(rng.choice([16, 32]))
        rb = _rollout_batch(rng, s, cols, r.max_new_tokens)
        if layout == "pack":
            host = packed_batch(rb, n_micro=micro_batch_count(cfg, s), choose_shape=packed_chooser(shapes),
                                width=r.max_prompt_len + r.max_new_tokens)
        else:
            host = bucketed_batch(rb) if layout == "bucket" else padded_batch(rb)
        assert host.layout == layout and host.old_logp is None
        want = abstract[batch_key(host)]
        assert jax.tree.structure(host) == jax.tree.structure(want)
        for h, a in zip(jax.tree.leaves(host), jax.tree.leaves(want)):
            assert (h.shape, h.dtype) == (a.shape, a.dtype)
        np.testing.assert_array_equal(host.behaviour_logp[:, :r.max_new_tokens].sum(),
                                      rb.behaviour_logp.sum())  # the sampler's, as the rollout gave them


def test_old_logp_is_a_field_of_its_own():
    """Handing the first update's log-probs over adds old_logp and leaves the sampler's untouched."""
    fields = UpdateBatch.field_shapes("max", sequences=4, completion=8, width=24)
    assert "old_logp" not in fields
    with_old = UpdateBatch.field_shapes("max", sequences=4, completion=8, width=24, old_logp=True)
    assert with_old["old_logp"] == with_old["behaviour_logp"]
    rb = _rollout_batch(np.random.default_rng(0), 4, 16, 8)
    batch = padded_batch(rb)
    handed = batch.replace(old_logp=np.zeros_like(batch.behaviour_logp))
    assert handed.behaviour_logp is batch.behaviour_logp
    assert dict(handed.shapes())["old_logp"] == (4, 8) and "old_logp" not in dict(batch.shapes())
    with pytest.raises(ValueError, match="update layout"):
        UpdateBatch.field_shapes("padded", sequences=4, completion=8, width=24)


def test_loss_config_is_the_loss_part_of_algo():
    """Every LossConfig field comes from the YAML's algo.* keys (and rollout.max_new_tokens) through the usual
    dotted overrides; the loss has no YAML surface of its own."""
    import dataclasses

    from lrmq.configlib import ConfigError, load_config
    from lrmq.rl.config import TrainConfig
    from lrmq.rl.losses import LossConfig

    cfg = load_config(TrainConfig, overrides=[
        "algo.policy_loss=ppo-clip", "algo.eps_low=0.1", "algo.eps_high=0.28", "algo.importance_sampling=sequence",
        "algo.loss_aggregation=token-mean", "rollout.max_new_tokens=24", "algo.beta=0.04", "algo.kl_estimator=k2",
        "algo.kl_bias_correction=true", "algo.rollout_correction=token_mask", "algo.rollout_correction_cap=2.5",
        "algo.rollout_correction_min=0.4", "algo.router_aux_coef=0.001"])
    want = LossConfig(policy_loss="ppo-clip", eps_low=0.1, eps_high=0.28, importance_level="sequence",
                      aggregation="token-mean", max_len=24, beta=0.04, kl_estimator="k2", kl_bias_correction=True,
                      rollout_correction="token_mask", rollout_correction_cap=2.5, rollout_correction_min=0.4,
                      router_aux_coef=0.001)
    assert cfg.loss_config() == want
    # each field differs from its default above, so a field left out of loss_config would show
    assert all(getattr(want, f.name) != f.default for f in dataclasses.fields(LossConfig))
    with pytest.raises(ConfigError, match="loss"):
        load_config(TrainConfig, overrides=["loss.eps_low=0.1"])


def test_update_programs_compile_what_the_updates_run_and_find_it(tmp_path, monkeypatch):
    """`UpdatePrograms.compile` compiles, per update shape, the step variants of `old_logprob_sources` and the
    reference log-probs, and `step` / `reference` hand back those programs for the trainer's host batches (a
    variant the config never runs is not compiled: asked for, it is the jitted one, recorded as missed).
    `lower_compile` is stubbed: this checks the bookkeeping, not XLA."""
    import lrmq.rl.precompile as precompile
    from lrmq.rl.precompile import UpdatePrograms
    from lrmq.rl.step import make_optimizer

    compiled = []

    def fake_lower_compile(fn, *args, mesh):
        compiled.append((fn, args[3] if len(args) == 5 else args[2]))
        return ("compiled", len(compiled) - 1), 0.0

    monkeypatch.setattr(precompile, "lower_compile", fake_lower_compile)
    monkeypatch.setattr(precompile, "memory_report", lambda c: {"total": c[1]})
    cfg = tiny_train_config(str(tmp_path), rollout={"update_shapes": 3},
                            algo={"beta": 0.04, "old_logprobs": "recompute", "num_iterations": 2})
    programs = UpdatePrograms(None, cfg, make_optimizer(cfg)[0], None, make_mesh())
    mem = programs.compile(None, None, None, None)
    assert [fn for fn, _ in compiled] == [programs.steps["own"], programs.steps["old_logp"]] * 3 + [
        programs.reference_fn] * 3
    assert mem == {"train_step": 0, "reference_logprobs": 6}  # the first (largest) shape of each
    r = cfg.rollout
    s = r.prompts_per_step * r.group_size
    rng = np.random.default_rng(2)
    for _ in range(3):
        host = packed_batch(_rollout_batch(rng, s, 32, r.max_new_tokens), choose_shape=packed_chooser(programs.shapes),
                            width=r.max_prompt_len + r.max_new_tokens)
        ref = np.zeros((s, r.max_new_tokens), np.float32)
        first = programs.step("own", host, ref)
        later = programs.step("old_logp", host.replace(old_logp=host.behaviour_logp), ref)
        assert first[0] == later[0] == programs.reference(host)[0] == "compiled"
        assert compiled[first[1]][1].old_logp is None and compiled[later[1]][1].old_logp is not None
        assert batch_key(compiled[later[1]][1]) == batch_key(host.replace(old_logp=host.behaviour_logp))
    assert not programs.missed
    assert programs.step("behaviour_logp", host, ref) is programs.steps["behaviour_logp"] and programs.missed
