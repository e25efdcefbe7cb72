"""The engine's host scheduler against a fake device: no model, no compile.

The fake device keeps a pool of token ids instead of keys and values. Prefill writes each prompt into its pages;
a decode step writes each live row's input token at its position, reads the row's whole context back through
its page table (so a page shared, copied or handed out twice shows up as a wrong context), and samples the
token `1000 * sequence + position`: a recomputed sequence gets the same tokens, as with the engine's keys.
"""

import jax
import numpy as np
import pytest

from lrmq.generation.batch import DecodeBatch, DecodeOutput, PrefillBatch, keeps_decoding, key_data
from lrmq.generation.kv_pool import NULL_PAGE, pages_for
from lrmq.generation.scheduler import (Scheduler, Seq, check_kv_pages, pages_for_one_sequence, prefill_batch,
                                      row_buckets, rows_for)

PAD = -7


def expected(seq: Seq, upto: int) -> list[int]:
    """The context of `seq` at positions 0..upto: its prompt, then the fake device's tokens."""
    return (list(seq.prompt) + [1000 * seq.index + q for q in range(len(seq.prompt), upto + 1)])[:upto + 1]


class FakeDevice:
    """groups: the pool split over data groups (page ids local to a group; row r of a batch of R rows reads and
    writes group r // (R / groups) only, as a chip of that group does)."""

    def __init__(self, pages: int, page_size: int, seqs: list[Seq], steps: int, groups: int = 1):
        self.pool = np.full((groups, pages // groups, page_size), -1, np.int64)
        self.ps, self.seqs, self.steps, self.groups = page_size, seqs, steps, groups
        self.batches: list[DecodeBatch] = []

    def _cell(self, rows, r, table_row, pos):
        return r // (rows // self.groups), table_row[pos // self.ps], pos % self.ps

    def prefill(self, batch: PrefillBatch):
        for r in range(batch.rows):
            for t, pos in zip(batch.tokens[r], batch.positions[r]):
                if pos >= 0:
                    self.pool[self._cell(batch.rows, r, batch.page_table[r], pos)] = t

    def decode(self, batch: DecodeBatch) -> DecodeOutput:
        self.batches.append(batch)
        group = np.arange(batch.rows) // (batch.rows // self.groups)
        self.pool[group, batch.copy_dst] = self.pool[group, batch.copy_src]
        tok, pos, gen, live = (np.array(x) for x in (batch.tokens, batch.positions, batch.generated, batch.live))
        out_tok = np.full((batch.rows, self.steps), PAD, np.int64)
        out_lp = np.zeros((batch.rows, self.steps), np.float32)
        i = 0
        while i < self.steps and keeps_decoding(live, batch.stop_below, batch.group_stop_below, self.groups):
            for r in np.flatnonzero(live):
                seq = self.seqs[int(batch.keys[r, 0])]
                cell = lambda p: self._cell(batch.rows, r, batch.page_table[r], p)  # noqa: E731
                self.pool[cell(pos[r])] = tok[r]
                context = [self.pool[cell(p)] for p in range(pos[r] + 1)]
                assert context == expected(seq, pos[r]), (seq.index, pos[r])
                out_tok[r, i], out_lp[r, i] = 1000 * seq.index + pos[r] + 1, -(pos[r] + 1) / 1000
                tok[r], pos[r], gen[r] = out_tok[r, i], pos[r] + 1, gen[r] + 1
                live[r] = gen[r] < batch.max_new[r]
            i += 1
        return DecodeOutput(out_tok, out_lp, gen, live)


def make(prompts, budgets, *, slots, pages, page_size=4, sync_steps=4, multiple=1, groups=1):
    seqs = [Seq(i, tuple(p), b, np.array([i, 0], np.uint32)) for i, (p, b) in enumerate(zip(prompts, budgets))]
    width = max(pages_for(len(p), page_size) for p in prompts) + pages_for(max(budgets) + sync_steps, page_size) + 2
    sched = Scheduler(seqs, slots=slots, pages=pages, width=width, page_size=page_size, sync_steps=sync_steps,
                      buckets=row_buckets(slots, multiple), groups=groups)
    return sched, seqs, FakeDevice(pages, page_size, seqs, sync_steps, groups)


def run(sched: Scheduler, device: FakeDevice, on_admit=None) -> list[int]:
    """Engine.generate's loop on the fake device; the sequences in the order they finished."""
    finished = []
    while sched.busy:
        prompts = sched.admit()
        if on_admit is not None:
            on_admit(prompts)
        if prompts:
            length = max(len(p.ids) - 1 for p in prompts)
            device.prefill(sched.prefill(prompts, length))
        sched.reserve()
        batch = sched.plan()
        finished += [s.index for s in sched.apply(batch, device.decode(batch))]
    return finished


def check_done(sched: Scheduler, seqs: list[Seq]):
    for s in seqs:
        assert s.tokens == expected(s, len(s.prompt) + s.max_new - 1)[len(s.prompt):], s.index
        assert s.logprobs == pytest.approx([-(len(s.prompt) + t) / 1000 for t in range(s.max_new)])
    for pool in sched.pools:  # every page back
        assert sorted(pool.free) == list(range(1, pool.pages))
    assert not sched.prompts


def test_admission_follows_the_queue_and_slots_refill():
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11], [12, 13]]
    sched, seqs, device = make(prompts, [3, 9, 2, 5, 4], slots=2, pages=40)
    first = sched.admit()
    assert [s.index for s in sched.slots] == [0, 1] and [s.index for s in sched.queue] == [2, 3, 4]
    assert [p.ids for p in first] == [(1, 2, 3), (4, 5)]
    device.prefill(prefill_batch(first, 2, 4, 4))
    sched.reserve()
    batch = sched.plan()
    assert batch.rows == 2 and batch.stop_below == 2  # requests wait: back as soon as a row finishes
    finished = [s.index for s in sched.apply(batch, device.decode(batch))]
    assert finished == [0] and sched.slots[0] is None
    finished += run(sched, device)
    assert [s.admitted for s in seqs] == [1, 2, 3, 4, 5]  # queue order
    assert sorted(finished) == [0, 1, 2, 3, 4] and sched.stats["preempted"] == 0
    check_done(sched, seqs)


