"""JAX's persistent compilation cache, on by default for lrmq's programs.

A second run of the same config (same shapes, same jax/XLA, same devices) loads its compiled programs
from disk instead of compiling them again: the first GRPO step of a tiny run drops from seconds to
well under a second, of a paper recipe from minutes (benchmarks/compile_cache.py measures it).
"""

from __future__ import annotations

import logging
import os

import jax
from jax.experimental.compilation_cache import compilation_cache as cc

log = logging.getLogger(__name__)

ENV = "LRMQ_COMPILE_CACHE"
# Programs that compile faster than this are not worth a disk round trip (JAX's own default is 1 s;
# lrmq's step compiles on CPU take 0.3-3 s, so keep most of them).
MIN_COMPILE_SECS = 0.2


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lrmq", "jax")


def resolve(setting: str) -> str | None:
    """The cache dir a setting means: "auto" / "" = $LRMQ_COMPILE_CACHE or ~/.cache/lrmq/jax; "off" = none;
    anything else is the dir itself. $LRMQ_COMPILE_CACHE=off turns the default off."""
    if setting in ("", "auto"):
        setting = os.environ.get(ENV) or default_dir()
    if setting == "off":
        return None
    return os.path.abspath(os.path.expanduser(setting)) if "://" not in setting else setting


def enable(setting: str = "auto") -> str | None:
    """Point JAX's persistent compilation cache at `setting`'s dir (see `resolve`); returns the dir.

    A cache dir the user already configured (JAX_COMPILATION_CACHE_DIR or jax.config) is left alone."""
    path = resolve(setting)
    if path is None:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current and setting in ("", "auto"):
        return current
    if current == path:
        return path
    if "://" not in path:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:  # an unwritable cache only costs compile time
            log.warning("compilation cache %s is not writable (%s); compiling without it", path, e)
            return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    # JAX decides whether to use a persistent cache at its first compile; a process that compiled before
    # this call (a notebook, a test session) must be told to look again.
    cc.reset_cache()
    log.info("JAX compilation cache: %s", path)
    return path


def disable_for_compile_only_gpu() -> None:
    """Turn JAX's persistent cache off for this process: a compile-only GPU executable (`lrmq.targets`) is written
    to it but cannot be read back ("PjRtCompiler must be constructed with a Client to call
    DeserializeLoadedExecutable"), so a second run would warn for each program and compile it again anyway."""
    jax.config.update("jax_enable_compilation_cache", False)
