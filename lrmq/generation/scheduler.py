"""The engine's host side: which sequences decode in which slot, on which pages (numpy only, no device).

The `Scheduler` owns the queue of waiting sequences, the decode slots, the free pages (`PagePool`) and the
resident prompts with their reference counts. The engine (`lrmq.generation.engine`) drives it, one device call
per turn of its loop:

* `admit()` moves waiting sequences into free slots, in queue order, while the pool has pages for them; a
  prompt already resident is shared (its full pages read in place, its partly filled last page copied into
  the sequence's own first page: copy on write); it returns the prompts to prefill (`prefill_batch`).
* `reserve()` gives every running sequence its pages `sync_steps` tokens ahead, oldest first; when the pool
  runs dry the youngest is preempted (`_preempt`): its pages go back and it waits at the front of the queue,
  to be recomputed from its prompt (same key, so the same tokens).
* `plan()` returns the `DecodeBatch` of the slots. With nobody waiting the live rows move to the front and the
  batch has only as many rows as they need (a row bucket, `row_buckets`), so a long tail runs at the cost of its
  own rows; it asks the device back when a row finishes while sequences wait, or when the live rows fit the
  next smaller bucket.
* `apply(batch, output)` records the tokens a call sampled and returns the sequences that finished; their slots
  and pages are free for the next `admit`.

Data groups (`groups` > 1: the engine's pool is split over the mesh's data axes, `kv_pool.kv_page_axes`): each
group holds its own pages (page ids local to the group, 0 its null page) and its own block of slots, and a
batch of `rows` rows gives group g the rows [g * rows / groups, (g + 1) * rows / groups) -- the rows its chips
hold. A sequence decodes in one group, on that group's pages; a prompt is resident per group (its samples are
admitted where it is resident first, else where the most pages are free); preemption takes the youngest of the
same group; live rows move to the front of their group's block, and a batch shrinks to the bucket that holds
the fullest group. One group is today's scheduler, row for row.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from lrmq.generation.batch import DecodeBatch, DecodeOutput, PrefillBatch
from lrmq.generation.kv_pool import NULL_PAGE, pages_for


def row_buckets(slots: int, multiple: int = 1) -> list[int]:
    """Row counts the programs are compiled for, ascending: the slots, and `multiple` (the data-parallel divisor)
    times powers of 4 below them (fewer rows decode a tail; a handful of compiles, not one per count)."""
    m, out = multiple, {slots}
    while m < slots:
        out.add(m)
        m *= 4
    return sorted(out)


def rows_for(n: int, buckets: Sequence[int], groups: int = 1) -> int:
    """The smallest bucket holding `n` rows in each of `groups` data groups (a bucket's rows are split evenly)."""
    return next(b for b in buckets if b // groups >= n)


def group_rows(rows: int, per_group: int, groups: int) -> list[tuple[int, int]]:
    """(row, slot) pairs of a batch of `rows` rows over `groups` groups of `per_group` slots: group g's first
    rows / groups slots take its block of rows."""
    n = rows // groups
    return [(g * n + k, g * per_group + k) for g in range(groups) for k in range(n)]


def pages_for_one_sequence(prompt_tokens: int, max_new: int, page_size: int, sync_steps: int) -> int:
    """The smallest KV pool, in pages (the null page included), that runs one sequence of `prompt_tokens` prompt
    tokens and `max_new` new ones to its end without preempting itself: the null page, the prompt's pages
    (`SharedPrompt`) and the sequence's own pages `sync_steps` decode steps past its last reserve
    (`Seq.own_pages_needed` at its last reserve: alone, it decodes `sync_steps` tokens per call, so the last reserve
    comes after the largest multiple of `sync_steps` below `max_new`)."""
    p = max(prompt_tokens, 1)
    shared = (p - 1) // page_size
    last = (max(max_new, 1) - 1) // sync_steps * sync_steps
    return 1 + pages_for(p - 1, page_size) + pages_for(p + last + sync_steps, page_size) - shared


def check_kv_pages(pages: int, option: str, *, prompt_tokens: int, max_new: int, page_size: int, sync_steps: int,
                   prompt_note: str = "") -> None:
    """A set KV pool (`pages` > 0) that cannot hold one sequence is a config error: ValueError naming `option` and
    the smallest value that works (`pages_for_one_sequence`); 0 (sized to fit) is always accepted. Commands call
    it when they validate their config, before any model is built."""
    if pages <= 0:
        return
    need = pages_for_one_sequence(prompt_tokens, max_new, page_size, sync_steps)
    if pages < need:
        raise ValueError(f"{option}={pages}: a KV pool of {pages} pages of {page_size} tokens cannot hold one "
                         f"sequence of {prompt_tokens} prompt tokens{prompt_note} + {max_new} new tokens (pages reserved "
                         f"{sync_steps} decode steps ahead); the smallest that works is {option}={need} "
                         f"(or 0: sized to fit)")


class PagePool:
    """The free pages of the pool (page 0 is the null page, never handed out). A prompt's pages belong to
    its `SharedPrompt`, which counts the slots reading them and gives them back when the last one finishes."""

    def __init__(self, pages: int):
        self.free = deque(range(1, pages))
        self.pages = pages

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        return [self.free.popleft() for _ in range(n)]

    def release(self, pages: Sequence[int]):
        self.free.extend(pages)


@dataclass(eq=False)
class SharedPrompt:
    ids: tuple[int, ...]
    pages: list[int]  # pages of its first len - 1 tokens (the last is fed as the first decode input)
    users: int = 0  # slots reading its pages
    group: int = 0  # the data group whose pages hold it


@dataclass(eq=False)
class Seq:
    """One request: its prompt, token budget and raw key data, and what it has generated so far."""

    index: int
    prompt: tuple[int, ...]
    max_new: int
    key: np.ndarray
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    experts: list = field(default_factory=list)  # record_experts: [sparse layers, k] of each decode step's input
    pages: list[int] = field(default_factory=list)  # own pages (from the prompt's partly filled one on)
    admitted: int = 0  # admission order (the youngest is preempted first)
    copy: tuple[int, int] | None = None  # (prompt page, own page) to copy before its first decode step
    group: int = 0  # the data group it decodes in (its pages are that group's)

    def shared_pages(self, page_size: int) -> int:
        """Full pages of the prompt's first len - 1 tokens: read from the prompt's pages as they are."""
        return (len(self.prompt) - 1) // page_size

    def own_pages_needed(self, page_size: int, ahead: int) -> int:
        """Own pages covering every position up to `ahead` decode steps past the tokens so far."""
        return pages_for(len(self.prompt) + len(self.tokens) + ahead, page_size) - self.shared_pages(page_size)


class Scheduler:
    """Admission, page reservation, preemption and row planning of one `Engine.generate` call (module docstring).
    pages: the pool's pages in all (`groups` x the pages of a group); slots: a multiple of `groups`.
    stats: decode and prefill calls, prompts prefilled, sequences preempted and decode steps run."""

    def __init__(self, seqs: Sequence[Seq], *, slots: int, pages: int, width: int, page_size: int,
                 sync_steps: int, buckets: Sequence[int] = (), groups: int = 1):
        if slots % groups or pages % groups:
            raise ValueError(f"{slots} slots and {pages} pages must split evenly over {groups} data groups")
        self.queue: deque[Seq] = deque(seqs)
        self.slots: list[Seq | None] = [None] * slots
        self.groups, self.per_group = groups, slots // groups
        self.pools = [PagePool(pages // groups) for _ in range(groups)]
        self.prompts: dict[tuple[int, tuple[int, ...]], SharedPrompt] = {}  # (group, ids) -> resident prompt
        self.width, self.page_size, self.sync_steps = width, page_size, sync_steps
        self.buckets = list(buckets) or [slots]
        self.clock = 0
        self.stats = {"decode_calls": 0, "prefill_calls": 0, "prefilled_prompts": 0, "preempted": 0, "steps": 0}

    @property
    def busy(self) -> bool:
        """Sequences wait or decode."""
        return bool(self.queue) or any(s is not None for s in self.slots)

    def _running(self) -> list[int]:
        return [j for j, s in enumerate(self.slots) if s is not None]

    def _group_slots(self, g: int) -> range:
        return range(g * self.per_group, (g + 1) * self.per_group)

    # ------------------------------------------------------------------ admission
    def admit(self) -> list[SharedPrompt]:
        """Fill free slots from the front of the queue while the pool has pages; the prompts to prefill (those
        not resident before, with tokens before their last: a one-token prompt has nothing to write)."""
        new: list[SharedPrompt] = []
        while self.queue:
            s = self.queue[0]
            admitted = next((g for g in self._groups_for(s.prompt) if self._admit(s, g)), None)
            if admitted is None:
                break
            pr = self.prompts[admitted, s.prompt]
            if pr.users == 1 and pr.pages:
                new.append(pr)
        if new:
            self.stats["prefill_calls"] += 1
            self.stats["prefilled_prompts"] += len(new)
        return new

    def _groups_for(self, prompt: tuple[int, ...]) -> list[int]:
        """The groups with a free slot, in the order a sequence of `prompt` tries them: where the prompt is
        resident, then the most free pages, then the lowest index."""
        free = [g for g in range(self.groups) if any(self.slots[j] is None for j in self._group_slots(g))]
        return sorted(free, key=lambda g: ((g, prompt) not in self.prompts, -len(self.pools[g].free), g))

    def _admit(self, s: Seq, g: int) -> bool:
        """Put `s` in group `g`'s first free slot with its prompt's pages (taken when it is not resident there)
        and its own; False, taking nothing, when the group's pages are short."""
        ps, pool = self.page_size, self.pools[g]
        pr = self.prompts.get((g, s.prompt))
        if pr is None:
            got = pool.take(pages_for(len(s.prompt) - 1, ps))
            if got is None:
                return False
            pr = self.prompts[g, s.prompt] = SharedPrompt(s.prompt, got, group=g)
        own = pool.take(s.own_pages_needed(ps, self.sync_steps))
        if own is None:
            if pr.users == 0:  # taken just now
                pool.release(pr.pages)
                del self.prompts[g, s.prompt]
            return False
        self.queue.popleft()
        pr.users += 1
        s.pages, s.group = own, g
        if (len(s.prompt) - 1) % ps:  # the prompt's partly filled page becomes this sequence's own
            s.copy = (pr.pages[s.shared_pages(ps)], own[0])
        self.slots[next(j for j in self._group_slots(g) if self.slots[j] is None)] = s
        self.clock += 1
        s.admitted = self.clock
        return True

    # ------------------------------------------------------------------ pages ahead, preemption
    def reserve(self) -> None:
        """Give each running sequence, oldest first, its own pages `sync_steps` tokens ahead; when its group's
        pages run dry, preempt the group's youngest (possibly the sequence itself) until the pages are there."""
        for s in sorted((self.slots[j] for j in self._running()), key=lambda s: s.admitted):
            while s in self.slots and not self._grow(s):
                group = [j for j in self._running() if self.slots[j].group == s.group]
                self._preempt(max(group, key=lambda j: self.slots[j].admitted))

    def _grow(self, s: Seq) -> bool:
        """Take the pages `s` lacks; False (taking none) when its group has too few."""
        missing = s.own_pages_needed(self.page_size, self.sync_steps) - len(s.pages)
        got = self.pools[s.group].take(max(missing, 0))
        if got is None:
            return False
        s.pages += got
        return True

    def _preempt(self, slot: int) -> None:
        """Stop the sequence in `slot`: its pages go back, and it waits at the front of the queue to start over
        (its key is kept: the recomputed tokens are the same)."""
        s = self.slots[slot]
        s.tokens, s.logprobs, s.experts, s.copy = [], [], [], None
        self._free(slot)
        self.queue.appendleft(s)
        self.stats["preempted"] += 1

    def _free(self, slot: int) -> None:
        """Empty `slot`: its own pages go back, and its prompt's once no other slot reads them."""
        s = self.slots[slot]
        pool = self.pools[s.group]
        pool.release(s.pages)
        s.pages = []
        pr = self.prompts[s.group, s.prompt]
        pr.users -= 1
        if pr.users == 0:
            pool.release(pr.pages)
            del self.prompts[s.group, s.prompt]
        self.slots[slot] = None

    # ------------------------------------------------------------------ the device call
    def plan(self) -> DecodeBatch:
        """The decode batch of the running slots (module docstring: rows and when the device hands back)."""
        running = self._running()
        if not running:  # the queue waits, and not even its first sequence fits the empty pool
            raise RuntimeError(f"the KV pool of {self.pools[0].pages} pages of {self.page_size} tokens"
                               f"{' per data group' if self.groups > 1 else ''} cannot hold one sequence of "
                               f"{len(self.queue[0].prompt)} prompt tokens plus {self.sync_steps} decode steps; "
                               f"raise engine pages")
        # back when a row finishes: a waiting one takes its slot
        rows, stop_below, group_below = len(self.slots), len(running), 0
        if not self.queue:  # live rows to the front of their group, decoded in the smallest bucket that holds the
            # fullest group, until every group fits the next smaller one
            for g in range(self.groups):
                block = self._group_slots(g)
                self.slots[block.start:block.stop] = sorted(self.slots[block.start:block.stop],
                                                            key=lambda s: s is None)
            fullest = max(sum(self.slots[j] is not None for j in self._group_slots(g)) for g in range(self.groups))
            rows = rows_for(fullest, self.buckets, self.groups)
            smaller = [b for b in self.buckets if b < rows]
            stop_below, group_below = 0, smaller[-1] // self.groups + 1 if smaller else 0
        batch = DecodeBatch.zeros(rows, self.width).replace(stop_below=np.asarray(stop_below, np.int32),
                                                            group_stop_below=np.asarray(group_below, np.int32))
        for row, slot in group_rows(rows, self.per_group, self.groups):
            if self.slots[slot] is not None:
                self._fill(batch, row, self.slots[slot])
        return batch

    def _fill(self, batch: DecodeBatch, row: int, s: Seq) -> None:
        pages = self.prompts[s.group, s.prompt].pages[:s.shared_pages(self.page_size)] + s.pages
        batch.page_table[row, :len(pages)] = pages
        batch.copy_src[row], batch.copy_dst[row] = s.copy or (NULL_PAGE, NULL_PAGE)
        s.copy = None
        batch.tokens[row] = s.tokens[-1] if s.tokens else s.prompt[-1]
        batch.positions[row] = len(s.prompt) - 1 + len(s.tokens)
        batch.generated[row], batch.max_new[row], batch.live[row] = len(s.tokens), s.max_new, True
        batch.keys[row] = s.key

    def apply(self, batch: DecodeBatch, out: DecodeOutput) -> list[Seq]:
        """Record what a decode call of `batch` sampled (`out` on the host); the sequences that finished, in row
        order (their slots and pages are free)."""
        self.stats["decode_calls"] += 1
        self.stats["steps"] += int((out.generated - batch.generated).max())
        finished = []
        for row, slot in group_rows(batch.rows, self.per_group, self.groups):
            s = self.slots[slot]
            if s is None:
                continue
            k = int(out.generated[row] - batch.generated[row])
            s.tokens += out.tokens[row, :k].tolist()
            s.logprobs += out.logprobs[row, :k].tolist()
            if out.experts is not None:
                s.experts += list(out.experts[row, :k])
            if not out.live[row]:
                self._free(slot)
                finished.append(s)
        return finished

    def prefill(self, prompts: Sequence[SharedPrompt], length: int) -> PrefillBatch:
        """The `PrefillBatch` of `admit`'s prompts (`prefill_batch`), `length` tokens wide, in the smallest row
        bucket that holds each group's prompts in its block of rows."""
        counts = [sum(p.group == g for p in prompts) for g in range(self.groups)]
        return prefill_batch(prompts, rows_for(max(counts), self.buckets, self.groups), length, self.page_size,
                             self.groups)


def prefill_rows(prompts: Sequence[SharedPrompt], rows: int, groups: int = 1) -> list[int]:
    """The row of each prompt in a prefill batch of `rows` rows: group g's prompts in order in its block."""
    taken, out = [0] * groups, []
    for p in prompts:
        out.append(p.group * (rows // groups) + taken[p.group])
        taken[p.group] += 1
    return out


def prefill_batch(prompts: Sequence[SharedPrompt], rows: int, length: int, page_size: int,
                  groups: int = 1) -> PrefillBatch:
    """The first len - 1 tokens of each prompt at positions 0.., with its pages: group g's prompts in order in
    its block of rows / groups rows (one group: row r is prompts[r]); rows past them are padding."""
    batch = PrefillBatch.zeros(rows, length, pages_for(length, page_size))
    for p, r in zip(prompts, prefill_rows(prompts, rows, groups)):
        n = len(p.ids) - 1
        batch.tokens[r, :n] = p.ids[:n]
        batch.positions[r, :n] = np.arange(n)
        batch.page_table[r, :len(p.pages)] = p.pages
    return batch
