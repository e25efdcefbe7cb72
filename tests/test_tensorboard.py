"""lrmq.tensorboard.summary_writer: tensorboardX event files without importing torch at a command's start."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

from conftest import REPO_ROOT


def _scalars(log_dir: str) -> dict[str, float]:
    """{tag: value} of the scalar summaries in the event files under log_dir (TFRecord frames of Event protos)."""
    from tensorboardX.proto.event_pb2 import Event

    out = {}
    for name in sorted(os.listdir(log_dir)):
        data = open(os.path.join(log_dir, name), "rb").read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + n])  # u64 length, u32 crc, payload, u32 crc
            i += 12 + n + 4
            for v in event.summary.value:
                out[v.tag] = v.simple_value
    return out


def test_a_command_logs_without_importing_torch(tmp_path):
    """In a fresh interpreter (as `lrmq.train` starts): the writer's events are written and torch stays unloaded,
    and importing torch afterwards still works (nothing is left blocking it)."""
    code = ("import sys; from lrmq.tensorboard import summary_writer; w = summary_writer(sys.argv[1]); "
            "w.add_scalar('reward/mean', 0.25, 3); w.flush(); w.close(); "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "import importlib.util; assert importlib.util.find_spec('torch') is not None; print('OK')")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr[-2000:]
    assert _scalars(str(tmp_path)) == {"reward/mean": 0.25}


def test_with_torch_already_loaded_the_writer_is_unchanged(tmp_path):
    """In a process that imported torch first (this one: the reference models), tensorboardX keeps it."""
    import torch

    from lrmq.tensorboard import summary_writer

    w = summary_writer(str(tmp_path))
    w.add_scalar("loss", 1.5, 0)
    w.close()
    assert sys.modules["torch"] is torch
    assert _scalars(str(tmp_path)) == {"loss": 1.5}
