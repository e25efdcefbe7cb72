"""LoRA adapter files with Hugging Face peft names: `adapter_model.safetensors` + `adapter_config.json`.

`save_lora(model, dir)` writes the adapters of a model prepared by `lrmq.quant.training` (atomic
directory write); `load_lora(model, dir)` loads them back into a model with adapters on the same
modules. Tensor names are `base_model.model.<HF module>.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r], the HF module names coming from the one name table (`lrmq.checkpoint.hf_names`). A mixture-of-experts
layer's stacked adapters (`lrmq.quant.lora.ExpertLoRA`) are written per expert, under the per-expert module names
of Qwen3-MoE's published checkpoints and of peft on transformers 4's `Qwen3MoeSparseMoeBlock`
(`base_model.model.model.layers.N.mlp.experts.E.gate_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]);
target_modules lists the projection names (`gate_proj`, ...), which peft matches against each expert's module.
transformers 5 fuses the experts into 3-D parameters (`experts.gate_up_proj`), which peft's `target_modules` does
not reach (it adapts them through `target_parameters`, a different adapter layout that is not written here).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from lrmq import paths
from lrmq.atomic import atomic_dir
from lrmq.checkpoint.hf_names import NAME_MAP
from lrmq.model.linear import ExpertLinear
from lrmq.quant.lora import lora_linears
from lrmq.sharding import host_array

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def hf_module_name(path: str, expert: int | None = None) -> str:
    """'layers.3.attn.q_proj' -> 'model.layers.3.self_attn.q_proj' (HF module name, no '.weight'); a
    mixture-of-experts projection with its `expert`: 'layers.0.mlp.experts.gate_proj', 2 ->
    'model.layers.0.mlp.experts.2.gate_proj'."""
    kernel = path + ".kernel"
    for hf, ours, _ in NAME_MAP:
        if not ours.endswith(".kernel") or not hf.endswith(".weight"):
            continue
        if "{i}" in ours:
            pre, post = ours.split("{i}")
            if kernel.startswith(pre) and kernel.endswith(post):
                i = kernel[len(pre):len(kernel) - len(post)]
                if i.isdigit() and ("{e}" in hf) == (expert is not None):
                    return hf.format(i=i, e=expert)[: -len(".weight")]
        elif kernel == ours:
            return hf[: -len(".weight")]
    raise KeyError(f"no Hugging Face name for module {path!r}" + ("" if expert is None else f" (expert {expert})"))


def adapter_names(path: str, lin) -> list[tuple[str, int | None]]:
    """[(peft name prefix 'base_model.model.<hf module>', expert or None)] of an adapted module: one for a Linear,
    one per expert for an ExpertLinear."""
    if isinstance(lin, ExpertLinear):
        return [("base_model.model." + hf_module_name(path, e), e) for e in range(lin.num_experts)]
    return [("base_model.model." + hf_module_name(path), None)]


def lora_state(model) -> dict[str, np.ndarray]:
    """Adapters alone, HF-peft names and orientation: `base_model.model.<hf>.lora_A.weight` [r, in],
    `...lora_B.weight` [out, r] (float32); per expert for a mixture-of-experts projection."""
    out = {}
    for path, lin in lora_linears(model):
        a = host_array(lin.lora.a[...]).astype(np.float32)
        b = host_array(lin.lora.b[...]).astype(np.float32)
        for name, e in adapter_names(path, lin):
            out[name + ".lora_A.weight"] = np.ascontiguousarray((a if e is None else a[e]).T)
            out[name + ".lora_B.weight"] = np.ascontiguousarray((b if e is None else b[e]).T)
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
    tensors, cfg = lora_state(model), adapter_config(model)
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(cfg, f, indent=2)
    return out_dir


def read_adapter_config(adapter_dir: str) -> tuple[int, float]:
    """(rank r, lora_alpha) of an adapter directory's adapter_config.json; one line naming the file when it is
    missing, not JSON, or lacks either number."""
    if not os.path.isdir(adapter_dir):
        what = "is a file" if os.path.exists(adapter_dir) else "does not exist"
        raise FileNotFoundError(f"adapter directory {adapter_dir} {what} (it holds {ADAPTER_CONFIG} and "
                                f"{ADAPTER_WEIGHTS})")
    path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    cfg = paths.read_json(path, what="adapter config")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    for key, v in (("r", r), ("lora_alpha", alpha)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{path}: {key} must be a positive number, found {v!r}")
    return int(r), float(alpha)


def load_lora(model, adapter_dir: str) -> list[str]:
    """Load adapters saved by `save_lora` into a model that already has adapters on the same modules
    (e.g. after `prepare_for_training`); shapes and the module set must match. Keeps shardings."""
    wpath = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    if not os.path.isfile(wpath):
        raise FileNotFoundError(f"{wpath}: no adapter weights")
    try:
        tensors = load_file(wpath)
    except Exception as e:  # safetensors raises its own error types for truncated / corrupt files
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{wpath}: cannot read the adapter weights ({first})") from None
    lins = lora_linears(model)
    want = set()
    for path, lin in lins:
        names = adapter_names(path, lin)
        for suffix, var in ((".lora_A.weight", lin.lora.a), (".lora_B.weight", lin.lora.b)):
            old = var.get_value()
            need = tuple(old.shape[-2:][::-1])
            parts = []
            for name, _ in names:
                key = name + suffix
                want.add(key)
                if key not in tensors:
                    raise KeyError(f"{wpath}: missing {key}")
                if tuple(tensors[key].shape) != need:
                    raise ValueError(f"{wpath}: {key} has shape {tensors[key].shape}, the model needs {need}")
                parts.append(tensors[key].T)
            arr = np.stack(parts) if isinstance(lin, ExpertLinear) else parts[0]
            new = jnp.asarray(arr, old.dtype)
            sh = getattr(old, "sharding", None)
            var.set_value(jax.device_put(new, sh) if sh is not None else new)
    extra = sorted(set(tensors) - want)
    if extra:
        raise ValueError(f"{wpath}: adapters for modules the model does not adapt: {extra[:5]}")
    return [p for p, _ in lins]
