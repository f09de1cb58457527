"""How `moe-rl train` and `moe-rl sft` take a run directory before they write anything into it.

`claim_run_dir` checks the path, takes the directory's lock (moe_rl.runs.lock: one writer per directory) and decides
what this invocation does there, without writing:

    no run yet                         start
    a run that saved no checkpoint     start over (failed, killed, or refused at set-up): with or without --resume,
                                       unless it finished or diverged, which are results and are never overwritten
    a run with a checkpoint at step s  --resume: continue from s (s == total steps: nothing to do, nothing touched;
                                       s > total steps: refused). Without --resume: refused, naming --resume

    kept step_XXXXXX.pt, no latest.pt  refused, with or without --resume: --resume-from names the one to continue
    --resume-from step_XXXXXX.pt       continue from that checkpoint of the run (refused while a newer one is there)

A resume is verified before anything is written (moe_rl.runs.digest): config.json and manifest.json must read as
JSON objects, metrics.jsonl must hold every step before the checkpoint and, where the manifest recorded them, those
lines, the checkpoint's bytes and the task data (`check_same_inputs`) must be what they were.

So a run that failed before its first checkpoint never has to be deleted by hand, and a resume that cannot start
(a bad checkpoint, a changed config or task, lost metrics) leaves the directory, its manifest included, as it was.
A directory made by a claim whose set-up was refused is removed again (it held nothing but the lock).
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
from moe_rl.runs.atomic import TEMP_SUFFIX
from moe_rl.runs.checkpoint import CHECKPOINTS, LATEST, checkpoint_step, kept_checkpoints, link_copy, load_checkpoint
from moe_rl.runs.digest import check_resumable_dir, input_changes
from moe_rl.runs.lock import LOCK_FILE, RunLock
from moe_rl.runs.runlog import STATUSES, TABLE_KINDS, RunDir, RunExistsError, read_config, read_manifest

RESULT_STATUSES = ("finished", "diverged")  # a run that ended this way is a result: never started over


@dataclass
class Claim:
    """What this process may do with its run directory, and the lock that makes it the only writer."""

    path: Path
    action: str  # start | resume | done (resume asked, the checkpoint is already at the last step)
    lock: RunLock | None
    step: int | None = None  # the checkpoint's step (resume, done)
    earlier: dict[str, Any] = field(default_factory=dict)  # the manifest of an attempt that is started over
    checkpoint: Path | None = None  # the file a resume restores: checkpoints/latest.pt, or --resume-from's
    manifest: dict[str, Any] = field(default_factory=dict)  # the run's manifest (resume)
    created: bool = False  # the claim made the directory
    kind: str = "train"  # train | sft: the command whose run lives here (manifest `kind`)

    def release(self) -> None:
        """Release the lock; a directory this claim made and nothing was written to goes too."""
        if self.lock is None:
            return
        self.lock.release()
        if self.created and [p.name for p in self.path.iterdir()] == [LOCK_FILE]:
            (self.path / LOCK_FILE).unlink(missing_ok=True)
            try:
                self.path.rmdir()
            except OSError:  # someone else wrote into it meanwhile: it is theirs now
                pass

    def check_same_inputs(self, inputs: dict[str, Any]) -> None:
        """Refuse a resume whose input data (manifest `inputs`, e.g. the task file) changed since the run started."""
        saved = self.manifest.get("inputs")
        changed = input_changes(saved, inputs) if self.action == "resume" and isinstance(saved, dict) else []
        if changed:
            raise ConfigError(f"cannot resume {self.path}: {'; '.join(changed)}: the steps after {self.step} would "
                              "train on other data. Restore it, or start a new run (another --out-dir) from the "
                              f"checkpoint with --init-from {self.checkpoint}")


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
    existing = next(p for p in (path, *path.absolute().parents) if _exists(p))
    longest = max(path.absolute().parts, key=lambda part: len(os.fsencode(part)))
    limit = _name_max(existing)
    if len(os.fsencode(longest)) > limit:
        raise ConfigError(f"{flag} {path}: the name {longest[:24]}... is {len(os.fsencode(longest))} bytes long; "
                          f"the file system allows {limit} per file or folder name: choose a shorter {flag}")
    if path.is_symlink() and not path.exists():
        raise ConfigError(f"{flag} {path} is a symbolic link to {os.readlink(path)}, which does not exist: make the "
                          f"folder it points to, or choose another {flag}")
    if existing == path and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a directory; choose another {flag}")
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path}: {existing} is a file, so the directory cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {existing} is not writable by this user")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long to ask about
        return False


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def claim_run_dir(out_dir: str | os.PathLike, *, resume: bool, total_steps: int,
                  resume_flag: str | None = "--resume", resume_from: str | os.PathLike | None = None,
                  kind: str = "train") -> Claim:
    """Check, lock and classify the run directory (see the module docstring); writes nothing but the lock file.
    `resume_flag` is None for a command without resume (sft), whose refusals then never suggest one. `kind` (train |
    sft) is the command: a directory holding the other command's run, or files moe-rl did not write, is refused
    before the lock file is made."""
    if not str(out_dir).strip():
        raise ConfigError("--out-dir is empty: give the run's directory (e.g. --out-dir runs/<name>), or leave the "
                          "flag out for a new runs/<time>-<name>")
    path = Path(out_dir)
    check_out_dir(path)
    if (resume or resume_from) and not path.exists():
        raise FileNotFoundError(f"nothing to resume: {path} does not exist (check the run name)")
    check_owned(path, kind)
    created = not path.exists()
    lock = RunLock.acquire(path)
    claim = Claim(path, "start", lock, created=created, kind=kind)
    try:
        check_owned(path, kind)  # again under the lock: another process may have written meanwhile
        claim = _classify(path, resume, total_steps, resume_flag, lock, resume_from)
        claim.created, claim.kind = created, kind
        if claim.action == "resume":
            _verify_resume(claim)
        return claim
    except BaseException:
        claim.release()
        raise


def is_run_manifest(manifest: Any) -> bool:
    """A manifest.json written by moe-rl: a JSON object with a known status and a start time."""
    return isinstance(manifest, dict) and manifest.get("status") in STATUSES and "started_at" in manifest


def run_kind(path: Path, manifest: dict[str, Any]) -> str | None:
    """train | sft: the manifest's `kind`, or for a run from before it was kept, read off its config.json (an RL
    config has a rollout, an SFT config steps or total_steps and no rollout); None when neither tells."""
    if manifest.get("kind") in ("train", "sft"):
        return manifest["kind"]
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if "rollout" in config:
        return "train"
    return "sft" if "steps" in config or "total_steps" in config else None


def foreign_files(path: Path) -> list[str]:
    """The names in a directory other than the lock and moe-rl's own temporary files (what makes it not empty)."""
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE
                  and not (p.name.startswith(".") and p.name.endswith(TEMP_SUFFIX)))


