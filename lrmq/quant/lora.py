"""LoRA adapters on the linear seam (QLoRA: frozen packed base + trainable `nnx.LoRAParam`s).

`LoRA(in, out, rank, alpha, dropout)`: `a` [in, r] (peft init: kaiming-uniform with a=sqrt(5), i.e.
U(-1/sqrt(in), 1/sqrt(in))), `b` [r, out] zeros; `lora(x) = dropout(x) @ a @ b * alpha / r`.
Logical axes: `a` (kernel in-axis, "lora_rank"), `b` ("lora_rank", kernel out-axis); "lora_rank" is
replicated (lrmq.sharding.RULES).

**Dropout** (`mode`):
* ``"train"`` (default): dropout is applied only in *differentiated* forwards. `x @ a` is a
  `custom_vjp` (`lora_down`) whose primal (what plain evaluation runs) has no dropout and whose forward
  rule (what `jax.grad` runs whenever the adapter `a` is differentiated) drops `x`. So rollouts, evaluation, log-prob recomputation and the KL reference are deterministic
  with no dropout, while the jitted GRPO update trains with dropout, from one graphdef and with no
  flag to flip (the trainer merges the same graph for both).
* ``"off"``: never; ``"always"``: in every forward (tests).
The mask's key is `fold_in(fold_in(key(seed), crc32(path)), hash(x))` (see `lrmq.quant.qat.data_hash`):
no RNG state needs threading through the jitted step; it changes with every batch and micro-batch and
is reproducible on resume. `model.set_attributes`-style toggling works too: `set_lora_dropout(model, m)`.
"""

from __future__ import annotations

import json
import math
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrmq.model.params import LOGICAL_AXES_KEY
from lrmq.quant.qat import data_key, path_salt
from lrmq.quant.transforms import DEFAULT_TARGETS, iter_linears, kernel_axes, require_linears

DROPOUT_MODES = ("train", "off", "always")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _drop(x, rate: float, seed: int, salt: int):
    keep = jax.random.bernoulli(data_key(seed, salt, x), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x)).astype(x.dtype), keep


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def lora_down(x, a, rate: float, seed: int, salt: int):
    """x @ a, with dropout on x only in differentiated forwards (a is the trainable adapter, so every
    GRPO update differentiates it, whether or not x itself depends on trainable parameters)."""
    return x @ a  # plain evaluation (rollouts, eval, reference): no dropout


def _down_fwd(x, a, rate, seed, salt):
    xd, keep = _drop(x, rate, seed, salt)
    return xd @ a, (xd, a, keep)


def _down_bwd(rate, seed, salt, res, g):
    xd, a, keep = res
    da = jnp.einsum("...k,...r->kr", xd, g, preferred_element_type=jnp.float32).astype(a.dtype)
    dxd = g @ a.T
    dx = jnp.where(keep, dxd / (1.0 - rate), jnp.zeros_like(dxd)).astype(xd.dtype)
    return dx, da


lora_down.defvjp(_down_fwd, _down_bwd)


class LoRA(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, rank: int = 8, alpha: float = 16.0,
                 dropout: float = 0.0, rngs: nnx.Rngs, axes=(None, None), param_dtype=jnp.float32,
                 mode: str = "train", seed: int = 0, salt: int = 0):
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        if mode not in DROPOUT_MODES:
            raise ValueError(f"LoRA dropout mode {mode!r}; known: {list(DROPOUT_MODES)}")
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on torch's [r, in] lora_A
        a = jax.random.uniform(rngs.params(), (in_features, rank), jnp.float32, -bound, bound).astype(param_dtype)
        self.a = nnx.LoRAParam(a, **{LOGICAL_AXES_KEY: (axes[0], "lora_rank")})
        self.b = nnx.LoRAParam(jnp.zeros((rank, out_features), param_dtype), **{LOGICAL_AXES_KEY: ("lora_rank", axes[1])})
        self.rank, self.alpha, self.rate = int(rank), float(alpha), float(dropout)
        self.mode, self.seed, self.salt = mode, int(seed), int(salt)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def __call__(self, x):
        a, b = self.a[...].astype(x.dtype), self.b[...].astype(x.dtype)
        if self.rate > 0.0 and self.mode == "train":
            h = lora_down(x, a, self.rate, self.seed, self.salt)
        elif self.rate > 0.0 and self.mode == "always":
            h = _drop(x, self.rate, self.seed, self.salt)[0] @ a
        else:
            h = x @ a
        return (h @ b) * jnp.asarray(self.scale, x.dtype)

    def delta(self) -> jax.Array:
        """scale * a @ b, the [in, out] weight update (float32)."""
        return self.scale * (self.a[...].astype(jnp.float32) @ self.b[...].astype(jnp.float32))


def apply_lora(model, pattern: str = DEFAULT_TARGETS, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               rngs: nnx.Rngs | None = None, *, seed: int = 0, mesh=None, mode: str = "train") -> list[str]:
    """Attach a LoRA adapter to every targeted Linear (in place); returns the paths. With `mesh`, the
    adapters are placed by their logical axes."""
    rngs = rngs if rngs is not None else nnx.Rngs(seed)
    touched = []
    for path, lin in require_linears(model, pattern, "apply_lora"):
        if lin.lora is not None:
            raise ValueError(f"apply_lora: {path} already has an adapter")
        pdt = _param_dtype(model)
        lora = LoRA(lin.in_features, lin.out_features, rank=rank, alpha=alpha, dropout=dropout, rngs=rngs,
                    axes=kernel_axes(lin), param_dtype=pdt, mode=mode, seed=seed, salt=path_salt(path))
        if mesh is not None:
            _place(lora, mesh)
        lin.lora = nnx.data(lora)
        touched.append(path)
    return touched


