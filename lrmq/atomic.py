"""Atomic outputs: write into a sibling temp dir, rename into place only on success.

URLs (`gs://...`, see lrmq.paths): an object store has no rename, so a directory is staged in a local
temp dir ($TMPDIR) and uploaded with config.json last (`lrmq.paths.publish_dir`), and a text file is
one object PUT, which readers see whole or not at all.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid

from lrmq import paths


def atomic_dir(path: str, *, overwrite: bool = False):
    """Context manager yielding a local directory to fill; on success it becomes `path`."""
    if paths.is_url(path):
        return _staged_upload(paths.resolve(path), overwrite)
    return _local_atomic_dir(path, overwrite)


@contextlib.contextmanager
def _staged_upload(url: str, overwrite: bool):
    if not overwrite and paths.epath_of(url).exists():
        raise FileExistsError(f"output directory {url} already exists (pass overwrite to replace it)")
    with tempfile.TemporaryDirectory(prefix="lrmq-stage-") as tmp:
        yield tmp  # an exception here uploads nothing
        paths.publish_dir(tmp, url)


@contextlib.contextmanager
def _local_atomic_dir(path: str, overwrite: bool):
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
    if paths.is_url(path):
        paths.write_text(paths.resolve(path), text)
        return
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
