"""The packed copy of the policy that rollouts sample from (`rollout.quant`, FlashRL-style quantized rollouts).

Decoding is memory-bound: an int4 copy of the projections reads about a quarter of bf16's bytes per decoded
token. The float policy trains, saves and exports; after an update (every `refresh` updates) the targeted
Linears are quantized on device, inside one jitted program, into a packed `QuantizedWeight` that the model's
linear seam serves through the Pallas kernels (TPU/GPU) or the XLA dequant path (CPU):

* int8 / int4: lrmq's RTN (llm-awq's asymmetric quantizer, groups of `group_size` input rows; -1 = per output
  channel), the same codes `lrmq.quantize --method rtn` writes for those weights;
* nf4: bitsandbytes NF4 with double quantization (block 64), as `lrmq.quantize --method nf4`.

AWQ scales (`RolloutCopy.scales`, computed once, from the first rollout batch, by `awq_rollout_scales`) are
folded into the float weights before each RTN: the previous op (RMSNorm scale, or the previous Linear's output
columns) divided by s, the Linear's input rows times s, as AWQ's own fold; the scales stay fixed while the
weights move.

Only the packed kernels are new arrays: the copy's other variables (embedding, norms, lm head) are the policy's
own, taken from its current state at every rollout (`RolloutCopy.states`), so the copy adds the packed bytes
and nothing else. Under QLoRA the adapters are merged into the dequantized base before quantizing
(`merge_lora=True`); unmerged adapters need no copy at all (the learner itself samples).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrmq.model.linear import ExpertLinear, default_dot_general, default_ragged_dot
from lrmq.ptq import awq
from lrmq.ptq import layer_fn as lf
from lrmq.ptq.awq import AWQOptions, awq_quantize_model
from lrmq.quant.training import export_float_model
from lrmq.quant.formats import quantize_weight
from lrmq.quant.qat import select_targets, set_dot_general, set_ragged_dot
from lrmq.quant.qkernel import QuantizedExpertKernel, QuantizedKernel
from lrmq.quant.transforms import kernel_axes, qweight_shardings
from lrmq.sharding import LOGICAL_AXES_KEY, abstract_state

# rollout.quant -> quantize_weight options (the group size of int formats comes from the config)
ROLLOUT_FORMATS = {
    "int8": dict(fmt="int", bits=8, symmetric=False),
    "int4": dict(fmt="int", bits=4, symmetric=False),
    "nf4": dict(fmt="nf4", bits=4, block_size=64, double_quant=True),
}


@dataclasses.dataclass(frozen=True)
class RolloutQuant:
    """What the rollout copy is: its format, int group size, the Linears it packs, and whether QLoRA adapters
    are merged first."""

    fmt: str
    group_size: int = 128
    targets: str = r".*\.(q|k|v|o|gate|up|down)_proj$"
    merge_lora: bool = False

    def __post_init__(self):
        if self.fmt not in ROLLOUT_FORMATS:
            raise ValueError(f"rollout.quant={self.fmt!r}: known formats are {', '.join(ROLLOUT_FORMATS)}")

    def options(self) -> dict:
        opts = dict(ROLLOUT_FORMATS[self.fmt])
        if opts["fmt"] == "int":
            opts["group_size"] = self.group_size
        return opts


def check_shapes(model, spec: RolloutQuant, option: str = "rollout.quant_group_size") -> None:
    """Refuse, naming the Linear and the option, a group size that does not divide a targeted Linear's rows."""
    if ROLLOUT_FORMATS[spec.fmt]["fmt"] != "int" or spec.group_size == -1:
        return
    linears, experts = select_targets(model, spec.targets, "rollout.quant")
    for path, lin in linears + experts:
        if lin.in_features % spec.group_size:
            raise ValueError(f"{option}={spec.group_size} does not divide {path}'s {lin.in_features} input rows "
                             "(use a divisor, or -1 for one scale per output channel)")


def fold_awq_scales(model, scales: dict) -> None:
    """AWQ's fold on a float model (in place): previous op / s_prev, the group's Linears' input rows * s_fc."""
    groups = {g.name: g for g in (awq.ATTN_IN, awq.ATTN_OUT, awq.MLP_IN, awq.MLP_OUT)}
    for i, per_group in scales.items():
        layer = model.layers[int(i)]
        p = lf.get_layer_params(layer)
        for name, (s_prev, s_fc) in per_group.items():
            p = awq.fold_scale(p, jnp.asarray(s_prev), jnp.asarray(s_fc), groups[name])
        lf.set_layer_params(layer, p)


def quantize_for_rollout(model, spec: RolloutQuant, mesh=None, scales: dict | None = None) -> list[str]:
    """Pack the targeted Linears of `model` (in place; works on traced weights, inside jit) and return their
    paths: adapters merged into the (dequantized) base when `spec.merge_lora`, AWQ `scales` folded, QAT
    dot_generals reset (a packed kernel brings its own matmul). A mixture-of-experts model's targeted expert
    projections are packed too, each stacked [E, K, N] kernel into one stacked-experts weight (every expert
    quantized alone, as a Linear of its shape: `formats.quantize_weight`), served by `QuantizedExpertKernel`'s
    grouped matmul; the router is never a target and stays float."""
    linears, experts = select_targets(model, spec.targets, "rollout.quant")
    for path, lin in linears + experts:
        w = lin.float_weight()
        if getattr(lin, "lora", None) is not None:
            if not spec.merge_lora:
                raise ValueError(f"{path} has a LoRA adapter: the rollout copy merges adapters only with "
                                 "rollout.lora=merged")
            w = (w.astype(jnp.float32) + lin.lora.delta()).astype(w.dtype)
            lin.lora = None
        lin.kernel = nnx.Param(w, **{LOGICAL_AXES_KEY: kernel_axes(lin)})
    if scales:
        fold_awq_scales(model, scales)
    for path, lin in linears + experts:
        qw = quantize_weight(lin.kernel.get_value(), **spec.options())
        axes = kernel_axes(lin)
        if mesh is not None and mesh.size > 1:
            qw = jax.tree.map(jax.lax.with_sharding_constraint, qw, qweight_shardings(qw, axes, mesh))
        if isinstance(lin, ExpertLinear):
            lin.kernel = QuantizedExpertKernel(qw, **{LOGICAL_AXES_KEY: axes})
            set_ragged_dot(lin, default_ragged_dot)
        else:
            lin.kernel = QuantizedKernel(qw, **{LOGICAL_AXES_KEY: axes})
            set_dot_general(lin, default_dot_general)
    return [path for path, _ in linears + experts]