def check_owned(path: Path, kind: str) -> None:
    """Refuse a run directory that is neither new, empty, nor a moe-rl run of this command (`kind`): a folder of the
    user's files (a config.json, metrics.jsonl or anything else that moe-rl did not write, e.g. `--out-dir .`), a
    manifest.json that cannot be read, or the other command's run (train into an sft run and the reverse)."""
    for parent in path.absolute().parents:
        if (parent / "manifest.json").is_file() and is_run_manifest(_manifest(parent)):
            raise ConfigError(f"--out-dir {path} is inside the run {parent}: a run directory cannot hold another run "
                              "(moe-rl report would never see it); choose a directory outside it")
    names = foreign_files(path)
    if not names:
        return
    if "manifest.json" not in names and {"config.json", CHECKPOINTS} <= set(names):
        raise ConfigError(f"--out-dir {path} holds a run whose manifest.json is gone (config.json and {CHECKPOINTS}/ "
                          "but no manifest.json), so what a resume verifies is lost; nothing was changed: restore "
                          "manifest.json from a copy, or start a new run (another --out-dir) from its checkpoint with "
                          f"--init-from {path / CHECKPOINTS / LATEST}")
    if "manifest.json" in names:
        manifest = read_manifest(path)  # DataError naming the file when it cannot be read
        if is_run_manifest(manifest):
            other = run_kind(path, manifest)
            if other is not None and other != kind:
                how = (f"to start RL from it, use --init-from {path / CHECKPOINTS / LATEST} with a new --out-dir"
                       if other == "sft" else "choose another --out-dir")
                raise ConfigError(f"--out-dir {path} holds a moe-rl {other} run, not a {kind} run; nothing was "
                                  f"changed: {how}")
            return
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise ConfigError(f"--out-dir {path} is not empty and is not a moe-rl run (it holds {shown}, and no manifest.json "
                      "written by moe-rl); nothing was changed: choose a new or empty directory")


def _classify(path: Path, resume: bool, total_steps: int, resume_flag: str | None, lock: RunLock,
              resume_from: str | os.PathLike | None) -> Claim:
    if resume_from is not None:
        return _claim_resume_from(path, Path(resume_from), total_steps, lock)
    step = checkpoint_step(path)  # DataError, naming the file, for a checkpoint that cannot be read
    kept = kept_checkpoints(path)
    if step is None and kept:
        names = ", ".join(p.name for _, p in kept)
        raise ConfigError(f"{path / CHECKPOINTS / LATEST} is gone but {names} remain: nothing was changed. Continue "
                          f"from the newest with --resume-from {kept[-1][1]}, or choose another --out-dir")
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
    newer = [p.name for s, p in kept if s > step]
    if newer:  # latest.pt replaced by an older file: continuing from it would overwrite the kept newer ones
        raise ConfigError(f"{path / CHECKPOINTS / LATEST} is at step {step} but {', '.join(newer)} is newer: nothing "
                          f"was changed. Continue from the newest with --resume-from {kept[-1][1]}, or move the newer "
                          "ones out of the directory to roll back")
    if total_steps < step:
        raise ConfigError(f"--total-steps {total_steps} is below the step of {path}'s checkpoint ({step}); a resume "
                          "only continues a run: pass --total-steps >= its step")
    action = "done" if total_steps == step and status in RESULT_STATUSES else "resume"
    return Claim(path, action, lock, step, checkpoint=path / CHECKPOINTS / LATEST)


