"""Hugging Face safetensors checkpoints in and out.

Import streams one tensor at a time from memory-mapped safetensors straight onto its sharding
(`jax.make_array_from_callback` materializes only the local shards), so peak host memory stays near
one tensor. Export writes into a temporary directory and renames it into place: a failed export
leaves nothing behind (for a URL `out_dir`: staged locally, then uploaded with config.json last; see
lrmq.atomic).

Multi-controller runs (one process per host): parameters sharded over hosts are not readable by one
process alone. Every process must call `save_hf_model`; each tensor is gathered in turn (a collective
all of them join, so host memory holds one tensor at a time) and only process 0 writes.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from lrmq import paths
from lrmq.atomic import atomic_dir
from lrmq.checkpoint import remote
from lrmq.checkpoint.hf_names import Slot, expand, fused_views
from lrmq.checkpoint.shards import ShardWriter
from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder
from lrmq.sharding import LOGICAL_AXES_KEY, host_array, logical_to_spec

# Tensors some exporters write that carry no information for us.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")


class CheckpointError(ValueError):
    """A checkpoint lrmq cannot read; the message names every offending file or tensor."""


def flat_params(model: nnx.Module) -> dict[str, nnx.Variable]:
    """'layers.0.attn.q_proj.kernel' -> Variable, for every parameter of the model."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        out[".".join(str(p) for p in path)] = var
    return out


def tensor_index(ckpt_dir: str) -> dict[str, str]:
    """HF tensor name -> safetensors file, for single-file and sharded (index.json) checkpoints; the files are
    URLs for a bucket checkpoint's local view (`remote.local_view`)."""
    if remote.is_remote_view(ckpt_dir):
        return _remote_index(ckpt_dir)
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    single = os.path.join(ckpt_dir, "model.safetensors")
    if os.path.exists(index):
        wm = _weight_map(index, index)
        outside = sorted({v for v in wm.values() if not inside_dir(ckpt_dir, v)})
        if outside:
            raise CheckpointError(f"{index} names files outside the checkpoint directory {ckpt_dir}: {outside}")
        files = {os.path.join(ckpt_dir, v) for v in wm.values()}
        missing = sorted(f for f in files if not os.path.exists(f))
        if missing:
            raise CheckpointError(f"{index} lists files that do not exist: {missing}")
        return {k: os.path.join(ckpt_dir, v) for k, v in wm.items()}
    if os.path.exists(single):
        return {name: single for name in _names_in(single)}
    raise CheckpointError(f"{ckpt_dir}: no model.safetensors or model.safetensors.index.json")


def _weight_map(index: str, where: str) -> dict[str, str]:
    """The `weight_map` of a safetensors index file: {tensor name: file name} (CheckpointError naming `where`)."""
    try:
        wm = paths.read_json(index, what="safetensors index").get("weight_map")
    except paths.FileFormatError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{where}: weight_map must map tensor names to file names")
    return wm


def _remote_index(view: str) -> dict[str, str]:
    url, files = remote.remote_url(view), set(remote.weight_files(view))
    index = os.path.join(view, "model.safetensors.index.json")
    if os.path.exists(index):
        wm = _weight_map(index, f"{url}/model.safetensors.index.json")
        outside = sorted(v for v in wm.values() if "/" in v)
        if outside:
            raise CheckpointError(f"{url}/model.safetensors.index.json names files outside the checkpoint directory: "
                                  f"{outside}")
        missing = sorted(set(wm.values()) - files)
        if missing:
            raise CheckpointError(f"{url}/model.safetensors.index.json lists files that do not exist: {missing}")
        return {k: paths.join(url, v) for k, v in wm.items()}
    if "model.safetensors" in files:
        single = paths.join(url, "model.safetensors")
        return {name: single for name in _remote(single).keys()}
    raise CheckpointError(f"{url}: no model.safetensors or model.safetensors.index.json")


def _remote(url: str) -> "remote.RemoteSafetensors":
    try:
        return remote.open_safetensors(url)
    except remote.SafetensorsError as e:
        raise CheckpointError(str(e)) from None


def inside_dir(directory: str, name: str) -> bool:
    """`name`, a path read from a checkpoint's metadata, stays inside `directory` (no absolute path, no
    `..` out of it, no symlink pointing out of it)."""
    if os.path.isabs(name) or not name:
        return False
    root = os.path.realpath(directory)
    target = os.path.realpath(os.path.join(root, name))
    return os.path.commonpath([root, target]) == root and target != root


def _names_in(path: str) -> list[str]:
    try:
        with safe_open(path, framework="numpy") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
        raise _read_error(path, e) from None


