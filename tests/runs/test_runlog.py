"""Run directory, manifest, metrics.jsonl, Parquet tables and tracker mirrors (moe_rl.runs.runlog and neighbours)."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import types
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import moe_rl
from moe_rl.errors import ConfigError, DataError
from moe_rl.runs import provenance
from moe_rl.runs.atomic import atomic_write, atomic_write_text, iter_temp_files
from moe_rl.runs.jsonlog import MetricsWriter, read_jsonl
from moe_rl.runs.runlog import (
    RunDir,
    RunExistsError,
    read_config,
    read_manifest,
    read_metrics,
    read_tables,
    write_table,
)
from moe_rl.runs.trackers import TRACKING_EXTRA, TensorBoardTracker, WandbTracker, make_trackers

REPO_ROOT = Path(moe_rl.__file__).resolve().parent.parent


@dataclasses.dataclass
class OptimConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)


@dataclasses.dataclass
class TinyConfig:
    seed: int = 7
    total_steps: int = 10
    out: Path = Path("runs/tiny")
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)


def steps_of(records):
    return [record["step"] for record in records]


# ---------------------------------------------------------------------------------------------------------------------
# RunDir: creation, manifest, refusal, resume


def test_new_run_writes_config_manifest_metrics_and_folders(tmp_path):
    run = RunDir(tmp_path / "tiny", TinyConfig())
    assert read_config(run.path) == {
        "seed": 7,
        "total_steps": 10,
        "out": "runs/tiny",
        "optim": {"lr": 1e-3, "betas": [0.9, 0.95]},
    }
    assert run.metrics_path.read_text() == ""
    assert all((run.path / folder).is_dir() for folder in ("routing", "samples", "checkpoints"))

    manifest = read_manifest(run.path)
    assert manifest["status"] == "running" and manifest["reason"] is None and manifest["ended_at"] is None
    assert manifest["seed"] == 7
    assert manifest["command"] == sys.argv
    assert manifest["device"] == "cpu" or manifest["device"].startswith("cuda:")
    assert manifest["packages"]["torch"] == torch.__version__
    assert manifest["packages"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert manifest["resumes"] == []
    started = datetime.fromisoformat(manifest["started_at"])
    assert started.utcoffset() == timedelta(0)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_manifest_records_the_git_commit_of_the_package(tmp_path):
    git = read_manifest(RunDir(tmp_path / "run", {"seed": 1}).path)["git"]
    expected = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert git["sha"] == expected.stdout.strip() and len(git["sha"]) == 40
    assert isinstance(git["dirty"], bool)


def test_git_state_is_none_outside_git_and_without_git(tmp_path, monkeypatch):
    assert provenance.git_state(tmp_path) == {"sha": None, "dirty": None}

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(provenance.subprocess, "run", no_git)
    assert provenance.git_state(REPO_ROOT) == {"sha": None, "dirty": None}


def test_missing_package_version_is_none():
    versions = provenance.package_versions(["numpy", "surely-not-an-installed-package"])
    assert versions["numpy"] == np.__version__
    assert versions["surely-not-an-installed-package"] is None


def test_starting_a_run_where_one_exists_is_refused(tmp_path):
    run = RunDir(tmp_path / "tiny", TinyConfig())
    with run.open_metrics() as metrics:
        metrics.write({"loss": 1.0}, step=1)
    with pytest.raises(RunExistsError, match=r"metrics\.jsonl.*--resume.*new run name"):
        RunDir(tmp_path / "tiny", TinyConfig())
    assert read_metrics(run.path)[0]["loss"] == 1.0  # nothing was overwritten


def test_a_directory_with_only_checkpoints_is_refused_too(tmp_path):
    (tmp_path / "tiny" / "checkpoints").mkdir(parents=True)
    (tmp_path / "tiny" / "checkpoints" / "latest.pt").write_bytes(b"x")
    with pytest.raises(RunExistsError, match=r"checkpoints/latest\.pt"):
        RunDir(tmp_path / "tiny", TinyConfig())


def test_resume_may_change_total_steps_and_records_it(tmp_path):
    RunDir(tmp_path / "tiny", TinyConfig()).mark_failed("killed")
    run = RunDir(tmp_path / "tiny", TinyConfig(total_steps=20), resume=True)
    manifest = read_manifest(run.path)
    assert manifest["status"] == "running" and manifest["reason"] is None and manifest["ended_at"] is None
    assert len(manifest["resumes"]) == 1
    assert manifest["resumes"][0]["changed"] == {"total_steps": [10, 20]}
    assert read_config(run.path)["total_steps"] == 20


def test_resume_with_a_different_config_names_the_key(tmp_path):
    RunDir(tmp_path / "tiny", TinyConfig())
    changed = TinyConfig(optim=OptimConfig(lr=3e-4))
    with pytest.raises(ConfigError, match=r"optim\.lr") as error:
        RunDir(tmp_path / "tiny", changed, resume=True)
    assert "0.001" in str(error.value) and "0.0003" in str(error.value)
    assert "(manifest.json) in optim.lr (" in str(error.value)  # only the differing key is named
    assert "\n" not in str(error.value)  # one line
    assert read_config(tmp_path / "tiny")["optim"]["lr"] == 1e-3  # the saved config is untouched


@pytest.mark.parametrize("betas, resumes", [((0.9, 0.95), True), ((0.8, 0.95), False)])
def test_a_field_added_since_the_run_started_resumes_only_at_its_default(tmp_path, betas, resumes):
    """A run from before optim.betas existed (its config.json lacks it) resumes when the new field holds its
    default, the behaviour the run had; with another value that is a change, and refused."""
    import json

    RunDir(tmp_path / "tiny", TinyConfig()).mark_failed("killed")
    saved = json.loads((tmp_path / "tiny" / "config.json").read_text())
    del saved["optim"]["betas"]
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(saved))
    manifest = json.loads((tmp_path / "tiny" / "manifest.json").read_text())
    del manifest["experiment"]  # a run from before the manifest recorded its config
    (tmp_path / "tiny" / "manifest.json").write_text(json.dumps(manifest))
    resumed = TinyConfig(optim=OptimConfig(betas=betas))
    if resumes:
        RunDir(tmp_path / "tiny", resumed, resume=True)
        assert read_config(tmp_path / "tiny")["optim"]["betas"] == [0.9, 0.95]
    else:
        with pytest.raises(ConfigError, match=r"optim\.betas: the run has '<absent>', this command \[0\.8, 0\.95\]"):
            RunDir(tmp_path / "tiny", resumed, resume=True)


def test_resume_of_a_missing_run_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        RunDir(tmp_path / "never-ran", TinyConfig(), resume=True)


def test_first_ending_wins(tmp_path):
    run = RunDir(tmp_path / "run", {"seed": 0})
    run.mark_diverged("loss is NaN at step 3")
    run.mark_finished()
    manifest = read_manifest(run.path)
    assert manifest["status"] == "diverged" and manifest["reason"] == "loss is NaN at step 3"
    assert datetime.fromisoformat(manifest["ended_at"]) >= datetime.fromisoformat(manifest["started_at"])


def test_context_manager_marks_failed_on_exception_and_finished_otherwise(tmp_path):
    with pytest.raises(RuntimeError):
        with RunDir(tmp_path / "bad", {"seed": 0}):
            raise RuntimeError("out of memory")
    assert read_manifest(tmp_path / "bad")["status"] == "failed"
    assert read_manifest(tmp_path / "bad")["reason"] == "RuntimeError: out of memory"
    with RunDir(tmp_path / "good", {"seed": 0}):
        pass
    assert read_manifest(tmp_path / "good")["status"] == "finished"


# ---------------------------------------------------------------------------------------------------------------------
# Atomic writes


def test_atomic_writes_leave_no_temp_files(tmp_path):
    run = RunDir(tmp_path / "run", TinyConfig())
    write_table(run, "routing", 1, [{"layer": 0, "churn": 0.1}])
    run.mark_finished()
    assert list(iter_temp_files(run.path)) == []
    assert not [p for p in run.path.rglob(".*")]


def test_a_failed_atomic_write_keeps_the_old_file_and_no_temp(tmp_path):
    target = atomic_write_text(tmp_path / "config.json", "old")

    def crash_mid_write(file):
        file.write(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, crash_mid_write)
    assert target.read_text() == "old"
    assert list(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_honour_the_umask_like_the_appended_metrics(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        run = RunDir(tmp_path / "run", TinyConfig())
        write_table(run, "routing", 1, [{"layer": 0, "churn": 0.1}])
        run.mark_finished()
        assert os.umask(umask) == umask  # reading the umask put it back
    finally:
        os.umask(old)
    files = [run.path / "config.json", run.path / "manifest.json", run.path / "routing" / "step_000001.parquet",
             run.path / "metrics.jsonl"]
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: oct(mode) for f in files}


# ---------------------------------------------------------------------------------------------------------------------
# metrics.jsonl


def test_metrics_convert_tensors_and_numpy_and_keep_nan_and_inf(tmp_path):
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        metrics.write({"loss": torch.tensor(0.5), "kl": np.float32(0.25), "tokens": np.int64(3), "lr": 1e-3}, step=1)
        metrics.write({"step": 2, "loss": float("nan"), "grad_norm": torch.tensor([float("inf")])})
    first, second = read_jsonl(tmp_path / "metrics.jsonl")
    assert (first["step"], first["loss"], first["kl"], first["tokens"], first["lr"]) == (1, 0.5, 0.25, 3, 1e-3)
    assert isinstance(first["loss"], float) and isinstance(first["tokens"], int)
    assert second["step"] == 2 and math.isnan(second["loss"]) and second["grad_norm"] == math.inf
    assert "NaN" in (tmp_path / "metrics.jsonl").read_text().splitlines()[1]
    frame = pd.read_json(tmp_path / "metrics.jsonl", lines=True)  # a common reader accepts the NaN token too
    assert frame["loss"].isna().tolist() == [False, True]


def test_metrics_refuse_vectors_and_missing_steps(tmp_path):
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        with pytest.raises(TypeError, match="'churn' has 4 elements"):
            metrics.write({"churn": torch.zeros(4)}, step=1)
        with pytest.raises(ValueError, match="needs its step"):
            metrics.write({"loss": 1.0})
        with pytest.raises(ValueError, match="disagrees"):
            metrics.write({"step": 3, "loss": 1.0}, step=4)
    assert read_jsonl(tmp_path / "metrics.jsonl") == []


def test_reader_drops_a_partial_last_line_and_accepts_an_empty_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    assert read_jsonl(path) == []
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert read_jsonl(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]


def test_reader_rejects_a_broken_line_in_the_middle_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2,\n{"step": 3}\n')
    with pytest.raises(DataError, match=r"metrics\.jsonl:2"):
        read_jsonl(path)


KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from moe_rl.runs.runlog import RunDir
    run = RunDir(sys.argv[1], {"seed": 0, "total_steps": 10})
    metrics = run.open_metrics()
    for step in (1, 2, 3):
        metrics.write({"loss": 1.0 / step}, step=step)
    with open(run.metrics_path, "a") as file:  # the line a kill interrupts
        file.write('{"step": 4, "loss": 0.2')
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_metrics_survive_a_sigkill_and_resume_continues_cleanly(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path / "run")], env=env, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()

    records = read_metrics(tmp_path / "run")
    assert steps_of(records) == [1, 2, 3]
    assert [r["loss"] for r in records] == [1.0, 0.5, 1.0 / 3]
    assert read_manifest(tmp_path / "run")["status"] == "running"

    # The last checkpoint was at step 2: step 3 and the partial step 4 are dropped, then logged again.
    run = RunDir(tmp_path / "run", {"seed": 0, "total_steps": 10}, resume=True)
    with run.open_metrics(resume_from_step=2) as metrics:
        assert steps_of(read_metrics(run.path)) == [1, 2]
        for step in (3, 4):
            metrics.write({"loss": 0.1 * step}, step=step)
    records = read_metrics(run.path)
    assert steps_of(records) == [1, 2, 3, 4]
    assert records[2]["loss"] == pytest.approx(0.3)


def test_resume_truncates_metrics_and_tables_beyond_the_checkpoint(tmp_path):
    run = RunDir(tmp_path / "run", {"seed": 0})
    with run.open_metrics() as metrics:
        for step in range(1, 6):
            metrics.write({"loss": float(step)}, step=step)
    for step in (2, 5):
        write_table(run, "routing", step, [{"layer": 0, "churn": 0.1}])
        write_table(run, "samples", step, [{"prompt": "1+1", "completion": "2", "reward": 1.0}])

    run = RunDir(tmp_path / "run", {"seed": 0}, resume=True)
    with run.open_metrics(resume_from_step=3) as metrics:
        metrics.write({"loss": 40.0}, step=4)
    records = read_metrics(run.path)
    assert steps_of(records) == [1, 2, 3, 4]
    assert [r["loss"] for r in records] == [1.0, 2.0, 3.0, 40.0]
    assert read_tables(run.path, "routing")["step"].tolist() == [2]
    assert read_tables(run.path, "samples")["step"].tolist() == [2]


# ---------------------------------------------------------------------------------------------------------------------
# Parquet tables


def test_tables_round_trip_in_step_order(tmp_path):
    run = RunDir(tmp_path / "run", {"seed": 0})
    path = write_table(run, "routing", 12, [{"layer": 0, "churn": 0.1}, {"layer": 1, "churn": 0.2}])
    write_table(run, "routing", 3, pd.DataFrame({"layer": [0], "churn": [0.05]}))
    assert path == run.path / "routing" / "step_000012.parquet"
    frame = read_tables(run.path, "routing")
    assert frame[["step", "layer", "churn"]].values.tolist() == [[3, 0, 0.05], [12, 0, 0.1], [12, 1, 0.2]]
    assert read_tables(run.path, "samples").empty


def test_tables_refuse_an_unknown_kind_and_a_wrong_step(tmp_path):
    with pytest.raises(ConfigError, match="routing"):
        write_table(tmp_path, "rouitng", 1, [{"layer": 0}])
    with pytest.raises(DataError, match="other than 2"):
        write_table(tmp_path, "routing", 2, [{"step": 1, "layer": 0}])


# ---------------------------------------------------------------------------------------------------------------------
# Trackers


def test_missing_wandb_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail as if not installed
    with pytest.raises(ImportError) as error:
        WandbTracker("moe-rl")
    assert "'wandb'" in str(error.value) and TRACKING_EXTRA in str(error.value)
    assert TRACKING_EXTRA == "pip install 'moe-rl[tracking]'"


def test_missing_tensorboard_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(ImportError, match=r"'tensorboard'.*pip install 'moe-rl\[tracking\]'"):
        TensorBoardTracker(tmp_path / "tb")


def test_unknown_tracker_name_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="tensorboard"):
        make_trackers(["mlflow"], tmp_path)
    assert make_trackers([], tmp_path) == []


class FakeWandbRun:
    def __init__(self):
        self.logged, self.finished = [], False

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self):
        self.finished = True


def test_metrics_are_mirrored_to_wandb_after_the_local_line(monkeypatch, tmp_path):
    fake_run = FakeWandbRun()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: fake_run))
    run = RunDir(tmp_path / "run", {"seed": 0})
    with run.open_metrics(trackers=make_trackers(["wandb"], run.path)) as metrics:
        metrics.write({"loss": torch.tensor(0.5), "note": "warmup"}, step=1)
    assert fake_run.logged[0][0] == 1
    assert fake_run.logged[0][1]["loss"] == 0.5 and "note" not in fake_run.logged[0][1]
    assert fake_run.finished


def test_a_failing_tracker_does_not_lose_the_local_line(tmp_path):
    class BrokenTracker:
        def log(self, metrics, step):
            raise ConnectionError("offline")

        def close(self):
            pass

    with MetricsWriter(tmp_path / "metrics.jsonl", trackers=[BrokenTracker()]) as metrics:
        metrics.write({"loss": 1.0}, step=1)
    assert steps_of(read_jsonl(tmp_path / "metrics.jsonl")) == [1]
