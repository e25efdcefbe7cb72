"""Host logic between the Sampler and the Learner: which policy version each rollout is sampled from (`Schedule`),
and the stream of rollouts in data order, produced inline or by a thread running ahead (`RolloutStream`). Nothing
here touches a model: tests drive it with fakes (tests/test_rl_roles.py), as tests/test_scheduler.py drives the
generation scheduler.

The schedule is deterministic, so a run, and a resumed run, sample the same tokens whatever the timing:

* batch i (0-based; step i + 1 trains on it) is sampled from version v(i) = the smallest multiple of
  rollout.sync_every >= max(0, i - k), k = rollout.max_staleness (the learner publishes a version after every
  sync_every updates); its lag at its update, i - v(i), is at most k. k = 0 is today's synchronous loop.
* rollout.min_ess: when the effective sample size of update v(i)'s importance weights fell below it, batch i waits
  for the newest version it can have (on-policy) instead.
* a checkpoint after update j (before version j is published) first lets the stream produce every batch whose
  version is out already; those pending rollouts are saved with it, so the resumed run continues where the
  uninterrupted one would.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass
from typing import Callable

from lrmq.rl.messages import Rollout, WeightVersion


@dataclass(frozen=True)
class Schedule:
    max_staleness: int = 0
    sync_every: int = 1
    min_ess: float = 0.0

    def publishes(self, version: int) -> bool:
        """Whether the learner sends version `version` (updates done) to the sampler."""
        return version % self.sync_every == 0

    def base_version(self, index: int) -> int:
        """v(i): the smallest published version >= max(0, i - k)."""
        v = max(0, index - self.max_staleness)
        return -(-v // self.sync_every) * self.sync_every

    def version_for(self, index: int, ess: dict[int, float] | None = None) -> int:
        """The version batch `index` is sampled from: v(i), or the newest published one <= i when min_ess is set and
        update v(i)'s effective sample size (`ess`: by version) fell below it."""
        v = self.base_version(index)
        if self.min_ess and ess is not None and ess.get(v, 1.0) < self.min_ess:
            return index - index % self.sync_every
        return v

    def lag(self, rollout: Rollout) -> int:
        return rollout.index - rollout.version

    def stale(self, rollout: Rollout) -> bool:
        return self.lag(rollout) > self.max_staleness


class StreamError(RuntimeError):
    """The producer thread failed; the message holds its traceback."""


class RolloutStream:
    """Rollouts of batches start..end-1 in order. `produce(index, version) -> Rollout` samples one (the sampler's
    work: the data batch, the generation, the reward); `threaded`: a thread produces them as soon as their versions
    are published (running ahead by up to max_staleness versions), else `take` produces them inline. `pending`:
    rollouts restored from a checkpoint, taken before anything is produced; `floor`: the oldest version there is
    (a resumed learner's): a batch scheduled from an older one takes it instead."""

    def __init__(self, produce: Callable[[int, WeightVersion], Rollout], schedule: Schedule, *, start: int, end: int,
                 threaded: bool, pending: list[Rollout] = (), floor: int = 0):
        self.produce, self.schedule, self.end, self.floor = produce, schedule, end, floor
        self.ready: dict[int, Rollout] = {r.index: r for r in pending}
        self.next = self._after(start - 1)  # the next index to produce (pending ones are skipped)
        self.versions: dict[int, WeightVersion] = {}
        self.ess: dict[int, float] = {}
        self.cond = threading.Condition()
        self.error: str | None = None
        self.closed = False
        self.idle = False  # the thread waits for a version not published yet (or has produced everything)
        self.thread = threading.Thread(target=self._run, name="lrmq-sampler", daemon=True) if threaded else None
        if self.thread is not None:
            self.thread.start()

    # ------------------------------------------------------------------ learner side
    def publish(self, version: WeightVersion) -> None:
        with self.cond:
            self.versions[version.version] = version
            self.idle = False
            self.cond.notify_all()

    def record_ess(self, version: int, ess: float) -> None:
        with self.cond:
            self.ess[version] = ess

    def take(self, index: int) -> Rollout:
        """Batch `index`'s rollout (waiting for the thread, or produced now)."""
        if self.thread is None and index not in self.ready:
            self._produce_next()
        with self.cond:
            while index not in self.ready:
                self._raise_if_failed()
                if self.idle and self.next <= index:  # it waits for a version the learner has not published
                    raise StreamError(f"batch {index} is scheduled from version {self._version_of(self.next)}, "
                                      f"never published before it is needed (published: {sorted(self.versions)})")
                self.cond.wait(0.5)
            return self.ready.pop(index)

    def drain(self) -> list[Rollout]:
        """Wait until every batch whose version is published has been produced; the rollouts not taken yet, in
        order (a checkpoint saves them)."""
        if self.thread is None:
            while self.next < self.end and self._version_of(self.next) in self.versions:
                self._produce_next()
        with self.cond:
            while self.thread is not None and not self.idle:
                self._raise_if_failed()
                self.cond.wait(0.5)
            self._raise_if_failed()
            return [self.ready[i] for i in sorted(self.ready)]

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=60)

    # ------------------------------------------------------------------ producer side
    def _after(self, index: int) -> int:
        i = index + 1
        while i in self.ready:
            i += 1
        return i

    def _version_of(self, index: int) -> int:
        return max(self.schedule.version_for(index, self.ess), self.floor)

    def _produce_next(self) -> None:
        i = self.next
        v = self._version_of(i)
        if v not in self.versions:
            raise RuntimeError(f"batch {i} is scheduled from version {v}, which was not published "
                               f"(published: {sorted(self.versions)})")
        ro = self.produce(i, self.versions[v])
        with self.cond:
            self.ready[i] = ro
            self.next = self._after(i)
            for old in [k for k in self.versions if k < v]:  # no later batch is scheduled from an older version
                del self.versions[old]
            self.cond.notify_all()

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.closed and (self.next >= self.end or self._version_of(self.next) not in self.versions):
                        self.idle = True
                        self.cond.notify_all()
                        self.cond.wait()
                    if self.closed:
                        return
                    self.idle = False
                self._produce_next()
        except BaseException:  # noqa: BLE001 (re-raised in the consumer's thread)
            with self.cond:
                self.error = traceback.format_exc()
                self.idle = True
                self.cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise StreamError(f"the sampler thread failed:\n{self.error}")
