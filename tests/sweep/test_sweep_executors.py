"""Sweeps on a scheduler's terms: submitit's debug executor, SLURM array submission, and a preempted local job,
each requeued and resumed from its checkpoint (moe_rl.sweep.slurm, moe_rl.sweep.jobs)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import metric_lines
from test_sweep import experiment

from moe_rl.errors import ConfigError
from moe_rl.experiments import get_experiment
from moe_rl.rl.trainer import Trainer
from moe_rl.runs.runlog import read_manifest
from moe_rl.sweep.command import plan_sweep, print_plan
from moe_rl.sweep.sweepdir import checkpoint_step, read_index, read_record


def test_debug_executor_requeue_resumes_from_the_checkpoint(tmp_path, monkeypatch, capsys):
    submitit = pytest.importorskip("submitit")
    from moe_rl.sweep.slurm import SweepJob, submit

    plan = plan_sweep(experiment([{"seed": 0}], warm=True, total_steps=4), tmp_path / "s")
    save, preempted = Trainer.save, []

    def save_then_preempt(self):
        save(self)
        if self.step == 2 and not preempted:  # what submitit's signal handler raises once it has requeued the job
            preempted.append(True)
            raise SystemExit(144)

    monkeypatch.setattr(Trainer, "save", save_then_preempt)
    [job] = submit(plan, submitit.DebugExecutor(folder=tmp_path / "submitit"))  # runs the warm start first
    assert read_manifest(tmp_path / "s" / "warmstart" / plan.runs[0].warmstart)["status"] == "finished"
    with pytest.raises(SystemExit):
        job.result()
    run_dir = Path(plan.runs[0].config.out_dir)
    assert read_manifest(run_dir)["status"] == "failed" and checkpoint_step(run_dir) == 2
    assert read_index(plan.sweep_dir)["status"].tolist() == ["failed"]
    first_half = metric_lines(run_dir)[:2 * 4]
    capsys.readouterr()
    print_plan(plan, existing=True)  # what --dry-run shows now
    assert "resume   base,seed=0  from the checkpoint at step 2; was failed: SystemExit: 144" in capsys.readouterr().out

    requeued = job.submission().function.checkpoint()
    assert isinstance(requeued.function, SweepJob) and requeued.function.requeues == 1
    result = requeued.result()
    assert (result["action"], result["resumed_from"], result["status"]) == ("resume", 2, "finished")
    lines = metric_lines(run_dir)
    assert [line["step"] for line in lines if line["minibatch"] == 0] == [0, 1, 2, 3]
    assert lines[:2 * 4] == first_half  # steps 0-1 were not run again
    assert len(read_manifest(run_dir)["resumes"]) == 1
    assert read_index(plan.sweep_dir)["status"].tolist() == ["finished"]


FAKE_SBATCH = """#!/bin/sh
# A stand-in for sbatch: keep the script it was given and answer as SLURM does.
n=$(ls "$FAKE_SBATCH_DIR" | wc -l)
cp "$1" "$FAKE_SBATCH_DIR/$n.sh"
echo "Submitted batch job $((100 + n))"
"""


def test_slurm_submission_is_an_array_after_the_warm_starts(tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    from moe_rl.sweep.config import SweepConfig
    from moe_rl.sweep.slurm import make_executor, submit

    bin_dir, scripts = tmp_path / "bin", tmp_path / "scripts"
    bin_dir.mkdir(), scripts.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SBATCH_DIR", str(scripts))
    cfg = SweepConfig("smoke", executor="slurm", partition="gpu", gpus_per_job=2, time=90, array_parallelism=3,
                      slurm_param=("account=lab",))
    plan = plan_sweep(get_experiment("smoke"), tmp_path / "s")
    jobs = submit(plan, make_executor(cfg, plan.sweep_dir), threads=cfg.cpus_per_job)
    assert [job.job_id for job in jobs] == ["101_0", "101_1", "101_2", "101_3"]
    warm_script, array_script = (scripts / "0.sh").read_text(), (scripts / "1.sh").read_text()
    for flag in ("--partition=gpu", "--gpus-per-node=2", "--time=90", "--account=lab", "--signal=USR2@"):
        assert flag in warm_script and flag in array_script
    assert "--array" not in warm_script and "--dependency" not in warm_script
    assert "#SBATCH --array=0-3%3" in array_script and "#SBATCH --dependency=afterany:100" in array_script
    index = read_index(plan.sweep_dir)
    assert index["status"].tolist() == ["queued"] * 4
    assert read_record(plan.sweep_dir, "run", "obj=gspo,mode=R2")["job_id"] == "101_3"
    assert submit(plan, make_executor(cfg, plan.sweep_dir)) == []  # queued jobs are not submitted twice
    assert len(list(scripts.iterdir())) == 2


def test_slurm_executor_without_slurm_says_so(tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    from moe_rl.sweep.config import SweepConfig
    from moe_rl.sweep.slurm import make_executor

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="SLURM is not available here"):
        make_executor(SweepConfig("smoke", executor="slurm"), tmp_path)


@pytest.mark.slow
def test_local_executor_preempted_job_requeues_and_resumes(tmp_path, monkeypatch):
    submitit = pytest.importorskip("submitit")
    from moe_rl.sweep.slurm import submit

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))  # the job imports this checkout

    plan = plan_sweep(experiment([{"seed": 0}], total_steps=30), tmp_path / "s")
    executor = submitit.LocalExecutor(folder=tmp_path / "submitit" / "%j")
    executor.update_parameters(timeout_min=5)
    [job] = submit(plan, executor, threads=1)
    run_dir = Path(plan.runs[0].config.out_dir)
    deadline = time.time() + 120
    while not (run_dir / "checkpoints" / "latest.pt").exists():
        assert time.time() < deadline and job.state == "RUNNING", job.stderr()
        time.sleep(0.05)
    # SLURM signals the job's processes before a preemption or the time limit; so do we.
    os.kill(read_record(plan.sweep_dir, "run", "base,seed=0")["pid"], signal.SIGUSR2)
    result = job.result()
    assert result["requeues"] == 1 and result["action"] == "resume" and result["resumed_from"] >= 1
    assert result["status"] == "finished"
    assert [line["step"] for line in metric_lines(run_dir, minibatch=0)] == list(range(30))
    assert len(read_manifest(run_dir)["resumes"]) == 1
    assert read_index(plan.sweep_dir)["attempts"].tolist() == [2]


# --- the real command -----------------------------------------------------------------------------------------------
