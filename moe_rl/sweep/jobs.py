"""Sweep jobs: run one warm start or run of a stored sweep (`execute_job`), and the local pool of worker processes.

    python -m moe_rl.sweep.jobs <sweep_dir> run <name> [--threads N]  what each local worker runs
    run_local(plan, workers=2)                                          what `moe-rl sweep` runs without --executor

Each job decides for itself from the run directory (moe_rl.sweep.sweepdir.run_action): skip a finished or diverged run,
resume one that stopped with a checkpoint, start the others (over). The SLURM jobs (moe_rl.sweep.slurm) call the same
`execute_job`, so a requeued job resumes the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from moe_rl.errors import USER_ERRORS, ConfigError
from moe_rl.rl.overrides import from_dict
from moe_rl.rl.run_config import SFTConfig, TrainConfig
from moe_rl.runs.interrupt import SIGNALS, Interrupted
from moe_rl.runs.lock import holder
from moe_rl.runs.progress import duration
from moe_rl.runs.provenance import utc_now
from moe_rl.runs.runlog import read_config, read_manifest
from moe_rl.sweep.sweepdir import (
    RUNS,
    WARMSTART,
    checkpoint_step,
    clear_diverged,
    file_lock,
    job_status,
    read_record,
    read_sweep,
    record_path,
    run_action,
    store_plan,
    todo,
    update_record,
    warmstart_done,
    write_index,
)

if TYPE_CHECKING:
    from moe_rl.sweep.plan import SweepPlan


class WarmStartError(RuntimeError):
    """A run's warm start has not finished, so the run cannot start."""


# ---------------------------------------------------------------------------------------------------------------------
# One job: a warm start or a run, in the current process (the local worker subprocess or a SLURM job)


def execute_job(sweep_dir: str | os.PathLike, kind: str, name: str, threads: int | None = None) -> dict[str, Any]:
    """Run, resume or skip one warm start or run of a stored sweep; returns {name, action, status, reason, ...}.

    Exceptions propagate (the job fails) after the job record notes them; the index is rebuilt either way."""
    sweep_dir = Path(sweep_dir)
    data = read_sweep(sweep_dir)
    attempts = read_record(sweep_dir, kind, name).get("attempts", 0) + 1
    update_record(sweep_dir, kind, name, state="running", attempts=attempts, error=None, host=os.uname().nodename,
                  pid=os.getpid())
    try:
        result = _warmstart_job(data, name, threads) if kind == "warmstart" else _run_job(data, name, threads)
    except BaseException as err:  # also SystemExit from a submitit requeue and KeyboardInterrupt
        update_record(sweep_dir, kind, name, state="ended", error=one_line(f"{type(err).__name__}: {err}"))
        raise
    else:
        update_record(sweep_dir, kind, name, state="ended", error=None)
    finally:
        write_index(sweep_dir)
    return result


def one_line(text: str) -> str:
    """An error as the one line index.csv and the progress line carry (a multi-line message joined with ' / ')."""
    return " / ".join(line.strip() for line in text.splitlines() if line.strip()).rstrip(": ")


def _run_job(data: Mapping, name: str, threads: int | None) -> dict[str, Any]:
    from moe_rl.commands.train import train

    entry = next((r for r in data["runs"] if r["name"] == name), None)
    if entry is None:
        raise ConfigError(f"the sweep has no run named {name!r}")
    cfg = from_dict(TrainConfig, entry["config"])
    run_dir = Path(cfg.out_dir)
    if entry["warmstart"] and not warmstart_done(Path(data["warmstarts"][entry["warmstart"]]["out_dir"])):
        raise WarmStartError(f"warm start {entry['warmstart']} has not finished, so this run cannot start")
    action, why = run_action(run_dir)
    resumed_from = None
    if action == "busy":  # a worker of an earlier sweep driver still runs it: leave it alone
        return {"name": name, "action": action, "why": why, "status": "running", "reason": why, "resumed_from": None}
    if action == "skip":
        pass
    elif action == "resume":
        resumed_from = checkpoint_step(run_dir)
        saved_threads = read_config(run_dir).get("threads", cfg.threads)  # a resume must not change the config
        train(dataclasses.replace(cfg, resume=True, threads=saved_threads))
    else:
        if action == "restart":
            shutil.rmtree(run_dir)
        train(dataclasses.replace(cfg, threads=threads or cfg.threads))
    manifest = read_manifest(run_dir)
    return {"name": name, "action": action, "why": why, "status": manifest["status"],
            "reason": manifest.get("reason"), "resumed_from": resumed_from}


