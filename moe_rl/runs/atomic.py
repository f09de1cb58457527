"""Atomic file writes: a reader, or a run killed mid-write, sees the old file or the new one, never half of one.

Every file of a run directory that is rewritten as a whole (config.json, manifest.json, Parquet tables, checkpoints)
goes through `atomic_write`. The one exception is metrics.jsonl, which is appended line by line (see runlog.py).
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from moe_rl.errors import DiskFullError

# Temp files start with a dot and end with this suffix, so listings of `step_*.parquet` or `*.pt` never match them
# and `remove_stale_temp_files` can find the leftovers of a killed writer.
TEMP_SUFFIX = ".tmp"


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Call `write(file)` on a temp file next to `path`, fsync it, then rename it over `path`.

    The temp file lives in the same folder because `os.replace` is atomic only within one file system. It gets the
    mode a plain `open` would give (0666 less the umask): mkstemp's 0600 would hide results and checkpoints from the
    group on a shared cluster.
    """
    path = Path(path)
    try:
        fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    except OSError as err:
        if err.errno == errno.ENOSPC:  # no room even for a directory entry
            raise DiskFullError(path) from None
        raise
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with open_temp(fd, path) as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_name, path)
    except BaseException as err:
        Path(temp_name).unlink(missing_ok=True)
        if disk_full(err):
            raise DiskFullError(path) from None
        raise
    fsync_dir(path.parent)
    return path


def open_temp(fd: int, path: Path) -> IO[bytes]:
    """The writer of the temp file that will replace `path` (a seam: the tests make its writes fail as a full disk
    does)."""
    return os.fdopen(fd, "wb")


def disk_full(err: BaseException) -> bool:
    """Whether `err` is, or was raised while handling, an ENOSPC: torch.save turns the OSError of a failed write
    into `RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos`, which keeps the OSError as its
    context only."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def current_umask() -> int:
    """The process's umask (reading it means setting it, so it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Atomically replace `path` with `text` (UTF-8)."""
    return atomic_write(path, lambda file: file.write(text.encode("utf-8")))


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename inside `folder` durable; a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def iter_temp_files(folder: str | os.PathLike) -> Iterator[Path]:
    """The temp files `atomic_write` leaves behind in `folder` (and below) when its process is killed."""
    yield from (p for p in Path(folder).rglob(f".*{TEMP_SUFFIX}") if p.is_file())


def remove_stale_temp_files(folder: str | os.PathLike) -> list[Path]:
    """Delete leftovers of killed writers; call only when no other process writes into `folder`."""
    removed = list(iter_temp_files(folder))
    for temp in removed:
        temp.unlink(missing_ok=True)
    return removed
