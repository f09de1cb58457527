"""`moe-rl sweep`'s options (parsed by tyro; the field docstrings are its --help)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import tyro

from moe_rl.rl.overrides import Assignments


@dataclass
class SweepConfig:
    """Run a named experiment as a sweep of runs (see the module docstring for the directory layout)."""

    experiment: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="EXPERIMENT")] = ""
    """Name of an experiment in experiments/ (their table: experiments/__init__.py; an unknown name lists them).
    Leave it out with --grid or --grid-file."""
    grid: Assignments = ()
    """An ad-hoc sweep instead of a named experiment: field=v1,v2 per swept field, dotted as in --set (seed too);
    every combination runs from train's defaults (changed by --set), e.g. --grid objective.name=grpo,gspo seed=0,1."""
    grid_file: str | None = None
    """An ad-hoc sweep from a YAML or JSON file mapping each field to its list of values (with or without --grid)."""
    arg: Assignments = ()
    """Arguments of the experiment function, name=value (e.g. scale=gpu seeds=5)."""
    set: Assignments = ()
    """Overrides for every run, dotted.field=value (optim.lr=3e-4 total_steps=10); sft.<field>=value: warm start.
    A field the experiment sweeps cannot be overridden."""
    sweep_dir: str | None = None
    """The sweep directory; default sweeps/<experiment>[,<arg>=<value>...]."""
    only: Assignments = ()
    """Run only the runs whose swept values match, key=v1,v2 (e.g. optim.lr=2e-4,4e-4 seed=2): the others stay as
    they are, for a later invocation; to spend seeds near a frontier first. Any swept field, the seed included; a
    field only some cells set matches the others by their config's value (objective.name=grpo)."""
    dry_run: bool = False
    """Print the plan (runs, swept values, what would start, resume or be skipped) and run nothing."""
    workers: int = 1
    """local: runs at a time, each in its own process."""
    threads: int = 1
    """local: torch threads per run. 1 is fastest at CPU model sizes, and the CPU kernels (MKL batch calls, the C
    product loop) serve only one thread: with more, those runs take torch's own kernels (docs/performance.md,
    "Threads")."""
    retry_diverged: bool = False
    """Start diverged runs over (by default a diverged run is a result and is skipped)."""
    executor: Literal["local", "slurm", "submitit-local"] = "local"
    """local: worker subprocesses here. slurm: one SLURM job per run, as a job array (needs submitit).
    submitit-local: the SLURM code path run on this machine through submitit's LocalExecutor."""
    partition: str | None = None
    """slurm: the partition."""
    gpus_per_job: int = 1
    """slurm: GPUs per job."""
    cpus_per_job: int = 8
    """slurm: CPUs per job (also the torch threads of the run)."""
    mem_gb: int | None = None
    """slurm: memory per job in GB; None = the partition's default."""
    time: int = 240
    """slurm: time limit per job, in minutes; a job that reaches it is requeued and resumes from its checkpoint."""
    array_parallelism: int = 64
    """slurm: jobs of the array running at once."""
    slurm_param: Assignments = ()
    """slurm: further sbatch parameters, name=value (e.g. account=my-lab qos=high constraint=h100)."""
    wait: bool = False
    """slurm, submitit-local: wait until every job has ended, then print the summary."""
