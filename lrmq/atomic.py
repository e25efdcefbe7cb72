"""Atomic outputs: write into a sibling temp dir, rename into place only on success.

* Every file and directory of an output gets the user's umask (0o666 / 0o777 minus it), whatever mode
  the library that wrote it chose (safetensors' `save_file` writes 0600 via its own temp file).
* Temporaries are named `.NAME.tmp-HOST-PID-HEX` (files: `.tmp-HOST-PID-HEX`): the next atomic write
  into the same parent removes those of dead processes of this host (and, of any host, those older
  than `STALE_AFTER_S`), so a killed run leaves nothing behind for long. A `.old` copy left between
  the two renames of a replacement is put back when its output is missing.
* Disk full (ENOSPC) while an output is written raises `DiskFullError` naming the output; the
  temporary is removed, so nothing half-written is left.
* An output path that exists as the wrong kind of thing (a file where an output directory belongs, a
  directory where an output file belongs, a file where a parent directory belongs) is refused with a
  sentence that says so (`lrmq.paths.check_dir_path` / `check_file_path`), before anything is written.

URLs (`gs://...`, see lrmq.paths): an object store has no rename, so a directory is staged in a local
temp dir ($TMPDIR) and uploaded with config.json last (`lrmq.paths.publish_dir`), and a text file is
one object PUT, which readers see whole or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import stat
import tempfile
import time
import uuid

from lrmq import paths

# a temporary of another host (whose pids we cannot check) or of the old naming is stale after this
STALE_AFTER_S = 24 * 3600
_HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "host"
_TMP = re.compile(r"^\.(?P<base>.*?)\.?tmp-(?:(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-)?(?P<hex>[0-9a-f]{12})"
                  r"(?P<old>\.old)?$")


class DiskFullError(OSError):
    """No space left on the device while writing an output (`filename`); nothing was left there."""

    def __str__(self) -> str:
        return self.strerror


def umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux: /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def apply_umask(root: str) -> None:
    """Files under `root` (and `root` itself when a file) get 0o666 minus the umask (execute bits kept,
    also masked), directories 0o777 minus it: what open() / mkdir() give by default."""
    mask = umask()

    def fix(p: str, is_dir: bool) -> None:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            return
        want = (0o777 if is_dir else (0o666 | (st.st_mode & 0o111))) & ~mask
        if stat.S_IMODE(st.st_mode) != want:
            os.chmod(p, want)

    if not os.path.isdir(root):
        fix(root, False)
        return
    for d, dirs, files in os.walk(root):
        fix(d, True)
        for f in files:
            fix(os.path.join(d, f), False)


def _tmp_name(prefix: str) -> str:
    return f"{prefix}tmp-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _is_stale(m: re.Match, path: str) -> bool:
    if m.group("host") == _HOST:
        return not _pid_alive(int(m.group("pid")))
    try:
        return time.time() - os.lstat(path).st_mtime > STALE_AFTER_S
    except OSError:
        return False


def clean_stale_temporaries(parent: str) -> list[str]:
    """Remove the temporaries of dead writers in `parent` (see the module doc); returns what it removed
    (a `.old` whose output is missing is renamed back to it instead)."""
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = _TMP.match(name)
        if not m:
            continue
        p = os.path.join(parent, name)
        if not _is_stale(m, p):
            continue
        try:
            if m.group("old") and m.group("base"):
                target = os.path.join(parent, m.group("base"))
                if not os.path.exists(target):
                    os.rename(p, target)  # the only copy of the output: put it back
                    continue
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
            removed.append(p)
        except OSError:
            pass  # another process got there first, or no permission: not ours to fight over
    return removed


def is_disk_full(e: BaseException) -> bool:
    """Whether `e`, or an exception it was raised from, is a full disk (ENOSPC, also wrapped by a library)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e):  # wrapped by a library (tensorstore, orbax)
            return True
        e = e.__cause__ or e.__context__
    return False


def _tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total


def disk_full_error(path: str, *, needed: int | None = None, written: int | None = None) -> DiskFullError:
    """The one-line error of a full disk: the output, the bytes it needs (exactly, or at least what had been
    written when the disk filled) and the bytes free there."""
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path)) or ".").free
    except OSError:
        free = None
    size = (f"it needs {needed:,} bytes" if needed is not None else
            f"it needs more than the {written:,} bytes written before the disk filled" if written else "")
    room = f"{free:,} bytes are free there" if free is not None else ""
    detail = "; ".join(x for x in (size, room) if x)
    return DiskFullError(errno.ENOSPC, f"no space left on device while writing {path}"
                                       + (f" ({detail})" if detail else "")
                                       + "; nothing was written there (free space and rerun)", path)


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
    paths.check_dir_path(path, "output directory")  # a file there (or above it): a sentence, not [Errno 17]
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"output directory {path} already exists (pass overwrite to replace it)")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    clean_stale_temporaries(parent)
    # Not tempfile.mkdtemp: its 0700 mode would survive the rename and hide shared checkpoints from
    # other users; os.mkdir applies the umask like any ordinary directory.
    while True:
        tmp = os.path.join(parent, _tmp_name(f".{os.path.basename(path)}."))
        try:
            os.mkdir(tmp)
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        apply_umask(tmp)
    except BaseException as e:
        written = _tree_bytes(tmp) if is_disk_full(e) else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise disk_full_error(path, written=written) from e
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
    paths.check_file_path(path)  # a directory there, or a file above it: a sentence, not [Errno 21] / [Errno 17]
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    clean_stale_temporaries(d)
    # 0o666 minus the umask, as open() would give (mkstemp's 0600 would survive the replace).
    tmp = os.path.join(d, _tmp_name("."))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if is_disk_full(e):
            raise disk_full_error(os.path.abspath(path), needed=len(text.encode("utf-8"))) from e
        raise
