"""The sweep directory's state: sweep.json (one grid per directory), what to do with each run, job records, index.csv.

    <sweep>/sweep.json            the stored plan: experiment, arguments, overrides, swept values, hash, run configs
    <sweep>/index.csv             one row per run, rebuilt from the manifests and job records (`write_index`)
    <sweep>/runs/<name>/          run directories; their manifest.json is the truth about each run
    <sweep>/warmstart/<key>/      SFT runs
    <sweep>/jobs/<name>.json      the job record: state (queued | running | ended), attempts, last error, job id
    <sweep>/jobs/<name>.log       the local worker's stdout and stderr (warm starts under jobs/warmstart/)

Readers and writers used by moe_rl.sweep (the command), moe_rl.sweep.jobs (workers) and moe_rl.sweep.slurm (submitit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from moe_rl.errors import ConfigError, DataError
from moe_rl.runs.atomic import atomic_write_text
from moe_rl.runs.checkpoint import CHECKPOINTS, LATEST, checkpoint_step
from moe_rl.runs.lock import holder
from moe_rl.runs.provenance import utc_now
from moe_rl.runs.runlog import ABSENT, config_differences, field_defaults, read_json_object, read_manifest
from moe_rl.sweep.plan import VOLATILE_FIELDS, PlannedRun, SweepPlan, stable_config

SWEEP_JSON, INDEX_CSV = "sweep.json", "index.csv"
RUNS, WARMSTART, JOBS = "runs", "warmstart", "jobs"


# ---------------------------------------------------------------------------------------------------------------------
# sweep.json: one grid per directory


def read_sweep(sweep_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(sweep_dir) / SWEEP_JSON
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {sweep_dir} is not a sweep directory")
    data = read_json_object(path, "the sweep's plan")
    if "hash" not in data:
        raise DataError(f"{path} has no 'hash': it is not a sweep.json written by moe-rl sweep; restore it, or use "
                        "another --sweep-dir")
    return data


def check_same_grid(plan: SweepPlan) -> bool:
    """True when the directory already holds this grid, False when it is new; refuses a different grid. The same
    grid stored by an older moe-rl (its configs lack fields added since, which this plan holds at their defaults) is
    this grid: the runs ran with those defaults' behaviour."""
    path = plan.sweep_dir / SWEEP_JSON
    if not path.exists():
        return False
    stored, new = read_sweep(plan.sweep_dir), plan.to_json()
    if stored["hash"] == new["hash"] or added_since(stored, plan) is not None:
        return True
    raise ConfigError(
        f"{plan.sweep_dir} holds a different grid (experiment {stored['experiment']!r}, {stored['n_runs']} runs, "
        f"hash {stored['hash'][:12]}); this one is {new['experiment']!r}, {new['n_runs']} runs, hash "
        f"{new['hash'][:12]}.\n{grid_differences(stored, new)}\nTo continue the stored sweep, run its own command: "
        f"{stored['command']}\nTo run this grid, choose another --sweep-dir, or delete {plan.sweep_dir} to start over."
    )


def added_since(stored: Mapping, plan: SweepPlan) -> set[str] | None:
    """The config fields the stored plan lacks and `plan` holds at their defaults, when those are its only
    differences from the stored plan (the same run names; each run's config and its warm start's, the sweep's own
    paths aside); None when anything else differs."""
    new = plan.to_json()
    old_runs, new_runs = {r["name"]: r for r in stored["runs"]}, {r["name"]: r for r in new["runs"]}
    if old_runs.keys() != new_runs.keys() or not plan.runs:
        return None
    run_defaults = field_defaults(plan.runs[0].config)
    warm_defaults = field_defaults(next(iter(plan.warmstarts.values()))) if plan.warmstarts else {}
    added: set[str] = set()
    for name, old_run in old_runs.items():
        new_run = new_runs[name]
        if (old_run["warmstart"] is None) != (new_run["warmstart"] is None):
            return None
        pairs = [(old_run["config"], new_run["config"], run_defaults)]
        if new_run["warmstart"] is not None:
            pairs.append((stored["warmstarts"][old_run["warmstart"]], new["warmstarts"][new_run["warmstart"]],
                          warm_defaults))
        for old_config, new_config, defaults in pairs:
            for key, (old, value) in config_differences(stable_config(old_config), stable_config(new_config)).items():
                if old != ABSENT or key not in defaults or defaults[key] != value:
                    return None
                added.add(key)
    return added


