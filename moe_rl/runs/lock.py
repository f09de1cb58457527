"""One writer per run directory: an exclusive `fcntl` lock on <run>/.lock, held for the life of the process.

The OS releases the lock when its process dies (a crash, SIGKILL), so a lock is never stale: a directory whose lock
can be taken has no live writer. The file also records the holder's pid and host, which the refusal names. The
record is rewritten just after the lock is taken, so for a moment a held lock's record still names the previous
writer (or a copied run's maker, or is empty): a reader that finds it naming a process of this host that has ended,
or unreadable, waits for the new record (RECORD_WAIT_S) before it names anyone.

    lock = RunLock.acquire("runs/x")      # ConfigError at once when another process holds it
    holder("runs/x")                      # "pid 123 on host-a" while someone holds it, else None (the sweep's check)
    lock.release()                        # or let the process end
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from moe_rl.errors import ConfigError

LOCK_FILE = ".lock"
# How long a reader waits for a new holder to replace a stale or empty record (the writer does it microseconds after
# taking the lock; a loaded machine can stretch that to a scheduling slice or two).
RECORD_WAIT_S = 2.0


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
    """Name the holder from the record, once the record is the holder's own (see the module docstring)."""
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        record = _read_record(path)
        if record is not None and not _names_an_ended_process_here(record):
            return f"pid {record['pid']} on {record['host']}"
        if time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    if record is None:
        return f"the holder of {path}, which has not written its record yet"
    return f"the holder of {path}, which has not written its record yet (it still names pid {record['pid']}, ended)"


def _read_record(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return record if isinstance(record, dict) and {"pid", "host"} <= record.keys() else None
    except (OSError, ValueError):
        return None


def _names_an_ended_process_here(record: dict) -> bool:
    """A record of this host whose pid no longer runs is a previous writer's, not the holder's (another host's pids
    cannot be checked from here, and are taken at their word)."""
    if record["host"] != socket.gethostname() or not isinstance(record["pid"], int):
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive: another user's process
        pass
    return False
