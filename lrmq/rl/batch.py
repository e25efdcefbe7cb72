"""Rollout batches: prompts + sampled completions (`RolloutBatch`, host) -> the update batch the compiled step
consumes (`UpdateBatch`, in one of three layouts: `padded_batch`, `bucketed_batch`, `packed_batch`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import struct

from lrmq.model.moe import UNRECORDED

LAYOUTS = ("pack", "bucket", "max")  # rollout.update_padding


@dataclass
class RolloutBatch:
    """Host-side arrays for S = prompts x G sequences; prompt length P, completion length N (fixed)."""

    tokens: np.ndarray  # [S, P+N] int32: left-padded prompt then completion (pad after its end)
    mask: np.ndarray  # [S, P+N] int32: 1 on real prompt and completion tokens
    completion: np.ndarray  # [S, N] int32
    completion_mask: np.ndarray  # [S, N] float32
    behaviour_logp: np.ndarray  # [S, N] float32: the sampler's log-probs of the completion (0 on padding)
    advantages: np.ndarray  # [S] float32
    rewards: np.ndarray  # [S] float32
    # rollout.routing_replay: [S, P+N, sparse layers, k] uint8, the experts the sampler ran each token through (as
    # `tokens`; `moe.UNRECORDED` on padding and on the last completion token, which the sampler never ran)
    experts: np.ndarray | None = None

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def prompt_len(self) -> int:
        """P: the prompt columns (the rollout pads prompts to a bucket of its longest, not max_prompt_len)."""
        return self.tokens.shape[1] - self.completion.shape[1]



@struct.dataclass
class UpdateBatch:
    """One update's batch, host arrays or device arrays (a pytree; `layout` is static), S sequences of N
    completion columns.

    Every layout: `completion_mask` [S, N] float32, `behaviour_logp` [S, N] float32 (the sampler's log-probs,
    never replaced), `advantages` [S] float32, and `old_logp` [S, N] float32 or None: pi_old, the policy's
    log-probs at the start of the update when they are not the sampler's or the update's own forward (the first
    update's, handed to the later ones; `step.old_logprob_sources` says which the update divides by).
    max / bucket (padded): `tokens` / `mask` [S, P + N] int32, `completion` [S, N] int32 (bucket: P and N cut to
    the batch's power-of-two buckets). pack: `tokens` / `positions` / `segments` [rows, W] int32 and `src` /
    `target` / `dest` [groups x micro-batches, slots] int32 (see `packed_batch`). `experts` (rollout.routing_replay;
    else None): [token rows, token columns, sparse layers, k] uint8, the sampler's experts laid out as `tokens`,
    which the update's forward replays."""

    layout: str = struct.field(pytree_node=False)  # one of LAYOUTS
    tokens: Any
    completion_mask: Any
    behaviour_logp: Any
    advantages: Any
    mask: Any = None
    completion: Any = None
    positions: Any = None
    segments: Any = None
    src: Any = None
    target: Any = None
    dest: Any = None
    old_logp: Any = None
    experts: Any = None

    @staticmethod
    def field_shapes(layout: str, *, sequences: int, completion: int, width: int, rows: int = 0, groups: int = 0,
                     slots: int = 0, old_logp: bool = False,
                     experts: tuple[int, int] | None = None) -> dict[str, tuple[tuple[int, ...], Any]]:
        """{field: (shape, dtype)} of a batch of `layout`: S = `sequences`, N = `completion` columns, `width`
        token columns; pack: `rows` token rows and `groups` (device groups x micro-batches) index rows of `slots`;
        `old_logp`: with the old log-probs; `experts`: (sparse layers, k) of replayed experts. The abstract batches
        compiled ahead of time are built from it."""
        if layout not in LAYOUTS:
            raise ValueError(f"update layout {layout!r}: expected one of {LAYOUTS}")
        i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
        per_seq = {"completion_mask": ((sequences, completion), f32), "behaviour_logp": ((sequences, completion), f32),
                   "advantages": ((sequences,), f32)}
        if layout == "pack":
            inputs = {k: ((rows, width), i32) for k in ("tokens", "positions", "segments")}
            inputs.update({k: ((groups, slots), i32) for k in ("src", "target", "dest")})
        else:
            inputs = {"tokens": ((sequences, width), i32), "mask": ((sequences, width), i32),
                      "completion": ((sequences, completion), i32)}
        if experts is not None:
            inputs["experts"] = ((rows if layout == "pack" else sequences, width, *experts), np.dtype(np.uint8))
        return {**inputs, **per_seq, **({"old_logp": ((sequences, completion), f32)} if old_logp else {})}

    @classmethod
    def abstract(cls, layout: str, sharding, **sizes) -> UpdateBatch:
        """The batch of `field_shapes(layout, **sizes)` as ShapeDtypeStructs, each with `sharding(ndim)`: what
        `jax.jit(step).lower` takes to compile an update ahead of time."""
        return cls(layout=layout, **{k: jax.ShapeDtypeStruct(dims, dtype, sharding=sharding(len(dims)))
                                     for k, (dims, dtype) in cls.field_shapes(layout, **sizes).items()})

    @property
    def num_sequences(self) -> int:
        return self.completion_mask.shape[0]

    def shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(field, shape) of every array the batch holds: with `layout`, what a compiled update is looked up by."""
        return tuple((f.name, tuple(getattr(self, f.name).shape)) for f in dataclasses.fields(self)
                     if f.name != "layout" and getattr(self, f.name) is not None)

    def token_count(self) -> int:
        """The real (non-padding) tokens the update's forward runs on."""
        if self.layout == "pack":
            return int((np.asarray(self.positions) >= 0).sum())
        return int(np.asarray(self.mask).sum())


def truncate_left(ids: list[int], max_len: int) -> list[int]:
    """Keep the last max_len tokens (the question's end and the generation prompt matter most)."""
    return ids[-max_len:] if len(ids) > max_len else ids


def build_batch(prompt_tokens: np.ndarray, prompt_mask: np.ndarray, completion: np.ndarray, lengths: np.ndarray,
                logprobs: np.ndarray, advantages: np.ndarray, rewards: np.ndarray) -> RolloutBatch:
    n = completion.shape[1]
    cmask = (np.arange(n)[None, :] < lengths[:, None]).astype(np.float32)
    tokens = np.concatenate([prompt_tokens, completion], axis=1).astype(np.int32)
    mask = np.concatenate([prompt_mask, cmask.astype(np.int32)], axis=1)
    return RolloutBatch(tokens=tokens, mask=mask, completion=completion.astype(np.int32), completion_mask=cmask,
                        behaviour_logp=(logprobs * cmask).astype(np.float32), advantages=advantages.astype(np.float32),
                        rewards=rewards.astype(np.float32))


def replay_experts(prompt_mask: np.ndarray, lengths: np.ndarray, n: int, ran: list[np.ndarray]) -> np.ndarray:
    """`RolloutBatch.experts` [S, P + N, sparse layers, k] uint8 of an engine's recorded experts (`ran[i]`:
    `GenerationResult.experts`, sequence i's prompt tokens then its completion tokens but the last), placed as
    `build_batch` places the tokens: left-padded prompt (`prompt_mask` [S, P]), then the completion;
    `moe.UNRECORDED` where nothing ran."""
    s, p = prompt_mask.shape
    out = np.full((s, p + n) + ran[0].shape[1:], UNRECORDED, np.uint8)
    for i, e in enumerate(ran):
        m = int(prompt_mask[i].sum())
        if len(e) != m + max(int(lengths[i]) - 1, 0):
            raise ValueError(f"sequence {i}: {len(e)} recorded experts for {m} prompt + {int(lengths[i])} completion "
                             "tokens (expected one per token but the last)")
        out[i, p - m:p - m + len(e)] = e
    return out


def truncated_rows(completion: np.ndarray, lengths: np.ndarray, eos_ids) -> np.ndarray:
    """[S] bool: completions cut at the length budget, i.e. whose last token is not an EOS (TRL's
    `mask_truncated_completions` test; a completion ending with EOS exactly at the budget is complete)."""
    n = completion.shape[1]
    last = completion[np.arange(len(lengths)), np.clip(lengths - 1, 0, n - 1)]
    return (lengths >= n) & ~np.isin(last, np.asarray(list(eos_ids)))


def mask_rows(rb: RolloutBatch, rows: np.ndarray) -> RolloutBatch:
    """The batch with no loss on `rows` (their completion_mask zeroed; attention keeps them intact)."""
    cmask = rb.completion_mask * (~rows)[:, None].astype(np.float32)
    return dataclasses.replace(rb, completion_mask=cmask, behaviour_logp=rb.behaviour_logp * cmask)


def bucket(n: int, limit: int, minimum: int = 16) -> int:
    """The next power of two >= n (at least `minimum`), capped at `limit`."""
    b = minimum
    while b < n:
        b *= 2
    return min(b, limit)


def padded_batch(rb: RolloutBatch) -> UpdateBatch:
    """The update batch at the rollout's own width (rollout.update_padding=max: prompts at max_prompt_len)."""
    return UpdateBatch(layout="max", tokens=rb.tokens, mask=rb.mask, completion=rb.completion,
                       completion_mask=rb.completion_mask, behaviour_logp=rb.behaviour_logp, advantages=rb.advantages,
                       experts=rb.experts)


def bucketed_batch(rb: RolloutBatch) -> UpdateBatch:
    """`padded_batch` narrowed to the next power of two of the batch's longest prompt and completion.

    Prompts are left-padded and positions come from the mask, so dropping all-padding columns on the
    left of the prompt and on the right of the completion changes no log-prob; the update then
    computes on the batch's real width instead of max_prompt_len + max_new_tokens, with one compile
    per bucket pair."""
    n, prompt_len = rb.completion.shape[1], rb.prompt_len
    real = rb.mask.astype(bool)
    longest_prompt = int(real[:, :prompt_len].sum(axis=1).max(initial=0))
    longest_completion = int(real[:, prompt_len:].sum(axis=1).max(initial=0))
    pb, cb = bucket(longest_prompt, prompt_len), bucket(longest_completion, n)
    cols = np.r_[prompt_len - pb:prompt_len, prompt_len:prompt_len + cb]
    return UpdateBatch(layout="bucket", tokens=rb.tokens[:, cols], mask=rb.mask[:, cols],
                       completion=rb.completion[:, :cb], completion_mask=rb.completion_mask[:, :cb],
                       behaviour_logp=rb.behaviour_logp[:, :cb], advantages=rb.advantages,
                       experts=None if rb.experts is None else rb.experts[:, cols])


def row_bucket(n: int, per_octave: int = 4) -> int:
    """n rounded up to `per_octave` steps per doubling (exact up to 2 * per_octave): with 4, the next of 1..8,
    10, 12, 14, 16, 20, 24, 28, 32, 40, ... (at most 25% padding); with 2, of 1..4, 6, 8, 12, 16, 24, 32, ..."""
    n = max(n, 1)
    if n <= 2 * per_octave:
        return n
    step = (1 << (n.bit_length() - 1)) // per_octave
    return -(-n // step) * step


def packed_buckets(rows: int, slots: int) -> tuple[int, int]:
    """Default packed shape: rows in quarter-octave steps, completion slots (which vary more from step to
    step, and only feed the vocabulary projection) in half-octave steps."""
    return row_bucket(rows), row_bucket(slots, per_octave=2)


def packed_ladder(rows_max: int, slots_max: int, count: int, *, ratio: float = 2 ** 0.5,
                  slot_align: int = 128) -> list[tuple[int, int]]:
    """`count` packed shapes (rows, slots) per device group, largest first: the worst case (`rows_max`: one
    sequence per row; `slots_max`: every completion at full length) and then both scaled down by `ratio` at
    each step. Slots are rounded up to multiples of `slot_align` (when there are that many). A batch uses the
    smallest that holds it (`ladder_choice`): the set is fixed by the config, so every shape is compiled
    before the first step, and the padding is at most `ratio` times the rows a batch needs (until the
    smallest shape)."""
    out: list[tuple[int, int]] = []
    for i in range(count):
        f = ratio ** -i
        r = max(1, math.ceil(rows_max * f - 1e-9))
        t = max(1, math.ceil(slots_max * f - 1e-9))
        if slots_max >= slot_align:
            t = min(slots_max, -(-t // slot_align) * slot_align)
        if not out or (r, t) != out[-1]:
            out.append((r, t))
    return out


def ladder_choice(ladder):
    """choose_shape for `packed_batch`: the smallest (rows, slots) of `ladder` holding a batch's need."""
    ordered = sorted(ladder)

    def choose(rows: int, slots: int) -> tuple[int, int]:
        for r, t in ordered:
            if r >= rows and t >= slots:
                return r, t
        raise ValueError(f"no packed shape of {ordered} holds {rows} rows and {slots} slots")

    return choose


def pow2_buckets(limit: int, minimum: int = 16) -> list[int]:
    """Every value `bucket(n, limit, minimum)` can take: powers of two from `minimum`, capped at `limit`."""
    out, b = [], minimum
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def _check_packable(rb: RolloutBatch, n_micro: int, groups: int, width: int) -> None:
    s = rb.completion.shape[0]
    if s % n_micro or (s // n_micro) % groups:
        raise ValueError(f"{s} sequences do not split into {n_micro} micro-batches x {groups} device groups")
    if width < rb.tokens.shape[1]:
        raise ValueError(f"packed width {width} below the batch's {rb.tokens.shape[1]} columns")
    if np.any((rb.mask[:, :rb.prompt_len].sum(axis=1) == 0) & (rb.completion_mask > 0).any(axis=1)):
        raise ValueError("a sequence with an empty prompt: nothing predicts its first completion token")


def _first_fit_decreasing(items: list[tuple[int, int]], width: int) -> list[list[tuple[int, int]]]:
    """(length, sequence) items -> rows of (sequence, length) of at most `width` tokens: longest first, each into
    the first row with room for it."""
    rows: list[list[tuple[int, int]]] = []
    free: list[int] = []
    for length, x in sorted(items, reverse=True):
        for q, f in enumerate(free):
            if f >= length:
                rows[q].append((x, length))
                free[q] -= length
                break
        else:
            rows.append([(x, length)])
            free.append(width - length)
    return rows


def packed_batch(rb: RolloutBatch, *, n_micro: int = 1, groups: int = 1,
                 choose_shape=None, width: int | None = None) -> UpdateBatch:
    """The update batch with no padding computed: each sequence's real tokens packed into rows of the
    batch's width (prompt bucket + max_new_tokens), several sequences per row (first-fit decreasing), each
    with its own positions and a segment id that confines its attention to itself (`Decoder.hidden(segments=)`).

    Only the tokens a loss term needs go in: the prompt and the completion up to its last token with a
    nonzero completion_mask, minus that last token (nothing is predicted from it). A sequence with no
    such token (e.g. a masked truncated completion) costs nothing.

    Layout, so that `step.micro_batches` and the batch sharding over `groups` (= data x fsdp devices)
    keep every sequence with its own rows: sequence s belongs to micro-batch i = s % n_micro and, within
    it, to device block d of the K = S / n_micro rows (K / groups each, as the strided micro-batch split
    and a leading-dim sharding place it). Each (i, d) group gets R packed rows (row (d * R + q) *
    n_micro + i) and Tg completion-token slots (row d * n_micro + i of `src`/`target`/`dest`):

      tokens / positions / segments [n_micro * groups * R, W]: packed inputs (pad: token 0, position -1,
        segment 0);
      src [groups * n_micro, Tg]: flat index q * W + column of the hidden state predicting each needed
        completion token within its group's rows; target: that token; dest: local sequence * N + j, its
        place in the group's [K / groups, N] log-prob grid (padding slots: K / groups * N, dropped);
      completion_mask / behaviour_logp [S, N], advantages [S]: as `padded_batch(rb)`.

    R and Tg: the largest over groups, rounded up by `choose_shape(rows, slots)` -> (R, Tg) (default
    `packed_buckets`; the trainer picks from its fixed `packed_ladder`). W: `width` (the trainer passes
    max_prompt_len + max_new_tokens, so the shape does not follow the rollout's prompt bucket), default the
    batch's own width."""
    s, n = rb.completion.shape
    prompt_len = rb.prompt_len
    width = rb.tokens.shape[1] if width is None else width
    _check_packable(rb, n_micro, groups, width)
    k_loc = s // n_micro // groups
    real = rb.mask.astype(bool)
    cmask = rb.completion_mask > 0
    needed = np.where(cmask.any(axis=1), n - np.argmax(cmask[:, ::-1], axis=1), 0)  # completion tokens used
    n_prompt = real[:, :prompt_len].sum(axis=1)

    # place every sequence: group -> rows of (sequence, length); and each group's completion slots
    rows_of: dict[tuple[int, int], list[list[tuple[int, int]]]] = {}
    slots_needed = 0
    for g_i in range(n_micro):
        for g_d in range(groups):
            members = [k * n_micro + g_i for k in range(g_d * k_loc, (g_d + 1) * k_loc)]
            slots_needed = max(slots_needed, int(needed[members].sum()))
            rows_of[(g_i, g_d)] = _first_fit_decreasing(
                [(int(n_prompt[x] + needed[x] - 1), x) for x in members if needed[x]], width)
    rows_needed = max(len(v) for v in rows_of.values())
    r_rows, t_slots = (choose_shape or packed_buckets)(rows_needed, slots_needed)
    if r_rows < rows_needed or t_slots < slots_needed:
        raise ValueError(f"packed shape ({r_rows} rows, {t_slots} slots) below the needed ({rows_needed}, {slots_needed})")

    tokens = np.zeros((n_micro * groups * r_rows, width), np.int32)
    positions = np.full_like(tokens, -1)
    segments = np.zeros_like(tokens)
    experts = None if rb.experts is None else np.full(tokens.shape + rb.experts.shape[2:], UNRECORDED, np.uint8)
    src = np.zeros((groups * n_micro, t_slots), np.int32)
    target = np.zeros_like(src)
    dest = np.full_like(src, k_loc * n)
    for (g_i, g_d), rows in rows_of.items():
        slot, grow = 0, g_d * n_micro + g_i
        for q, row in enumerate(rows):
            r, col = (g_d * r_rows + q) * n_micro + g_i, 0
            for seg, (x, length) in enumerate(row, start=1):
                seq = rb.tokens[x][real[x]][:length]  # prompt then completion, padding dropped
                tokens[r, col:col + length] = seq
                if experts is not None:
                    experts[r, col:col + length] = rb.experts[x][real[x]][:length]
                positions[r, col:col + length] = np.arange(length)
                segments[r, col:col + length] = seg
                m = int(needed[x])
                first = int(n_prompt[x]) - 1  # the prompt's last token predicts completion token 0
                src[grow, slot:slot + m] = q * width + col + first + np.arange(m)
                target[grow, slot:slot + m] = rb.completion[x, :m]
                dest[grow, slot:slot + m] = ((x // n_micro) % k_loc) * n + np.arange(m)
                slot += m
                col += length
    return UpdateBatch(layout="pack", tokens=tokens, positions=positions, segments=segments, src=src, target=target,
                       dest=dest, completion_mask=rb.completion_mask, behaviour_logp=rb.behaviour_logp,
                       advantages=rb.advantages, experts=experts)