def _param_dtype(model):
    cfg = getattr(model, "cfg", None)
    return jnp.dtype(cfg.param_dtype) if cfg is not None else jnp.float32


def _place(module, mesh):
    from lrmq.sharding import logical_to_spec

    for var in (module.a, module.b):
        spec = logical_to_spec(var.get_metadata()[LOGICAL_AXES_KEY], var.get_value().shape, mesh)
        var.set_value(jax.device_put(var.get_value(), jax.sharding.NamedSharding(mesh, spec)))


def set_lora_dropout(model, mode: str) -> None:
    if mode not in DROPOUT_MODES:
        raise ValueError(f"LoRA dropout mode {mode!r}; known: {list(DROPOUT_MODES)}")
    for _, lin in iter_linears(model, None):
        if lin.lora is not None:
            lin.lora.mode = mode


def lora_linears(model) -> list[tuple[str, object]]:
    return [(p, lin) for p, lin in iter_linears(model, None) if lin.lora is not None]


def merge_lora(model) -> list[str]:
    """W <- W + scale * a @ b for every adapted Linear, then drop the adapter (in place).

    A packed base is dequantized first: the merged kernel is always a float `nnx.Param` (param dtype),
    keeping the kernel's logical axes and (when sharded) its sharding."""
    from lrmq.quant.training import restore_float_kernel

    merged = []
    for path, lin in lora_linears(model):
        w = lin.float_weight().astype(jnp.float32) + lin.lora.delta()
        restore_float_kernel(model, lin, w)
        lin.lora = None
        merged.append(path)
    return merged


# ----------------------------------------------------------------------------- adapter files (peft-like)
def hf_module_name(path: str) -> str:
    """'layers.3.attn.q_proj' -> 'model.layers.3.self_attn.q_proj' (HF module name, no '.weight')."""
    from lrmq.checkpoint.hf_names import NAME_MAP

    kernel = path + ".kernel"
    for hf, ours, _ in NAME_MAP:
        if not ours.endswith(".kernel") or not hf.endswith(".weight"):
            continue
        if "{i}" in ours:
            pre, post = ours.split("{i}")
            if kernel.startswith(pre) and kernel.endswith(post):
                i = kernel[len(pre):len(kernel) - len(post)]
                if i.isdigit():
                    return hf.format(i=i)[: -len(".weight")]
        elif kernel == ours:
            return hf[: -len(".weight")]
    raise KeyError(f"no Hugging Face name for module {path!r}")


def lora_state(model) -> dict[str, np.ndarray]:
    """Adapters alone, HF-peft names and orientation: `base_model.model.<hf>.lora_A.weight` [r, in],
    `...lora_B.weight` [out, r] (float32)."""
    out = {}
    for path, lin in lora_linears(model):
        name = "base_model.model." + hf_module_name(path)
        out[name + ".lora_A.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(lin.lora.a[...]), np.float32).T)
        out[name + ".lora_B.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(lin.lora.b[...]), np.float32).T)
    return out


def adapter_config(model) -> dict:
    lins = lora_linears(model)
    if not lins:
        raise ValueError("the model has no LoRA adapters")
    first = lins[0][1].lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.rank, "lora_alpha": first.alpha,
            "lora_dropout": first.rate, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "target_modules": sorted({p.rsplit(".", 1)[-1] for p, _ in lins}),
            "base_model_name_or_path": None}


def save_lora(model, out_dir: str, *, overwrite: bool = False) -> str:
    """adapter_model.safetensors + adapter_config.json (atomic directory write)."""
    from safetensors.numpy import save_file

    from lrmq.checkpoint.atomic import atomic_dir

    tensors, cfg = lora_state(model), adapter_config(model)
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(cfg, f, indent=2)
    return out_dir


def load_lora(model, adapter_dir: str) -> list[str]:
    """Load adapters saved by `save_lora` into a model that already has adapters on the same modules
    (e.g. after `prepare_for_training`); shapes and the module set must match. Keeps shardings."""
    from safetensors.numpy import load_file

    wpath = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    if not os.path.isfile(wpath):
        raise FileNotFoundError(f"{wpath}: no adapter weights")
    tensors = load_file(wpath)
    lins = lora_linears(model)
    want = set()
    for path, lin in lins:
        name = "base_model.model." + hf_module_name(path)
        for key, var, tr in ((name + ".lora_A.weight", lin.lora.a, True), (name + ".lora_B.weight", lin.lora.b, True)):
            want.add(key)
            if key not in tensors:
                raise KeyError(f"{wpath}: missing {key}")
            arr = tensors[key].T if tr else tensors[key]
            old = var.get_value()
            if tuple(arr.shape) != tuple(old.shape):
                raise ValueError(f"{wpath}: {key} has shape {tensors[key].shape}, the model needs "
                                 f"{tuple(old.shape[::-1])}")
            new = jnp.asarray(arr, old.dtype)
            sh = getattr(old, "sharding", None)
            var.set_value(jax.device_put(new, sh) if sh is not None else new)
    extra = sorted(set(tensors) - want)
    if extra:
        raise ValueError(f"{wpath}: adapters for modules the model does not adapt: {extra[:5]}")
    return [p for p, _ in lins]
