"""Nothing lost, nothing silent: bad inputs and faults through the real `moe-rl` command.

Every case asserts the exit status, that the culprit is named, that no traceback is printed and that nothing in an
existing run directory was lost (line counts, manifests, checkpoints). Process starts dominate the cost (torch's
import), so the cases that fail before training run as one batch: one interpreter calls `moe_rl.cli.main` once per
case, with its own stdout and stderr, exactly as the `moe-rl` entry point does. Concurrency, divergence, progress and
sweeps use separate processes, since those are about processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moe_rl.runs.lock import holder
from moe_rl.sweep.sweepdir import run_action

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "4", "--model.n-kv-heads", "2",
        "--model.n-experts", "4", "--model.top-k", "2", "--model.d-expert", "32", "--model.d-dense", "64"]
TRAIN = ["train", *TINY, "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", "--minibatches", "2",
         "--rollout.sampling.max-new-tokens", "6", "--log.eval-prompts", "4", "--log.samples-every", "1"]
SFT = ["sft", *TINY, "--batch-size", "8", "--log.eval-prompts", "4", "--sampling.max-new-tokens", "6"]
# A dependency's SyntaxWarnings, printed when its bytecode is not cached yet, are not our output.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
       "PYTHONWARNINGS": "ignore::SyntaxWarning"}


def moe_rl(*args, cwd=REPO, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_rl.cli", *map(str, args)], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


BATCH_DRIVER = """
import contextlib, io, json, sys, traceback
from moe_rl.cli import main
results = []
for argv in json.loads(sys.stdin.read()):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"code": code, "out": out.getvalue(), "err": err.getvalue()})
print("RESULTS" + json.dumps(results))
"""


def run_batch(cases: list[list], cwd) -> list[dict]:
    """Each argv through moe_rl.cli.main in one interpreter: [{code, out, err}] in order."""
    done = subprocess.run([sys.executable, "-c", BATCH_DRIVER], input=json.dumps([list(map(str, c)) for c in cases]),
                          cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULTS", 1)[1])


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines()


def manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def snapshot(run: Path) -> dict:
    """What must survive a refused command: the metrics lines, the manifest, the checkpoint's bytes."""
    ckpt = run / "checkpoints" / "latest.pt"
    return {"metrics": lines_of(run / "metrics.jsonl"), "manifest": (run / "manifest.json").read_text(),
            "checkpoint": ckpt.read_bytes() if ckpt.exists() else None}


# --- runs shared by the cases ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def warm(work) -> Path:
    """A 2-step SFT run (its checkpoint is the init_from of the RL runs); prints a progress line every step."""
    done = moe_rl(*SFT, "--out-dir", work / "sft", "--total-steps", "2", "--log.print-every", "1")
    assert done.returncode == 0, done.stderr
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("step ")] == ["1/2", "2/2"]
    assert done.stdout.splitlines()[-1].startswith("finished: 2 steps") and str(work / "sft") in done.stdout
    return work / "sft"


@pytest.fixture(scope="module")
def finished(work, warm) -> Path:
    """A finished 2-step RL run, started from a copy of the warm start that is deleted afterwards; a held-out eval
    at every step and at the end. Checks the progress output: one line per rollout step, then the status line."""
    init = work / "init.pt"
    shutil.copy(warm / "checkpoints" / "latest.pt", init)
    done = moe_rl(*TRAIN, "--out-dir", "finished", "--total-steps", "2", "--log.eval-every", "1",
                  "--init-from", init, cwd=work)
    assert done.returncode == 0, done.stderr
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/2", "2/2"]
    for field in ("reward", "eval", "churn", "kl", "s/step", "ETA"):
        assert field in steps[0]
    assert done.stdout.splitlines()[-1].startswith("finished: 2 steps") and "finished" in done.stdout
    init.unlink()  # --resume must not need it
    return work / "finished"


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- item 3 (and 2): every bad input is one named line, exit status 2 -----------------------------------------------


