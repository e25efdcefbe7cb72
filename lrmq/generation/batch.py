"""What crosses the jit boundary of the generation engine: one pytree of inputs per device call.

The host scheduler (`lrmq.generation.scheduler`) fills a `PrefillBatch` for the prompts it admits and a
`DecodeBatch` per decode call; `Engine.warmup` compiles on `zeros`, the ahead-of-time compiles lower on
`abstract` (`Engine.abstract_calls`). A decode call returns the pool and a `DecodeOutput`.

Each field is declared once, with its dtype, its trailing shape (named sizes: "width", "length", ...) and the
value an idle row holds; `zeros`, `abstract` and the programs' signatures follow from the declaration. A new
per-row input (a KV scale, a per-row temperature) is one field here, the line of `Scheduler.plan` that fills it
and the device code that reads it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from lrmq.generation.kv_pool import NULL_PAGE
from lrmq.sharding import batch_sharding


@functools.cache
def key_data() -> jax.ShapeDtypeStruct:
    """Shape and dtype of one sequence's raw key data (`jax.random.key_data` of the default key)."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))


def _input(dtype, *trailing: str, fill=0, per_row: bool = True):
    """A field: [rows, *trailing] (per_row) or [*trailing] of `dtype` ("key": the raw key data's), holding `fill`
    where idle."""
    return struct.field(metadata={"input": (dtype, trailing, fill, per_row)})


class _Inputs:
    """`zeros` / `abstract` of a dataclass whose fields are `_input`s."""

    @classmethod
    def _build(cls, rows: int, dims: dict[str, int], make):
        out = {}
        for f in dataclasses.fields(cls):
            dtype, trailing, fill, per_row = f.metadata["input"]
            shape = tuple(key_data().shape if d == "key" else (dims[d],) for d in trailing)
            shape = sum(shape, (rows,) if per_row else ())
            out[f.name] = make(shape, np.dtype(key_data().dtype if dtype == "key" else dtype), fill, per_row)
        return cls(**out)

    @classmethod
    def _zeros(cls, rows: int, **dims):
        return cls._build(rows, dims, lambda shape, dtype, fill, _: np.full(shape, fill, dtype))

    @classmethod
    def _abstract(cls, rows: int, mesh, **dims):
        def sds(shape, dtype, _, per_row):
            sharding = None
            if mesh is not None:  # rows over the data axes, the rest replicated
                sharding = batch_sharding(mesh, len(shape)) if per_row else NamedSharding(mesh, P())
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        return cls._build(rows, dims, sds)

    @property
    def rows(self) -> int:
        return len(self.page_table)  # every batch has one, a row each


@struct.dataclass
class PrefillBatch(_Inputs):
    """Prompts to write into their pages, one a row: tokens at positions 0..n-1, padding at -1 after them."""

    tokens: Any = _input(np.int32, "length")
    positions: Any = _input(np.int32, "length", fill=-1)
    page_table: Any = _input(np.int32, "pages")  # the prompt's pages

    @classmethod
    def zeros(cls, rows: int, length: int, pages: int) -> "PrefillBatch":
        return cls._zeros(rows, length=length, pages=pages)

    @classmethod
    def abstract(cls, rows: int, length: int, pages: int, mesh=None) -> "PrefillBatch":
        return cls._abstract(rows, mesh, length=length, pages=pages)


@struct.dataclass
class DecodeBatch(_Inputs):
    """The decode program's inputs, one row a slot (`Scheduler.plan`); idle rows (`live` False) decode nothing."""

    page_table: Any = _input(np.int32, "width")  # the row's pages: its prompt's full shared ones, then its own
    # before the first step page copy_src[r] is copied to copy_dst[r] (copy on write of a shared prompt's partly
    # filled last page into the row's own first page; NULL_PAGE to NULL_PAGE: nothing)
    copy_src: Any = _input(np.int32, fill=NULL_PAGE)
    copy_dst: Any = _input(np.int32, fill=NULL_PAGE)
    tokens: Any = _input(np.int32)  # the next input: the last token sampled, or the prompt's last
    positions: Any = _input(np.int32)  # its position
    generated: Any = _input(np.int32)  # tokens sampled so far: token t is sampled with fold_in(key, t)
    max_new: Any = _input(np.int32, fill=1)  # the row's token budget
    live: Any = _input(np.bool_)
    keys: Any = _input("key", "key")  # the sequence's raw key data
    stop_below: Any = _input(np.int32, per_row=False)  # back to the host once fewer rows than this are live
    # ... or once every data group has fewer live rows than this (`keeps_decoding`; the scheduler's `group_rows`)
    group_stop_below: Any = _input(np.int32, per_row=False)

    @classmethod
    def zeros(cls, rows: int, width: int) -> "DecodeBatch":
        """Host arrays of `rows` idle rows (what `Scheduler.plan` fills; `Engine.warmup` runs it as is)."""
        return cls._zeros(rows, width=width)

    @classmethod
    def abstract(cls, rows: int, width: int, mesh=None) -> "DecodeBatch":
        """ShapeDtypeStructs of a batch of `rows`, laid out for `mesh`, for ahead-of-time compiles."""
        return cls._abstract(rows, mesh, width=width)


def keeps_decoding(live, stop_below, group_stop_below, groups: int = 1):
    """Whether a decode call goes on with these `live` rows [rows] (numpy on the host's fakes, jax in the program):
    some row is live, at least `stop_below` in all, and at least `group_stop_below` in the fullest of `groups` data
    groups (group g: rows [g * rows / groups, (g + 1) * rows / groups))."""
    xp = np if isinstance(live, np.ndarray) else jax.numpy
    per_group = xp.sum(live.reshape(groups, -1), axis=1)
    return xp.any(live) & (xp.sum(live) >= stop_below) & (xp.max(per_group) >= group_stop_below)


@struct.dataclass
class DecodeOutput:
    """What a decode call gives back: per row the tokens it sampled in this call and their log-probabilities
    ([rows, sync_steps], pad / 0 after the row stopped), its `generated` count after the call, and whether it is
    still live (False: it stopped at an EOS or its budget, or was idle). `experts` (an engine recording them,
    `EngineConfig.record_experts`; else None): [rows, sync_steps, sparse layers, k] uint8, the experts each step's
    input token ran (the prompt's last token, then each sampled token but the last), zeros after the row stopped."""

    tokens: Any
    logprobs: Any
    generated: Any
    live: Any
    experts: Any = None
