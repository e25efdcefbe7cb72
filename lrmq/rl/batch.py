"""Rollout batches: prompts + sampled completions -> the fixed-shape arrays the train step consumes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass
class RolloutBatch:
    """Host-side arrays for S = prompts x G sequences; prompt length P, completion length N (fixed)."""

    tokens: np.ndarray  # [S, P+N] int32: left-padded prompt then completion (pad after its end)
    mask: np.ndarray  # [S, P+N] int32: 1 on real prompt and completion tokens
    completion: np.ndarray  # [S, N] int32
    completion_mask: np.ndarray  # [S, N] float32
    old_logp: np.ndarray  # [S, N] float32: rollout log-probs (the importance-ratio denominator)
    advantages: np.ndarray  # [S] float32
    rewards: np.ndarray  # [S] float32

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    def arrays(self) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens, "mask": self.mask, "completion": self.completion,
                "completion_mask": self.completion_mask, "old_logp": self.old_logp, "advantages": self.advantages}


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
                        old_logp=(logprobs * cmask).astype(np.float32), advantages=advantages.astype(np.float32),
                        rewards=rewards.astype(np.float32))


def truncated_rows(completion: np.ndarray, lengths: np.ndarray, eos_ids) -> np.ndarray:
    """[S] bool: completions cut at the length budget, i.e. whose last token is not an EOS (TRL's
    `mask_truncated_completions` test; a completion ending with EOS exactly at the budget is complete)."""
    n = completion.shape[1]
    last = completion[np.arange(len(lengths)), np.clip(lengths - 1, 0, n - 1)]
    return (lengths >= n) & ~np.isin(last, np.asarray(list(eos_ids)))


def mask_rows(rb: RolloutBatch, rows: np.ndarray) -> RolloutBatch:
    """The batch with no loss on `rows` (their completion_mask zeroed; attention keeps them intact)."""
    cmask = rb.completion_mask * (~rows)[:, None].astype(np.float32)
    return dataclasses.replace(rb, completion_mask=cmask, old_logp=rb.old_logp * cmask)


def bucket(n: int, limit: int, minimum: int = 16) -> int:
    """The next power of two >= n (at least `minimum`), capped at `limit`."""
    b = minimum
    while b < n:
        b *= 2
    return min(b, limit)


def bucketed_arrays(rb: RolloutBatch, prompt_len: int) -> dict[str, np.ndarray]:
    """`rb.arrays()` narrowed to the next power of two of the batch's longest prompt and completion.

    Prompts are left-padded and positions come from the mask, so dropping all-padding columns on the
    left of the prompt and on the right of the completion changes no log-prob; the update then
    computes on the batch's real width instead of max_prompt_len + max_new_tokens, with one compile
    per bucket pair."""
    arrays = rb.arrays()
    n = rb.completion.shape[1]
    real = rb.mask.astype(bool)
    longest_prompt = int(real[:, :prompt_len].sum(axis=1).max(initial=0))
    longest_completion = int(real[:, prompt_len:].sum(axis=1).max(initial=0))
    pb, cb = bucket(longest_prompt, prompt_len), bucket(longest_completion, n)
    if (pb, cb) == (prompt_len, n):
        return arrays
    cols = np.r_[prompt_len - pb:prompt_len, prompt_len:prompt_len + cb]
    out = {k: arrays[k][:, cols] for k in ("tokens", "mask")}
    out.update({k: arrays[k][:, :cb] for k in ("completion", "completion_mask", "old_logp")})
    out["advantages"] = arrays["advantages"]
    return out