def _read_error(path: str, e: Exception) -> CheckpointError:
    """Prefer the plain 'truncated' diagnosis over safetensors' own wording when it applies."""
    try:
        _check_complete(path, os.path.getsize(path))
    except CheckpointError as truncated:
        return truncated
    except Exception:  # header unreadable too: report the original error
        pass
    return CheckpointError(f"{path}: cannot read safetensors file ({e})")


def _shapes(index: dict[str, str]) -> dict[str, tuple[int, ...]]:
    by_file: dict[str, list[str]] = {}
    for n, p in index.items():
        by_file.setdefault(p, []).append(n)
    shapes = {}
    for path, names in by_file.items():
        if paths.is_url(path):  # the header only; a truncated file is refused by its reader
            reader = _remote(path)
            shapes.update((n, reader.shape(n)) for n in names)
            continue
        size = os.path.getsize(path)
        try:
            with safe_open(path, framework="numpy") as f:
                for n in names:
                    sl = f.get_slice(n)
                    shapes[n] = tuple(sl.get_shape())
        except Exception as e:
            raise _read_error(path, e) from None
        _check_complete(path, size)
    return shapes


def _check_complete(path: str, size: int) -> None:
    """safetensors opens a truncated file lazily; compare the header's extent with the file size."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: file is truncated ({size} bytes, header needs {8 + n + end})")


def match_names(model: nnx.Module, cfg: ModelConfig, index: dict[str, str], shapes: dict[str, tuple[int, ...]],
                source: str, consumed: frozenset[str] = frozenset(), preset: frozenset[str] = frozenset()
                ) -> dict[str, Slot]:
    """Check every tensor against the model; one error lists all problems. `consumed`: tensors already read
    by another reader (a quantized Linear's packed tensors, `lrmq.checkpoint.quantized`), `preset`: the params
    it set (not read here). Per-expert names may be views of fused tensors (`with_fused_views`)."""
    params = flat_params(model)
    mapping = expand(set(params) - preset, cfg)
    problems = []
    missing = sorted(h for h in mapping if h not in index)
    if missing:
        problems.append("missing tensors: " + ", ".join(missing))
    unexpected = sorted(n for n in index if n not in mapping and n not in consumed and not n.endswith(IGNORED_SUFFIXES)
                        and not (n == "lm_head.weight" and cfg.tie_word_embeddings))
    if unexpected:
        problems.append("unexpected tensors: " + ", ".join(unexpected))
    for h, slot in sorted(mapping.items()):
        if h not in shapes:
            continue
        want = stored_shape(tuple(params[slot.path].get_value().shape), slot)
        if shapes[h] != want:
            problems.append(f"wrong shape for {h}: expected {want}, found {shapes[h]}")
    if problems:
        raise CheckpointError(f"{source}: checkpoint does not match the {cfg.family} config:\n  " + "\n  ".join(problems))
    return mapping


def stored_shape(param_shape: tuple[int, ...], slot: Slot) -> tuple[int, ...]:
    """The shape of the HF tensor that fills `slot` of a parameter of `param_shape`."""
    shape = param_shape[1:] if slot.expert is not None else param_shape
    return shape[::-1] if slot.transform == "T" else shape


def with_fused_views(cfg: ModelConfig, index: dict[str, str], shapes: dict[str, tuple[int, ...]], source: str
                     ) -> tuple[dict[str, str], dict[str, tuple[int, ...]], dict[str, tuple[str, tuple]]]:
    """(index, shapes, views) with transformers 5's fused expert tensors (`hf_names.FUSED_EXPERTS`) replaced by
    the per-expert tensors they hold: views maps each such name to (fused name, its block's numpy index). A fused
    tensor of the wrong shape is a CheckpointError naming it."""
    views = fused_views(index, cfg)
    if not views:
        return index, shapes, views
    index, shapes = dict(index), dict(shapes)
    blocks: dict[str, list[str]] = {}
    for name, (fused, _) in views.items():
        blocks.setdefault(fused, []).append(name)
    for fused, names in blocks.items():
        parts = len(names) // cfg.num_experts
        shape = shapes.get(fused)
        if shape is None or len(shape) != 3 or shape[0] != cfg.num_experts or shape[1] % parts:
            raise CheckpointError(f"{source}: fused expert tensor {fused} has shape {shape}, expected "
                                  f"[{cfg.num_experts} experts, {parts} x rows, columns]")
        for name in names:
            index[name] = index[fused]
            shapes[name] = (shape[1] // parts, shape[2])
        del index[fused], shapes[fused]
    return index, shapes, views


def _read_stored(path: str, name: str, views: dict[str, tuple[str, tuple]], handles: dict[str, Any]) -> np.ndarray:
    """HF tensor `name` from safetensors file `path` (a URL: range reads), a fused tensor's block when `views`
    says it is one."""
    src, idx = views.get(name, (name, None))
    if paths.is_url(path):
        reader = _remote(path)
        return reader.tensor(src) if idx is None else reader.tensor(src, slice(idx[0], idx[0] + 1))[0][idx[1:]]
    if path not in handles:
        handles[path] = safe_open(path, framework="numpy").__enter__()
    return handles[path].get_tensor(src) if idx is None else handles[path].get_slice(src)[idx]


def load_hf_model(ckpt_dir: str, *, mesh=None, dtype: str | None = None, param_dtype: str | None = None,
                  config: ModelConfig | None = None) -> Decoder:
    cfg = config or ModelConfig.from_hf_file(ckpt_dir, dtype=dtype, param_dtype=param_dtype)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    return fill_hf_params(abstract, ckpt_dir, tensor_index(ckpt_dir), mesh=mesh)


def fill_hf_params(abstract: Decoder, ckpt_dir: str, index: dict[str, str], *, mesh=None,
                   consumed: frozenset[str] = frozenset()) -> Decoder:
    """Read every `nnx.Param` of `abstract` (built by `nnx.eval_shape`) from the checkpoint's tensors `index`
    (`tensor_index`), checked first by `match_names`; `consumed` tensors were read by another reader. A stacked
    expert parameter is assembled on the host from its per-expert tensors, then placed."""
    cfg = abstract.cfg
    shapes = _shapes({k: v for k, v in index.items() if k not in consumed})
    index, shapes, views = with_fused_views(cfg, index, shapes, ckpt_dir)
    preset = frozenset(p for p, v in flat_params(abstract).items() if not isinstance(v.get_value(), jax.ShapeDtypeStruct))
    mapping = match_names(abstract, cfg, index, shapes, ckpt_dir, consumed, preset)
    params = flat_params(abstract)
    pieces: dict[str, list[tuple[str, Slot]]] = {}
    for hf_name, slot in mapping.items():
        pieces.setdefault(slot.path, []).append((hf_name, slot))
    handles: dict[str, Any] = {}
    try:
        for ours, parts in pieces.items():
            var = params[ours]
            target = var.get_value()
            axes = var.get_metadata().get(LOGICAL_AXES_KEY)
            hf_name, slot = parts[0]
            path = index[hf_name]
            if slot.expert is None and paths.is_url(path):
                # streamed: this host's rows of each tensor, nothing on disk
                var.set_value(_place_remote(_remote(path), hf_name, slot.transform, target.dtype, axes, mesh))
                continue
            if slot.expert is None:
                var.set_value(_place(_oriented(_read_stored(path, hf_name, views, handles), slot, target.dtype,
                                               path, hf_name), axes, mesh))
                continue
            stacked = np.empty(target.shape, target.dtype)
            for hf_name, slot in parts:
                path = index[hf_name]
                stacked[slot.expert] = _oriented(_read_stored(path, hf_name, views, handles), slot, target.dtype,
                                                 path, hf_name)
            var.set_value(_place(stacked, axes, mesh))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return abstract


def _oriented(arr: np.ndarray, slot: Slot, dtype, path: str, name: str) -> np.ndarray:
    """A stored tensor in lrmq's orientation and `dtype`, refused when non-finite or past `dtype`'s range."""
    return _checked(arr.T if slot.transform == "T" else arr, dtype, path, name)


def _checked(arr: np.ndarray, dtype, where: str, name: str) -> np.ndarray:
    if not _finite(arr):
        raise CheckpointError(f"{where}: tensor {name} has non-finite values (NaN or Inf)")
    arr = np.asarray(arr).astype(dtype)
    if not _finite(arr):
        raise CheckpointError(f"{where}: tensor {name} overflows {dtype} (values past its range)")
    return arr


def _place_remote(reader, hf_name: str, tr: str, dtype, axes, mesh) -> jax.Array:
    """A bucket tensor placed on `mesh` (or the default device) reading, for each of this host's devices, only
    the rows of the stored tensor its shard covers (with "T": the stored tensor is ours transposed, so our
    column shards are its row ranges). Devices holding the same rows share one read."""
    shape = reader.shape(hf_name)
    ours = shape[::-1] if tr == "T" else shape
    if mesh is None:
        arr = _checked(reader.tensor(hf_name), dtype, reader.url, hf_name)
        return jnp.asarray(arr.T if tr == "T" else arr)
    sharding = jax.sharding.NamedSharding(mesh, logical_to_spec(axes, ours, mesh))
    rows_read: dict[tuple, np.ndarray] = {}

    def shard(idx):
        stored = tuple(idx)[::-1] if tr == "T" else tuple(idx)
        rows = stored[0] if stored else slice(None)
        key = rows.indices(shape[0]) if shape else ()
        if key not in rows_read:
            rows_read[key] = _checked(reader.tensor(hf_name, rows if shape else None), dtype, reader.url, hf_name)
        part = rows_read[key][(slice(None), *stored[1:])] if shape else rows_read[key]
        return part.T if tr == "T" else part

    return jax.make_array_from_callback(ours, sharding, shard)


def _finite(arr: np.ndarray) -> bool:
    arr = np.asarray(arr)
    return not np.issubdtype(arr.dtype, np.inexact) and arr.dtype != ml_dtypes.bfloat16 or bool(np.isfinite(arr).all())


def _place(arr: np.ndarray, axes, mesh) -> jax.Array:
    if mesh is None:
        return jnp.asarray(arr)
    sharding = jax.sharding.NamedSharding(mesh, logical_to_spec(axes, arr.shape, mesh))
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def hf_tensors(model: Decoder, dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, numpy array) for every parameter, in HF orientation and the export dtype; a stacked expert
    parameter as one tensor per expert (gathered once, its experts consecutive in the order).

    Iterates in the fixed NAME_MAP order, so every process of a multi-host run gathers the same
    tensor at the same time (see `host_array`)."""
    cfg = model.cfg
    params = flat_params(model)
    out_dtype = np.dtype(ml_dtypes.bfloat16) if (dtype or cfg.param_dtype) == "bfloat16" else np.dtype(dtype or cfg.param_dtype)
    held: tuple[str, np.ndarray] | None = None
    for hf_name, slot in expand(set(params), cfg).items():
        if held is None or held[0] != slot.path:
            held = (slot.path, host_array(params[slot.path].get_value()))
        arr = held[1] if slot.expert is None else held[1][slot.expert]
        if slot.transform == "T":
            arr = arr.T
        yield hf_name, np.ascontiguousarray(arr.astype(out_dtype))


def hf_config_dict(cfg: ModelConfig, dtype: str | None = None) -> tuple[dict, str]:
    """(config.json dict, export dtype) of an HF checkpoint of ``cfg`` written in ``dtype`` (default: the config's
    torch_dtype, else the param dtype); the dtype field names the stored dtype."""
    hf_cfg = cfg.to_hf_dict()
    export_dtype = dtype or _hf_dtype(hf_cfg) or cfg.param_dtype
    if "torch_dtype" in hf_cfg and "dtype" not in hf_cfg:
        hf_cfg["torch_dtype"] = export_dtype
    else:
        hf_cfg["dtype"] = export_dtype
    return hf_cfg, export_dtype


def save_hf_model(model: Decoder, out_dir: str, *, dtype: str | None = None, tokenizer_from: str | None = None,
                  max_shard_bytes: int = 2 * 1024**3, overwrite: bool = False) -> str:
    """Write model.safetensors (sharded with an index past max_shard_bytes) + config.json, atomically.

    `out_dir` may be a URL. Multi-host: call on every process (see the module docstring); it returns
    once process 0 has finished writing."""
    _check_float_model(model)
    hf_cfg, export_dtype = hf_config_dict(model.cfg, dtype)
    if jax.process_index() != 0:
        for _ in hf_tensors(model, export_dtype):  # join each tensor's gather; process 0 writes
            pass
        _sync_processes(f"lrmq.save_hf_model:{out_dir}")
        return out_dir
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        # each tensor goes to disk as it comes (host memory: one tensor, not a shard or the model)
        shards = ShardWriter(tmp, max_shard_bytes)
        for name, arr in hf_tensors(model, export_dtype):
            shards.add(name, arr)
        shards.close()
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2)
        if tokenizer_from:
            copy_tokenizer_files(tokenizer_from, tmp)
    _sync_processes(f"lrmq.save_hf_model:{out_dir}")
    return out_dir


def _sync_processes(name: str) -> None:
    """Multi-host: nobody returns before the export is in place (a no-op on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _check_float_model(model: nnx.Module) -> None:
    """Packed (QuantizedKernel) weights are not Params: without this check export would silently drop them."""
    odd = [".".join(str(p) for p in path) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.RngState)))
           if not isinstance(v, nnx.Param)]
    if odd:
        raise CheckpointError("save_hf_model exports float parameters only; dequantize these first: " + ", ".join(odd))


def _hf_dtype(hf_cfg: dict) -> str | None:
    d = hf_cfg.get("dtype") or hf_cfg.get("torch_dtype")
    return str(d).replace("torch.", "") if d else None


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> None:
    for name in TOKENIZER_FILES:
        p = os.path.join(src_dir, name)
        if os.path.exists(p):
            shutil.copy2(p, os.path.join(dst_dir, name))