def bad_inputs(work: Path, warm: Path, finished: Path) -> dict[str, tuple[list, str]]:
    """{case: (argv, text the message must contain)}; writes the bad files the cases need."""
    good = torch.load(warm / "checkpoints" / "latest.pt", weights_only=True)
    files = work / "bad"
    files.mkdir()
    (files / "random.pt").write_bytes(os.urandom(4096))
    (files / "text.pt").write_text("not a checkpoint\n")
    raw = (warm / "checkpoints" / "latest.pt").read_bytes()
    (files / "truncated.pt").write_bytes(raw[: len(raw) // 2])
    torch.save([1, 2, 3], files / "list.pt")
    torch.save({"weights": good["model"]}, files / "no_model.pt")
    missing = dict(good["model"])
    missing.pop(next(iter(missing)))
    torch.save({"model": missing}, files / "missing_weight.pt")
    (files / "bad.yaml").write_text("total_steps: 2\nseed: 1: 2\nquiet: true\n")
    (files / "bad.json").write_text('{\n  "total_steps": 2,\n  "seed": 1,,\n}\n')
    (files / "unknown.yaml").write_text("total_stepz: 2\n")
    (files / "a_file").write_text("x")
    corrupt = copy_run(finished, work / "corrupt_resume")
    (corrupt / "checkpoints" / "latest.pt").write_bytes(os.urandom(2048))
    no_model = copy_run(finished, work / "no_model_resume")
    torch.save({"step": 2}, no_model / "checkpoints" / "latest.pt")
    # without the manifest's record of the checkpoint (a run from before it was kept), the loader names what is missing
    (no_model / "manifest.json").write_text(json.dumps({k: v for k, v in manifest(no_model).items()
                                                        if k != "checkpoints"}, indent=2))
    copy_run(finished, work / "below")
    copy_run(finished, work / "again")
    init = ["--total-steps", "1"]
    return {
        "init_from a directory": ([*TRAIN, *init, "--out-dir", work / "i1", "--init-from", warm], "is a directory"),
        "init_from random bytes": ([*TRAIN, *init, "--out-dir", work / "i2", "--init-from", files / "random.pt"],
                                   "random.pt is not a torch checkpoint"),
        "init_from a text file": ([*TRAIN, *init, "--out-dir", work / "i3", "--init-from", files / "text.pt"],
                                  "text.pt is not a torch checkpoint"),
        "init_from truncated": ([*TRAIN, *init, "--out-dir", work / "i4", "--init-from", files / "truncated.pt"],
                                "truncated.pt is not a torch checkpoint"),
        "init_from a non-dict": ([*TRAIN, *init, "--out-dir", work / "i5", "--init-from", files / "list.pt"],
                                 "list.pt is not a moe-rl checkpoint: it holds a list"),
        "init_from without model": ([*TRAIN, *init, "--out-dir", work / "i6", "--init-from", files / "no_model.pt"],
                                    "no_model.pt is not a moe-rl checkpoint: it has no 'model'"),
        "init_from missing a weight": ([*TRAIN, *init, "--out-dir", work / "i7", "--init-from",
                                        files / "missing_weight.pt"], "missing_weight.pt: the checkpoint lacks"),
        "resume a corrupt checkpoint": ([*TRAIN, "--out-dir", corrupt, "--total-steps", "3", "--log.eval-every",
                                         "1", "--resume"], "corrupt_resume/checkpoints/latest.pt is not a torch"),
        "resume a checkpoint without model": ([*TRAIN, "--out-dir", no_model, "--total-steps", "3",
                                               "--log.eval-every", "1", "--resume"], "has no 'model'"),
        "resume below the checkpoint": ([*TRAIN, "--out-dir", work / "below", "--total-steps", "1",
                                         "--log.eval-every", "1", "--resume"], "--total-steps 1 is below"),
        "start where a run is": ([*TRAIN, "--out-dir", work / "again", "--total-steps", "2", "--log.eval-every", "1"],
                                 "pass --resume to continue it"),
        "vocab smaller than the tokenizer": ([*TRAIN, *init, "--out-dir", work / "v", "--model.vocab-size", "20"],
                                             "model.vocab_size=20 is smaller than the tokenizer's vocabulary"),
        "prompt longer than max_seq_len": ([*TRAIN, *init, "--out-dir", work / "m", "--model.max-seq-len", "8"],
                                           "model.max_seq_len=8 is too short"),
        "wandb not installed": ([*TRAIN, *init, "--out-dir", work / "w", "--log.trackers", "wandb"],
                                "pip install 'moe-rl[tracking]'"),
        "sft tensorboard not installed": ([*SFT, "--total-steps", "1", "--out-dir", work / "tb", "--log.trackers",
                                           "tensorboard"],
                                          "error: --log.trackers tensorboard needs the 'tensorboard' package"),
        "config file: bad YAML": ([*TRAIN, f"--config-file={files / 'bad.yaml'}"], "bad.yaml:2: not valid YAML"),
        "config file: bad JSON": ([*TRAIN, "--config-file", files / "bad.json"], "bad.json:3: not valid JSON"),
        "config file: unknown field": ([*SFT, "--config-file", files / "unknown.yaml"],
                                       "unknown.yaml: 'total_stepz' is not a field of SFTConfig"),
        "train --out-dir a file": ([*TRAIN, "--out-dir", files / "a_file"], "a_file is a file, not a directory"),
        "sft --out-dir a file": ([*SFT, "--out-dir", files / "a_file"], "a_file is a file, not a directory"),
        "sft where a run finished": ([*SFT, "--total-steps", "2", "--out-dir", warm], "choose another --out-dir"),
        "report --out a file": (["report", finished, "--out", files / "a_file"], "--out"),
        "sweep --sweep-dir a file": (["sweep", "smoke", "--sweep-dir", files / "a_file", "--dry-run"],
                                     "--sweep-dir"),
        "resume nothing": ([*TRAIN, "--out-dir", work / "never", "--resume"], "nothing to resume"),
    }


def test_bad_inputs_are_one_named_line_and_lose_nothing(work, warm, finished):
    cases = bad_inputs(work, warm, finished)
    runs = {name: work / name for name in ("corrupt_resume", "no_model_resume", "below", "again")}
    before = {name: snapshot(run) for name, run in runs.items()} | {"sft": snapshot(warm)}
    results = run_batch([argv for argv, _ in cases.values()], cwd=work)
    failures = []
    for (case, (_, culprit)), result in zip(cases.items(), results):
        printed = result["out"] + result["err"]
        lines = [line for line in result["err"].splitlines() if line.strip()]
        ok = (result["code"] == 2 and culprit in printed and "Traceback" not in printed and len(lines) == 1
              and "weights_only" not in printed and "--resume" not in (printed if "sft" in case else ""))
        if not ok:
            failures.append(f"{case}: exit {result['code']}: {printed.strip()[-800:]}")
    assert not failures, "\n".join(failures)
    for name, run in runs.items():  # nothing lost, and a refused resume never flips a finished manifest
        assert snapshot(run) == before[name], name
        assert manifest(run)["status"] == "finished"
    assert snapshot(warm) == before["sft"]


def test_runs_stopped_before_a_checkpoint_start_again_and_resume_keeps_every_line(work, finished):
    """--init-from bad left only a lock file: it starts with and without --resume. A finished run's resume with the
    same --total-steps is a no-op; a resume of a renamed directory spelled ./name, whose init_from was deleted,
    continues it."""
    restart = copy_run(finished, work / "restart")
    (restart / "checkpoints" / "latest.pt").unlink()
    (restart / "manifest.json").write_text(json.dumps({**manifest(restart), "status": "failed", "reason": "killed"}))
    noop = copy_run(finished, work / "noop")
    before = snapshot(noop)
    cont = copy_run(finished, work / "cont")
    kept = lines_of(cont / "metrics.jsonl")
    empty = work / "failed_setup"
    empty.mkdir()
    (empty / ".lock").write_text("")
    results = run_batch([
        [*TRAIN, "--out-dir", empty, "--total-steps", "1", "--resume", "--quiet"],
        [*TRAIN, "--out-dir", restart, "--total-steps", "1", "--quiet"],
        [*TRAIN, "--out-dir", "noop", "--total-steps", "2", "--log.eval-every", "1", "--resume"],
        [*TRAIN, "--out-dir", "./cont", "--total-steps", "3", "--log.eval-every", "1", "--resume",
         "--init-from", work / "init.pt"],  # the same command line, but init.pt is gone
    ], cwd=work)
    assert [r["code"] for r in results] == [0, 0, 0, 0], results
    assert "Traceback" not in json.dumps(results)
    assert results[0]["out"] == "" and results[1]["out"] == ""  # --quiet
    assert manifest(empty)["status"] == "finished"
    assert manifest(restart)["status"] == "finished"
    assert manifest(restart)["earlier_attempts"][0]["reason"] == "killed"
    assert "nothing to do" in results[2]["out"] and snapshot(noop) == before  # the final eval line included
    grown = lines_of(cont / "metrics.jsonl")
    assert grown[: len(kept) - 1] == kept[:-1]  # every line up to the checkpoint, byte for byte
    # the old "after training" eval line (step 2) is replaced by step 2's own eval of the same policy
    assert [json.loads(line)["step"] for line in grown[len(kept) - 1 :]] == [2, 2, 3]  # 2 updates, then the eval
    assert [line.split()[1] for line in results[3]["out"].splitlines() if line.startswith("step ")] == ["3/3"]
    resumes = manifest(cont)["resumes"]
    assert set(resumes[-1]["changed"]) == {"total_steps", "out_dir"}  # renamed: allowed, and recorded


# --- item 1: one writer per run directory ---------------------------------------------------------------------------


def test_a_second_writer_is_refused_at_once_and_the_sweep_leaves_a_busy_run_alone(work, finished):
    run = copy_run(finished, work / "busy")
    # the same command the run was made with (its init_from is deleted: a resume does not read it), so that the
    # first writer really runs instead of stopping at a config change
    first = subprocess.Popen([sys.executable, "-m", "moe_rl.cli", *TRAIN, "--out-dir", run, "--total-steps", "200",
                              "--log.eval-every", "1", "--init-from", str(work / "init.pt"), "--resume", "--quiet"],
                             cwd=work, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        # the copied run's .lock still names the process that made it, and the new writer rewrites the record just
        # after it takes the lock: wait for the record, not only for the lock (a loaded CI machine saw the old pid)
        expected = f"pid {first.pid} on {os.uname().nodename}"
        while holder(run) != expected and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert holder(run) == expected, first.poll()
        assert run_action(run) == ("busy", f"in use by pid {first.pid} on {os.uname().nodename}")
        t0 = time.perf_counter()
        second = moe_rl(*TRAIN, "--out-dir", run, "--total-steps", "200", "--log.eval-every", "1", "--init-from",
                        work / "init.pt", "--resume", cwd=work)
        assert second.returncode == 2 and f"in use by another run (pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr and time.perf_counter() - t0 < 60
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert holder(run) is None  # the OS released the lock of the killed process
    assert manifest(run)["status"] in ("finished", "running")  # never failed by the refused second writer
    assert (run / "checkpoints" / "latest.pt").exists()


# --- item 4: divergence ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "sft"])
def test_divergence_is_reported_with_its_step_and_exit_status_3(work, command):
    argv = [*TRAIN, "--total-steps", "2", "--optim.lr", "1e30"] if command == "train" else \
        [*SFT, "--total-steps", "3", "--optim.lr", "1e30"]
    done = moe_rl(*argv, "--out-dir", work / f"nan_{command}", "--quiet", cwd=work)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("diverged at step ") and "non-finite loss" in last and f"nan_{command}" in last
    assert manifest(work / f"nan_{command}")["status"] == "diverged"
    assert not (work / f"nan_{command}" / "checkpoints" / "latest.pt").exists()


# --- sweeps ---------------------------------------------------------------------------------------------------------


def test_a_sweep_names_a_bad_init_from_and_plans_around_a_corrupt_checkpoint(work):
    sweep = work / "sweep"
    args = ["sweep", "smoke", "--sweep-dir", sweep, "--workers", "2", "--set", f"init-from={work / 'nothing.pt'}"]
    done = moe_rl(*args, cwd=work)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr
    assert "ETA" in done.stdout and "[4/4]" in done.stdout
    index = (sweep / "index.csv").read_text().splitlines()
    assert len(index) == 5 and all("init_from" in row and "nothing.pt does not exist" in row for row in index[1:])
    assert all(len(row) < 400 for row in index)  # a short reason, not torch's paragraph

    # one run with a corrupt checkpoint: the plan (and --dry-run) still works, and only that run fails on it
    bad = sweep / "runs" / "obj=grpo,mode=native"
    assert not bad.exists()  # the refused --init-from left no directory holding only .lock
    (bad / "checkpoints").mkdir(parents=True)
    (bad / "checkpoints" / "latest.pt").write_bytes(b"garbage")
    (bad / "manifest.json").write_text(json.dumps({"status": "failed", "reason": "killed"}))
    dry = moe_rl(*args, "--dry-run", cwd=work)
    assert dry.returncode == 0, dry.stderr
    tally = next(line for line in dry.stdout.splitlines() if "runs (4):" in line)
    assert "1 resume" in tally and "3 start" in tally and "latest.pt is not a torch checkpoint" in dry.stdout
    job = subprocess.run([sys.executable, "-m", "moe_rl.sweep.jobs", sweep, "run", bad.name], cwd=work, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 1 and "Traceback" not in job.stderr and "is not a torch checkpoint" in job.stderr
    row = next(r for r in (sweep / "index.csv").read_text().splitlines() if r.startswith(f'"{bad.name}"')
               or r.startswith(bad.name))
    assert "failed" in row and "is not a torch checkpoint" in row


# --- item 6: configs as the field expects (in-process: no process start needed) ------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_file_yaml_or_json_and_flags_override_it(tmp_path, suffix):
    import tyro

    from moe_rl.cli import _config_file
    from moe_rl.rl.run_config import TrainConfig

    path = tmp_path / f"cfg{suffix}"
    path.write_text("total_steps: 7\noptim:\n  lr: 0.01\nrouting_mode: R2\n" if suffix == ".yaml" else
                    json.dumps({"total_steps": 7, "optim": {"lr": 0.01}, "routing_mode": "R2"}))
    for spelling in ([f"--config-file={path}"], ["--config-file", str(path)]):
        rest, defaults = _config_file(TrainConfig, ["--seed", "3", *spelling, "--total-steps", "9"])
        cfg = tyro.cli(TrainConfig, args=rest, default=defaults)
        assert (cfg.total_steps, cfg.optim.lr, cfg.routing_mode, cfg.seed) == (9, 0.01, "R2", 3)


def test_choice_fields_list_their_choices_and_sweep_set_takes_flag_spellings():
    import typing

    from moe_rl.objectives import objective_names
    from moe_rl.objectives.config import ObjectiveName
    from moe_rl.rl.overrides import parse_assignments

    assert sorted(typing.get_args(ObjectiveName)) == objective_names()
    assert parse_assignments(["--optim.warmup-steps=5", "total-steps=3", "seed=1"]) == \
        {"optim.warmup_steps": "5", "total_steps": "3", "seed": "1"}


def test_wandb_gets_project_entity_group_and_keeps_the_run_id(monkeypatch, tmp_path):
    import types

    from moe_rl.runs.trackers import make_trackers

    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or types.SimpleNamespace(log=None, finish=None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    make_trackers(["wandb"], tmp_path / "run", wandb={"project": "p", "entity": "e", "group": "g"}, run_id="abc")
    assert {k: calls[0][k] for k in ("project", "entity", "group", "id", "resume", "name")} == \
        {"project": "p", "entity": "e", "group": "g", "id": "abc", "resume": "allow", "name": "run"}


def test_a_run_without_out_dir_gets_a_fresh_name(tmp_path):
    from moe_rl.runs.claim import fresh_run_name

    first = fresh_run_name(str(tmp_path), "grpo-native")
    Path(first).mkdir()
    second = fresh_run_name(str(tmp_path), "grpo-native")
    assert first != second and Path(second).name.startswith(Path(first).name)
