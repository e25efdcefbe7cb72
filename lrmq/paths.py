"""Paths that may be local or URLs (`gs://bucket/run`, any scheme `etils.epath` handles).

Local paths keep plain os behaviour (absolute paths, renames, appends). URLs go through `epath`
only: object stores have neither directory renames nor appends, so whole directories are staged
locally and uploaded (`publish_dir`), and growing logs are written to a local file that `Mirror`
copies up.
"""

from __future__ import annotations

import os
import re
import shutil
import time

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# The schemes etils.epath routes to a real filesystem backend (etils/epath/gpath.py); any other
# "x://" would silently become a local relative path.
URL_SCHEMES = ("gs", "s3", "az", "hf")
# Written last when publishing a directory: every HF and lrmq loader opens config.json first, so a
# directory without it is not a model, and an interrupted upload is never mistaken for one.
PUBLISH_LAST = ("config.json",)
_COPY_CHUNK = 16 << 20


def is_url(path) -> bool:
    return bool(_URL.match(os.fspath(path)))


def resolve(path) -> str:
    """Local: the absolute path (as before). URL: checked and kept as given, minus trailing slashes."""
    path = os.fspath(path)
    m = _URL.match(path)
    if not m:
        return os.path.abspath(path)
    if m.group(1) not in URL_SCHEMES:
        raise ValueError(f"{path}: unsupported URL scheme {m.group(1)!r} (supported: "
                         + ", ".join(f"{s}://" for s in URL_SCHEMES) + ")")
    if not path[m.end():].strip("/"):
        raise ValueError(f"{path}: a URL run directory needs a bucket (e.g. gs://bucket/runs/name)")
    return path.rstrip("/")


def join(base, *parts: str) -> str:
    base = os.fspath(base)
    if is_url(base):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(base, *parts)


def epath_of(path):
    from etils import epath

    return epath.Path(os.fspath(path))


def ensure_dir(path) -> None:
    """Local: makedirs. URL: object stores need no directories; check the bucket exists instead
    (epath's mkdir would create a missing bucket, turning a typo into a new bucket)."""
    path = os.fspath(path)
    if not is_url(path):
        os.makedirs(path, exist_ok=True)
        return
    root = _URL.match(path).group(0) + path[_URL.match(path).end():].split("/", 1)[0]
    try:
        found = epath_of(root).exists()
    except Exception as e:  # credentials, network, a missing fsspec backend: name the path
        raise OSError(f"{path}: cannot reach {root} ({type(e).__name__}: {e})") from e
    if not found:
        raise FileNotFoundError(f"{path}: bucket {root} does not exist or is not accessible")


def write_text(path, text: str) -> None:
    """URL only: one object PUT, which readers see whole or not at all (no temp + rename needed)."""
    epath_of(path).write_text(text)


def upload_file(local: str, url) -> None:
    """Stream a local file to `url` (constant memory: exports are multi-GB)."""
    with open(local, "rb") as src, epath_of(url).open("wb") as dst:
        shutil.copyfileobj(src, dst, _COPY_CHUNK)


def download_file(url, local: str) -> bool:
    """Copy `url` to a local file; False when it does not exist."""
    p = epath_of(url)
    if not p.exists():
        return False
    with p.open("rb") as src, open(local, "wb") as dst:
        shutil.copyfileobj(src, dst, _COPY_CHUNK)
    return True


def remove(url) -> None:
    """Delete a file or a whole prefix at `url`; nothing there is fine."""
    p = epath_of(url)
    if p.is_dir():
        p.rmtree()
    elif p.exists():
        p.unlink()


def _files(local_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(local_dir):
        out += [os.path.relpath(os.path.join(root, n), local_dir) for n in names]
    return sorted(out)


def publish_dir(local_dir: str, url: str) -> None:
    """Upload a finished local directory to `url`, replacing what is there.

    Object stores cannot rename a directory, so this is ordered instead: the old copy loses its
    config.json first, then the rest, and the new copy gets its config.json last. A reader that
    opens config.json first (every HF / lrmq loader) sees the old model, no model, or the whole
    new one, never a half-uploaded one.
    """
    dst = epath_of(url)
    for name in PUBLISH_LAST:
        remove(dst / name)
    remove(dst)
    files = _files(local_dir)
    for rel in sorted(files, key=lambda f: f in PUBLISH_LAST):  # stable: PUBLISH_LAST ones go last
        upload_file(os.path.join(local_dir, rel), dst / rel.replace(os.sep, "/"))


class Mirror:
    """A local directory copied up to a URL: how append-only logs (metrics.jsonl, TensorBoard event
    files) live in a run dir on an object store, which cannot append. Each sync uploads the files
    that changed since the last one, whole; `interval_s` bounds how often that happens."""

    def __init__(self, local_dir: str, url: str, *, interval_s: float = 30.0):
        self.local_dir, self.url, self.interval_s = local_dir, url, interval_s
        self._seen: dict[str, tuple[int, int]] = {}
        self._last = float("-inf")  # the first sync always uploads

    def pull(self, rel: str) -> bool:
        """Start from the copy already at the URL (a resumed run keeps appending to it)."""
        local = os.path.join(self.local_dir, rel)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        if not download_file(join(self.url, rel), local):
            return False
        self._seen[rel] = _stamp(local)
        return True

    def delete(self, rel: str) -> None:
        local = os.path.join(self.local_dir, rel)
        if os.path.exists(local):
            os.remove(local)
        self._seen.pop(rel, None)
        remove(join(self.url, rel))

    def sync(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._last < self.interval_s:
            return
        for rel in _files(self.local_dir):
            stamp = _stamp(os.path.join(self.local_dir, rel))
            if self._seen.get(rel) != stamp:
                upload_file(os.path.join(self.local_dir, rel), join(self.url, rel.replace(os.sep, "/")))
                self._seen[rel] = stamp
        self._last = time.monotonic()


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns
