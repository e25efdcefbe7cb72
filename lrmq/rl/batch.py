"""Rollout batches: prompts + sampled completions -> the fixed-shape arrays the train step consumes."""

from __future__ import annotations

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
