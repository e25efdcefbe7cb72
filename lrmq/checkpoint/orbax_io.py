"""The lrmq checkpoint format: a directory that restores straight onto a mesh.

    config.json       the Hugging Face config dict (ModelConfig.to_hf_dict()) plus an "lrmq" sub-dict
                      {"format_version", "dtype", "param_dtype"} for what HF has no field for
    lrmq_state.json   one entry per saved variable: type, shape/dtype of each array, logical axes and,
                      for packed weights, the QuantizedWeight static fields
    params/           an orbax StandardCheckpointer tree: every non-RNG variable of the model; or, in the
                      safetensors storage layout (lrmq_state.json "storage": "safetensors"),
                      params.safetensors / params-0000i-of-0000N.safetensors + params.safetensors.index.json
                      (`LrmqWriter`: written variable by variable, e.g. by a streamed PTQ; read: `lrmq_shards`)
    tokenizer files   copied from `tokenizer_from` when present

The manifest (not orbax metadata, whose layout changes between orbax releases) is what `load_lrmq`
builds its abstract target from: shapes are checked before any byte is read, and every array is
restored directly with its `NamedSharding` on the requested mesh (any mesh shape, not the saving one),
whichever the storage layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrmq import paths
from lrmq.atomic import atomic_dir
from lrmq.checkpoint import lrmq_shards, remote
from lrmq.checkpoint.hf import CheckpointError, _sync_processes, copy_tokenizer_files
from lrmq.checkpoint.lrmq_shards import STATE_FILE
from lrmq.checkpoint.shards import DEFAULT_MAX_SHARD_BYTES, ShardWriter
from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder
from lrmq.quant.formats import WeightFormat
from lrmq.quant.qkernel import QuantizedExpertKernel, QuantizedKernel
from lrmq.quant.qweight import QuantizedWeight
from lrmq.sharding import LOGICAL_AXES_KEY, host_array, state_shardings

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
STORAGES = ("orbax", "safetensors")  # lrmq_state.json "storage" (absent: orbax)


# ----------------------------------------------------------------------------- state <-> flat paths
def _path_str(path) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def _savable_vars(model: nnx.Module) -> dict[str, nnx.Variable]:
    """'layers.0.attn.q_proj.kernel' -> Variable for all variables except RNG state."""
    state = nnx.state(model, nnx.Not(nnx.RngState))
    return {_path_str(p): v for p, v in nnx.to_flat_state(state)}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Dotted paths -> nested dict with str keys (orbax stores keys as str; ints would not round trip)."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        *head, last = path.split(".")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = value
    return out


def _lookup(tree, path: str):
    for k in path.split("."):
        tree = tree[k] if k in tree else tree[int(k)]  # nnx State keeps list indices as ints
    return tree


def _is_quantized_value(v) -> bool:
    return hasattr(v, "codes") and hasattr(v, "static") and hasattr(v, "arrays")


def _array_desc(a) -> list:
    return [list(int(d) for d in a.shape), jnp.dtype(a.dtype).name]


# ----------------------------------------------------------------------------- save
def _manifest(model: Decoder) -> dict[str, dict[str, Any]]:
    """Describe every variable, refusing ones `load_lrmq` could not rebuild (they'd be silently lost)."""
    cfg = model.cfg
    base = set(_savable_vars(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))))
    out, problems = {}, []
    for path, var in _savable_vars(model).items():
        value = var.get_value()
        axes = var.get_metadata().get(LOGICAL_AXES_KEY)
        entry: dict[str, Any] = {"logical_axes": list(axes) if axes is not None else None}
        if _is_quantized_value(value) and isinstance(var, QuantizedKernel):
            if path not in base or not path.endswith(".kernel"):
                problems.append(f"{path}: packed weight where the decoder has no Linear kernel")
                continue
            entry.update(type="QuantizedKernel", static=_json_static(value.static()),
                         arrays={k: _array_desc(a) for k, a in value.arrays().items()})
        elif type(var) is nnx.Param and path in base and hasattr(value, "shape"):
            entry.update(type="Param", array=_array_desc(value))
        else:
            problems.append(f"{path}: {type(var).__name__}")
        out[path] = entry
    missing = sorted(base - set(out))
    if missing:
        problems.append("missing from the model: " + ", ".join(missing))
    if problems:
        raise CheckpointError("save_lrmq can store the decoder's float parameters and packed QuantizedKernel "
                              "weights only (merge LoRA adapters first); cannot store:\n  " + "\n  ".join(problems))
    return out


