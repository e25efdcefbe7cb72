"""Paths that may be local or URLs (`gs://bucket/run`, any scheme `etils.epath` handles).

Local paths keep plain os behaviour (absolute paths, renames, appends). URLs go through `epath`
only: object stores have neither directory renames nor appends, so whole directories are staged
locally and uploaded (`publish_dir`), and growing logs are written to a local file that `Mirror`
copies up.

Reading small local files (`read_bytes`, `decode_utf8`, `read_json`): a missing path, a directory where a
file belongs, bytes that are not UTF-8 and JSON that does not parse or is not the expected kind are one line
naming the file (and the line and column): `FileNotFoundError` or `FileFormatError` (a ValueError), which
every command reports as its error line. Paths that must be directories (`check_dir_path`) get the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from typing import Any

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


class FileFormatError(ValueError):
    """A file that exists but cannot be read as what it should be; the message names it (and the line)."""


def read_bytes(path, what: str = "file", where: str | None = None) -> bytes:
    """A file's bytes, local or in a bucket (a URL). `what` is what the file should be ("config file"), `where` how messages name it
    (default: the path; e.g. "--text-file notes.txt")."""
    path = os.fspath(path)
    where = where or path
    if is_url(path):  # a bucket object: read whole (data, calibration, config files are small)
        p = epath_of(resolve(path))
        try:
            if p.is_dir():
                raise FileFormatError(f"{where}: is a directory, expected a {what}")
            if not p.exists():
                raise FileNotFoundError(f"{where}: {what} does not exist")
            return p.read_bytes()
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise FileFormatError(f"{where}: cannot read this {what} ({e})") from None
    if not os.path.exists(path):
        raise FileNotFoundError(f"{where}: {what} does not exist")
    if os.path.isdir(path):
        raise FileFormatError(f"{where}: is a directory, expected a {what}")
    try:
        with open(path, "rb") as f:
            return f.read()
    except PermissionError:
        raise FileFormatError(f"{where}: no permission to read this {what}") from None
    except OSError as e:
        raise FileFormatError(f"{where}: cannot read this {what} ({e.strerror or e})") from None


def decode_utf8(data: bytes, where: str) -> str:
    """UTF-8 text (a leading byte-order mark dropped); a bad byte is reported with its line and column."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise FileFormatError(f"{where} line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column "
                              f"{col})") from None
    return text.removeprefix("\ufeff")


def json_error(where: str, e: json.JSONDecodeError, line: int | None = None) -> FileFormatError:
    """The one-line message of a JSON syntax error; `line` when the text was one line of a larger file."""
    return FileFormatError(f"{where} line {e.lineno if line is None else line}: not valid JSON ({e.msg} at "
                           f"column {e.colno})")


def kind_of(v: Any) -> str:
    """How messages name a JSON / YAML value's kind."""
    return {dict: "mapping (JSON object)", list: "list", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null (empty)"}.get(type(v), type(v).__name__)


def read_json(path, *, what: str = "JSON file", where: str | None = None, expect: type | None = dict) -> Any:
    """A local JSON file's value; an empty file, bad UTF-8, a syntax error (line and column) or, with `expect`
    (default dict), a value of another kind is a FileFormatError naming the file."""
    path = os.fspath(path)
    where = where or path
    text = decode_utf8(read_bytes(path, what, where), where)
    if not text.strip():
        raise FileFormatError(f"{where}: empty {what}, expected JSON")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise json_error(where, e) from None
    if expect is not None and not isinstance(value, expect):
        want = "a mapping (JSON object)" if expect is dict else f"a {expect.__name__}"
        raise FileFormatError(f"{where}: expected {want}, found a {kind_of(value)}")
    return value


def first_existing(path: str) -> str:
    """The longest prefix of `path` (itself included) that exists."""
    p = os.path.abspath(path)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def check_dir_path(path, what: str | None = None) -> None:
    """A local path where a directory is (or will be) made: raises NotADirectoryError with a sentence when
    it, or a directory it would be made in, is a file. `what` names it ("--out", "outputs.dir"). URLs are
    not checked."""
    path = os.fspath(path)
    if is_url(path):
        return
    name = f"{what} {path}" if what else path
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{name} is a file where a directory belongs; remove it or choose another path")
    found = first_existing(path)
    if found != os.path.abspath(path) and not os.path.isdir(found):
        raise NotADirectoryError(f"{name} cannot be made: {found} is a file, not a directory")


def check_file_path(path, what: str = "output file") -> None:
    """A local path where a file is written: NotADirectoryError / IsADirectoryError with a sentence when it is
    a directory or lies under a file. URLs are not checked."""
    path = os.fspath(path)
    if is_url(path):
        return
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what} {path} is a directory where a file belongs; remove it or choose another "
                                "path")
    parent = os.path.dirname(os.path.abspath(path))
    found = first_existing(parent)
    if not os.path.isdir(found):
        raise NotADirectoryError(f"{what} {path} cannot be written: {found} is a file, not a directory")


def join(base, *parts: str) -> str:
    base = os.fspath(base)
    if is_url(base):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(base, *parts)


class UnreachableError(OSError):
    """A bucket whose storage service does not answer (no network, a wrong emulator address): one line, exit 2."""


# The one probe of a bucket's service before its client is used: the client (gcsfs) retries a failed connection
# six times with backoff (84 s and a 221-line traceback without network); the probe asks once, without retries.
PROBE_TIMEOUT_S = 8.0
_PROBED: dict[tuple[str, str], str | None] = {}  # (endpoint, bucket) -> None (it answered) or why it did not