def _warmstart_job(data: Mapping, key: str, threads: int | None) -> dict[str, Any]:
    from moe_rl.commands.sft import sft

    cfg = from_dict(SFTConfig, data["warmstarts"][key])
    run_dir = Path(cfg.out_dir)
    if warmstart_done(run_dir):
        return {"name": key, "action": "skip", "status": "finished", "reason": None}
    busy = holder(run_dir)
    if busy is not None:
        raise WarmStartError(f"warm start {key} is in use by {busy} (a worker of an earlier sweep); wait for it")
    if run_dir.exists():
        shutil.rmtree(run_dir)  # SFT has no resume: an interrupted warm start starts over
    sft(dataclasses.replace(cfg, threads=threads or cfg.threads))
    return {"name": key, "action": "start", "status": read_manifest(run_dir)["status"], "reason": None}


# ---------------------------------------------------------------------------------------------------------------------
# Local execution: a bounded pool of worker subprocesses


def run_local(plan: SweepPlan, workers: int = 1, retry_diverged: bool = False,
              echo: Callable[[str], None] = print, threads: int = 1,
              selected: set[str] | None = None) -> pd.DataFrame:
    """Run the sweep here, `workers` jobs at a time, each in its own subprocess with `threads` torch threads (1 by
    default: the CPU kernels serve one thread, and one is fastest at these model sizes; docs/performance.md, "Threads").
    Returns the index. `selected` (SweepPlan.selected): run only these of the runs to do; the others stay as they are.

    Order: a free worker takes a waiting warm start if there is one, else a run whose warm start has ended, so runs
    of a finished architecture start while other warm starts still train; among those it takes the costliest first
    (`job_cost`), so the long jobs do not end up alone at the end of the sweep."""
    if workers < 1:
        raise ConfigError(f"workers={workers} must be >= 1")
    if threads < 1:
        raise ConfigError(f"threads={threads} must be >= 1")
    plan.sweep_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(plan.sweep_dir / ".lock", blocking=False):
        store_plan(plan)
        if retry_diverged:
            clear_diverged(plan)
        keys, names = todo(plan, selected=selected)
        runs = {run.name: run for run in plan.runs}
        jobs = [Job("warmstart", key, None, job_cost(plan.warmstarts[key])) for key in keys]
        jobs += [Job("run", name, runs[name].warmstart, job_cost(runs[name].config)) for name in names]
        pool = Workers()
        with pool.forwarding_signals():
            _pool(plan.sweep_dir, jobs, workers, threads, echo, pool)
        index = write_index(plan.sweep_dir)
    if pool.signum is not None:  # every worker has stopped at a checkpoint; a re-run resumes them
        raise Interrupted(pool.signum)
    return index


class Workers:
    """The local pool's worker processes. Each runs in a session of its own, so a Ctrl-C in the terminal reaches
    the driver alone, which passes SIGINT or SIGTERM on to every worker (and starts no new one): each finishes its
    step, saves a checkpoint and ends `interrupted` (moe_rl.runs.interrupt); a second signal stops them at once. A
    worker outlives a driver killed outright (SIGKILL), as before."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.RLock()  # re-entrant: a second signal may arrive inside `forward`

    def run(self, command: list[str], **popen) -> int | None:
        """Run `command` to its end; its exit status, or None when a signal came first and it was not started."""
        with self._lock:
            if self.signum is not None:
                return None
            process = subprocess.Popen(command, start_new_session=True, **popen)
            self._running.add(process)
        try:
            return process.wait()
        finally:
            with self._lock:
                self._running.discard(process)

    def forward(self, signum: int, frame=None) -> None:
        self.signum = signum
        with self._lock:
            for process in self._running:
                process.send_signal(signum)

    @contextlib.contextmanager
    def forwarding_signals(self):
        """Pass SIGINT and SIGTERM on to the workers while in the block (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self.forward) for s in SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


@dataclasses.dataclass(frozen=True)
class Job:
    kind: str
    """"warmstart" or "run"."""
    name: str
    """The warm start's key or the run's name."""
    needs: str | None
    """The key of the warm start a run starts from (it waits until that warm start has ended), or None."""
    cost: float
    """A proxy of its compute (job_cost), to start the costliest ready job first."""


