"""The generation engine: continuous batching over a paged KV cache (`lrmq.generation.paged`, `kv_pool`).

A fixed number of decode slots share a pool of fixed-size KV pages; each slot has a page table. A
request (prompt, per-sequence key, token budget) waits in a queue until a slot is free, then decodes in
that slot; when it stops (an EOS token or its budget) its pages return to the pool and the next request
takes the slot. Every device shape is static: one decode compile per (slots, pages, page table width),
one prefill compile per (rows, prompt length) bucket, never one per step.

* Prompts are deduplicated: requests with the same prompt (a GRPO group's G samples, an evaluation
  item's n samples) prefill it once and share its full pages; the partly filled last page is copied into
  each sample's own first page (copy on write), and the prompt's last token is fed as each sample's
  first decode input, so nothing else differs between a shared and an unshared prompt.
* Token t of a sequence is sampled with `fold_in(key_of_sequence, t)`: results do not depend on the
  slot, the pages, the batch composition or the order in which the scheduler admits requests.
* The host schedules (`lrmq.generation.scheduler.Scheduler`: admission, pages, preemption, row buckets), the
  device decodes: one call takes a `DecodeBatch` (`lrmq.generation.batch`) and runs up to `sync_steps` decode
  steps in a `lax.while_loop`, returning early when a row finishes while requests wait (its slot is refilled),
  or, with nobody waiting, when the live rows fit a smaller row bucket (the slots, and the data-parallel
  divisor times powers of 4 below them): they then move to the front and decode in that program, so a long
  tail runs at the cost of its own rows. `warmup` compiles every bucket's programs ahead of a run. Pages are
  reserved `sync_steps` tokens ahead; when the pool runs out the youngest slot is preempted and recomputed
  later (same key, so the same tokens). `generate` is the loop: admit -> prefill -> reserve -> plan -> decode
  -> apply.
* Before a call the layers are stacked once into their decode layout (`layer_runs`); the loop body scans
  over them, and on a mesh the weights are relaid once per call (tensor parallel, `sharding.DECODE_RULES`),
  never moved per token.

Returns generated ids, the log-probability of each sampled token (temperature applied, before top-k/top-p
truncation: the quantity GRPO's importance ratio uses), lengths (the EOS token is counted and kept) and the
scheduler's counters (`GenerationResult.stats`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrmq.generation.batch import DecodeBatch, DecodeOutput, PrefillBatch, keeps_decoding
from lrmq.generation.attention import kv_format, resolve_impl
from lrmq.generation.kv_format import KVFormat, check_kv_cache
from lrmq.generation.kv_pool import (KVScales, QuantPool, abstract_pool, check_kv_scales, copy_pages, fitted_pages,
                                     kv_groups, new_pool, page_bytes, pages_for, pool_scales, pool_shape, with_scales)
from lrmq.generation.paged import PagedCache
from lrmq.generation.sampling import SamplingConfig, sample
from lrmq.generation.scheduler import (Scheduler, Seq, SharedPrompt, check_kv_pages, pages_for_one_sequence,
                                      prefill_rows, row_buckets)
from lrmq.model.decoder import Decoder, layer_runs
from lrmq.sharding import DECODE_RULES, batch_divisor, constrain_state, host_array, state_shardings, use_rules


@dataclass
class GenerationResult:
    tokens: np.ndarray  # [B, max_new_tokens] int32, pad after the end
    logprobs: np.ndarray  # [B, max_new_tokens] float32, 0 after the end
    lengths: np.ndarray  # [B] int32, generated tokens including EOS
    # what the call did (`Scheduler.stats`): decode_calls, prefill_calls, prefilled_prompts, preempted, steps;
    # with a quantized KV cache also kv_saturated: K / V entries clipped at the format's max (`kv_pool.QuantPool`)
    stats: dict[str, int] = field(default_factory=dict)
    # fp8 KV cache: the per-layer / KV-head scales the call wrote under (calibrated on its first prefill, or the
    # `kv_scales` it was given); pass them to a later call to keep them (`rollout.kv_scale_refresh`). None else
    kv_scales: KVScales | None = None
    # an engine recording experts (`EngineConfig.record_experts`): per sequence, [prompt + generated - 1, sparse
    # layers, k] uint8, the experts each token the sampler ran went through (every prompt token, then every
    # generated token but the last, which nothing ran); None else
    experts: list[np.ndarray] | None = None


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine (see the module docstring)."""

    slots: int = 0  # decode slots: sequences decoded at once (0 = all requests of a call, at most 256)
    page_size: int = 16  # tokens per KV page
    # KV pages in the pool (0 = sized by pool_bytes, else enough that no request is ever preempted); on a mesh whose
    # data groups split the pages (`kv_pool.kv_groups`), rounded up to a multiple of the groups, each holding its share
    pages: int = 0
    # with pages=0: bytes per device the pool may take (`kv_pool.pool_budget`: a share of the device's memory less
    # what else lives there); the pool is the worst case capped to it (`kv_pool.fitted_pages`). 0 = no limit
    pool_bytes: int = 0
    block_pages: int = 8  # pages read per block of decode attention
    sync_steps: int = 64  # decode steps per device call at most (pages are reserved this far ahead)
    # the pages' format (`kv_format.KV_CACHE_FORMATS`): auto = the model's dtype; bf16; fp8_e4m3 / fp8_e5m2 / int8
    # quantized with their scales (`kv_pool.QuantPool`); resolved with the attention into one `KVFormat`
    kv_cache: str = "auto"
    # decode attention (`attention.DECODE_ATTENTION`; "auto": the compile target's kernel where it takes the call, else
    # XLA): rollout.decode_attention / generation.decode_attention / --decode-attention
    attention: str = "auto"
    # mixture-of-experts models: the programs also return the experts every token ran (GenerationResult.experts),
    # for routing replay (rollout.routing_replay)
    record_experts: bool = False

    def __post_init__(self):
        check_kv_cache(self.kv_cache, "engine.kv_cache")
        for name in ("slots", "pages", "pool_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"engine.{name} must be >= 0 (got {getattr(self, name)})")
        for name in ("page_size", "block_pages", "sync_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name} must be >= 1 (got {getattr(self, name)})")


def bucket_length(n: int, minimum: int = 16) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), np.int32)
    for i, p in enumerate(prompts):
        if len(p) > length:
            raise ValueError(f"prompt {i} has {len(p)} tokens, more than the {length} allowed")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        tokens[i, length - len(p):] = p
        mask[i, length - len(p):] = 1
    return tokens, mask


