"""The messages between the Sampler and the Learner (`lrmq.rl.sampler`, `lrmq.rl.learner`, `lrmq.rl.loop`).

Nothing else crosses between the two: the learner sends `WeightVersion`s, the sampler returns `Rollout`s stamped
with the version they were sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flax import struct

from lrmq.rl.batch import RolloutBatch


@struct.dataclass
class WeightVersion:
    """The weights a sampler samples from, as of `version` learner updates: `states` is the pytree the sampler's
    rollout engine reads (the policy's (trainable, rest), or with rollout.quant the packed copy's (packed, shared))
    on the sampler's mesh in the decode layout; `packed`: whether they are the packed copy; `nbytes`: their bytes
    (what a sync moves, all devices together). A pytree: `states` are its leaves, the rest static."""

    states: Any
    version: int = struct.field(pytree_node=False)
    packed: bool = struct.field(pytree_node=False, default=False)
    nbytes: int = struct.field(pytree_node=False, default=0)


def tree_bytes(tree) -> int:
    """Bytes of every array of `tree` (global shapes)."""
    import jax

    return int(sum(int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


@dataclass
class Rollout:
    """What one rollout produced: the batch to train on, its statistics (reward/*, completion/*, prompt/*, perf/*,
    rollout/*), one record per completion (completions.jsonl) and whether the reward failed on every comparison
    (the batch is then not trained on); `index`: the data batch it holds (0-based; step index + 1 trains on it),
    `version`: the WeightVersion it was sampled from; `prompts`: that data batch (problems, answers), so a rollout
    dropped as stale can be sampled anew from the same prompts."""

    batch: RolloutBatch
    stats: dict[str, float]
    completions: list[dict]
    reward_failed: bool
    index: int = 0
    version: int = 0
    prompts: dict = field(default_factory=dict)
