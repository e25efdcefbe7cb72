"""The Sampler / Learner split (lrmq.rl.sampler, lrmq.rl.learner) and the loop between them (lrmq.rl.loop,
lrmq.rl.trainer): the default (colocated, max_staleness 0) reproduces the synchronous trainer it replaced; the
schedule, the stream and its thread are host logic, tested with fakes and no model."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from sync_golden import GOLDEN, fingerprint, golden_config


def test_the_default_loop_reproduces_the_synchronous_trainer(tmp_path):
    """2 steps of the tiny model, colocated and on-policy: the same completions (texts, rewards, advantages, token
    counts: a sha256) and the same train/* and reward/* metrics as GRPOTrainer at 6576fb1, before the split
    (tests/data/sync_golden.json). The floats were bit-identical where the golden was recorded (one process, 2
    cores); under the suite's workers (one core each) XLA's CPU reductions split differently, so they are compared
    to 1e-5 relative there: the tokens, which any change of the protocol would move, exactly."""
    from lrmq.rl.trainer import GRPOTrainer

    GRPOTrainer(golden_config(str(tmp_path))).train()
    with open(GOLDEN) as f:
        golden = json.load(f)
    got = fingerprint(str(tmp_path))
    assert got.keys() == golden.keys()
    for step, want in golden.items():
        assert got[step]["completions_sha256"] == want["completions_sha256"], step
        assert got[step]["metrics"].keys() == want["metrics"].keys(), step
        for k, v in want["metrics"].items():
            assert got[step]["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (step, k)


# ------------------------------------------------------------------ the schedule and the stream, with fakes
def _fake_rollout(index, version, sequences=4):
    from lrmq.rl.batch import RolloutBatch
    from lrmq.rl.messages import Rollout

    z = np.zeros((sequences, 3), np.float32)
    rb = RolloutBatch(np.zeros((sequences, 5), np.int32), np.ones((sequences, 5), np.int32),
                      np.zeros((sequences, 3), np.int32), z, z + index, np.arange(sequences, dtype=np.float32),
                      np.zeros(sequences, np.float32))
    return Rollout(rb, {"reward/mean": float(index)}, [{"completion": f"c{index}"}], False, index=index,
                   version=version, prompts={"problem": [f"p{index}"], "answer": ["1"]})


def _version(v):
    from lrmq.rl.messages import WeightVersion

    return WeightVersion(states=None, version=v)


@pytest.mark.parametrize("k,every,expected", [
    (0, 1, [0, 1, 2, 3, 4, 5]),
    (1, 1, [0, 0, 1, 2, 3, 4]),
    (2, 1, [0, 0, 0, 1, 2, 3]),
    (2, 2, [0, 0, 0, 2, 2, 4]),  # published every 2 updates: the smallest published version within k
    (3, 2, [0, 0, 0, 0, 2, 2]),
])
def test_the_schedule_bounds_the_lag(k, every, expected):
    from lrmq.rl.loop import Schedule

    s = Schedule(k, every)
    assert [s.version_for(i) for i in range(6)] == expected
    assert all(0 <= i - v <= k and s.publishes(v) for i, v in enumerate(expected))


def test_min_ess_sends_the_next_batch_on_policy():
    from lrmq.rl.loop import Schedule

    s = Schedule(2, 1, min_ess=0.5)
    assert s.version_for(5, {3: 0.9}) == 3
    assert s.version_for(5, {3: 0.2}) == 5  # update 3's weights were far from the sampler's: wait for version 5


def _drive(k, steps, *, threaded, pending=(), start=0, save_at=(), delay=0.0):
    """The trainer's loop with fakes: take batch j, 'update' (the version advances), publish, save = drain."""
    from lrmq.rl.loop import RolloutStream, Schedule

    produced, saved = [], {}

    def produce(index, version):
        time.sleep(delay)
        produced.append((index, version.version, threading.current_thread().name))
        return _fake_rollout(index, version.version)

    s = Schedule(k)
    stream = RolloutStream(produce, s, start=start, end=steps, threaded=threaded, pending=list(pending), floor=start)
    stream.publish(_version(start))
    taken = []
    try:
        for j in range(start, steps):
            ro = stream.take(j)
            taken.append((ro.index, ro.version))
            if j + 1 in save_at:
                saved[j + 1] = [(r.index, r.version) for r in stream.drain()]
            if j + 1 < steps:
                stream.publish(_version(j + 1))
    finally:
        stream.close()
    return taken, produced, saved


@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_stream_gives_each_batch_its_scheduled_version_inline_or_threaded(k):
    """Threaded (the sampler running ahead) and inline give the same (index, version) sequence, the schedule's;
    the thread really produces them; a checkpoint after update j holds the batches whose versions are out."""
    from lrmq.rl.loop import Schedule

    inline, _, saved_inline = _drive(k, 8, threaded=False, save_at={3, 5})
    threaded, produced, saved = _drive(k, 8, threaded=True, save_at={3, 5}, delay=0.01)
    s = Schedule(k)
    assert inline == threaded == [(i, s.version_for(i)) for i in range(8)]
    assert {name for *_, name in produced} == {"lrmq-sampler"}
    # after update j (version j not published yet): batches j .. j - 1 + k, sampled from versions <= j - 1
    assert saved == saved_inline == {j: [(i, s.version_for(i)) for i in range(j, j + k)] for j in (3, 5)}


def test_a_resumed_stream_continues_as_the_uninterrupted_one():
    """Resume at step 3 of a k=2 run with the pending rollouts its checkpoint saved: the same (index, version)s."""
    whole, _, saved = _drive(2, 8, threaded=True, save_at={3})
    pending = [_fake_rollout(i, v) for i, v in saved[3]]
    resumed, produced, _ = _drive(2, 8, threaded=True, pending=pending, start=3)
    assert resumed == whole[3:]
    assert [i for i, *_ in produced] == [5, 6, 7]  # 3 and 4 came from the checkpoint


def test_a_failing_sampler_thread_fails_the_loop_with_its_traceback():
    from lrmq.rl.loop import RolloutStream, Schedule, StreamError

    def produce(index, version):
        if index == 1:
            raise ValueError("reward server gone")
        return _fake_rollout(index, version.version)

    stream = RolloutStream(produce, Schedule(1), start=0, end=4, threaded=True)
    stream.publish(_version(0))
    try:
        assert stream.take(0).index == 0
        with pytest.raises(StreamError, match="(?s)sampler thread failed.*ValueError: reward server gone"):
            stream.take(1)
    finally:
        stream.close()


def test_a_batch_from_a_version_never_published_is_an_error_not_a_hang():
    from lrmq.rl.loop import RolloutStream, Schedule, StreamError

    stream = RolloutStream(lambda i, v: _fake_rollout(i, v.version), Schedule(0), start=0, end=3, threaded=True)
    stream.publish(_version(0))
    try:
        stream.take(0)
        with pytest.raises(StreamError, match="batch 1 is scheduled from version 1, never published"):
            stream.take(1)  # the learner forgot to publish version 1
    finally:
        stream.close()


def test_pending_rollouts_round_trip_through_checkpoint_metadata():
    from lrmq.rl.pending import pending_from_meta, pending_to_meta

    ro = [_fake_rollout(3, 1), _fake_rollout(4, 2)]
    back = pending_from_meta(json.loads(json.dumps(pending_to_meta(ro))))
    for a, b in zip(ro, back):
        assert (a.index, a.version, a.stats, a.completions, a.prompts, a.reward_failed) == \
               (b.index, b.version, b.stats, b.completions, b.prompts, b.reward_failed)
        for f in ("tokens", "behaviour_logp", "advantages", "completion_mask"):
            np.testing.assert_array_equal(getattr(a.batch, f), getattr(b.batch, f))


# ------------------------------------------------------------------ each role without the other two
@pytest.fixture(scope="module")
def roles(tmp_path_factory):
    """A Learner and a Sampler of the tiny model, made separately (no trainer, no loop)."""
    import jax
    from conftest import tiny_train_config

    from lrmq.checkpoint.load import load_model
    from lrmq.rl.learner import Learner
    from lrmq.rl.sampler import Sampler
    from lrmq.sharding import make_mesh
    from lrmq.tokenizer import Tokenizer

    cfg = tiny_train_config(str(tmp_path_factory.mktemp("roles")), rollout={"max_new_tokens": 12})
    mesh = make_mesh(None)
    with jax.set_mesh(mesh):
        model = load_model(cfg.model.checkpoint, mesh=mesh)
    learner = Learner(cfg, model, mesh)
    sampler = Sampler(cfg, Tokenizer.from_dir(cfg.model.checkpoint), policy_graphdef=learner.graphdef,
                      rollout_graphdef=learner.graphdef, model_cfg=model.cfg, mesh=mesh,
                      engine=cfg.rollout.engine_config())
    return cfg, learner, sampler


def test_the_sampler_alone_stamps_its_rollouts_with_the_version(roles):
    """A WeightVersion made by hand (the tiny model's weights, called version 7): the rollout carries that
    version, its data index and its prompts; group-relative advantages sum to zero per group."""
    import jax

    from lrmq.rl.messages import WeightVersion, tree_bytes

    cfg, learner, sampler = roles
    states = jax.tree.map(lambda x: x, learner.states())
    version = WeightVersion(states, version=7, nbytes=tree_bytes(states))
    batch = {"problem": ["1 + 2", "3 + 4", "5 + 6", "7 + 8"], "answer": ["3", "7", "11", "15"]}
    ro = sampler.rollout(batch, jax.random.key(0), 5, version, {"rollout/sync_s": 0.25})
    g = cfg.rollout.group_size
    assert (ro.index, ro.version, ro.prompts["problem"]) == (5, 7, batch["problem"])
    assert ro.batch.num_sequences == 4 * g and len(ro.completions) == 4 * g
    assert ro.stats["rollout/weight_bytes"] == version.nbytes and ro.stats["rollout/sync_s"] == 0.25
    np.testing.assert_allclose(ro.batch.advantages.reshape(4, g).sum(1), 0, atol=1e-5)


def test_the_learner_alone_updates_and_publishes_fresh_buffers(roles):
    """A hand-made rollout batch: the update advances the version; a published copy does not alias the learner's
    buffers, so it stays readable after the next update donates them (a sampler thread may be reading it)."""
    from lrmq.rl.batch import build_batch

    cfg, learner, _ = roles
    rng = np.random.default_rng(0)
    s, p, n = 16, 8, 12
    rb = build_batch(rng.integers(5, 200, (s, p)).astype(np.int32), np.ones((s, p), np.int32),
                     rng.integers(5, 200, (s, n)).astype(np.int32), rng.integers(1, n + 1, s),
                     -rng.uniform(0.5, 3, (s, n)).astype(np.float32), rng.normal(0, 1, s).astype(np.float32),
                     np.zeros(s, np.float32))
    version, stats = learner.publish(copy=True)
    before = [np.asarray(x) for x in jax_leaves(version.states)]
    v0 = learner.version
    m = learner.update(rb)
    assert learner.version == v0 + 1 and np.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
    after = [np.asarray(x) for x in jax_leaves(version.states)]  # readable: not the donated buffers
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    moved = [not np.array_equal(np.asarray(a), b) for a, b in zip(jax_leaves(learner.states()), before)]
    assert any(moved) and stats["rollout/sync_bytes"] == version.nbytes > 0


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_compile_only_puts_each_role_on_its_own_chips(monkeypatch, tmp_path):
    """`--compile-only` with rollout.placement=split (aot.check_fit on a v5e:2x4 topology, libtpu's devices): the
    update is compiled on a mesh of the learner's shape (4 chips: data=1 x fsdp=4 here), the rollout's prefill and
    decode on one of the sampler's (4 chips: mesh.rollout_fsdp=0 splits the tiny model's 2 KV heads 2 ways, data=2;
    with fp8 pages on TPU 1 way, data=4), each for a slice of its own size (libtpu refuses a program over a topology's
    later chips), and the KV pool is sized for the sampler's chips less only the sampler's weights. The
    compiles themselves are replaced by a recorder (what they would compile on is the point; the compilers are
    tested in test_aot.py)."""
    from conftest import tiny_train_config

    from lrmq import aot
    from lrmq.rl.placement import placement_meshes

    seen = {}

    class Compiled:
        def memory_analysis(self):
            return None

        def cost_analysis(self):
            return {"flops": 1.0, "bytes accessed": 1.0}

        def as_text(self):  # no collectives (aot.program_collectives reads the compiled HLO text)
            return ""

    def fake(name):
        def compile_fn(run, *a, **k):
            seen.setdefault(name, []).append(dict(run.mesh.shape))
            return Compiled(), 0.0
        return compile_fn

    monkeypatch.setattr(aot, "compile_train_step", fake("update"))
    monkeypatch.setattr(aot, "compile_rollout", fake("rollout"))
    monkeypatch.setattr(aot, "memory_report", lambda c: {k: 1 for k in ("arguments", "temporaries", "outputs",
                                                                          "aliased", "total")})
    cfg = tiny_train_config(str(tmp_path), rollout={"placement": "split", "update_shapes": 1},
                            mesh={"data": 1, "fsdp": 4})
    report = aot.check_fit(cfg, aot.topology_devices("v5e:2x4"), log=lambda m: None)
    assert seen["update"] == [{"data": 1, "fsdp": 4, "tensor": 1}]
    assert seen["rollout"] == [{"data": 2, "fsdp": 2, "tensor": 1}] * 2  # prefill, decode
    fp8 = tiny_train_config(str(tmp_path), rollout={"placement": "split", "kv_cache": "fp8_e4m3"})
    assert dict(placement_meshes(fp8, aot.topology_devices("v5e:2x4"))[1].shape) == {"data": 4, "fsdp": 1, "tensor": 1}
    assert report.placement["learner_chips"] == report.placement["sampler_chips"] == 4
    assert report.pool["sized"] == "worst case" and report.estimate is not None
    assert report.estimate["step_s"] == max(report.estimate["rollout_s"], report.estimate["update_s"])


def test_split_devices_shares_one_cpu_device_and_never_an_accelerator():
    """rollout.placement=split: each process's devices divided by mesh.rollout_fraction; a process with one CPU
    device (a laptop's run of the issue's command) gives it to both roles; one accelerator per process is refused
    with the key to change."""
    from types import SimpleNamespace

    from lrmq.configlib import ConfigError
    from lrmq.rl.placement import split_devices

    dev = lambda i, proc=0, platform="cpu": SimpleNamespace(id=i, process_index=proc, platform=platform)  # noqa: E731
    four = [dev(3), dev(1), dev(0), dev(2)]
    sampler, learner = split_devices(four, 0.25)
    assert [d.id for d in sampler] == [0] and [d.id for d in learner] == [1, 2, 3]
    one = [dev(0)]
    assert split_devices(one, 0.5) == (one, one)
    with pytest.raises(ConfigError, match="rollout_fraction=0.5 of process 1's 1 local device"):
        split_devices([dev(0, 0, "tpu"), dev(1, 0, "tpu"), dev(2, 1, "tpu")], 0.5)