def test_shared_prompt_counts_its_readers_and_returns_its_pages_after_the_last():
    shared = list(range(1, 11))  # 9 tokens before the last: 2 full pages of 4 and a partly filled one
    prompts = [shared, [20, 21, 22], shared, shared]
    sched, seqs, device = make(prompts, [2, 6, 9, 5], slots=4, pages=40)
    free = len(sched.pools[0].free)
    prefill = []
    seen = []

    def on_admit(prompts):
        prefill.extend(p.ids for p in prompts)
        pr = sched.prompts.get((0, tuple(shared)))
        seen.append((pr.users if pr else 0, len(sched.pools[0].free)))

    finished = run(sched, device, on_admit)
    assert prefill == [tuple(shared), (20, 21, 22)]  # the shared prompt prefilled once
    assert sched.stats["prefilled_prompts"] == 2 and sched.stats["prefill_calls"] == 1
    assert seen[0][0] == 3  # three slots read its pages
    assert finished[0] == 0 and seen[1][0] == 2  # one left: the pages stay for the two still reading them
    assert len(sched.pools[0].free) == free
    check_done(sched, seqs)


def test_copy_on_write_pairs_in_the_first_call_only():
    shared, whole = list(range(1, 11)), list(range(30, 39))  # 9 and 8 tokens before the last (page size 4)
    sched, seqs, device = make([shared, shared, whole], [9, 9, 9], slots=3, pages=40)
    device.prefill(prefill_batch(sched.admit(), 3, 9, 4))
    pr = sched.prompts[0, tuple(shared)]
    sched.reserve()
    batch = sched.plan()
    own = [s.pages[0] for s in sched.slots]
    assert batch.copy_src.tolist() == [pr.pages[2], pr.pages[2], NULL_PAGE]  # its third, partly filled page
    assert batch.copy_dst.tolist() == [own[0], own[1], NULL_PAGE]  # ... into each reader's own first page
    assert own[0] != own[1]
    assert batch.page_table[0, :3].tolist() == [*pr.pages[:2], own[0]]  # full pages read in place
    sched.apply(batch, device.decode(batch))
    again = sched.plan()
    assert (again.copy_src == NULL_PAGE).all() and (again.copy_dst == NULL_PAGE).all()


