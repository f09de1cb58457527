"""The run directory's lock names its holder, never the writer before it (moe_rl/runs/lock.py)."""

import fcntl
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from moe_rl.errors import ConfigError
from moe_rl.runs import lock
from moe_rl.runs.lock import LOCK_FILE, RunLock, holder

HOST = socket.gethostname()

# Takes the lock as RunLock.acquire does, but waits `delay` seconds before rewriting the record (a negative delay:
# never), so that the moment between the two lasts long enough to be read.
SLOW_WRITER = """
import fcntl, json, os, socket, sys, time
handle = open(sys.argv[1], "a+", encoding="utf-8")
fcntl.flock(handle, fcntl.LOCK_EX)
delay = float(sys.argv[2])
if delay >= 0:
    time.sleep(delay)
    handle.seek(0); handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\\n"); handle.flush()
time.sleep(30)
"""


def ended_pid() -> int:
    """The pid of a process of this host that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def start_slow_writer(run_dir, delay: float) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(run_dir / LOCK_FILE), str(delay)])
    deadline = time.time() + 30
    with open(run_dir / LOCK_FILE, encoding="utf-8") as probe:
        while time.time() < deadline:
            try:
                fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(probe, fcntl.LOCK_UN)
            except BlockingIOError:
                return child
            time.sleep(0.005)
    child.kill()
    raise AssertionError("the slow writer never took the lock")


@pytest.fixture
def copied_run(tmp_path):
    """A run directory whose .lock records a writer of this host that has ended (a finished or copied run)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": ended_pid(), "host": HOST}) + "\n")
    return run_dir


def test_a_new_holder_is_named_even_while_the_record_still_names_the_writer_before_it(copied_run, monkeypatch):
    monkeypatch.setattr(lock, "RECORD_WAIT_S", 30.0)  # a loaded machine may be slow to run the child's write
    old = json.loads((copied_run / LOCK_FILE).read_text())["pid"]
    child = start_slow_writer(copied_run, delay=1.0)
    try:
        assert json.loads((copied_run / LOCK_FILE).read_text())["pid"] == old  # inside the moment
        assert holder(copied_run) == f"pid {child.pid} on {HOST}"
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {child.pid} on "):
            RunLock.acquire(copied_run)
    finally:
        child.kill()
        child.wait()
    assert holder(copied_run) is None


def test_a_holder_that_has_not_written_its_record_is_not_named_by_the_ended_writer(copied_run, monkeypatch):
    monkeypatch.setattr(lock, "RECORD_WAIT_S", 0.2)
    old = json.loads((copied_run / LOCK_FILE).read_text())["pid"]
    child = start_slow_writer(copied_run, delay=-1)
    try:
        named = holder(copied_run)
    finally:
        child.kill()
        child.wait()
    assert named == f"the holder of {copied_run / LOCK_FILE}, which has not written its record yet (it still names " \
                    f"pid {old}, ended)"


def test_a_record_of_a_live_process_or_another_host_is_taken_at_its_word(tmp_path):
    run_dir = tmp_path / "run"
    mine = RunLock.acquire(run_dir)
    try:
        assert holder(run_dir) == f"pid {os.getpid()} on {HOST}"
        # another host's pid cannot be checked from here: named as recorded, at once
        (run_dir / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere"}) + "\n")
        t0 = time.perf_counter()
        assert holder(run_dir) == "pid 1 on elsewhere" and time.perf_counter() - t0 < lock.RECORD_WAIT_S
    finally:
        mine.release()
    assert holder(run_dir) is None
