"""One writer per run directory: an exclusive `fcntl` lock on <run>/.lock, held for the life of the process.

The OS releases the lock when its process dies (a crash, SIGKILL), so a lock is never stale: a directory whose lock
can be taken has no live writer. The file also records the holder's pid and host, which the refusal names.

    lock = RunLock.acquire("runs/x")      # ConfigError at once when another process holds it
    holder("runs/x")                      # "pid 123 on host-a" while someone holds it, else None (the sweep's check)
    lock.release()                        # or let the process end
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

from moe_rl.errors import ConfigError

LOCK_FILE = ".lock"


class RunLock:
    """The held lock of one run directory (`acquire`), released by `release` or by the death of the process."""

    def __init__(self, path: Path, handle):
        self.path, self._handle = path, handle

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike) -> RunLock:
        """Take <run_dir>/.lock (creating the directory); ConfigError naming the holder when it is taken."""
        path = Path(run_dir) / LOCK_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise ConfigError(f"{run_dir} is in use by another run ({_describe(path)}); wait for it to end, or stop "
                              "that process, or choose another --out-dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
        handle.flush()
        return cls(path, handle)

    def release(self) -> None:
        if not self._handle.closed:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()


def holder(run_dir: str | os.PathLike) -> str | None:
    """Who holds the run directory's lock ("pid N on HOST"), or None when nobody does (never takes it for long)."""
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _describe(path)
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def _describe(path: Path) -> str:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return f"pid {record['pid']} on {record['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"the holder of {path}"
