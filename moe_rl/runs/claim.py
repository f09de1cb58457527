"""How `moe-rl train` and `moe-rl sft` take a run directory before they write anything into it.

`claim_run_dir` checks the path, takes the directory's lock (moe_rl.runs.lock: one writer per directory) and decides
what this invocation does there, without writing:

    no run yet                         start
    a run that saved no checkpoint     start over (failed, killed, or refused at set-up): with or without --resume,
                                       unless it finished or diverged, which are results and are never overwritten
    a run with a checkpoint at step s  --resume: continue from s (s == total steps: nothing to do, nothing touched;
                                       s > total steps: refused). Without --resume: refused, naming --resume

So a run that failed before its first checkpoint never has to be deleted by hand, and a resume that cannot start
(a bad checkpoint, a changed config) leaves the directory, its manifest included, as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from moe_rl.errors import ConfigError
from moe_rl.runs.checkpoint import CHECKPOINTS, LATEST, checkpoint_step
from moe_rl.runs.lock import RunLock
from moe_rl.runs.runlog import TABLE_KINDS, RunDir, RunExistsError

RESULT_STATUSES = ("finished", "diverged")  # a run that ended this way is a result: never started over


@dataclass
class Claim:
    """What this process may do with its run directory, and the lock that makes it the only writer."""

    path: Path
    action: str  # start | resume | done (resume asked, the checkpoint is already at the last step)
    lock: RunLock | None
    step: int | None = None  # the checkpoint's step (resume, done)
    earlier: dict[str, Any] = field(default_factory=dict)  # the manifest of an attempt that is started over

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def fresh_run_name(parent: str = "runs", stem: str = "run") -> str:
    """runs/<UTC time>-<stem>, made unique with a counter: the out_dir of a run started without --out-dir."""
    base = Path(parent) / f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{stem}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return str(path)


def check_out_dir(path: str | os.PathLike, flag: str = "--out-dir") -> None:
    """Refuse a path that is a regular file, or a directory (or nearest existing parent) this user cannot write."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a directory; choose another {flag}")
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path}: {existing} is a file, so the directory cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {existing} is not writable by this user")


def claim_run_dir(out_dir: str | os.PathLike, *, resume: bool, total_steps: int,
                  resume_flag: str | None = "--resume") -> Claim:
    """Check, lock and classify the run directory (see the module docstring); writes nothing but the lock file.
    `resume_flag` is None for a command without resume (sft), whose refusals then never suggest one."""
    path = Path(out_dir)
    check_out_dir(path)
    if resume and not path.exists():
        raise FileNotFoundError(f"nothing to resume: {path} does not exist (check the run name)")
    lock = RunLock.acquire(path)
    try:
        return _classify(path, resume, total_steps, resume_flag, lock)
    except BaseException:
        lock.release()
        raise


def _classify(path: Path, resume: bool, total_steps: int, resume_flag: str | None, lock: RunLock) -> Claim:
    step = checkpoint_step(path)  # DataError, naming the file, for a checkpoint that cannot be read
    manifest = _manifest(path)
    status = manifest.get("status")
    if step is None:
        if status in RESULT_STATUSES:
            raise RunExistsError(f"{path} holds a {status} run (no checkpoint); it is a result and is not started "
                                 "over: choose another --out-dir, or delete it")
        return Claim(path, "start", lock, earlier=manifest)
    if not resume or resume_flag is None:
        how = f"pass {resume_flag} to continue it, or choose another --out-dir" if resume_flag else \
            "choose another --out-dir, or delete it"
        raise RunExistsError(f"{path} already holds a {status or 'stopped'} run with a checkpoint at step {step}; "
                             f"{how}")
    if total_steps < step:
        raise ConfigError(f"--total-steps {total_steps} is below the step of {path}'s checkpoint ({step}); a resume "
                          "only continues a run: pass --total-steps >= its step")
    return Claim(path, "done" if total_steps == step and status in RESULT_STATUSES else "resume", lock, step)


def clear_attempt(claim: Claim) -> None:
    """Remove what an attempt without a checkpoint left (it cannot be continued), so that the run starts over."""
    for name in ("metrics.jsonl", "config.json", "manifest.json"):
        (claim.path / name).unlink(missing_ok=True)
    for folder in (*TABLE_KINDS, CHECKPOINTS):
        if (claim.path / folder).is_dir() and not (claim.path / folder / LATEST).exists():
            shutil.rmtree(claim.path / folder)


def earlier_attempt(claim: Claim) -> dict[str, Any] | None:
    """What the manifest of a run started over keeps of the attempt before it."""
    if not claim.earlier:
        return None
    return {k: claim.earlier.get(k) for k in ("status", "reason", "started_at", "ended_at", "host")}


def _manifest(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def open_claimed(claim: Claim, config: Any, *, seed: int | None, device: Any) -> RunDir:
    """The RunDir of a claimed directory: resumed from its checkpoint, or (re)started, keeping in the manifest what
    an attempt that saved no checkpoint left, and a tracker id that stays the run's across resumes."""
    if claim.action == "resume":
        run = RunDir(claim.path, config, resume=True, seed=seed, device=device)
    else:
        earlier = earlier_attempt(claim)
        clear_attempt(claim)
        run = RunDir(claim.path, config, seed=seed, device=device)
        if earlier is not None:
            run.manifest["earlier_attempts"] = [*claim.earlier.get("earlier_attempts", []), earlier]
    run.manifest.setdefault("tracker_id", claim.earlier.get("tracker_id") or uuid.uuid4().hex[:12])
    run.mark_running()
    return run