def _json_static(static: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in static.items()}


def _hf_config_for(cfg: ModelConfig) -> dict[str, Any]:
    hf = cfg.to_hf_dict()
    # config.json describes the stored weights: keep its dtype field in step with param_dtype.
    key = "torch_dtype" if "torch_dtype" in hf and "dtype" not in hf else "dtype"
    if str(hf.get(key, "")).replace("torch.", "") != cfg.param_dtype:
        hf[key] = cfg.param_dtype
    hf["lrmq"] = {"format_version": FORMAT_VERSION, "dtype": cfg.dtype, "param_dtype": cfg.param_dtype}
    return hf


def save_lrmq(model: Decoder, path: str, *, tokenizer_from: str | None = None, overwrite: bool = False,
              weight_formats=None, storage: str = "orbax", max_shard_bytes: int | None = None) -> str:
    """Write an lrmq checkpoint atomically (nothing at `path` unless every file was written). `weight_formats`
    (`lrmq.quant.formats.WeightFormat`s of its packed weights) are recorded in lrmq_state.json
    (`read_weight_formats`). `storage`: "orbax" (a params/ tree) or "safetensors" (`LrmqWriter`:
    shards of at most `max_shard_bytes`, default 5 * 10**9, with an index)."""
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {list(STORAGES)}, got {storage!r}")
    if max_shard_bytes is not None and storage != "safetensors":
        raise ValueError("max_shard_bytes applies to storage='safetensors' only")
    manifest = _manifest(model)
    if storage == "safetensors":
        _save_safetensors(model, path, manifest, overwrite=overwrite, weight_formats=weight_formats,
                          tokenizer_from=tokenizer_from, max_shard_bytes=max_shard_bytes)
        return path
    flat = {p: v.get_value() for p, v in _savable_vars(model).items()}
    hf = _hf_config_for(model.cfg)
    import orbax.checkpoint as ocp  # here, not at import: orbax costs ~0.9 s of every CLI start

    with atomic_dir(path, overwrite=overwrite) as tmp:
        ckptr = ocp.StandardCheckpointer()
        try:
            ckptr.save(os.path.join(tmp, PARAMS_DIR), _nest(flat))
            ckptr.wait_until_finished()  # the save is async; the rename below must see finished files
        finally:
            ckptr.close()
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
            state = {"format_version": FORMAT_VERSION, "variables": manifest}
            if weight_formats:
                state["weight_formats"] = [wf.to_dict() for wf in weight_formats]
            json.dump(state, f, indent=1)
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(hf, f, indent=2)
        if tokenizer_from:
            copy_tokenizer_files(tokenizer_from, tmp)
    return path


