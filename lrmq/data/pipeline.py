"""Prompt batches for RL: a grain MapDataset that shuffles, shards by process, repeats and batches.

    source -> shuffle(seed) -> [pi : n - n % pc : pc] -> repeat(num_epochs) -> batch(B, drop_remainder)

Every process gets the same number of records (the n % pc remainder of each epoch's shuffle is
dropped), so multi-host steps stay in lockstep. grain reshuffles each epoch (seed + epoch).
The iterator state is a small JSON-able dict; restoring it continues with exactly the next batch.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import grain

_STATE_VERSION = 1


def _collate(rows: Sequence[dict]) -> dict[str, list]:
    # dict of lists (not grain's default np.stack): prompts are variable-length strings.
    return {k: [r[k] for r in rows] for k in rows[0]}


class PromptPipeline:
    """Iterator over `{"problem": [...], "answer": [...], ...}` batches of `batch_size` prompts.

    `records`: a list of dicts or a `datasets.Dataset` (anything with `len` and `__getitem__ -> dict`).
    `batch_size` counts prompts per process per step. `num_epochs=None` repeats forever.
    """

    def __init__(
        self,
        records: Any,
        *,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        num_epochs: Optional[int] = None,
        process_index: Optional[int] = None,
        process_count: Optional[int] = None,
        read_threads: int = 0,
    ):
        if process_index is None or process_count is None:
            import jax  # only when the caller does not say which process this is

            process_index = jax.process_index() if process_index is None else process_index
            process_count = jax.process_count() if process_count is None else process_count
        n = len(records)
        if n == 0:
            raise ValueError("PromptPipeline: records is empty")
        if batch_size < 1:
            raise ValueError(f"PromptPipeline: batch_size must be >= 1, got {batch_size}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"PromptPipeline: process_index {process_index} not in [0, {process_count})")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"PromptPipeline: num_epochs must be >= 1 or None, got {num_epochs}")
        shard_len = n // process_count
        if shard_len < batch_size:
            raise ValueError(
                f"PromptPipeline: {n} records over {process_count} processes leave {shard_len} per process, "
                f"fewer than batch_size={batch_size}"
            )
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self.process_index = process_index
        self.process_count = process_count
        self.num_records = n
        self.steps_per_epoch = shard_len // batch_size  # a batch may straddle epochs when repeating

        ds = grain.MapDataset.source(records)
        if shuffle:
            ds = ds.shuffle(seed=seed)
        ds = ds[process_index : shard_len * process_count : process_count]
        ds = ds.repeat(num_epochs)
        self._dataset = ds.batch(batch_size, drop_remainder=True, batch_fn=_collate)
        opts = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=2 * read_threads)
        self._iter = self._dataset.to_iter_dataset(opts).__iter__()

    @property
    def dataset(self) -> grain.MapDataset:
        """The batched MapDataset (random access: `dataset[k]` is batch k)."""
        return self._dataset

    def __iter__(self) -> "PromptPipeline":
        return self

    def __next__(self) -> dict[str, list]:
        return next(self._iter)

    def _identity(self) -> dict:
        return {
            "num_records": self.num_records,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_epochs": self.num_epochs,
            "process_index": self.process_index,
            "process_count": self.process_count,
        }

    def get_state(self) -> dict:
        """JSON-serializable; includes the settings it is only valid for."""
        return {"version": _STATE_VERSION, **self._identity(), "grain": copy.deepcopy(self._iter.get_state())}

    def set_state(self, state: dict) -> None:
        """Continue exactly after the batch at which `state` was taken; refuses a different pipeline."""
        if state.get("version") != _STATE_VERSION or "grain" not in state:
            raise ValueError(f"PromptPipeline.set_state: not a version-{_STATE_VERSION} pipeline state: keys {sorted(state)}")
        mine = self._identity()
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"PromptPipeline.set_state: state is from a different pipeline ({detail})")
        self._iter.set_state(copy.deepcopy(state["grain"]))