def gcs_endpoint() -> str:
    """The GCS JSON API location gcsfs (epath's gs:// backend) talks to: $STORAGE_EMULATOR_HOST when set (as
    gcsfs.core._location reads it), else Google's."""
    loc = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if loc in ("", "default"):
        return "https://storage.googleapis.com"
    return loc if loc.startswith(("http://", "https://")) else f"http://{loc}"


def check_reachable(path) -> None:
    """A gs:// URL's storage service answers: one GET of its bucket, `PROBE_TIMEOUT_S` at most, no retries, no
    proxy (gcsfs's aiohttp session uses none); any HTTP answer counts (whether the bucket exists and may be
    read is the client's to say). Otherwise `UnreachableError` naming `path`. Once per bucket and process;
    other schemes are not probed."""
    import urllib.error
    import urllib.parse
    import urllib.request

    path = os.fspath(path)
    m = _URL.match(path)
    if not m or m.group(1) != "gs":
        return
    bucket = path[m.end():].split("/", 1)[0]
    key = (gcs_endpoint(), bucket)
    if key not in _PROBED:
        url = f"{key[0]}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}?fields=name"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            opener.open(url, timeout=PROBE_TIMEOUT_S).close()
            _PROBED[key] = None
        except urllib.error.HTTPError:  # 401 / 403 / 404: it answered
            _PROBED[key] = None
        except (urllib.error.URLError, OSError, ValueError) as e:
            why = getattr(e, "reason", None) or e
            _PROBED[key] = f"{type(why).__name__}: {why}" if not isinstance(why, str) else why
    if _PROBED[key] is not None:
        raise UnreachableError(f"{path}: cannot reach gs://{bucket}: no answer from {key[0]} ({_PROBED[key]}; "
                               f"asked once, {PROBE_TIMEOUT_S:.0f} s at most); check the network (or "
                               "STORAGE_EMULATOR_HOST)")


def epath_of(path):
    """The `etils.epath.Path` of a local path or URL; a gs:// bucket is probed first (`check_reachable`)."""
    from etils import epath

    check_reachable(path)
    return epath.Path(os.fspath(path))


def ensure_dir(path) -> None:
    """Local: makedirs. URL: object stores need no directories; check the bucket exists instead
    (epath's mkdir would create a missing bucket, turning a typo into a new bucket)."""
    path = os.fspath(path)
    if not is_url(path):
        check_dir_path(path)
        os.makedirs(path, exist_ok=True)
        return
    root = _URL.match(path).group(0) + path[_URL.match(path).end():].split("/", 1)[0]
    check_reachable(path)  # UnreachableError names the run dir itself
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


_TEMPS: list[tuple[int, str]] = []  # (creator pid, path) of this process's temporary dirs
TEMP_KINDS = ("copy", "remote", "run-logs")
_TEMP_NAME = re.compile(r"^lrmq-(" + "|".join(TEMP_KINDS) + r")-(\d+)-")


def process_temp_dir(kind: str) -> str:
    """A new temporary directory `$TMPDIR/lrmq-KIND-PID-XXXXXXXX` (KIND one of `TEMP_KINDS`: local copies of
    bucket files, local views of bucket checkpoints, the staging dir of a URL run dir's logs) that is removed when
    this process exits, normally or by an error (`remove_process_temps`, registered with atexit); the pid in its
    name tells whose it is (`temp_owner`)."""
    import atexit
    import tempfile

    if kind not in TEMP_KINDS:
        raise ValueError(f"unknown temporary dir kind {kind!r} (known: {', '.join(TEMP_KINDS)})")
    if not _TEMPS:
        atexit.register(remove_process_temps)
    path = tempfile.mkdtemp(prefix=f"lrmq-{kind}-{os.getpid()}-")
    _TEMPS.append((os.getpid(), path))
    return path


def remove_process_temps() -> None:
    """Remove the temporary dirs this process made (`process_temp_dir`); a forked child leaves its parent's."""
    for pid, path in list(_TEMPS):
        if pid == os.getpid():
            shutil.rmtree(path, ignore_errors=True)
            _TEMPS.remove((pid, path))
    _COPIES.clear()


def temp_owner(name: str) -> int | None:
    """The pid in a `process_temp_dir` name (None for another name)."""
    m = _TEMP_NAME.match(os.path.basename(name))
    return int(m.group(2)) if m else None


_COPIES: dict[str, str] = {}


def local_copy(url, what: str = "file", where: str | None = None) -> str:
    """A bucket file, or the files of a bucket directory, copied once per process into a temporary directory
    (for readers that take only local paths, e.g. `datasets`); returns the local path. A missing URL is
    FileNotFoundError naming `where` (default: the URL). The copy is removed when the process exits."""
    url = resolve(url)
    if url in _COPIES:
        return _COPIES[url]
    p = epath_of(url)
    if not p.exists():
        raise FileNotFoundError(f"{where or url}: {what} does not exist")
    root = process_temp_dir("copy")
    local = os.path.join(root, p.name)
    if p.is_dir():
        os.makedirs(local)
        for f in p.iterdir():
            if not f.is_dir():
                download_file(f, os.path.join(local, f.name))
    else:
        download_file(p, local)
    _COPIES[url] = local
    return local


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