def with_stored_warm_starts(plan: SweepPlan) -> SweepPlan:
    """`plan` with the stored plan's warm start keys (folder names), where the directory holds this grid stored by an
    older moe-rl (added_since): a warm start key hashes its config, so a field added since would otherwise name a
    new folder and train the warm starts again. Any other plan comes back unchanged."""
    if not (plan.sweep_dir / SWEEP_JSON).exists() or not plan.warmstarts:
        return plan
    stored = read_sweep(plan.sweep_dir)
    if stored["hash"] == plan.to_json()["hash"] or not added_since(stored, plan):
        return plan
    stored_key = {r["name"]: r["warmstart"] for r in stored["runs"]}
    renamed = {run.warmstart: stored_key[run.name] for run in plan.runs if run.warmstart is not None}
    warmstarts = {renamed[key]: dataclasses.replace(cfg, out_dir=str(plan.sweep_dir / WARMSTART / renamed[key]))
                  for key, cfg in plan.warmstarts.items()}
    runs = [run if run.warmstart is None else dataclasses.replace(
                run, warmstart=renamed[run.warmstart],
                config=dataclasses.replace(run.config, init_from=str(
                    Path(warmstarts[renamed[run.warmstart]].out_dir) / CHECKPOINTS / LATEST)))
            for run in plan.runs]
    return dataclasses.replace(plan, runs=runs, warmstarts=warmstarts)


def grid_differences(stored: Mapping, new: Mapping, limit: int = 5) -> str:
    old_runs = {r["name"]: r for r in stored["runs"]}
    new_runs = {r["name"]: r for r in new["runs"]}
    lines = []
    for label, names in (("only in the stored grid", old_runs.keys() - new_runs.keys()),
                         ("only in this grid", new_runs.keys() - old_runs.keys())):
        if names:
            shown = sorted(names)[:limit]
            lines.append(f"  runs {label}: {', '.join(shown)}{' ...' if len(names) > limit else ''}")
    changed: dict[str, set] = {}
    for name in old_runs.keys() & new_runs.keys():
        diff = config_differences(old_runs[name]["config"], new_runs[name]["config"])
        for key, pair in diff.items():
            if key.split(".")[0] not in VOLATILE_FIELDS:
                changed.setdefault(key, set()).add(f"{pair[0]!r} -> {pair[1]!r}")
    lines += [f"  {key}: {', '.join(sorted(pairs)[:3])}" for key, pairs in sorted(changed.items())[:limit]]
    return "\n".join(lines) or "  (the warm starts differ)"