def test_pool_running_dry_preempts_the_youngest_and_recomputes_it():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13]]
    budgets = [14, 12, 13, 10]
    ample, seqs_ample, device = make(prompts, budgets, slots=3, pages=60)
    run(ample, device)
    sched, seqs, device = make(prompts, budgets, slots=3, pages=14)
    victims = []
    preempt = sched._preempt

    def spy(slot):
        running = [s for s in sched.slots if s is not None]
        victims.append((sched.slots[slot].admitted, max(s.admitted for s in running)))
        preempt(slot)

    sched._preempt = spy
    run(sched, device)
    assert sched.stats["preempted"] > 0 and len(victims) == sched.stats["preempted"]
    assert all(admitted == youngest for admitted, youngest in victims)
    assert max(s.admitted for s in seqs) > len(seqs)  # a preempted sequence was admitted again
    assert [s.tokens for s in seqs] == [s.tokens for s in seqs_ample]  # recomputed to the same tokens
    check_done(sched, seqs)


@pytest.mark.parametrize("multiple, buckets, rows", [(1, [1, 4, 8], [8, 4, 1]), (2, [2, 8], [8, 8, 2])])
def test_live_rows_move_to_the_front_and_decode_in_a_smaller_bucket(multiple, buckets, rows):
    budgets = [2, 2, 2, 6, 6, 10]
    sched, seqs, device = make([[5]] * 6, budgets, slots=8, pages=60, sync_steps=4, multiple=multiple)
    assert sched.buckets == buckets
    run(sched, device)
    assert [b.rows for b in device.batches] == rows
    for b in device.batches:  # live rows first; back to the host once they fit the next smaller bucket
        n = int(b.live.sum())
        assert b.live.tolist() == [True] * n + [False] * (b.rows - n)
        smaller = [x for x in buckets if x < b.rows]
        assert b.stop_below == 0 and b.group_stop_below == (smaller[-1] + 1 if smaller else 0)
    assert device.batches[-1].keys[0, 0] == 5  # the longest sequence ends in row 0
    check_done(sched, seqs)


def test_a_pool_too_small_for_one_sequence_says_so():
    sched, _, device = make([list(range(1, 21))], [4], slots=2, pages=6)
    with pytest.raises(RuntimeError, match="KV pool of 6 pages of 4 tokens cannot hold one sequence of 20 prompt"):
        run(sched, device)


def test_batches_zeros_and_abstract_agree_field_by_field():
    z, a = DecodeBatch.zeros(4, 16), DecodeBatch.abstract(4, 16)
    assert jax.tree.structure(z) == jax.tree.structure(a)
    for x, y in zip(jax.tree.leaves(z), jax.tree.leaves(a)):
        assert (x.shape, x.dtype) == (y.shape, y.dtype)
    assert z.page_table.shape == (4, 16) and z.keys.shape == (4, *key_data().shape) and z.stop_below.shape == ()
    assert (z.max_new == 1).all() and not z.live.any() and (z.copy_src == NULL_PAGE).all()
    p = PrefillBatch.zeros(2, 8, 2)
    assert p.tokens.shape == (2, 8) and (p.positions == -1).all() and p.page_table.shape == (2, 2)
    assert jax.tree.structure(PrefillBatch.abstract(2, 8, 2)) == jax.tree.structure(p)


@pytest.mark.parametrize("prompt_len,max_new,page_size,sync_steps", [(3, 10, 4, 4), (5, 3, 4, 4), (1, 7, 2, 3),
                                                                     (9, 12, 4, 5)])
