"""SIGINT and SIGTERM end `train`, `sft` and a local sweep cleanly (issue 25): the step in flight finishes, a
checkpoint is saved, the manifest says `interrupted` with the step, one line says how to resume, the exit status is
128 + the signal; the resumed run gives the metrics of a run that was never stopped.

A quick case sends the signal from inside a step of `moe_rl.cli.main` in this process; the slow ones signal real
processes (train, sft, a sweep driver), and their reference and resumed runs go through `moe_rl.cli.main` here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cli

from moe_rl.runs.interrupt import Interrupted, StopOnSignal

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
       "PYTHONWARNINGS": "ignore::SyntaxWarning"}
TINY = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "4", "--model.n-kv-heads", "2",
        "--model.n-experts", "4", "--model.top-k", "2", "--model.d-expert", "32", "--model.d-dense", "64"]
TRAIN = ["train", *TINY, "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", "--minibatches", "2",
         "--rollout.sampling.max-new-tokens", "4", "--checkpoint-every", "100"]
SFT = ["sft", *TINY, "--batch-size", "8", "--log.eval-prompts", "4", "--sampling.max-new-tokens", "4",
       "--log.print-every", "1"]


def signalled(argv, run: Path, signum: int, after_lines: int = 1, cwd=REPO) -> subprocess.CompletedProcess:
    """Start `moe-rl argv`, send `signum` once metrics.jsonl holds `after_lines` lines, and wait for it to end."""
    process = subprocess.Popen([sys.executable, "-m", "moe_rl.cli", *map(str, argv)], cwd=cwd, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    metrics = run / "metrics.jsonl"
    while time.time() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= after_lines:
            break
        time.sleep(0.05)
    process.send_signal(signum)
    out, err = process.communicate(timeout=240)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def metrics_without_time(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "wall_time" and not k.startswith("time/")}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_signal_in_process_ends_train_after_its_step_with_a_checkpoint(tmp_path, monkeypatch):
    """The quick version of the case below: the signal comes from inside the first rollout step."""
    import moe_rl.rl.trainer

    rl_step = moe_rl.rl.trainer.Trainer.rl_step

    def step_then_ctrl_c(self, write):
        rl_step(self, write)
        if self.step == 1:  # the second step: SIGINT while it runs
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(moe_rl.rl.trainer.Trainer, "rl_step", step_then_ctrl_c)
    run = tmp_path / "run"
    code, out, err = cli(*TRAIN, "--out-dir", run, "--total-steps", "5", "--quiet")
    assert code == 130 and out == ""
    assert err.splitlines() == [f"interrupted at step 2; resume with: moe-rl train --config-file {run / 'config.json'} "
                                "--resume"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["reason"] == "SIGINT at step 2"
    assert manifest["interrupted"] == {"signal": "SIGINT", "at_step": 2, "resumes_from_step": 2}
    assert manifest["checkpoints"]["latest.pt"]["step"] == 2  # checkpoint_every is 100: saved for the signal
    assert {json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()} == {0, 1}


@pytest.mark.slow
def test_train_stops_at_a_step_with_a_checkpoint_and_resumes_as_if_never_stopped(tmp_path):
    signum, status = signal.SIGINT, 130  # SIGTERM (143) takes the same path: the sft and sweep cases send it
    run = tmp_path / "run"
    done = signalled([*TRAIN, "--out-dir", run, "--total-steps", "400", "--quiet"], run, signum)
    assert done.returncode == status, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    manifest = json.loads((run / "manifest.json").read_text())
    step = manifest["interrupted"]["at_step"]
    assert lines == [f"interrupted at step {step}; resume with: moe-rl train --config-file {run / 'config.json'} "
                     "--resume"] and done.stdout == ""
    assert manifest["status"] == "interrupted" and manifest["reason"] == f"{signum.name} at step {step}"
    assert manifest["interrupted"] == {"signal": signum.name, "at_step": step, "resumes_from_step": step}
    assert 1 <= step < 400 and manifest["checkpoints"]["latest.pt"]["step"] == step

    total = step + 2
    code, _, err = cli("train", "--config-file", run / "config.json", "--resume", "--total-steps", total, "--quiet")
    assert code == 0, err
    reference = tmp_path / "reference"
    code, _, err = cli(*TRAIN, "--out-dir", reference, "--total-steps", total, "--quiet")
    assert code == 0, err
    assert metrics_without_time(run) == metrics_without_time(reference)
    resumed = json.loads((run / "manifest.json").read_text())
    assert resumed["status"] == "finished" and "interrupted" not in resumed
    assert resumed["resumes"][-1]["previous"]["interrupted"]["signal"] == signum.name


@pytest.mark.slow
def test_sft_stops_cleanly_and_says_it_starts_over(tmp_path):
    run = tmp_path / "sft"
    done = signalled([*SFT, "--out-dir", run, "--total-steps", "5000"], run, signal.SIGTERM)
    assert done.returncode == 143 and "Traceback" not in done.stderr, done.stderr
    manifest = json.loads((run / "manifest.json").read_text())
    step = manifest["interrupted"]["at_step"]
    assert done.stderr.strip().splitlines() == [f"interrupted at step {step}; sft has no resume: the same command "
                                                f"starts it over ({run})"]
    assert manifest["status"] == "interrupted" and manifest["interrupted"]["signal"] == "SIGTERM"
    assert not (run / "checkpoints" / "latest.pt").exists()


def test_a_second_signal_abandons_the_step_at_once():
    # What was installed before (Python's default_int_handler, or SIG_IGN when the test process was started in the
    # background of a non-interactive shell, which ignores SIGINT for its children) is what must come back.
    before = signal.getsignal(signal.SIGINT)
    with StopOnSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.requested and stop.signal_name == "SIGTERM"
        with pytest.raises(Interrupted, match="SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are put back


@pytest.mark.slow
def test_sigterm_to_a_sweep_driver_reaches_its_worker_and_a_rerun_resumes(tmp_path):
    sweep = tmp_path / "sweep"
    argv = ["sweep", "smoke", "--sweep-dir", sweep, "--workers", "1", "--arg", "steps=400"]
    process = subprocess.Popen([sys.executable, "-m", "moe_rl.cli", *map(str, argv)], cwd=tmp_path, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 400
    while time.time() < deadline and process.poll() is None:
        if any(len(p.read_text().splitlines()) >= 2 for p in (sweep / "runs").glob("*/metrics.jsonl")):
            break
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=400)
    assert process.returncode == 143, err
    assert "interrupted; run the same command again to resume" in err and "Traceback" not in err
    manifests = [json.loads(p.read_text()) for p in (sweep / "runs").glob("*/manifest.json")]
    assert [m["status"] for m in manifests] == ["interrupted"]  # the worker stopped too, at a checkpoint
    assert manifests[0]["interrupted"]["signal"] == "SIGTERM"
    assert not [line for line in subprocess.run(["pgrep", "-f", f"moe_rl.sweep.jobs {sweep}"], capture_output=True,
                                                text=True).stdout.splitlines()]
    dry = subprocess.run([sys.executable, "-m", "moe_rl.cli", *map(str, argv), "--dry-run"], cwd=tmp_path, env=ENV,
                         capture_output=True, text=True, timeout=300)
    tally = next(line for line in dry.stdout.splitlines() if "runs (4):" in line)
    assert dry.returncode == 0 and "1 resume" in tally, dry.stdout
