"""TensorBoard event files through tensorboardX, opened by one helper for every command that logs.

tensorboardX imports torch when it can, only so that its writer also accepts torch tensors; lrmq logs Python
floats and strings. Importing torch costs ~2 s of CPU at every `lrmq.train` / `lrmq.evaluate` start that logs
to TensorBoard (lrmq itself never imports it), so tensorboardX is imported with torch held out, unless torch is
already loaded in this process (then nothing changes). Event files are the same either way.
"""

from __future__ import annotations

import importlib
import sys

_HELD_OUT = "torch"


def _import_tensorboardx():
    """The tensorboardX module, imported without importing torch where torch is not loaded yet."""
    if "tensorboardX" in sys.modules or _HELD_OUT in sys.modules:
        return importlib.import_module("tensorboardX")
    sys.modules[_HELD_OUT] = None  # `import torch` raises ImportError: tensorboardX's optional-torch branch
    try:
        return importlib.import_module("tensorboardX")
    finally:
        if sys.modules.get(_HELD_OUT, ...) is None:
            del sys.modules[_HELD_OUT]


def summary_writer(log_dir: str):
    """A tensorboardX SummaryWriter writing event files under `log_dir`."""
    return _import_tensorboardx().SummaryWriter(log_dir)
