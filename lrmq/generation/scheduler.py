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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from lrmq.generation.batch import DecodeBatch, DecodeOutput, PrefillBatch
from lrmq.generation.paged import NULL_PAGE, pages_for


def row_buckets(slots: int, multiple: int = 1) -> list[int]:
    """Row counts the programs are compiled for, ascending: the slots, and `multiple` (the data-parallel divisor)
    times powers of 4 below them (fewer rows decode a tail; a handful of compiles, not one per count)."""
    m, out = multiple, {slots}
    while m < slots:
        out.add(m)
        m *= 4
    return sorted(out)


def rows_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding `n` rows."""
    return next(b for b in buckets if b >= n)


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


@dataclass(eq=False)
class Seq:
    """One request: its prompt, token budget and raw key data, and what it has generated so far."""

    index: int
    prompt: tuple[int, ...]
    max_new: int
    key: np.ndarray
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # own pages (from the prompt's partly filled one on)
    admitted: int = 0  # admission order (the youngest is preempted first)
    copy: tuple[int, int] | None = None  # (prompt page, own page) to copy before its first decode step

    def shared_pages(self, page_size: int) -> int:
        """Full pages of the prompt's first len - 1 tokens: read from the prompt's pages as they are."""
        return (len(self.prompt) - 1) // page_size

    def own_pages_needed(self, page_size: int, ahead: int) -> int:
        """Own pages covering every position up to `ahead` decode steps past the tokens so far."""
        return pages_for(len(self.prompt) + len(self.tokens) + ahead, page_size) - self.shared_pages(page_size)


class Scheduler:
    """Admission, page reservation, preemption and row planning of one `Engine.generate` call (module docstring).
    stats: decode and prefill calls, prompts prefilled, sequences preempted and decode steps run."""

    def __init__(self, seqs: Sequence[Seq], *, slots: int, pages: int, width: int, page_size: int,
                 sync_steps: int, buckets: Sequence[int] = ()):
        self.queue: deque[Seq] = deque(seqs)
        self.slots: list[Seq | None] = [None] * slots
        self.pool = PagePool(pages)
        self.prompts: dict[tuple[int, ...], SharedPrompt] = {}
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

    # ------------------------------------------------------------------ admission
    def admit(self) -> list[SharedPrompt]:
        """Fill free slots from the front of the queue while the pool has pages; the prompts to prefill (those
        not resident before, with tokens before their last: a one-token prompt has nothing to write)."""
        new: list[SharedPrompt] = []
        for slot in range(len(self.slots)):
            if self.slots[slot] is not None:
                continue
            if not self.queue:
                break
            s = self.queue[0]
            resident = s.prompt in self.prompts
            if not self._admit(s, slot):
                break
            if not resident and self.prompts[s.prompt].pages:
                new.append(self.prompts[s.prompt])
        if new:
            self.stats["prefill_calls"] += 1
            self.stats["prefilled_prompts"] += len(new)
        return new

    def _admit(self, s: Seq, slot: int) -> bool:
        """Put `s` in `slot` with its prompt's pages (taken when it is not resident) and its own; False, taking
        nothing, when the pool is short."""
        ps = self.page_size
        pr = self.prompts.get(s.prompt)
        if pr is None:
            got = self.pool.take(pages_for(len(s.prompt) - 1, ps))
            if got is None:
                return False
            pr = self.prompts[s.prompt] = SharedPrompt(s.prompt, got)
        own = self.pool.take(s.own_pages_needed(ps, self.sync_steps))
        if own is None:
            if pr.users == 0:  # taken just now
                self.pool.release(pr.pages)
                del self.prompts[s.prompt]
            return False
        self.queue.popleft()
        pr.users += 1
        s.pages = own
        if (len(s.prompt) - 1) % ps:  # the prompt's partly filled page becomes this sequence's own
            s.copy = (pr.pages[s.shared_pages(ps)], own[0])
        self.slots[slot] = s
        self.clock += 1
        s.admitted = self.clock
        return True

    # ------------------------------------------------------------------ pages ahead, preemption
    def reserve(self) -> None:
        """Give each running sequence, oldest first, its own pages `sync_steps` tokens ahead; when the pool runs
        dry, preempt the youngest (possibly the sequence itself) until the pages are there."""
        for s in sorted((self.slots[j] for j in self._running()), key=lambda s: s.admitted):
            while s in self.slots and not self._grow(s):
                self._preempt(max(self._running(), key=lambda j: self.slots[j].admitted))

    def _grow(self, s: Seq) -> bool:
        """Take the pages `s` lacks; False (taking none) when the pool has too few."""
        missing = s.own_pages_needed(self.page_size, self.sync_steps) - len(s.pages)
        got = self.pool.take(max(missing, 0))
        if got is None:
            return False
        s.pages += got
        return True

    def _preempt(self, slot: int) -> None:
        """Stop the sequence in `slot`: its pages go back, and it waits at the front of the queue to start over
        (its key is kept: the recomputed tokens are the same)."""
        s = self.slots[slot]
        s.tokens, s.logprobs, s.copy = [], [], None
        self._free(slot)
        self.queue.appendleft(s)
        self.stats["preempted"] += 1

    def _free(self, slot: int) -> None:
        """Empty `slot`: its own pages go back, and its prompt's once no other slot reads them."""
        s = self.slots[slot]
        self.pool.release(s.pages)
        s.pages = []
        pr = self.prompts[s.prompt]
        pr.users -= 1
        if pr.users == 0:
            self.pool.release(pr.pages)
            del self.prompts[s.prompt]
        self.slots[slot] = None

    # ------------------------------------------------------------------ the device call
    def plan(self) -> DecodeBatch:
        """The decode batch of the running slots (module docstring: rows and when the device hands back)."""
        running = self._running()
        if not running:  # the queue waits, and not even its first sequence fits the empty pool
            raise RuntimeError(f"the KV pool of {self.pool.pages} pages of {self.page_size} tokens cannot hold one "
                               f"sequence of {len(self.queue[0].prompt)} prompt tokens plus {self.sync_steps} decode "
                               f"steps; raise engine pages")
        rows, stop_below = len(self.slots), len(running)  # back when a row finishes: a waiting one takes its slot
        if not self.queue:  # live rows to the front, decoded in the smallest bucket that holds them, until they
            # fit the next smaller one
            self.slots.sort(key=lambda s: s is None)
            rows = rows_for(len(running), self.buckets)
            smaller = [b for b in self.buckets if b < rows]
            stop_below = smaller[-1] + 1 if smaller else 0
        batch = DecodeBatch.zeros(rows, self.width).replace(stop_below=np.asarray(stop_below, np.int32))
        for row, s in enumerate(self.slots[:rows]):
            if s is not None:
                self._fill(batch, row, s)
        return batch

    def _fill(self, batch: DecodeBatch, row: int, s: Seq) -> None:
        pages = self.prompts[s.prompt].pages[:s.shared_pages(self.page_size)] + s.pages
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
        for row, s in enumerate(self.slots[:batch.rows]):
            if s is None:
                continue
            k = int(out.generated[row] - batch.generated[row])
            s.tokens += out.tokens[row, :k].tolist()
            s.logprobs += out.logprobs[row, :k].tolist()
            if not out.live[row]:
                self._free(row)
                finished.append(s)
        return finished


def prefill_batch(prompts: Sequence[SharedPrompt], rows: int, length: int, page_size: int) -> PrefillBatch:
    """The first len - 1 tokens of each prompt (row r: prompts[r]) at positions 0.., with its pages; rows past
    the prompts are padding."""
    batch = PrefillBatch.zeros(rows, length, pages_for(length, page_size))
    for r, p in enumerate(prompts):
        n = len(p.ids) - 1
        batch.tokens[r, :n] = p.ids[:n]
        batch.positions[r, :n] = np.arange(n)
        batch.page_table[r, :len(p.pages)] = p.pages
    return batch