def job_cost(cfg: TrainConfig | SFTConfig) -> float:
    """A proxy of a job's compute, for ordering only: layers x steps x sequences per step (SFT: optimizer steps x
    batch size; RL: rollout steps x completions per rollout step)."""
    layers = cfg.model.n_layers
    if isinstance(cfg, SFTConfig):
        return float(layers * cfg.total_steps * cfg.batch_size)
    return float(layers * cfg.total_steps * cfg.rollout.prompts_per_step * cfg.rollout.group_size)


def _next_job(waiting: list[Job], unfinished_warmstarts: set[str]) -> Job | None:
    """The job a free worker takes: warm starts before runs, the costliest first, runs only once their warm start
    has ended (its success is checked by the run itself: a failed warm start fails its runs with a reason)."""
    ready = [j for j in waiting if j.kind == "warmstart" or j.needs not in unfinished_warmstarts]
    return min(ready, key=lambda j: (j.kind != "warmstart", -j.cost), default=None)


def _pool(sweep_dir: Path, jobs: list[Job], workers: int, threads: int, echo, processes: Workers) -> None:
    if not jobs:
        return
    width, t0 = len(str(len(jobs))), time.perf_counter()
    waiting, running, done = list(jobs), {}, 0
    unfinished_warmstarts = {j.name for j in jobs if j.kind == "warmstart"}
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        while (waiting and processes.signum is None) or running:
            while processes.signum is None and len(running) < workers and \
                    (job := _next_job(waiting, unfinished_warmstarts)) is not None:
                waiting.remove(job)
                running[pool.submit(_subprocess_job, sweep_dir, job.kind, job.name, threads, processes)] = job
            if not running:
                break
            # A timeout, so that the main thread returns to Python (and runs a signal handler) now and then.
            finished, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in finished:
                job = running.pop(future)
                seconds, done = future.result(), done + 1
                if job.kind == "warmstart":
                    unfinished_warmstarts.discard(job.name)
                run_dir = sweep_dir / (WARMSTART if job.kind == "warmstart" else RUNS) / job.name
                status, reason = job_status(sweep_dir, job.kind, job.name, run_dir)
                label = f"warm start {job.name}" if job.kind == "warmstart" else job.name
                eta = (time.perf_counter() - t0) / done * (len(jobs) - done)  # the pace so far, workers included
                echo(f"[{done:>{width}}/{len(jobs)}] {status:<8} {label}  ({seconds:.1f} s, ETA {duration(eta)})"
                     + (f"  {reason}" if reason and status != "finished" else ""))
    except BaseException:
        # The driver failed: start nothing more, tell the workers to stop at their next step, wait for them.
        processes.forward(signal.SIGTERM)
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()


def _subprocess_job(sweep_dir: Path, kind: str, name: str, threads: int, processes: Workers) -> float:
    """Run one job in a fresh interpreter (a crash cannot take the sweep down); returns its wall time."""
    log_path = record_path(sweep_dir, kind, name, ".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # The worker must import the same moe_rl as this process, whatever its working directory and install.
    code_root = str(Path(__file__).resolve().parents[2])  # the folder holding moe_rl/ (this is moe_rl/sweep/)
    python_path = os.pathsep.join(p for p in (code_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONPATH": python_path}
    command = [sys.executable, "-m", "moe_rl.sweep.jobs", str(sweep_dir), kind, name, "--threads", str(threads)]
    start = time.perf_counter()
    with open(log_path, "a") as log:
        log.write(f"=== {utc_now()} {shlex.join(command)}\n")
        log.flush()
        returncode = processes.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if returncode is None:  # the sweep was interrupted before this job started
        return 0.0
    if returncode != 0 and read_record(sweep_dir, kind, name).get("state") != "ended":
        # killed before it could note why (a signal, out of memory): the exit status and the log's last line
        how = f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
        update_record(sweep_dir, kind, name, state="ended", error=f"{how}: {_last_line(log_path)}")
        write_index(sweep_dir)
    return time.perf_counter() - start


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _job_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_rl.sweep.jobs",
                                     description="Run one job of a stored sweep (what `moe-rl sweep` workers run).")
    parser.add_argument("sweep_dir")
    parser.add_argument("kind", choices=("run", "warmstart"))
    parser.add_argument("name")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        result = execute_job(args.sweep_dir, args.kind, args.name, args.threads)
    except USER_ERRORS as err:  # the input's fault: one line, no traceback (the job record and index.csv have it)
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except Exception as err:
        traceback.print_exc()
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_job_main())