class LrmqWriter:
    """An lrmq checkpoint of ``cfg`` in the safetensors storage layout (`lrmq_shards`), written variable by variable
    into ``directory`` (an existing, empty directory: the caller's `lrmq.atomic.atomic_dir`, which makes the whole
    write atomic).

    ``add_param(flat, array)``: a float parameter (numpy, or a jax array gathered to the host), its dtype stored
    as given (the caller casts to ``cfg.param_dtype``); ``add_quantized(flat, qw)``: a Linear's packed kernel
    (``flat`` = ``'layers.0.attn.q_proj.kernel'``), its ``dtype`` set to ``cfg.param_dtype`` as
    `lrmq.ptq.exports.packed_kernels` does; ``close(weight_formats=..., tokenizer_from=...)``: the last shard,
    the index, lrmq_state.json, config.json and the tokenizer files. Every variable of ``Decoder(cfg)`` must be
    added exactly once, with the config's shape (CheckpointError naming it otherwise); logical axes come from the
    abstract Decoder. Host memory: the shard being filled (at most ``max_shard_bytes``)."""

    def __init__(self, directory: str, cfg: ModelConfig, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.directory, self.cfg = directory, cfg
        self._base = _savable_vars(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
        self._entries: dict[str, dict[str, Any]] = {}
        self._shards = ShardWriter(directory, max_shard_bytes, metadata={"format": "lrmq"},
                                   prefix=lrmq_shards.PARAMS_PREFIX)
        self._closed = False

    def _start(self, flat: str, what: str) -> dict[str, Any]:
        if self._closed:
            raise CheckpointError(f"{self.directory}: {flat}: the lrmq checkpoint was already closed")
        if flat not in self._base:
            raise CheckpointError(f"{flat}: the decoder of this config has no such variable (cannot store {what})")
        if flat in self._entries:
            raise CheckpointError(f"{flat}: written twice")
        if type(self._base[flat]) is not nnx.Param:
            raise CheckpointError(f"{flat}: a {type(self._base[flat]).__name__}, not a parameter")
        axes = self._base[flat].get_metadata().get(LOGICAL_AXES_KEY)
        return {"logical_axes": list(axes) if axes is not None else None}

    def _want_shape(self, flat: str) -> tuple[int, ...]:
        return tuple(self._base[flat].get_value().shape)

    def add_param(self, flat: str, array) -> None:
        entry = self._start(flat, "a float parameter")
        arr = host_array(array)
        if arr.shape != self._want_shape(flat):
            raise CheckpointError(f"{flat}: shape {list(arr.shape)}, the config needs {list(self._want_shape(flat))}")
        self._shards.add(flat, arr)
        entry.update(type="Param", array=_array_desc(arr))
        self._entries[flat] = entry

    def add_quantized(self, flat: str, qw: QuantizedWeight) -> None:
        self.add_packed(flat, dataclasses.replace(qw, dtype=self.cfg.param_dtype))

    def add_packed(self, flat: str, qw: QuantizedWeight) -> None:
        """`add_quantized` keeping ``qw.dtype`` as it is (`save_lrmq` of a model that holds packed kernels)."""
        entry = self._start(flat, "a packed weight")
        if not flat.endswith(".kernel"):
            raise CheckpointError(f"{flat}: packed weight where the decoder has no Linear kernel")
        if tuple(qw.shape) != self._want_shape(flat):
            raise CheckpointError(f"{flat}: packed weight of shape {list(qw.shape)}, the config needs "
                                  f"{list(self._want_shape(flat))}")
        arrays = {k: host_array(a) for k, a in qw.arrays().items()}
        for k, a in arrays.items():
            self._shards.add(f"{flat}.{k}", a)
        entry.update(type="QuantizedKernel", static=_json_static(qw.static()),
                     arrays={k: _array_desc(a) for k, a in arrays.items()})
        self._entries[flat] = entry

    def close(self, *, weight_formats=None, tokenizer_from: str | None = None) -> None:
        missing = [p for p in self._base if p not in self._entries]
        if missing:
            raise CheckpointError(f"{self.directory}: the lrmq checkpoint is incomplete, missing from the model: "
                                  + ", ".join(missing[:10])
                                  + (f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""))
        self._closed = True
        self._shards.close()
        state: dict[str, Any] = {"format_version": FORMAT_VERSION, "storage": lrmq_shards.STORAGE,
                                 "variables": {p: self._entries[p] for p in self._base}}
        if weight_formats:
            state["weight_formats"] = [wf.to_dict() for wf in weight_formats]
        with open(os.path.join(self.directory, STATE_FILE), "w") as f:
            json.dump(state, f, indent=1)
        with open(os.path.join(self.directory, CONFIG_FILE), "w") as f:
            json.dump(_hf_config_for(self.cfg), f, indent=2)
        if tokenizer_from:
            copy_tokenizer_files(tokenizer_from, self.directory)


def _save_safetensors(model: Decoder, path: str, manifest: dict[str, dict[str, Any]], *, overwrite: bool,
                      weight_formats, tokenizer_from: str | None, max_shard_bytes: int | None) -> None:
    """`save_lrmq(storage="safetensors")`. Multi-host (as `hf.save_hf_model`): every process gathers each array in
    turn, process 0 writes, nobody returns before the checkpoint is in place."""
    variables = _savable_vars(model)
    if jax.process_index() != 0:
        for p, var in variables.items():  # the writer's order: a packed weight's arrays, else the value
            value = var.get_value()
            for a in (value.arrays().values() if manifest[p]["type"] == "QuantizedKernel" else [value]):
                host_array(a)
    else:
        with atomic_dir(path, overwrite=overwrite) as tmp:
            writer = LrmqWriter(tmp, model.cfg, max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
            for p, var in variables.items():
                if manifest[p]["type"] == "QuantizedKernel":
                    writer.add_packed(p, var.get_value())
                else:
                    writer.add_param(p, var.get_value())
            writer.close(weight_formats=weight_formats, tokenizer_from=tokenizer_from)
    _sync_processes(f"lrmq.save_lrmq:{path}")


# ----------------------------------------------------------------------------- load
def _all_finite(tree) -> bool:
    """Every float leaf (a Param, or a packed weight's scales) is finite."""
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)
               if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating))


