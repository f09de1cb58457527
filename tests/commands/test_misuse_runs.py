"""Run directories, config files, sweeps and report folders misused the way a user would (issue 50, the cases
nobody listed): each is one line on stderr naming the path or flag and what is allowed, exit status 2, and nothing
written. Through `moe_rl.cli.main` in this process (the command's own path, no process start)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import cli, refused

import moe_rl.sweep.command
from moe_rl.cli import main

TINY = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "4", "--model.n-kv-heads", "2",
        "--model.n-experts", "4", "--model.top-k", "2", "--model.d-expert", "32", "--model.d-dense", "64"]
TRAIN = ["train", *TINY, "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", "--minibatches", "2",
         "--rollout.sampling.max-new-tokens", "4", "--checkpoint-every", "1", "--quiet"]


def tree(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("misuse") / "run"
    code, _, err = cli(*TRAIN, "--out-dir", run, "--total-steps", "1")
    assert code == 0, err
    return run


def test_a_dangling_symlink_as_out_dir_is_named(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    before = tree(tmp_path)
    refused(cli(*TRAIN, "--out-dir", tmp_path / "link", "--total-steps", "1"),
            f"--out-dir {tmp_path / 'link'} is a symbolic link to {tmp_path / 'nowhere'}, which does not exist")
    assert tree(tmp_path) == before


def test_a_tilde_the_shell_left_after_an_equals_sign_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(*TRAIN, "--out-dir=~/runs/a", "--total-steps", "1")
    assert code == 0, err
    assert (tmp_path / "home" / "runs" / "a" / "manifest.json").is_file() and not (tmp_path / "~").exists()


def test_a_run_inside_another_runs_directory_is_refused(made):
    before = tree(made)
    refused(cli(*TRAIN, "--out-dir", made / "sub", "--total-steps", "1"), f"is inside the run {made}")
    assert tree(made) == before


def test_a_manifest_given_as_the_config_file_is_named(made):
    refused(cli("train", "--config-file", made / "manifest.json"), "is a run's manifest.json, not a config",
            "config.json beside it")


def test_a_config_file_given_twice_is_named(made):
    refused(cli("train", "--config-file", made / "config.json", "--config-file", made / "config.json"),
            "--config-file is given twice")


def test_a_run_whose_manifest_was_deleted_is_named_as_such(made):
    run = Path(shutil.copytree(made, made.parent / "no_manifest"))
    (run / "manifest.json").unlink()
    before = tree(run)
    refused(cli(*TRAIN, "--out-dir", run, "--total-steps", "2", "--resume"), "manifest.json is gone",
            "restore manifest.json", "--init-from")
    assert tree(run) == before


def test_a_sweeps_folder_as_a_run_directory_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / "runs").mkdir(parents=True)
    (sweep / "sweep.json").write_text("{}")
    before = tree(sweep)
    refused(cli(*TRAIN, "--out-dir", sweep, "--total-steps", "1"), "is not empty and is not a moe-rl run",
            "runs, sweep.json")
    assert tree(sweep) == before


def test_an_empty_sweep_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(cli("sweep", "smoke", "--sweep-dir", "", "--dry-run"), "--sweep-dir is empty")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["run", "inside"])
def test_a_sweep_dir_that_is_or_is_inside_a_run_is_refused(made, where):
    before = tree(made)
    sweep_dir = made if where == "run" else made / "sweep"
    refused(cli("sweep", "smoke", "--sweep-dir", sweep_dir), f"--sweep-dir {sweep_dir} is",
            f"the run {made}" if where == "inside" else f"a run {made}")
    assert tree(made) == before


def test_a_sweep_dir_of_the_users_files_is_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("mine\n")
    refused(cli("sweep", "smoke", "--sweep-dir", tmp_path / "mine", "--dry-run"), "is not empty and holds no "
            "sweep.json (it holds notes.md)")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.md"]


def test_a_sweep_dir_seeded_with_another_sweeps_finished_warm_start_uses_it_and_a_users_file_is_still_refused(
        tmp_path):
    """One SFT for several sweeps: a folder holding only warmstart/ (copied from a sweep of the same model and task)
    is accepted and its finished warm start is used, not trained again; a file of the user's beside it is refused."""
    code, _, err = cli("sweep", "smoke", "--sweep-dir", tmp_path / "first", "--only", "objective.name=grpo",
                       "routing_mode=native")
    assert code == 0, err
    (key,) = [p.name for p in (tmp_path / "first" / "warmstart").iterdir()]
    shutil.copytree(tmp_path / "first" / "warmstart", tmp_path / "second" / "warmstart")
    code, out, err = cli("sweep", "smoke", "--sweep-dir", tmp_path / "second", "--dry-run")
    assert code == 0, err
    assert f"done     {key}" in out
    (tmp_path / "second" / "notes.md").write_text("mine\n")
    refused(cli("sweep", "smoke", "--sweep-dir", tmp_path / "second", "--dry-run"), "(it holds notes.md)")


def test_an_interrupted_sweep_prints_a_command_that_works_with_a_space_in_its_folder(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(moe_rl.sweep.command, "run_local", interrupted)
    sweep_dir = tmp_path / "my sweeps" / "s"
    err = io.StringIO()
    with pytest.raises(SystemExit) as stop, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        main(["sweep", "smoke", "--sweep-dir", str(sweep_dir)])
    assert stop.value.code == 130
    assert f"--sweep-dir '{sweep_dir}'" in err.getvalue(), err.getvalue()


def test_an_empty_report_out_is_refused_and_nothing_is_written(made, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(cli("report", made, "--out", ""), "--out is empty")
    assert list(tmp_path.iterdir()) == []


def test_a_relative_config_file_of_a_moved_run_resumes_from_any_directory(made, tmp_path):
    """The copy's own folder, not the out_dir written in its config.json, whatever the working directory."""
    run = Path(shutil.copytree(made, tmp_path / "copy"))
    original = tree(made)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code, _, err = cli("train", "--config-file", "copy/config.json", "--resume", "--total-steps", "2")
    finally:
        os.chdir(cwd)
    assert code == 0, err
    assert tree(made) == original
    assert json.loads((run / "manifest.json").read_text())["resumes"][-1]["from"]["step"] == 1