def sequence_keys(key: jax.Array, n: int) -> np.ndarray:
    """Raw key data of `fold_in(key, i)` for i < n: sequence i's key, whatever batch it runs in."""
    return np.asarray(jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(key, i)))(jnp.arange(n)))


# ----------------------------------------------------------------------------- device programs


def engine_impl(c: EngineConfig, model_cfg, mesh=None) -> str:
    """The decode attention a call of an engine of config `c` takes (`attention.resolve_impl` for the compile target:
    the mesh's devices, or a `pallas_kernels.target`)."""
    requested = KVFormat(c.kv_cache)
    return resolve_impl(c.attention, model_cfg.num_heads, pool_shape(model_cfg, 1, c.page_size),
                        requested.dtype(model_cfg), mesh=mesh, scaled=requested.quantized)


def engine_format(c: EngineConfig, model_cfg, mesh=None) -> KVFormat:
    """The resolved KV format of an engine's pool (`attention.kv_format` of its `engine_impl`)."""
    return kv_format(c.kv_cache, engine_impl(c, model_cfg, mesh))


def call_sizes(c: EngineConfig, model_cfg, mesh, n_requests: int, longest_prompt: int,
               max_new: int) -> tuple[int, int, int, int]:
    """(slots, pages, page-table width, the worst case's pages) of an engine call (`Engine.sizes`); the width
    covers the longest prompt's bucket; slots are a multiple of the mesh's data-parallel divisor. On a mesh whose
    data groups split the pool (`kv_pool.kv_groups`), each group is sized for its own slots (its worst case, or
    its share of `pool_bytes` per device): `pages` is the groups' pages in all."""
    multiple = batch_divisor(mesh) if mesh is not None else 1
    groups = kv_groups(mesh, model_cfg.num_kv_heads)
    slots = c.slots or min(n_requests, 256)
    slots = -(-slots // multiple) * multiple
    prompt = bucket_length(longest_prompt)
    own = pages_for(max_new + c.sync_steps, c.page_size) + 2  # from the prompt's partial page on
    width = pages_for(prompt, c.page_size) + own
    width = -(-width // c.block_pages) * c.block_pages
    worst = 1 + slots // groups * (own + pages_for(prompt, c.page_size))  # every slot at full length: no preemption
    if c.pages:
        per_group = -(-c.pages // groups)
    elif not c.pool_bytes:  # no budget: the worst case (the format's bytes per page do not matter)
        per_group = worst
    else:
        per_group = fitted_pages(c.pool_bytes, page_bytes(model_cfg, c.page_size, mesh,
                                                          engine_format(c, model_cfg, mesh)),
                                 worst, minimum=1 + own + pages_for(prompt, c.page_size))
    return slots, groups * per_group, width, groups * worst


def pool_info(c: EngineConfig, model_cfg, mesh, n_requests: int, longest_prompt: int, max_new: int) -> dict:
    """The KV pool an engine call of these sizes allocates: its pages (in all), the tokens they hold (the null
    pages aside), the data groups splitting them, its bytes per device (its group's pages), the worst case's pages
    (nothing ever preempted), the slots, and how it was sized ("kv_pages": set; "fitted": to `pool_bytes`, below
    the worst case; "worst case")."""
    slots, pages, _, worst = call_sizes(c, model_cfg, mesh, n_requests, longest_prompt, max_new)
    groups = kv_groups(mesh, model_cfg.num_kv_heads)
    return {"pages": pages, "tokens": (pages - groups) * c.page_size, "page_size": c.page_size, "groups": groups,
            "bytes_per_device": pages // groups * page_bytes(model_cfg, c.page_size, mesh,
                                                             engine_format(c, model_cfg, mesh)),
            "worst_case_pages": worst, "slots": slots,
            "sized": "kv_pages" if c.pages else "fitted" if pages < worst else "worst case"}


def _merge(graphdef, state) -> Decoder:
    return nnx.merge(graphdef, *(state if isinstance(state, tuple) else (state,)))


def _token_experts(experts):
    """`Decoder.hidden_runs`' experts [sparse layers, B, T, k] -> [B, T, sparse layers, k] uint8 (ids < 256)."""
    return jnp.moveaxis(experts, 0, 2).astype(jnp.uint8)


def _prefill_fn(graphdef, state, pool, batch: PrefillBatch, *, engine: EngineConfig, layout):
    """(the pool, the prompts' experts [rows, length, sparse layers, k] uint8 with `engine.record_experts`, else
    None)."""
    model = _merge(graphdef, state)
    runs = layout(model)
    cache = PagedCache(pool, batch.page_table, jnp.ones(batch.rows, bool), mode="prefill",
                       block_pages=engine.block_pages)
    _, cache, experts = model.hidden_runs(runs, batch.tokens, batch.positions, cache)
    return cache.pool, (_token_experts(experts) if engine.record_experts else None)


def _decode_fn(graphdef, state, pool, batch: DecodeBatch, *, engine: EngineConfig, sampling: SamplingConfig,
               eos: tuple[int, ...], pad_id: int, impl: str, layout, groups: int) -> tuple[object, DecodeOutput]:
    """Up to `sync_steps` decode steps of the batch's live rows (a `lax.while_loop`), back to the host early
    when `keeps_decoding` says so (fewer than `batch.stop_below` rows live, or the fullest of `groups` data groups
    under `batch.group_stop_below`)."""
    model = _merge(graphdef, state)
    runs = layout(model)  # once per call: the loop below reads these (and the embedding / lm head)
    pool = copy_pages(pool, batch.copy_src, batch.copy_dst)  # copy-on-write of shared prompts' last pages
    keys, max_new, page_table = jax.random.wrap_key_data(batch.keys), batch.max_new, batch.page_table
    eos_arr = jnp.asarray(eos, jnp.int32)
    s, steps = batch.rows, engine.sync_steps
    out_tok = jnp.full((s, steps), pad_id, jnp.int32)
    out_lp = jnp.zeros((s, steps), jnp.float32)
    record = engine.record_experts
    sparse = model.cfg.moe_layers
    out_exp = (jnp.zeros((s, steps, len(sparse), model.cfg.num_experts_per_tok), jnp.uint8) if record else None)

    def cond(c):  # up to sync_steps; back to the host once the live rows say so
        i, _, _, _, _, live, _, _, _ = c
        return (i < steps) & keeps_decoding(live, batch.stop_below, batch.group_stop_below, groups)

    def body(c):
        i, pool, tok, pos, gen, live, out_tok, out_lp, out_exp = c
        cache = PagedCache(pool, page_table, live, mode="decode", block_pages=engine.block_pages, impl=impl)
        h, cache, experts = model.hidden_runs(runs, tok[:, None], pos[:, None], cache)
        if record:  # the experts this step's input token ran
            ran = _token_experts(experts)[:, 0]
            out_exp = out_exp.at[:, i].set(jnp.where(live[:, None, None], ran, 0))
        logits = model.logits(h)[:, 0]
        step_keys = jax.vmap(jax.random.fold_in)(keys, gen)
        nxt, lp = jax.vmap(lambda k, lg: sample(k, lg[None], sampling))(step_keys, logits)
        nxt, lp = nxt[:, 0], lp[:, 0]
        out_tok = out_tok.at[:, i].set(jnp.where(live, nxt, pad_id))
        out_lp = out_lp.at[:, i].set(jnp.where(live, lp, 0.0))
        gen = gen + live.astype(jnp.int32)
        done = live & (jnp.isin(nxt, eos_arr) | (gen >= max_new))
        return i + 1, cache.pool, nxt, pos + 1, gen, live & ~done, out_tok, out_lp, out_exp

    init = (jnp.int32(0), pool, batch.tokens, batch.positions, batch.generated, batch.live, out_tok, out_lp, out_exp)
    _, pool, _, _, gen, live, out_tok, out_lp, out_exp = jax.lax.while_loop(cond, body, init)
    return pool, DecodeOutput(out_tok, out_lp, gen, live, out_exp)


def decode_layout(mesh):
    """model -> its stacked layer runs, every weight constrained to `DECODE_RULES` (tensor parallel over tensor
    x fsdp, whole over the model dimension): inside the jitted call this relays the FSDP shards once, before
    the decode loop. The embedding, final norm and lm head (outside the runs) are laid out in place, or XLA
    gathers them per step."""
    def layout(model):
        for part in (model.embed, model.final_norm, model.lm_head):
            if part is not None:
                nnx.update(part, constrain_state(nnx.state(part), mesh, DECODE_RULES))
        return [run.replace(state=constrain_state(run.state, mesh, DECODE_RULES, stacked=True))
                for run in layer_runs(model.layers)]

    return layout


class _OnMesh:
    """A jitted program traced, run and lowered under `jax.set_mesh(mesh)` and the decode rules: the paged cache's
    kernels (shard_map over the pool's KV heads), the packed-weight kernels (`qmatmul`, over the weights' decode
    layout) and the activation constraints read the mesh and rules in effect when it is traced."""

    def __init__(self, fn, mesh):
        self.fn, self.mesh = fn, mesh

    def __call__(self, *args):
        with jax.set_mesh(self.mesh), use_rules(DECODE_RULES):
            return self.fn(*args)

    def lower(self, *args):
        with jax.set_mesh(self.mesh), use_rules(DECODE_RULES):
            return self.fn.lower(*args)


def _on_mesh(fn, mesh):
    return fn if mesh is None else _OnMesh(fn, mesh)


# ----------------------------------------------------------------------------- the engine


class Engine:
    """Compiled prefill/decode programs for a model; reuse it across calls (rollouts, evaluation)."""

    def __init__(self, model: Decoder | None, *, eos_ids: Sequence[int], pad_id: int,
                 config: EngineConfig = EngineConfig(), graphdef=None, model_cfg=None, mesh=None):
        if not eos_ids:
            raise ValueError("eos_ids is empty: generation needs at least one stop token")
        # graphdef: pass the one from an `nnx.split(model, filter, ...)` to generate from split states
        self.graphdef = graphdef if graphdef is not None else nnx.split(model)[0]
        self.model_cfg = model_cfg if model_cfg is not None else model.cfg
        self.eos = tuple(int(e) for e in eos_ids)
        self.pad_id = int(pad_id)
        self.config = config  # complete and fixed: nothing changes it after construction
        self.mesh = mesh
        if config.record_experts and not self.model_cfg.num_experts:
            raise ValueError("engine.record_experts: the model is dense (no experts to record)")
        # on a mesh: slots split over the data axes, weights in the decode layout (`decode_layout`), the pool's pages
        # over the data groups (`kv_pool.kv_groups`: the scheduler allocates each group's own)
        self.slot_multiple = batch_divisor(mesh) if mesh is not None else 1
        self.groups = kv_groups(mesh, self.model_cfg.num_kv_heads)
        self.layout = decode_layout(mesh) if mesh is not None else (lambda model: layer_runs(model.layers))
        self._prefill = _on_mesh(jax.jit(partial(_prefill_fn, self.graphdef, engine=config, layout=self.layout),
                                         donate_argnums=(1,)), mesh)
        self._decode: dict = {}
        self.resolved_impl()  # a choice it refuses (fp8 pages at 1 KV head per TPU chip) fails here, before compiling

    def resolved_impl(self, mesh=None) -> str:
        """The decode attention a call made now takes (`engine_impl`: for the compile target of the mesh's devices,
        or a `pallas_kernels.target`); its pool's format is `kv_format(impl)`."""
        return engine_impl(self.config, self.model_cfg, mesh if mesh is not None else self.mesh)

    def kv_format(self, impl: str) -> KVFormat:
        """The resolved format of this engine's pool as decode attention `impl` reads it (`attention.kv_format`)."""
        return kv_format(self.config.kv_cache, impl)

    def _decode_for(self, sampling: SamplingConfig, impl: str):
        if (sampling, impl) not in self._decode:
            self._decode[sampling, impl] = _on_mesh(jax.jit(
                partial(_decode_fn, self.graphdef, engine=self.config, sampling=sampling, eos=self.eos,
                        pad_id=self.pad_id, impl=impl, layout=self.layout, groups=self.groups),
                donate_argnums=(1,)), self.mesh)
        return self._decode[sampling, impl]

    # ------------------------------------------------------------------ weights
    def decode_shardings(self, state):
        """The shardings of `state` (a pytree of nnx States: the engine's weights) in the decode layout on the
        engine's mesh (`sharding.DECODE_RULES`), or None off a mesh."""
        if self.mesh is None:
            return None
        leaves = jax.tree.leaves(state_shardings(state, self.mesh, DECODE_RULES))
        return jax.tree.unflatten(jax.tree.structure(state), leaves)

    def prepare(self, state, *, copy: bool = True):
        """`state` relaid into the decode layout once (`decode_shardings`): the programs given a prepared state
        relay nothing per call (their layout constraints are then no-ops). `copy`: fresh buffers even where the
        layout is already the one asked for, so the caller may donate or delete its own (a learner's update);
        copy=False may return `state`'s own arrays."""
        state = nnx.state(state) if isinstance(state, nnx.Module) else state
        target = self.decode_shardings(state)
        if target is None:
            return jax.tree.map(jnp.copy, state) if copy else state
        return jax.device_put(state, target, may_alias=not copy)

    # ------------------------------------------------------------------ sizing
    def sizes(self, n_requests: int, longest_prompt: int, max_new: int) -> tuple[int, int, int]:
        """(slots, pages, page-table width) for a call; the width covers the longest prompt's bucket."""
        return call_sizes(self.config, self.model_cfg, self.mesh, n_requests, longest_prompt, max_new)[:3]

    def row_buckets(self, slots: int) -> list[int]:
        """Row counts the programs are compiled for (`scheduler.row_buckets` over the data-parallel divisor)."""
        return row_buckets(slots, self.slot_multiple)

    def pool(self, pages: int, impl: str, *, mesh=None, abstract: bool = False):
        """The KV pool of a call (the one place it is built): `pages` pages in the format decode attention `impl`
        reads (`kv_format`), laid out for `mesh` (default: the engine's); zeroed on the devices, or its
        ShapeDtypeStructs (`abstract`, for ahead-of-time compiles)."""
        make = abstract_pool if abstract else new_pool
        return make(self.model_cfg, pages, self.config.page_size, mesh if mesh is not None else self.mesh,
                    self.kv_format(impl))

    def warmup(self, state, *, n_requests: int, prompt_len: int, max_new: int, sampling: SamplingConfig):
        """Compile every program a `generate(..., prompt_capacity=prompt_len)` call of these sizes can run (each
        row bucket's prefill and decode), running them on idle inputs: later calls compile nothing."""
        slots, pages, width = self.sizes(n_requests, prompt_len, max_new)
        impl, ps, length = self.resolved_impl(), self.config.page_size, bucket_length(prompt_len)
        pool = self.pool(pages, impl)
        decode = self._decode_for(sampling, impl)
        for rows in self.row_buckets(slots):
            pool = self._prefill(state, pool, PrefillBatch.zeros(rows, length, pages_for(length, ps)))[0]
            pool = decode(state, pool, DecodeBatch.zeros(rows, width))[0]
        jax.block_until_ready(pool)

    def abstract_calls(self, state, *, n_requests: int, prompt_len: int, max_new: int, sampling: SamplingConfig,
                       mesh=None) -> dict[str, tuple]:
        """{"prefill" | "decode": (jitted fn, abstract args)} of a call with these sizes (the largest prefill:
        every slot's prompt at once), for ahead-of-time compiles and memory checks."""
        slots, pages, width = self.sizes(n_requests, prompt_len, max_new)
        impl, ps, length = self.resolved_impl(mesh), self.config.page_size, bucket_length(prompt_len)
        pool = self.pool(pages, impl, mesh=mesh, abstract=True)
        prefill = PrefillBatch.abstract(slots, length, pages_for(length, ps), mesh)
        return {"prefill": (self._prefill, (state, pool, prefill)),
                "decode": (self._decode_for(sampling, impl), (state, pool, DecodeBatch.abstract(slots, width, mesh)))}

    # ------------------------------------------------------------------ generation
    def generate(self, state, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
                 sampling: SamplingConfig = SamplingConfig(), seed: int | jax.Array = 0,
                 keys: np.ndarray | None = None, on_finish=None, prompt_capacity: int = 0,
                 new_capacity: int = 0, kv_scales: KVScales | None = None) -> GenerationResult:
        """Complete every prompt. keys: raw per-sequence key data [N, ...] (default: `sequence_keys` of
        the seed's key); max_new_tokens: one budget, or one per prompt; on_finish(i, tokens, logprobs): called
        as sequence i stops (records can be written while the others still decode); prompt_capacity: size the
        programs for prompts this long (as `warmup` did) instead of the longest given; new_capacity: likewise for
        completions (the page table covers it; what a step costs does not depend on it); kv_scales: an fp8 cache
        writes under these scales (a `GenerationResult.kv_scales` of an earlier call) instead of calibrating them on
        this call's first prefill (an error for any other kv_cache)."""
        state = nnx.state(state) if isinstance(state, nnx.Module) else state
        seqs = requests(prompts, max_new_tokens, keys, seed)
        if kv_scales is not None:
            check_kv_scales(kv_scales, KVFormat(self.config.kv_cache), self.model_cfg)
        longest = max(len(s.prompt) for s in seqs)
        if prompt_capacity and longest > prompt_capacity:
            raise ValueError(f"a prompt has {longest} tokens, more than prompt_capacity {prompt_capacity}")
        width_new = max(s.max_new for s in seqs)
        if self.config.pages:  # a set pool must hold the sequence that needs the most pages (else it never ends)
            c = self.config
            big = max(seqs, key=lambda s: pages_for_one_sequence(len(s.prompt), s.max_new, c.page_size, c.sync_steps))
            check_kv_pages(-(-c.pages // self.groups), "the engine's KV pages"
                           + (f" per data group ({c.pages} over {self.groups})" if self.groups > 1 else ""),
                           prompt_tokens=len(big.prompt), max_new=big.max_new, page_size=c.page_size,
                           sync_steps=c.sync_steps)
        slots, pages, width = self.sizes(len(seqs), prompt_capacity or longest, max(width_new, new_capacity))
        c, impl = self.config, self.resolved_impl()
        sched = Scheduler(seqs, slots=slots, pages=pages, width=width, page_size=c.page_size,
                          sync_steps=c.sync_steps, buckets=self.row_buckets(slots), groups=self.groups)
        pool = self.pool(pages, impl)
        if kv_scales is not None:
            pool = with_scales(pool, kv_scales)
        decode = self._decode_for(sampling, impl)
        prefill_length = bucket_length(prompt_capacity) if prompt_capacity else 0
        prompt_experts: dict[tuple[int, ...], np.ndarray] = {}  # record_experts: a prompt's first len - 1 tokens'
        while sched.busy:  # plan -> prefill / decode -> apply
            pool = self._prefill_prompts(state, pool, sched, sched.admit(), prefill_length, prompt_experts)
            sched.reserve()
            batch = sched.plan()
            pool, out = decode(state, pool, batch)
            for s in sched.apply(batch, jax.tree.map(host_array, out)):
                if on_finish is not None:
                    on_finish(s.index, s.tokens, s.logprobs)
        stats = dict(sched.stats)
        if isinstance(pool, QuantPool):
            stats["kv_saturated"] = int(np.sum(host_array(pool.saturated)))
        experts = None
        if c.record_experts:  # each sequence's prompt (its first len - 1 from the prefill) then its decode steps'
            per_token = (len(self.model_cfg.moe_layers), self.model_cfg.num_experts_per_tok)
            none = np.zeros((0, *per_token), np.uint8)  # a one-token prompt has nothing prefilled
            experts = [np.concatenate([prompt_experts.get(s.prompt, none),
                                       np.asarray(s.experts, np.uint8).reshape(-1, *per_token)]) for s in seqs]
        return dataclasses.replace(collect(seqs, width_new, self.pad_id, stats), kv_scales=pool_scales(pool),
                                   experts=experts)

    def _prefill_prompts(self, state, pool, sched: Scheduler, prompts: list[SharedPrompt], length: int = 0,
                         experts: dict | None = None):
        """Write the first len - 1 tokens of each prompt into its pages (`Scheduler.prefill`: a row bucket, each
        data group's prompts in its rows); length: the prompt capacity's bucket (0 = the longest prompt's).
        `experts` (record_experts): filled with each prompt's first len - 1 tokens' experts, by its ids."""
        if not prompts:
            return pool
        length = length or bucket_length(max(len(p.ids) - 1 for p in prompts))
        batch = sched.prefill(prompts, length)
        pool, ran = self._prefill(state, pool, batch)
        if ran is not None:
            ran = host_array(ran)
            for p, row in zip(prompts, prefill_rows(prompts, batch.rows, sched.groups)):
                experts[p.ids] = ran[row, :len(p.ids) - 1]
        return pool


def requests(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], keys: np.ndarray | None,
             seed: int | jax.Array) -> list[Seq]:
    """The sequences of a `generate` call, checked: prompt i with its budget and key (`sequence_keys` of the
    seed's key unless `keys` are given)."""
    n = len(prompts)
    if n == 0:
        raise ValueError("no prompts to generate from")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
    budgets = [int(max_new_tokens)] * n if np.ndim(max_new_tokens) == 0 else [int(m) for m in max_new_tokens]
    if len(budgets) != n or min(budgets) < 1:
        raise ValueError("max_new_tokens: one budget >= 1 per prompt")
    if keys is None:
        keys = sequence_keys(jax.random.key(seed) if isinstance(seed, int) else seed, n)
    return [Seq(i, tuple(int(t) for t in p), budgets[i], keys[i]) for i, p in enumerate(prompts)]


def collect(seqs: Sequence[Seq], width: int, pad_id: int, stats: dict[str, int]) -> GenerationResult:
    """The finished sequences as arrays (row i: sequence i), `width` tokens wide."""
    tokens = np.full((len(seqs), width), pad_id, np.int32)
    logprobs = np.zeros((len(seqs), width), np.float32)
    lengths = np.zeros(len(seqs), np.int32)
    for s in seqs:
        tokens[s.index, :len(s.tokens)] = s.tokens
        logprobs[s.index, :len(s.logprobs)] = s.logprobs
        lengths[s.index] = len(s.tokens)
    return GenerationResult(tokens, logprobs, lengths, dict(stats))


def generate(model: Decoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_ids: Sequence[int],
             pad_id: int, sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
             config: EngineConfig = EngineConfig()) -> GenerationResult:
    """One-shot convenience wrapper around Engine."""
    return Engine(model, eos_ids=eos_ids, pad_id=pad_id, config=config).generate(
        model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed)
