"""QuantLRM end to end (psunlpgroup/QuantLRM = llm-awq + fine-tuning-update importance).

1. Inputs: the fine-tuned checkpoint and its pre-fine-tuning checkpoint -- any pair ``load_model``
   reads, read tensor by tensor (`TensorSource`: Hugging Face or lrmq, local or ``gs://``; only a quantized
   base is loaded whole) -- or a GRPO run directory (``final_policy/`` = after, ``initial_policy/`` = before).
2. The two are checked first: same architecture fields and, tensor by tensor, the same shapes
   (the error names the tensor and both shapes); identical weights (|dW| == 0 everywhere) are an error.
3. Importance (:mod:`lrmq.ptq.importance`): global positive-only min / exact median / max of |dW| over
   ``stats_targets``, the mapping (``u_shape`` = the reference; ``inverted_u``, ``increasing``,
   ``decreasing``, ``constant`` for the hypothesis-validation ablation) and the per-input-channel
   importance of each ``targets`` matrix. Defaults: pre-norm families (Qwen/Llama) targets
   q/o/gate/down with stats over all seven projections (the reference's Qwen3-8B run); Olmo-3 targets
   and stats over o/down only (the reference's OLMo run).
4. The AWQ loop of :mod:`lrmq.ptq.awq` with the statistic swapped: group ``attn_in`` <- q_proj,
   ``attn_out`` <- o_proj, ``mlp_in`` <- gate_proj, ``mlp_out`` <- down_proj importance;
   ``normalize=False``; v->o kept for GQA by down/up-sampling (``gqa_vo="downsample"``). A group whose
   source matrix is not a target is left unscaled. Clipping (activation based) and the quantizer are
   AWQ's. The calibration activations are still needed (block-output loss, clipping).

Which model is quantized: ``quantize="finetuned"`` (default; QuantLRM quantizes the fine-tuned LRM) or
``"base"`` (pseudo-fine-tuning: the pair is (original, briefly fine-tuned) and the original is the one
to quantize; see :mod:`lrmq.ptq.pseudo_ft`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import numpy as np

from lrmq import paths
from lrmq.checkpoint.load import load_model, resolve_checkpoint
from lrmq.checkpoint.quantized import quantized_format
from lrmq.checkpoint.tensors import open_tensors
from lrmq.ptq import layerwise as lw
from lrmq.ptq.awq import AWQOptions, ScaleGroup, awq_quantize_model
from lrmq.ptq.importance import ALL_PROJ, global_stats, importance_for_model
from lrmq.ptq.importance_files import plot_importance, save_importance_npz
from lrmq.ptq.layer_fn import LINEARS
from lrmq.ptq.result import PTQResult
from lrmq.quant.transforms import module_at

ARCH_FIELDS = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim", "qk_norm", "norm_placement", "tie_word_embeddings")


class QuantLRMError(ValueError):
    """Unusable (fine-tuned, base) pair; the message names the checkpoints / tensors."""


@dataclasses.dataclass(frozen=True)
class QuantLRMOptions:
    targets: tuple[str, ...] | None = None  # None: q/o/gate/down (pre-norm), o/down (Olmo-3)
    stats_targets: tuple[str, ...] | None = None  # None: all seven (pre-norm), = targets (Olmo-3)
    mapping: str = "u_shape"
    R: float = 10.0
    precision: str = "fp16"
    zero_chunks: int = 1
    quantize: str = "finetuned"  # finetuned | base

    def resolved(self, cfg) -> tuple[tuple[str, ...], tuple[str, ...]]:
        olmo = cfg.norm_placement == "post"
        targets = tuple(self.targets) if self.targets else (("o_proj", "down_proj") if olmo else
                                                            ("q_proj", "o_proj", "gate_proj", "down_proj"))
        stats = tuple(self.stats_targets) if self.stats_targets else (targets if olmo else ALL_PROJ)
        return targets, stats


def resolve_pair(finetuned: str | None = None, base: str | None = None, run_dir: str | None = None) -> tuple[str, str]:
    """(fine-tuned dir, base dir) from explicit paths or a GRPO run dir; a bucket URL (``gs://``, a run dir or a
    checkpoint) becomes its checkpoints' local views (`lrmq.checkpoint.remote`), the weights left in the bucket."""
    if run_dir:
        root = paths.epath_of(run_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"GRPO run directory not found: {run_dir}")
        ft, b = paths.join(run_dir, "final_policy"), paths.join(run_dir, "initial_policy")
        missing = [p for p in (ft, b) if not paths.epath_of(p).is_dir()]
        if missing:
            raise QuantLRMError(f"{run_dir}: not a finished GRPO run directory, missing {missing} "
                                "(the trainer writes initial_policy/ at start and final_policy/ at the end)")
        return resolve_checkpoint(ft), resolve_checkpoint(b)
    if not finetuned or not base:
        raise QuantLRMError("QuantLRM needs the fine-tuned checkpoint and the pre-fine-tuning (base) checkpoint, "
                            "or a GRPO run directory (final_policy + initial_policy); for a model without a base "
                            "checkpoint make one with lrmq.ptq.pseudo_ft")
    finetuned, base = resolve_checkpoint(finetuned), resolve_checkpoint(base)
    for p in (finetuned, base):
        if not os.path.exists(p):
            raise FileNotFoundError(f"checkpoint not found: {p}")
    return finetuned, base


