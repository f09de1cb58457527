"""SLURM sweeps through submitit: one job per run, submitted as a job array; preempted or timed-out jobs requeue
themselves and resume from their checkpoints.

    moe-rl sweep churn_repro --arg scale=gpu --executor slurm --partition gpu --gpus-per-job 1 --time 240
    moe-rl sweep smoke --executor submitit-local --wait          # the same code path on this machine

How a requeue works: before the time limit (or on preemption) SLURM sends the job a signal; submitit then calls
`SweepJob.checkpoint()`, which returns a submission of the same run, and requeues it. The training loop saved
checkpoints/latest.pt every `checkpoint_every` rollout steps, so the requeued job sees a run that stopped with a
checkpoint and resumes it from there (`moe_rl.sweep.run_action`).

Warm starts are submitted first; the run array starts after them (`--dependency=afterany`), and a run whose warm
start failed fails at once, naming it. Needs `pip install 'moe-rl[cluster]'`.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import submitit

from moe_rl.errors import ConfigError
from moe_rl.rl.overrides import parse_assignments
from moe_rl.sweep.jobs import execute_job
from moe_rl.sweep.sweepdir import clear_diverged, read_record, store_plan, todo, update_record, write_index

if TYPE_CHECKING:
    from moe_rl.sweep.config import SweepConfig
    from moe_rl.sweep.plan import SweepPlan

SUBMITIT = "submitit"  # submitit's pickles and logs: <sweep>/submitit/<job id>_*


class SweepJob:
    """One job of a sweep (a warm start or a run), as a picklable submitit callable."""

    def __init__(self, sweep_dir: str | Path, kind: str, name: str, threads: int | None = None, requeues: int = 0):
        self.sweep_dir, self.kind, self.name = str(sweep_dir), kind, name
        self.threads, self.requeues = threads, requeues

    def __call__(self) -> dict[str, Any]:
        result = execute_job(self.sweep_dir, self.kind, self.name, self.threads)
        return {**result, "requeues": self.requeues}

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on preemption or timeout: requeue the same job. The run's own checkpoints are on disk
        already, so the requeued job resumes from the latest one (resume=True) instead of starting at step 0."""
        return submitit.helpers.DelayedSubmission(
            SweepJob(self.sweep_dir, self.kind, self.name, self.threads, self.requeues + 1))

    def __repr__(self) -> str:
        return f"SweepJob({self.kind} {self.name!r}, requeues={self.requeues})"


def make_executor(cfg: SweepConfig, sweep_dir: Path) -> submitit.AutoExecutor:
    """A submitit executor from the command's SLURM options (`submitit-local` runs jobs on this machine)."""
    cluster = "slurm" if cfg.executor == "slurm" else "local"
    if cluster == "slurm" and shutil.which("srun") is None:
        raise ConfigError("--executor slurm: SLURM is not available here (no srun on PATH); run on a login node of "
                          "the cluster, or use --executor local (or submitit-local to try the SLURM code path)")
    executor = submitit.AutoExecutor(folder=sweep_dir / SUBMITIT / "%j", cluster=cluster)
    job_name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"moe-rl-{sweep_dir.name}")[:100]
    params: dict[str, Any] = dict(name=job_name, timeout_min=cfg.time,
                                  gpus_per_node=cfg.gpus_per_job, cpus_per_task=cfg.cpus_per_job,
                                  slurm_array_parallelism=cfg.array_parallelism,
                                  slurm_additional_parameters=parse_assignments(cfg.slurm_param, "--slurm-param"))
    if cluster == "local":
        params["gpus_per_node"] = 0  # the local executor would try to reserve GPUs this machine may not have
    if cfg.partition:
        params["slurm_partition"] = cfg.partition
    if cfg.mem_gb:
        params["mem_gb"] = cfg.mem_gb
    executor.update_parameters(**params)
    return executor


def is_slurm(executor: submitit.Executor) -> bool:
    inner = getattr(executor, "_executor", executor)  # AutoExecutor wraps the real one
    return isinstance(inner, submitit.SlurmExecutor)


def submit(plan: SweepPlan, executor: submitit.Executor, threads: int | None = None,
           retry_diverged: bool = False, selected: set[str] | None = None) -> list[submitit.Job]:
    """Store the plan, submit the warm starts that are missing, then one job per run to do (an array on SLURM).

    Runs whose job is already queued or running (by an earlier submission) are left to it. On SLURM the runs depend
    on the warm-start jobs; other executors (local, debug) have no dependencies, so this waits for the warm starts.
    `selected` (SweepPlan.selected): submit only these of the runs to do. Returns the run jobs."""
    store_plan(plan)
    if retry_diverged:
        clear_diverged(plan)
    keys, names = todo(plan, selected=selected)
    names = [n for n in names if _not_in_flight(plan, "run", n)]
    keys = [k for k in keys if _not_in_flight(plan, "warmstart", k)]
    warm_jobs = _submit_batch(plan, executor, "warmstart", keys, threads)
    if warm_jobs and is_slurm(executor):
        inner = getattr(executor, "_executor", executor)
        extra = dict(inner.parameters.get("additional_parameters") or {})
        dependency = "afterany:" + ":".join(job.job_id for job in warm_jobs)
        executor.update_parameters(slurm_additional_parameters={**extra, "dependency": dependency})
    else:
        for job in warm_jobs:
            job.exception()  # wait; a failure is in the job record and fails the runs that need it
    run_jobs = _submit_batch(plan, executor, "run", names, threads)
    write_index(plan.sweep_dir)
    return run_jobs


def _not_in_flight(plan: SweepPlan, kind: str, name: str) -> bool:
    record = read_record(plan.sweep_dir, kind, name)
    if record.get("state") in ("queued", "running") and record.get("job_id"):
        print(f"  {kind} {name}: job {record['job_id']} is still {record['state']}; not submitted again (cancel it "
              f"first, or delete {plan.sweep_dir}/jobs/.../{name}.json if that job is gone)")
        return False
    return True


def _submit_batch(plan: SweepPlan, executor, kind: str, names: list[str], threads: int | None) -> list:
    if not names:
        return []
    with executor.batch():
        jobs = [executor.submit(SweepJob(plan.sweep_dir, kind, name, threads)) for name in names]
    for name, job in zip(names, jobs):
        update_record(plan.sweep_dir, kind, name, state="queued", job_id=str(job.job_id))
    return jobs


def wait_for(jobs: list[submitit.Job], sweep_dir: Path) -> pd.DataFrame:
    """Block until every job has ended (a failed job is in the index, not raised); returns the index."""
    for job in jobs:
        job.exception()
    return write_index(sweep_dir)