def _claim_resume_from(path: Path, checkpoint: Path, total_steps: int, lock: RunLock) -> Claim:
    """--resume-from: one of the run's own checkpoints, with none newer beside it (a rollback must not lose one)."""
    folder = path / CHECKPOINTS
    if not checkpoint.is_file() or checkpoint.resolve().parent != folder.resolve():
        where = "does not exist" if not checkpoint.is_file() else f"is not in {folder}"
        raise ConfigError(f"--resume-from {checkpoint} {where}: it must be one of the run's own checkpoints "
                          f"({folder}/step_XXXXXX.pt); to start a new run from another checkpoint use --init-from")
    step = int(load_checkpoint(checkpoint, mmap=True, what="--resume-from", require=("step",))["step"])
    newer = [p.name for s, p in kept_checkpoints(path) if s > step]
    latest_step = checkpoint_step(path)
    if latest_step is not None and latest_step > step:
        newer.insert(0, f"{LATEST} (step {latest_step})")
    if newer:
        raise ConfigError(f"--resume-from {checkpoint} (step {step}): {folder} holds newer checkpoints "
                          f"({', '.join(newer)}), which a resume from an older one would overwrite; to roll back, "
                          "move them out of the directory first")
    if total_steps < step:
        raise ConfigError(f"--total-steps {total_steps} is below the step of --resume-from {checkpoint} ({step})")
    return Claim(path, "resume", lock, step, checkpoint=checkpoint)


def _verify_resume(claim: Claim) -> None:
    """Read and check what a resume continues, before anything is written: config.json, manifest.json, metrics.jsonl
    against the checkpoint (moe_rl.runs.digest). ConfigError or DataError naming the file."""
    if not (claim.path / "config.json").exists():
        raise FileNotFoundError(f"nothing to resume in {claim.path}: it has no config.json; start a new run instead")
    read_config(claim.path)
    claim.manifest = read_manifest(claim.path) if (claim.path / "manifest.json").exists() else {}
    check_resumable_dir(claim.path, claim.step, claim.manifest, claim.checkpoint)


def clear_attempt(claim: Claim) -> None:
    """Remove what an attempt without a checkpoint left (it cannot be continued), so that the run starts over. A
    kept checkpoint is never removed (`_classify` refuses to start over where one is)."""
    for name in ("metrics.jsonl", "config.json", "manifest.json"):
        (claim.path / name).unlink(missing_ok=True)
    for folder in TABLE_KINDS:
        if (claim.path / folder).is_dir():
            shutil.rmtree(claim.path / folder)
    if (claim.path / CHECKPOINTS).is_dir() and not kept_checkpoints(claim.path) \
            and not (claim.path / CHECKPOINTS / LATEST).exists():
        shutil.rmtree(claim.path / CHECKPOINTS)


def earlier_attempt(claim: Claim) -> dict[str, Any] | None:
    """What the manifest of a run started over keeps of the attempt before it."""
    if not claim.earlier:
        return None
    return {k: claim.earlier.get(k) for k in ("status", "reason", "started_at", "ended_at", "host")}


def _manifest(path: Path) -> dict[str, Any]:
    """The manifest when it can be read, else {} (a resume reads it strictly: `_verify_resume`)."""
    try:
        manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def open_claimed(claim: Claim, config: Any, *, seed: int | None, device: Any,
                 inputs: dict[str, Any] | None = None) -> RunDir:
    """The RunDir of a claimed directory: resumed from its checkpoint, or (re)started, keeping in the manifest what
    an attempt that saved no checkpoint left, a tracker id that stays the run's across resumes, and the content
    hashes of its `inputs` (moe_rl.tasks.digest)."""
    if claim.action == "resume":
        run = RunDir(claim.path, config, resume=True, seed=seed, device=device, kind=claim.kind)
        run.manifest["resumes"][-1]["from"] = {"checkpoint": claim.checkpoint.name, "step": claim.step}
        records = run.manifest.get("checkpoints", {})  # after a rollback: the newer files were moved away
        run.manifest["checkpoints"] = {name: r for name, r in records.items() if r.get("step", 0) <= claim.step}
        latest = claim.path / CHECKPOINTS / LATEST
        if not latest.exists():  # --resume-from after latest.pt was deleted: the directory is whole again
            link_copy(claim.checkpoint, latest)
    else:
        earlier = earlier_attempt(claim)
        clear_attempt(claim)
        run = RunDir(claim.path, config, seed=seed, device=device, kind=claim.kind)
        if earlier is not None:
            run.manifest["earlier_attempts"] = [*claim.earlier.get("earlier_attempts", []), earlier]
    run.manifest.setdefault("tracker_id", claim.earlier.get("tracker_id") or uuid.uuid4().hex[:12])
    if inputs is not None:
        run.manifest["inputs"] = inputs
    run.mark_running()
    return run
