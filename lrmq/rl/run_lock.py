"""One training per run directory: an exclusive lock file, `RUN_DIR/.lock`.

Two trainers on one run dir interleave metrics.jsonl and delete each other's checkpoints. The lock
records the holder (pid, host, its start time); a lock whose process is gone on this host is stale and
taken over; one held by a live process, or by another host, is an error naming the holder. The same
process may take it again (a second trainer object in one program, as tests and notebooks do).
URL run dirs (gs://) are not locked: object stores have no atomic create-if-absent through epath.
"""

from __future__ import annotations

import json
import os
import socket
import time

from lrmq import paths


class RunDirBusy(RuntimeError):
    """Another live process trains in this run directory."""


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (guards against a reused pid); None where /proc is unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return started is None or _start_time(pid) in (None, started)


class RunDirLock:
    NAME = ".lock"

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = None if paths.is_url(run_dir) else os.path.join(run_dir, self.NAME)
        self.held = False

    def _me(self) -> dict:
        pid = os.getpid()
        return {"pid": pid, "host": socket.gethostname(), "started": _start_time(pid),
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}

    def acquire(self) -> None:
        if self.path is None:
            return
        me = self._me()
        for _ in range(3):  # a stale lock removed by a racing process: try again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                holder = self._read()
                if holder is None:
                    continue
                if holder.get("host") == me["host"] and holder.get("pid") == me["pid"]:
                    self.held = True  # this process already holds it
                    return
                if holder.get("host") == me["host"] and not _alive(int(holder.get("pid", -1)), holder.get("started")):
                    self._remove_stale(holder)
                    continue
                raise RunDirBusy(
                    f"run dir {self.run_dir} is in use by process {holder.get('pid')} on {holder.get('host')} "
                    f"(since {holder.get('since')}); wait for it to finish, or choose another run.out_dir"
                    + ("" if holder.get("host") == me["host"] else
                       f". If that host's process is gone, delete {self.path}"))
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise RunDirBusy(f"could not take the lock {self.path}")

    def _read(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable / half-written: treat as held by an unknown process on this host

    def _remove_stale(self, holder: dict) -> None:
        # rename first: of two processes clearing the same stale lock, only one succeeds
        stale = f"{self.path}.stale-{os.getpid()}"
        try:
            os.replace(self.path, stale)
            os.remove(stale)
        except FileNotFoundError:
            pass

    def release(self) -> None:
        if not self.held or self.path is None:
            return
        holder = self._read()
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        self.held = False