# ----------------------------------------------------------------------------- tensor sources


def linear_paths(cfg) -> list[str]:
    """Every quantized Linear's module path; a sparse layer's stacked experts ``layers.N.mlp.experts.gate_proj``
    (one [E, K, N] tensor: importance per expert), its router never."""
    return [lw.linear_path(i, n, cfg.is_moe_layer(i)) for i in range(cfg.num_layers) for n in LINEARS]


class TensorSource:
    """Linear weights of a checkpoint in lrmq orientation [K, N], keyed by module path ('layers.3.attn.q_proj').

    A float checkpoint -- a Hugging Face directory (local: memory-mapped; ``gs://``: range reads) or an lrmq
    checkpoint (local or ``gs://``: one orbax partial restore per tensor) -- is read tensor by tensor through
    `lrmq.checkpoint.tensors.open_tensors`: nothing is loaded whole, nothing goes to an accelerator, and host
    memory holds the pair's current weights. A quantized checkpoint (compressed-tensors, AutoAWQ, an lrmq
    ``packed`` one: a base that exists only quantized) is loaded whole and its Linears dequantized."""

    def __init__(self, path: str):
        self.path = path
        self._model = None
        self._reader = None
        if quantized_format(resolve_checkpoint(path)) is None:
            self._reader = open_tensors(path)
            self.cfg = self._reader.cfg
            names = set(self._reader.names())
            self.entries = {p: p + ".kernel" for p in linear_paths(self.cfg) if p + ".kernel" in names}
        else:
            self._model = load_model(path)
            self.cfg = self._model.cfg
            self.entries = {p: p + ".kernel" for p in linear_paths(self.cfg)}

    def shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """module path -> (tensor name in the checkpoint, shape as stored: an HF weight's [N, K])."""
        if self._reader is not None:
            return {p: self._reader.stored(name) for p, name in self.entries.items()}
        return {p: (name, tuple(module_at(self._model, p).float_weight().shape)) for p, name in self.entries.items()}

    def kn_shape(self, path: str) -> tuple:
        """The weight at module `path` in lrmq orientation [K, N], as `get` returns it."""
        if self._reader is not None:
            return self._reader.shape(self.entries[path])
        return tuple(module_at(self._model, path).float_weight().shape)

    def get(self, path: str) -> np.ndarray:
        """The weight at module `path`, [K, N], its stored dtype (an HF file's: a zero-copy view of the mapped
        file; the importance pass reads each weight once)."""
        if self._reader is not None:
            return self._reader.get(self.entries[path])
        return np.asarray(module_at(self._model, path).float_weight())


