"""Atomic outputs: write into a sibling temp dir, rename into place only on success."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid


@contextlib.contextmanager
def atomic_dir(path: str, *, overwrite: bool = False):
    path = os.path.abspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"output directory {path} already exists (pass overwrite to replace it)")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    # Not tempfile.mkdtemp: its 0700 mode would survive the rename and hide shared checkpoints from
    # other users; os.mkdir applies the umask like any ordinary directory.
    while True:
        tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(tmp)
            break
        except FileExistsError:
            continue
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(path):
        old = tmp + ".old"
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)


def atomic_write_text(path, text: str) -> None:
    """Write text via a temp file in the same directory + os.replace: readers never see half a file."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    # 0o666 minus the umask, as open() would give (mkstemp's 0600 would survive the replace).
    tmp = os.path.join(d, f".tmp-{uuid.uuid4().hex[:12]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
