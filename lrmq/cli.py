"""What every `python -m lrmq.NAME` command shares.

* One error format: `lrmq.NAME: error: MESSAGE` on stderr, exit status 2, no traceback, for argparse
  errors (`ArgumentParser`) and for bad inputs found later (`run_main`: the exceptions of
  `USER_ERRORS`, a full disk included); Ctrl-C is `lrmq.NAME: interrupted`, exit status 130.
* Numeric options are range-checked by argparse before any work starts (`number`), with the same
  wording as config bounds (`lrmq.configlib`: `opt(ge=...)`): "must be >= 1, found 0".
* Outputs never overlap inputs (`check_disjoint`): an output that is, contains or is inside an input
  would delete or corrupt it when it is replaced.
* JAX's platforms are chosen before its backends start (`select_platforms`, first thing in every command's
  `main`): on a machine without a TPU, the TPU runtime (libtpu, installed for ahead-of-time TPU compiles) is
  never started, so it prints nothing; a TPU VM, a GPU machine and an explicit JAX_PLATFORMS are left to JAX.
* Python's garbage collector is set for tracing (`tune_gc`, in every command's `__main__` block).
"""

from __future__ import annotations

import argparse
import errno
import gc
import glob
import importlib.metadata
import importlib.util
import math
import os
import pkgutil
import sys
from typing import Callable, Mapping, Sequence

from lrmq import paths
from lrmq.atomic import DiskFullError, is_disk_full


# ----------------------------------------------------------------------------- JAX platforms
# Environment variables that say this process is meant to run on TPUs (set on TPU VMs by their images or
# launchers, or by hand); with any of them the choice stays JAX's.
TPU_ENV_HINTS = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_VISIBLE_CHIPS", "TPU_NAME",
                 "JAX_FORCE_TPU_INIT")
_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips; also Google's virtual NIC and disks (PCI classes 0x02 / 0x01)
_NVIDIA_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")  # what JAX itself looks for
_AMD_DEVICES = ("/dev/kfd",)


def tpu_present() -> bool:
    """Whether this machine may have a TPU: a TPU env hint, a TPU device node (/dev/accel*, a /dev/vfio group),
    or a Google PCI device other than a network or storage one. Generous on purpose: a false "yes" only
    leaves the choice to JAX (which then also prints the TPU runtime's start-up lines)."""
    if any(os.environ.get(k) for k in TPU_ENV_HINTS):
        return True
    if glob.glob("/dev/accel*") or [p for p in glob.glob("/dev/vfio/*") if os.path.basename(p) != "vfio"]:
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() != _GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor), "class")) as f:
                cls = f.read().strip()
        except OSError:
            continue
        if not cls.startswith(("0x01", "0x02")):
            return True
    return False


def _jax_plugins() -> set[str]:
    """Names of the installed JAX PJRT plugins (e.g. xla_cuda12), found the way JAX finds them, unimported."""
    names = set()
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        names |= {m.name for m in pkgutil.iter_modules(list(spec.submodule_search_locations))}
    names |= {ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")}
    return names


def default_platforms() -> str:
    """JAX_PLATFORMS for a machine without a TPU: its GPU where a plugin for it is installed, then the CPU."""
    plugins = " ".join(sorted(_jax_plugins())).lower()
    out = []
    if "cuda" in plugins and any(os.path.exists(d) for d in _NVIDIA_DEVICES):
        out.append("cuda")
    if "rocm" in plugins and any(os.path.exists(d) for d in _AMD_DEVICES):
        out.append("rocm")
    return ",".join([*out, "cpu"])


def select_platforms() -> str | None:
    """Choose JAX's platforms before its backends start; call it first in a command's `main`.

    The test extra installs libtpu (ahead-of-time TPU compiles need it, not a TPU), and JAX left to itself
    starts every backend it finds, libtpu's included, which on a machine without a TPU prints lines of
    metadata-server and worker-hostname errors. So when JAX_PLATFORMS is unset (an explicit value, "" too,
    is kept) and `tpu_present()` says no, JAX_PLATFORMS becomes `default_platforms()` ("cpu", or "cuda,cpu"
    on an NVIDIA machine with JAX's CUDA plugin). Compiles for a TPU topology (`--compile-only --topology`)
    load libtpu on their own and are unaffected. Returns what it set, or None."""
    if "JAX_PLATFORMS" in os.environ:
        return None
    jax = sys.modules.get("jax")
    if jax is not None and jax.config.jax_platforms:  # set in code before the command started
        return None
    if tpu_present():
        return None
    chosen = default_platforms()
    os.environ["JAX_PLATFORMS"] = chosen  # for jax imported later and for the processes a command starts
    if jax is not None:  # imported already: it read the environment then
        jax.config.update("jax_platforms", chosen)
    return chosen


# A young-generation collection every GC_GEN0 allocations instead of Python's 700: tracing and lowering a JAX program
# allocate millions of short-lived objects, and each collection walked the young ones, each full one everything.
GC_GEN0 = 50_000


def tune_gc() -> None:
    """Python's cyclic garbage collector set for a process that traces and compiles JAX programs: the objects that
    exist now (at a command's start: the imported modules, jax, flax and lrmq among them, which live as long as
    the process) leave the collector's view (`gc.freeze`), and young collections run every GC_GEN0 allocations.
    Cycles are still collected, less often. A 2-step `lrmq.train` run of configs/tiny_demo.yaml on one core:
    39.6 / 40.0 s of CPU without it, 35.6 / 36.4 s with it. The test suite sets its processes the same way."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(max(GC_GEN0, gc.get_threshold()[0]), *gc.get_threshold()[1:])


class UsageError(ValueError):
    """Bad command-line input found after parsing (a conflict between options, a path): exit status 2."""


# what a bad input raises (CheckpointError, CalibrationError, ConfigError, ... are ValueErrors; an unknown
# registry name is a KeyError)
USER_ERRORS = (ValueError, KeyError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
               PermissionError, DiskFullError, paths.UnreachableError)


def error_message(e: BaseException) -> str:
    """The text of a user error: a KeyError without its quotes, a full disk with the path."""
    if isinstance(e, DiskFullError):
        return str(e)
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        where = e.filename or "an output"
        return f"no space left on device while writing {where}"
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    if isinstance(e, OSError) and e.filename and e.strerror and str(e).startswith("[Errno"):
        # an OS error raised without lrmq's words: a sentence for the wrong kind of thing at a path
        where = e.filename if not e.filename2 else f"{e.filename} -> {e.filename2}"
        if isinstance(e, FileExistsError):
            kind = "a directory" if os.path.isdir(e.filename) else "a file"
            return f"{e.filename}: already exists ({kind} is there); remove it or choose another path"
        if isinstance(e, IsADirectoryError):
            return f"{where}: is a directory where a file belongs"
        if isinstance(e, NotADirectoryError):
            return f"{where}: part of this path is a file where a directory belongs"
        if isinstance(e, (FileNotFoundError, PermissionError)):
            return f"{e.filename}: {e.strerror}"
    return str(e) or type(e).__name__


def print_error(name: str, e: BaseException | str) -> None:
    msg = e if isinstance(e, str) else error_message(e)
    print(f"lrmq.{name}: error: {msg}", file=sys.stderr)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with lrmq's error line: `lrmq.NAME: error: ...` (after the usage), exit status 2."""

    def __init__(self, name: str, **kw):
        kw.setdefault("prog", f"python -m lrmq.{name}")
        super().__init__(**kw)
        self.lrmq_name = name

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"lrmq.{self.lrmq_name}: error: {message}\n")