def has_params(path: str) -> bool:
    """The directory holds an lrmq checkpoint's arrays in either storage layout (params/, or params.safetensors /
    its index: `lrmq_shards`)."""
    return os.path.isdir(os.path.join(path, PARAMS_DIR)) or lrmq_shards.has_params(path)


def is_lrmq_checkpoint(path: str) -> bool:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not (os.path.isfile(cfg_path) and has_params(path) and os.path.isfile(os.path.join(path, STATE_FILE))):
        return False
    try:
        with open(cfg_path) as f:
            return isinstance(json.load(f).get("lrmq"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def read_lrmq_config(path: str, *, dtype: str | None = None, param_dtype: str | None = None) -> ModelConfig:
    """The ModelConfig of an lrmq checkpoint (with its saved compute / param dtypes unless overridden)."""
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json at {cfg_path}")
    try:
        hf = paths.read_json(cfg_path, what="model config")
    except paths.FileFormatError as e:
        raise CheckpointError(str(e)) from None
    meta = hf.pop("lrmq", None)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{cfg_path}: no 'lrmq' section; this is not an lrmq checkpoint")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{cfg_path}: lrmq format_version {meta.get('format_version')!r} is not supported "
                              f"(this lrmq reads {FORMAT_VERSION})")
    return ModelConfig.from_hf_dict(hf, source=cfg_path, dtype=dtype or meta.get("dtype"),
                                    param_dtype=param_dtype or meta.get("param_dtype"))


def read_weight_formats(path: str) -> list:
    """The `WeightFormat`s an lrmq checkpoint records for its packed weights (lrmq_state.json `weight_formats`);
    [] for a float checkpoint or one written before formats were recorded. A malformed entry: CheckpointError."""

    p = os.path.join(path, STATE_FILE)
    if not os.path.exists(p):
        return []
    try:
        entries = paths.read_json(p, what="lrmq state manifest").get("weight_formats") or []
        return [WeightFormat.from_dict(e, where=f"{p}: weight_formats[{i}]") for i, e in enumerate(entries)]
    except (paths.FileFormatError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(str(e)) from None


def _read_state(path: str) -> dict[str, Any]:
    p = os.path.join(path, STATE_FILE)
    if not os.path.exists(p):
        raise CheckpointError(f"{p}: missing; {path} is not a complete lrmq checkpoint")
    try:
        state = paths.read_json(p, what="lrmq state manifest")
    except paths.FileFormatError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{p}: not a valid lrmq state manifest (a JSON object expected)")
    return state


def _read_manifest(path: str) -> dict[str, dict[str, Any]]:
    variables = _read_state(path).get("variables")
    if not isinstance(variables, dict) or not all(isinstance(v, dict) for v in variables.values()):
        raise CheckpointError(f"{os.path.join(path, STATE_FILE)}: not a valid lrmq state manifest (no 'variables' "
                              "mapping of entries)")
    return variables


def read_storage(path: str) -> str:
    """The storage layout of the lrmq checkpoint `path`: "orbax" (params/; lrmq_state.json has no "storage" key)
    or "safetensors" (`lrmq_shards`)."""
    storage = _read_state(path).get("storage", "orbax")
    if storage not in STORAGES:
        raise CheckpointError(f"{os.path.join(path, STATE_FILE)}: storage {storage!r} is not one of "
                              f"{list(STORAGES)}")
    return storage


def _install_quantized(abstract: Decoder, path: str, entry: dict[str, Any]) -> None:
    """Swap the abstract float kernel at `path` for an abstract QuantizedKernel of the saved layout."""
    *mod_path, attr = path.split(".")
    module = abstract
    for k in mod_path:
        module = module[int(k)] if k.isdigit() else getattr(module, k)
    static = dict(entry["static"])
    static["shape"] = tuple(static["shape"])
    arrays = {k: jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d)) for k, (s, d) in entry["arrays"].items()}
    axes = entry.get("logical_axes")
    meta = {LOGICAL_AXES_KEY: tuple(axes)} if axes is not None else {}
    kind = QuantizedExpertKernel if len(static["shape"]) == 3 else QuantizedKernel  # stacked experts: (E, K, N)
    setattr(module, attr, kind(QuantizedWeight(**arrays, **static), **meta))


