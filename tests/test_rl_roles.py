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