def test_pages_for_one_sequence_is_the_smallest_pool_that_finishes_it(prompt_len, max_new, page_size, sync_steps):
    """`pages_for_one_sequence` pages run a lone sequence to its end without a preemption; one page fewer never
    does (refused by `plan`, or the sequence preempts itself at every turn); `check_kv_pages` names the value."""
    need = pages_for_one_sequence(prompt_len, max_new, page_size, sync_steps)
    prompt = list(range(1, prompt_len + 1))
    sched, seqs, device = make([prompt], [max_new], slots=1, pages=need, page_size=page_size, sync_steps=sync_steps)
    assert run(sched, device) == [0] and sched.stats["preempted"] == 0
    check_done(sched, seqs)
    sched, _, device = make([prompt], [max_new], slots=1, pages=need - 1, page_size=page_size, sync_steps=sync_steps)
    with pytest.raises(RuntimeError, match="cannot hold one sequence"):
        for _ in range(4 * max_new):  # Engine.generate's loop, bounded: a self-preempting sequence never ends
            prompts = sched.admit()
            if prompts:
                device.prefill(prefill_batch(prompts, 1, prompt_len - 1, page_size))
            sched.reserve()
            if sched.stats["preempted"]:
                raise RuntimeError("cannot hold one sequence: preempted itself")
            batch = sched.plan()
            sched.apply(batch, device.decode(batch))
            assert sched.busy, "finished with one page fewer than pages_for_one_sequence"
    check_kv_pages(need, "x", prompt_tokens=prompt_len, max_new=max_new, page_size=page_size, sync_steps=sync_steps)
    check_kv_pages(0, "x", prompt_tokens=prompt_len, max_new=max_new, page_size=page_size, sync_steps=sync_steps)
    with pytest.raises(ValueError, match=f"the smallest that works is x={need} "):
        check_kv_pages(need - 1, "x", prompt_tokens=prompt_len, max_new=max_new, page_size=page_size,
                       sync_steps=sync_steps)


def test_data_groups_keep_each_sequence_on_its_own_groups_pages():
    """groups=2 (the pool split over a mesh's data axis): every row reads only its group's pool in the fake device,
    so a page id of the wrong group shows up as a wrong context; a prompt's samples share its pages where it is
    resident; a dry group preempts its own youngest; the batch shrinks to the fullest group's bucket."""
    prompts = [[1, 2, 3, 4, 5]] * 3 + [[6, 7]] * 3 + [[8, 9, 10]] * 2 + [[11]]
    budgets = [9, 3, 14, 5, 12, 2, 7, 15, 4]
    sched, seqs, device = make(prompts, budgets, slots=8, pages=2 * 9, multiple=2, groups=2)
    victims, preempt = [], sched._preempt

    def spy(slot):
        group = [s for s in sched.slots if s is not None and s.group == sched.slots[slot].group]
        victims.append((sched.slots[slot].admitted, max(s.admitted for s in group)))
        preempt(slot)

    sched._preempt = spy
    prefilled = []
    run(sched, device, on_admit=lambda ps: prefilled.extend((p.group, p.ids) for p in ps))
    check_done(sched, seqs)
    assert {g for g, _ in prefilled} == {0, 1} and sched.stats["preempted"] > 0
    assert all(admitted == youngest for admitted, youngest in victims)
    for b in device.batches:
        if b.stop_below:  # sequences waited: no row moved
            continue
        half = b.rows // 2
        for block in (b.live[:half], b.live[half:]):  # live rows at the front of each group's block
            n = int(block.sum())
            assert block.tolist() == [True] * n + [False] * (half - n)
    shrunk = [b for b in device.batches if b.rows < 8]
    assert shrunk and all(b.group_stop_below in (0, 2) for b in shrunk)
    with pytest.raises(ValueError, match="split evenly over 2 data groups"):
        Scheduler(seqs, slots=3, pages=18, width=8, page_size=4, sync_steps=4, groups=2)