def _check_manifest(path: str, manifest: dict[str, dict[str, Any]], variables: dict[str, nnx.Variable],
                    problems: list[str]) -> None:
    """The manifest's variables are the model's (`variables`: flat path -> abstract Variable of the config), with
    the config's shapes; one CheckpointError lists every problem (with `problems` found before)."""
    problems = list(problems)
    problems += [f"missing variable {p}" for p in sorted(set(variables) - set(manifest))]
    problems += [f"unexpected variable {p}" for p in sorted(set(manifest) - set(variables))]
    for p in sorted(set(variables) & set(manifest)):
        entry = manifest[p]
        if entry.get("type") == "Param":
            want = tuple(variables[p].get_value().shape)
            if tuple(entry["array"][0]) != want:
                problems.append(f"wrong shape for {p}: the config needs {want}, the checkpoint has "
                                f"{tuple(entry['array'][0])}")
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match its config.json:\n  " + "\n  ".join(problems))


def _params_location(path: str) -> str:
    """Where orbax reads the arrays: params/ of the directory, or of the bucket URL a local view stands for."""
    url = remote.remote_url(path)
    return paths.join(url, PARAMS_DIR) if url else os.path.abspath(os.path.join(path, PARAMS_DIR))


def _restore_error(path: str, e: Exception) -> CheckpointError:
    """An orbax / tensorstore failure as one line naming the checkpoint's params/ and the cause (tensorstore
    appends its whole multi-line spec)."""
    first = (str(e).strip().splitlines() or [""])[0].removesuffix(" See full TensorStore details.")
    return CheckpointError(f"{os.path.join(path, PARAMS_DIR)}: cannot restore ({type(e).__name__}: {first}); "
                           "the checkpoint's arrays are missing or damaged")