def _copy_filter(awq_scales: bool):
    """The variables a refresh writes: the packed kernels, and with AWQ the norms its scales fold into."""
    def f(path, value) -> bool:
        return isinstance(value, QuantizedKernel) or (awq_scales and any(p in AWQ_NORMS for p in path))

    return f


AWQ_NORMS = ("attn_norm", "mlp_norm")  # the RMSNorms AWQ's attn_in / mlp_in groups fold into


def calibration_blocks(prompts: list[list[int]], block: int = 256) -> np.ndarray:
    """AWQ calibration tokens [blocks, T] from prompts (their tokens concatenated, cut into equal blocks)."""
    ids = [t for p in prompts for t in p]
    if not ids:
        raise ValueError("rollout.quant_scales=awq: the first batch has no prompt tokens to calibrate on")
    t = min(block, len(ids))
    n = len(ids) // t
    return np.asarray(ids[: n * t], np.int32).reshape(n, t)


def awq_rollout_scales(graphdef, trainable, rest, tokens: np.ndarray, spec: RolloutQuant) -> dict:
    """AWQ's scale search (no clipping) on a float copy of the policy, calibrated on `tokens` [blocks, T]:
    {layer index as str: {scale group: (s_prev, s_fc)}} for `RolloutQuant.scales`."""
    opts = ROLLOUT_FORMATS[spec.fmt]
    model = export_float_model(nnx.merge(graphdef, trainable, rest, copy=True))  # adapters merged, float kernels
    result = awq_quantize_model(model, np.asarray(tokens, np.int32),
                                AWQOptions(bits=opts["bits"], group_size=spec.group_size, clip=False),
                                progress=False)
    return {str(i): {g: (jnp.asarray(a), jnp.asarray(b)) for g, (a, b) in groups.items()}
            for i, groups in result.scales.items()}


class RolloutCopy:
    """The quantized copy of a split policy (`graphdef`, trainable, rest): `refresh` re-quantizes it from the
    current float state on device (one compiled program); `states(trainable, rest)` is what the generation
    engine samples from, with `graphdef` (the copy's). `scales`: AWQ scales (`awq_rollout_scales`) folded before
    every quantization (`awq_scales=True`: the refresh writes the folded norms too), None for plain RTN."""

    def __init__(self, graphdef, trainable, rest, spec: RolloutQuant, *, awq_scales: bool = False, mesh=None):
        self.spec, self.mesh = spec, mesh
        self.scales = None
        holder = {}

        def build(trainable, rest, scales):
            model = nnx.merge(graphdef, trainable, rest)
            quantize_for_rollout(model, spec, mesh, scales)
            gd, packed, others = nnx.split(model, _copy_filter(awq_scales), ...)
            holder["graphdef"], holder["others"] = gd, others
            return packed

        check_shapes(nnx.merge(graphdef, trainable, rest), spec)
        abstract = jax.eval_shape(build, trainable, rest, None)
        self.abstract = abstract if mesh is None else abstract_state(abstract, mesh)
        self.graphdef = holder["graphdef"]
        self._other_paths = {path for path, _ in nnx.to_flat_state(holder["others"])}
        out_sh = None if mesh is None else jax.tree.map(lambda a: a.sharding, self.abstract)
        self._build = jax.jit(build, out_shardings=out_sh)
        self.packed = None

    def refresh(self, trainable, rest) -> float:
        """Quantize the current float policy into the copy; returns the seconds it took (compiles included)."""
        t0 = time.perf_counter()
        if self.mesh is not None:
            with jax.set_mesh(self.mesh):
                self.packed = self._build(trainable, rest, self.scales)
        else:
            self.packed = self._build(trainable, rest, self.scales)
        jax.block_until_ready(self.packed)
        return time.perf_counter() - t0

    def others(self, trainable, rest):
        """The policy's variables the copy shares (everything but the packed Linears and merged adapters)."""
        flat = [(p, v) for s in (trainable, rest) for p, v in nnx.to_flat_state(s) if p in self._other_paths]
        return nnx.from_flat_state(flat)

    def states(self, trainable, rest):
        if self.packed is None:
            raise RuntimeError("RolloutCopy.states before the first refresh")
        return (self.packed, self.others(trainable, rest))

    def abstract_states(self, trainable, rest):
        return (self.abstract, self.others(trainable, rest))

    def weight_bytes(self, trainable, rest) -> dict[str, int]:
        """{"packed": bytes of the arrays a refresh writes (packed Linears, AWQ-folded norms), "shared": the
        policy's arrays the copy reads too}."""
        return {"packed": _bytes(self.abstract), "shared": _bytes(self.others(trainable, rest))}


def _bytes(tree) -> int:
    return int(sum(np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