def run_main(name: str, body: Callable[[], int], errors: tuple = USER_ERRORS) -> int:
    """Run a command's body; a bad input (`errors`) or a full disk becomes one error line and exit 2."""
    try:
        return body()
    except errors as e:
        print_error(name, e)
        return 2
    except OSError as e:
        if is_disk_full(e):  # an ENOSPC not raised as DiskFullError (a USER_ERROR, handled above)
            print_error(name, e)
            return 2
        raise
    except KeyboardInterrupt:  # Ctrl-C: outputs are atomic, so nothing half-written is left
        print(f"lrmq.{name}: interrupted", file=sys.stderr)
        return 130


_OPS = (("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b), ("le", "<=", lambda v, b: v <= b),
        ("lt", "<", lambda v, b: v < b))


def number(kind: type = int, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, also: Sequence[float] = ()) -> Callable[[str], float]:
    """An argparse `type=` for a range-checked int or float; NaN and infinities are always refused,
    `also`: values allowed outside the bounds (e.g. -1 = per channel)."""
    bounds = {"ge": ge, "gt": gt, "le": le, "lt": lt}

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, found {text!r}") from None
        if v in also:
            return v
        if kind is float and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, found {text!r}")
        for key, sym, ok in _OPS:
            b = bounds[key]
            if b is not None and not ok(v, b):
                want = " and ".join(f"{s} {bounds[k]}" for k, s, _ in _OPS if bounds[k] is not None)
                want += "".join(f" or {a}" for a in also)
                raise argparse.ArgumentTypeError(f"must be {want}, found {text}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def _local(p: str | None) -> str | None:
    if not p or paths.is_url(p):
        return None
    return os.path.realpath(os.path.abspath(p))


def overlap(out: str, inp: str) -> str | None:
    """How the output path `out` overlaps the input path `inp` ("is", "contains", "is inside"), or None."""
    o, i = _local(out), _local(inp)
    if o is None or i is None:
        return None
    if o == i:
        return "is"
    if os.path.commonpath([o, i]) == o:
        return "contains"
    if os.path.commonpath([o, i]) == i:
        return "is inside"
    return None


def check_disjoint(outputs: Mapping[str, str | None], inputs: Mapping[str, str | None]) -> None:
    """Every output (what the flag or key is called -> path) is disjoint from every input and from the other
    outputs; raises UsageError naming both. URLs are not compared."""
    outs = [(k, v) for k, v in outputs.items() if v]
    for n, (oflag, out) in enumerate(outs):
        for iflag, inp in list(inputs.items()) + outs[n + 1:]:
            how = overlap(out, inp) if inp else None
            if how:
                raise UsageError(f"{oflag} {out} {how} {iflag} {inp}: an output must be a separate directory "
                                 "from every input (it would be replaced or deleted)")
