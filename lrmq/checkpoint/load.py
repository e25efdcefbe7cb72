"""One entry point for models on disk: a Hugging Face directory or an lrmq checkpoint."""

from __future__ import annotations

import os

from lrmq.checkpoint.hf import CheckpointError, load_hf_model
from lrmq.checkpoint.orbax_io import is_lrmq_checkpoint, load_lrmq
from lrmq.model.decoder import Decoder

# The tiny Qwen3 shipped with the package (`model.checkpoint: tiny`).
TINY_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tiny")


def resolve_checkpoint(path: str) -> str:
    """A checkpoint path, with the alias "tiny" for the shipped tiny model."""
    return TINY_MODEL_DIR if path == "tiny" else path


def is_hf_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and (
        os.path.isfile(os.path.join(path, "model.safetensors"))
        or os.path.isfile(os.path.join(path, "model.safetensors.index.json")))


def checkpoint_kind(path: str) -> str:
    """'lrmq' or 'hf'; raises naming the path (and what was looked for) when it is neither."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    # lrmq first: its config.json is also a valid HF config, but it has no safetensors.
    if is_lrmq_checkpoint(path):
        return "lrmq"
    if is_hf_checkpoint(path):
        return "hf"
    raise CheckpointError(
        f"{path}: not a model checkpoint; expected either a Hugging Face directory (config.json + "
        f"model.safetensors or model.safetensors.index.json) or an lrmq checkpoint (config.json with an "
        f"'lrmq' section, lrmq_state.json and params/)")


def load_model(path: str, *, mesh=None, dtype: str | None = None, param_dtype: str | None = None) -> Decoder:
    """Load a Decoder from either format, optionally straight onto `mesh`.

    dtype: compute dtype override; param_dtype: parameter dtype override (None keeps the stored one).
    """
    if checkpoint_kind(path) == "lrmq":
        return load_lrmq(path, mesh=mesh, dtype=dtype, param_dtype=param_dtype)
    return load_hf_model(path, mesh=mesh, dtype=dtype, param_dtype=param_dtype)