def store_plan(plan: SweepPlan) -> None:
    """Write sweep.json (after check_same_grid), keeping the creation time of an existing one."""
    same = check_same_grid(plan)
    data = plan.to_json()
    data["created_at"] = read_sweep(plan.sweep_dir)["created_at"] if same else utc_now()
    data["updated_at"] = utc_now()
    plan.sweep_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(plan.sweep_dir / SWEEP_JSON, json.dumps(data, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------------------------------
# What to do with a run, and its status


def manifest_or_none(run_dir: Path) -> dict | None:
    try:
        return read_manifest(run_dir)
    except (FileNotFoundError, DataError):
        return None


def run_action(run_dir: Path) -> tuple[str, str]:
    """(skip | busy | start | resume | restart, why). Finished and diverged runs are results and are skipped; a run
    whose process still holds its lock (a worker of an earlier, killed sweep driver) is busy and left alone; a run that
    stopped with a checkpoint resumes from it; one that stopped without a checkpoint starts over cleanly. A checkpoint
    that cannot be read plans a resume, which then fails for that run alone, naming the file."""
    busy = holder(run_dir)
    if busy is not None:
        return "busy", f"in use by {busy}"
    manifest = manifest_or_none(run_dir)
    if manifest is None:
        return ("restart", "no manifest: it died before starting") if run_dir.exists() else ("start", "")
    status, reason = manifest["status"], manifest.get("reason")
    if status in ("finished", "diverged"):
        return "skip", status + (f": {reason}" if reason else "")
    was = f"was {status}" + (f": {reason}" if reason else "")
    try:
        step = checkpoint_step(run_dir)
    except DataError as err:
        return "resume", f"{err}; {was}"
    if step is not None:
        return "resume", f"from the checkpoint at step {step}; {was}"
    return "restart", f"no checkpoint; {was}"


def warmstart_done(run_dir: Path) -> bool:
    manifest = manifest_or_none(run_dir)
    return bool(manifest and manifest["status"] == "finished" and (run_dir / CHECKPOINTS / LATEST).is_file())


def record_path(sweep_dir: Path, kind: str, name: str, suffix: str = ".json") -> Path:
    folder = Path(sweep_dir) / JOBS / (WARMSTART if kind == "warmstart" else "")
    return folder / f"{name}{suffix}"


def read_record(sweep_dir: Path, kind: str, name: str) -> dict[str, Any]:
    path = record_path(sweep_dir, kind, name)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def update_record(sweep_dir: Path, kind: str, name: str, **fields: Any) -> dict[str, Any]:
    """The job record: state (queued | running | ended), attempts, error, job_id, updated_at."""
    record = {**read_record(sweep_dir, kind, name), **fields, "updated_at": utc_now()}
    path = record_path(sweep_dir, kind, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    return record


def job_status(sweep_dir: Path, kind: str, name: str, run_dir: Path) -> tuple[str, str]:
    """(pending | queued | running | finished | diverged | failed, reason): the run's manifest, unless its process
    died without updating it (then the job record says how it ended)."""
    record = read_record(sweep_dir, kind, name)
    died = record.get("state") == "ended" and record.get("error")
    manifest = manifest_or_none(run_dir)
    # A job that failed without touching the manifest (a refused resume leaves it byte for byte) is failed, with the
    # job's reason, whatever the manifest still says about the attempt before (e.g. interrupted); a result stands.
    if manifest is not None and not (manifest["status"] not in ("finished", "diverged") and died):
        return manifest["status"], manifest.get("reason") or ""
    if died:
        return "failed", record["error"]
    return {"queued": "queued", "running": "running"}.get(record.get("state"), "pending"), ""


def write_index(sweep_dir: str | os.PathLike) -> pd.DataFrame:
    """Rebuild index.csv from sweep.json, the run manifests and the job records (under a lock: jobs call it too)."""
    sweep_dir = Path(sweep_dir)
    with file_lock(sweep_dir / ".index.lock"):
        frame = _index_frame(sweep_dir, read_sweep(sweep_dir))
        atomic_write_text(sweep_dir / INDEX_CSV, frame.to_csv(index=False))
    return frame


def _index_frame(sweep_dir: Path, data: Mapping) -> pd.DataFrame:
    swept = list(data["grid"])
    rows = []
    for run in data["runs"]:
        run_dir = Path(run["config"]["out_dir"])
        status, reason = job_status(sweep_dir, "run", run["name"], run_dir)
        if status == "pending" and run["warmstart"]:
            ws_status, ws_reason = job_status(sweep_dir, "warmstart", run["warmstart"],
                                              sweep_dir / WARMSTART / run["warmstart"])
            if ws_status == "failed":
                status, reason = "failed", f"warm start {run['warmstart']} failed: {ws_reason}"
        rows.append({"name": run["name"], **{k: run["point"].get(k) for k in swept}, "status": status,
                     "reason": reason, "warmstart": run["warmstart"] or "",
                     "attempts": read_record(sweep_dir, "run", run["name"]).get("attempts", 0),
                     "run_dir": os.path.relpath(run_dir, sweep_dir)})
    return pd.DataFrame(rows, columns=["name", *swept, "status", "reason", "warmstart", "attempts", "run_dir"])


def read_index(sweep_dir: str | os.PathLike) -> pd.DataFrame:
    return pd.read_csv(Path(sweep_dir) / INDEX_CSV, keep_default_na=False)


@contextlib.contextmanager
def file_lock(path: Path, blocking: bool = True) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            raise ConfigError(f"another `moe-rl sweep` is driving {path.parent} (it holds {path.name}); wait for it "
                              "to end, or stop it first") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------------------------------
# What this invocation runs


def todo(plan: SweepPlan, retry_diverged: bool = False, selected: set[str] | None = None) \
        -> tuple[list[str], list[str]]:
    """(warm starts to run, runs to run), in plan order: the runs not skipped (and, given `selected`, among those
    names: `moe-rl sweep --only`) and the warm starts they still need."""
    runs = [r for r in plan.runs if planned_action(r, retry_diverged)[0] not in ("skip", "busy")
            and (selected is None or r.name in selected)]
    keys = list(dict.fromkeys(r.warmstart for r in runs if r.warmstart))
    keys = [k for k in keys if not warmstart_done(Path(plan.warmstarts[k].out_dir))]
    return keys, [r.name for r in runs]


def planned_action(run: PlannedRun, retry_diverged: bool = False) -> tuple[str, str]:
    """What this invocation does with a planned run: run_action, except that --retry-diverged restarts diverged
    runs."""
    action, why = run_action(Path(run.config.out_dir))
    if retry_diverged and why.startswith("diverged"):
        return "restart", f"--retry-diverged; was {why}"
    return action, why


def clear_diverged(plan: SweepPlan) -> None:
    """--retry-diverged: remove the diverged runs, so that they start over."""
    for run in plan.runs:
        if run_action(Path(run.config.out_dir))[1].startswith("diverged"):  # a busy run is never removed
            shutil.rmtree(run.config.out_dir)