def check_pair(ft: TensorSource, base: TensorSource) -> None:
    """Same tensors with the same shapes, then the same architecture fields; else QuantLRMError."""
    sf, sb = ft.shapes(), base.shapes()
    problems = []
    for p in sorted(set(sf) | set(sb), key=lambda s: (len(s), s)):
        if p not in sb:
            problems.append(f"tensor {sf[p][0]} is in the fine-tuned checkpoint but not in the base")
        elif p not in sf:
            problems.append(f"tensor {sb[p][0]} is in the base checkpoint but not in the fine-tuned one")
        elif ft.kn_shape(p) != base.kn_shape(p):  # an HF checkpoint stores [N, K], a model [K, N]
            problems.append(f"tensor {sf[p][0]}: fine-tuned shape {sf[p][1]} != base shape {sb[p][1]}")
    for f in ARCH_FIELDS:
        a, b = getattr(ft.cfg, f), getattr(base.cfg, f)
        if a != b:
            problems.append(f"config {f}: fine-tuned {a!r} != base {b!r}")
    if problems:
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise QuantLRMError(f"the fine-tuned checkpoint {ft.path} and the base checkpoint {base.path} have different "
                            "architectures:\n  " + "\n  ".join(problems[:8]) + more)


def compute_importance(ft: TensorSource, base: TensorSource, opts: QuantLRMOptions):
    """(importances {module path: [K] float32}, global Stats, targets, stats_targets)."""
    targets, stats_targets = opts.resolved(ft.cfg)

    def pairs():
        for p in ft.entries:
            yield p, (lambda p=p: ft.get(p)), (lambda p=p: base.get(p))

    try:
        stats = global_stats(pairs, stats_targets=stats_targets)
    except ValueError as e:
        raise QuantLRMError(f"{ft.path} vs {base.path}: {e}") from None
    imps = importance_for_model(pairs, targets, stats=stats, mapping=opts.mapping, R=opts.R,
                                zero_chunks=opts.zero_chunks, precision=opts.precision)
    return imps, stats, targets, stats_targets


def importance_stat_fn(importances: dict[str, np.ndarray]) -> Callable:
    """AWQ statistic function: the group's source-matrix importance of this layer (None: skip group). A sparse
    layer's experts: the per-expert up -> down search gets each expert's own down_proj importance [E, F]; the one
    norm -> router + gate/up scale the mean over experts of their gate_proj importances."""

    def stat(ctx: lw.LayerContext, group: ScaleGroup, x):
        path = lw.linear_path(ctx.index, group.source, ctx.cfg.is_moe_layer(ctx.index))
        v = importances.get(path)
        if v is None:
            return None
        v = np.asarray(v, np.float32)
        if v.ndim == 2:  # stacked experts [E, K]: up -> down per expert (x None); norm -> gate/up is one scale
            if x is None:
                return v
            v = v.mean(axis=0)  # shared by every expert (and the router): the mean of the experts' importances
        if v.shape != (x.shape[-1],):
            raise QuantLRMError(f"importance of {lw.linear_path(ctx.index, group.source)} has shape {v.shape}, "
                                f"group {group.name} has {x.shape[-1]} input channels")
        return v

    return stat


def quantlrm_awq_options(base: AWQOptions) -> AWQOptions:
    """QuantLRM's AWQ settings: no normalization, GQA v->o via down/upsampling."""
    return dataclasses.replace(base, normalize=False, gqa_vo="downsample")


def quantlrm_quantize_model(source, tokens, importances, opts: AWQOptions, *, progress: bool = True, emit=None,
                            mesh=None) -> PTQResult:
    """AWQ with the fine-tuning importance as the statistic (``awq_quantize_model``'s source / emit / mesh)."""
    return awq_quantize_model(source, tokens, opts, stat_fn=importance_stat_fn(importances), method="quantlrm",
                              progress=progress, emit=emit, mesh=mesh)


def importance_artifacts(ft: TensorSource, base: TensorSource, importances, stats, mapping: str, R: float,
                         max_sample: int = 1 << 18) -> dict[str, bytes]:
    """{'importance.npz': bytes, 'importance.png': bytes} for the output directory."""
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as d:
        npz = os.path.join(d, "importance.npz")
        save_importance_npz(npz, importances)
        first = next(iter(importances))
        dw = np.abs(ft.get(first).astype(np.float32) - base.get(first).astype(np.float32)).ravel()
        if dw.size > max_sample:
            dw = dw[:: dw.size // max_sample]
        png = os.path.join(d, "importance.png")
        plot_importance(png, dw, stats, importances, mapping, R=R)
        for name, p in (("importance.npz", npz), ("importance.png", png)):
            with open(p, "rb") as f:
                out[name] = f.read()
    return out