def restore_arrays(path: str, arrays: dict[str, tuple[tuple[int, ...], Any]]) -> dict[str, np.ndarray]:
    """Some arrays of the lrmq checkpoint `path` ({flat name of its manifest, 'layers.3.attn.q_proj.kernel':
    (shape, dtype)}), restored onto the host as numpy with their stored dtypes. One orbax partial restore: only
    these arrays' chunks (and the tree's metadata) are read, never the other arrays; orbax parses the whole tree's
    metadata once per call (a cost that grows with the layers), so a layer's arrays are best asked for
    together.
    The shapes / dtypes (the manifest's) are checked against what was read (CheckpointError naming the tensor).
    The safetensors layout: `lrmq_shards.restore_arrays` (read-only views of the memory-mapped files, or a bucket's
    byte ranges; the headers checked first); a packed weight's arrays are named '<flat>.<field>' there
    ('layers.0.attn.q_proj.kernel.codes')."""
    if read_storage(path) == "safetensors":
        return lrmq_shards.restore_arrays(path, arrays)
    import orbax.checkpoint as ocp

    item = _nest({n: np.zeros((), dt) for n, (_, dt) in arrays.items()})
    args = _nest({n: ocp.RestoreArgs(restore_type=np.ndarray) for n in arrays})
    ckptr = ocp.PyTreeCheckpointer()
    try:
        restored = ckptr.restore(_params_location(path),
                                 args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True))
        out = {n: np.asarray(_lookup(restored, n)) for n in arrays}
    except Exception as e:  # orbax/tensorstore raise many types (a name not in the tree: a KeyError / ValueError)
        raise _restore_error(path, e) from e
    finally:
        ckptr.close()
    for n, (shape, dtype) in arrays.items():
        if out[n].shape != tuple(shape) or out[n].dtype != np.dtype(dtype):
            raise CheckpointError(f"{os.path.join(path, PARAMS_DIR)}: tensor {n} is {out[n].dtype}"
                                  f"{list(out[n].shape)}, {STATE_FILE} says {np.dtype(dtype)}{list(shape)}")
    return out


def load_lrmq(path: str, *, mesh=None, dtype: str | None = None, param_dtype: str | None = None) -> Decoder:
    """Restore an lrmq checkpoint; with `mesh`, every array lands directly on its logical-axis sharding.

    `dtype` overrides the compute dtype; `param_dtype` casts the float parameters after the restore
    (packed weights keep their stored dtypes).
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no lrmq checkpoint at {path}")
    cfg = read_lrmq_config(path, dtype=dtype)  # build with the saved param dtype; cast after the restore
    manifest = _read_manifest(path)
    storage = read_storage(path)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    problems = []
    for p, entry in manifest.items():
        if entry.get("type") == "QuantizedKernel":
            try:
                _install_quantized(abstract, p, entry)
            except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
                problems.append(f"{p}: cannot rebuild the packed weight ({e})")
    state = nnx.state(abstract, nnx.Not(nnx.RngState))
    variables = {_path_str(p): v for p, v in nnx.to_flat_state(state)}
    _check_manifest(path, manifest, variables, problems)

    if mesh is not None:
        shardings = state_shardings(state, mesh)
        sharding_of = lambda p: _lookup(shardings, p)
    else:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        sharding_of = lambda p: jax.tree.map(lambda _: one, variables[p].get_value())

    def target(p):
        entry, value = manifest[p], variables[p].get_value()
        if entry["type"] == "Param":
            shape, dt = entry["array"]
            return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dt), sharding=sharding_of(p))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), value, sharding_of(p))

    if storage == "safetensors":
        restored = lrmq_shards.restore_model(path, manifest, {p: target(p) for p in variables})
        where = remote.remote_url(path) or path
    else:
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()
        try:
            tree = ckptr.restore(_params_location(path), _nest({p: target(p) for p in variables}))
        except Exception as e:  # orbax/tensorstore raise many types
            raise _restore_error(path, e) from e
        finally:
            ckptr.close()
        restored = {p: _lookup(tree, p) for p in variables}
        where = os.path.join(path, PARAMS_DIR)

    cast = jnp.dtype(param_dtype) if param_dtype else None
    bad = [p for p in sorted(variables) if not _all_finite(restored[p])]
    if bad:
        raise CheckpointError(f"{where}: non-finite values (NaN or Inf) in " + ", ".join(bad))
    for p, var in variables.items():
        value = restored[p]
        if cast is not None and manifest[p]["type"] == "Param" and jnp.issubdtype(value.dtype, jnp.floating):
            value = value.astype(cast)  # elementwise: keeps the sharding
        var.set_value(value)
    nnx.update(abstract, state)  # no-op where nnx.state shares Variables with the module; needed where it copies
    if cast is not None:
        abstract.cfg = cfg.replace(param_dtype=jnp.dtype(cast).name)
    return abstract
