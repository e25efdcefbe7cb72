"""One entry point for models on disk: a Hugging Face directory or an lrmq checkpoint.

Every command reads a checkpoint option (`--checkpoint`, `--tokenizer`, `--base`, convert's SRC, the configs'
`model.checkpoint` / `model` / `tokenizer` / `checkpoint`) through these functions, and each resolves the
aliases "tiny" and "tiny-moe" (the shipped tiny models) with `resolve_checkpoint`: the model, its config and
its tokenizer are found the same way everywhere.
"""

from __future__ import annotations

import os

from lrmq import paths
from lrmq.checkpoint import remote
from lrmq.checkpoint.hf import CheckpointError, load_hf_model
from lrmq.checkpoint.quantized import hf_quantization, load_quantized_hf
from lrmq.checkpoint.lrmq_shards import PARAMS_FILE, PARAMS_INDEX
from lrmq.checkpoint.orbax_io import (CONFIG_FILE, PARAMS_DIR, STATE_FILE, has_params, is_lrmq_checkpoint, load_lrmq,
                                      read_lrmq_config)
from lrmq.cli import UsageError, error_message
from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder
from lrmq.tokenizer import Tokenizer

# The tiny Qwen3 shipped with the package (`model.checkpoint: tiny`), and its Qwen3-MoE sibling
# (`model.checkpoint: tiny-moe`; docs/tiny_model.md).
TINY_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tiny")
TINY_MOE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tiny-moe")
ALIASES = {"tiny": TINY_MODEL_DIR, "tiny-moe": TINY_MOE_DIR}


def resolve_checkpoint(path: str) -> str:
    """A checkpoint path, with the aliases "tiny" / "tiny-moe" for the shipped tiny models (idempotent); a bucket URL
    (gs://...) becomes its local view: the small files copied, the weights streamed from the bucket
    (`lrmq.checkpoint.remote`)."""
    path = ALIASES.get(path, path)
    if isinstance(path, str) and paths.is_url(path):
        return remote.local_view(path)
    return path


def is_hf_checkpoint(path: str) -> bool:
    weights = set(remote.weight_files(path)) if remote.is_remote_view(path) else set()
    return os.path.isfile(os.path.join(path, "config.json")) and (
        os.path.isfile(os.path.join(path, "model.safetensors")) or "model.safetensors" in weights
        or os.path.isfile(os.path.join(path, "model.safetensors.index.json")))


def hub_id_hint(path: str) -> str:
    """For a missing path shaped like a hub id ("Qwen/Qwen3-8B"): lrmq reads local (or bucket) directories only,
    never a model hub; say how to get one. Empty otherwise."""
    parts = path.split("/")
    if len(parts) == 2 and all(parts) and not path.startswith(".") and "://" not in path \
            and not os.path.isdir(parts[0]):
        return (f" (lrmq reads checkpoint directories, not hub ids: download it first, e.g. "
                f"`huggingface-cli download {path} --local-dir DIR`, and pass DIR)")
    return ""


def checkpoint_kind(path: str) -> str:
    """'lrmq' or 'hf'; raises naming the path (and what was looked for) when it is neither."""
    path = resolve_checkpoint(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory{hub_id_hint(path)}")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"{path}: is a file; a checkpoint is a directory (config.json, weights, "
                                 "tokenizer files)")
    # lrmq first: its config.json is also a valid HF config, but it has no safetensors.
    if is_lrmq_checkpoint(path):
        return "lrmq"
    if os.path.exists(os.path.join(path, STATE_FILE)) or has_params(path):
        # looks like an lrmq checkpoint: say which of its files is missing or broken
        missing = [n + (" (a directory is there)" if os.path.isdir(os.path.join(path, n)) else "")
                   for n in (CONFIG_FILE, STATE_FILE) if not os.path.isfile(os.path.join(path, n))]
        params = os.path.join(path, PARAMS_DIR)
        if not has_params(path):
            missing.append(PARAMS_DIR + "/" + (" (a file is there)" if os.path.exists(params) else "")
                           + f" or {PARAMS_FILE} / {PARAMS_INDEX}")
        if missing:
            raise CheckpointError(f"{path}: incomplete lrmq checkpoint, missing {', '.join(missing)}")
        read_lrmq_config(path)  # raises naming config.json and what is wrong with it
    if is_hf_checkpoint(path):
        hf_quantization(path)  # a quantization_config lrmq cannot read: one line naming config.json, now
        return "hf"
    cfg = os.path.join(path, CONFIG_FILE)
    if os.path.exists(cfg) and not os.path.isfile(cfg):
        raise CheckpointError(f"{cfg}: is a directory, expected the model config (a JSON file)")
    raise CheckpointError(
        f"{path}: not a model checkpoint; expected either a Hugging Face directory (config.json + "
        f"model.safetensors or model.safetensors.index.json) or an lrmq checkpoint (config.json with an "
        f"'lrmq' section, lrmq_state.json and params/ or {PARAMS_FILE})")


def check_checkpoint(path: str, option: str = "--checkpoint") -> str:
    """A command's checkpoint option, alias resolved and checked before any other work: the resolved path, or a
    UsageError naming the option (`--checkpoint: runs/x: no such file or directory`), so that a missing model is
    never reported as a missing tokenizer or config."""
    try:
        checkpoint_kind(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"{option}: {error_message(e)}") from None
    return resolve_checkpoint(path)


def load_model(path: str, *, mesh=None, dtype: str | None = None, param_dtype: str | None = None) -> Decoder:
    """Load a Decoder from either format, optionally straight onto `mesh`. A quantized Hugging Face checkpoint
    (compressed-tensors, AutoAWQ: `lrmq.checkpoint.quantized`) loads as the packed model it holds, as an lrmq
    ``packed`` checkpoint does.

    dtype: compute dtype override; param_dtype: parameter dtype override (None keeps the stored one).
    """
    path = resolve_checkpoint(path)
    if checkpoint_kind(path) == "lrmq":
        return load_lrmq(path, mesh=mesh, dtype=dtype, param_dtype=param_dtype)
    q = hf_quantization(path)
    if q is not None:  # compressed-tensors / AutoAWQ: the packed model it holds
        return load_quantized_hf(path, q, mesh=mesh, dtype=dtype, param_dtype=param_dtype)
    return load_hf_model(path, mesh=mesh, dtype=dtype, param_dtype=param_dtype)


def read_model_config(path: str, *, dtype: str | None = None) -> ModelConfig:
    """The ModelConfig of an HF or lrmq checkpoint (or of a bare config.json's directory), no weights read."""
    path = resolve_checkpoint(path)
    if os.path.isdir(path) and is_lrmq_checkpoint(path):
        return read_lrmq_config(path, dtype=dtype)
    return ModelConfig.from_hf_file(path, dtype=dtype)


def load_tokenizer(path: str, option: str | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint directory (or of a tokenizer directory), alias resolved; with `option`
    (`--tokenizer`), errors name it."""
    try:
        return Tokenizer.from_dir(resolve_checkpoint(path))
    except (OSError, ValueError) as e:
        if option is None:
            raise
        raise UsageError(f"{option}: {error_message(e)}") from None
