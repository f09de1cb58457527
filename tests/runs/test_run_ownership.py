"""A run owns its directory, and a resume continues the experiment it started (issue 50, items 1, 3, 4, 7, 12):
`--out-dir ''` and folders of the user's files are refused before a byte is written; a hand edit of config.json
does not change the resumed experiment (the manifest records the config it ran with); a copied run resumes in its
new place and the printed resume command is absolute and quoted; the saved config never says `"resume": true`;
another run's checkpoint is blamed, not metrics.jsonl; an sft directory is named as one.

Each refusal is one line naming the field or file, exit status 2, and leaves the directory byte for byte as it was.
The runs go through `moe_rl.cli.main` in this process (the command's own path, no process start).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from conftest import cli
from test_resume_guard import TINY, TRAIN, assert_refused, files

SFT = ["sft", *TINY, "--batch-size", "8", "--log.eval-prompts", "4", "--sampling.max-new-tokens", "4", "--quiet"]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A finished 2-step run with a checkpoint at each step."""
    run = tmp_path_factory.mktemp("own") / "run"
    code, _, err = cli(*TRAIN, "--out-dir", run, "--total-steps", "2")
    assert code == 0, err
    return run


def copy(made: Path, name: str) -> Path:
    return Path(shutil.copytree(made, made.parent / name))


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every entry under `folder` (the lock included) and the bytes of its files."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("command", [TRAIN, SFT])
def test_an_empty_out_dir_is_refused_and_nothing_is_written_into_the_working_directory(tmp_path, monkeypatch,
                                                                                        command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine\n")
    before = tree(tmp_path)
    code, _, err = cli(*command, "--out-dir", "")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "out_dir='' is empty" in err, err
    assert tree(tmp_path) == before


@pytest.mark.parametrize("command", [TRAIN, SFT])
def test_a_folder_of_the_users_files_is_refused_before_a_byte_is_written(tmp_path, command):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text('{"my": "own config"}\n')
    (folder / "metrics.jsonl").write_text('{"my": 1}\n')
    before = tree(folder)
    code, _, err = cli(*command, "--out-dir", folder, "--total-steps", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--out-dir {folder} is not empty and is not a moe-rl run" in err and "config.json, metrics.jsonl" in err
    assert tree(folder) == before  # not even a lock file


def test_the_working_directory_itself_is_refused_when_it_holds_anything(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "paper.tex").write_text("\\documentclass{article}\n")
    before = tree(tmp_path)
    code, _, err = cli(*TRAIN, "--out-dir", ".", "--total-steps", "1")
    assert code == 2 and "is not empty and is not a moe-rl run (it holds paper.tex" in err, err
    assert tree(tmp_path) == before


@pytest.mark.parametrize("field, saved, edited", [("routing_mode", '"native"', '"R3"'),
                                                  ("lr", "0.0003", "0.001")])
def test_a_hand_edited_config_json_is_refused_on_resume_naming_the_field(made, field, saved, edited):
    run = copy(made, f"edited_{field}")
    text = (run / "config.json").read_text()
    if field == "lr":  # the tiny runs' lr is the default, 5e-05
        saved = "5e-05"
    assert f'"{field}": {saved}' in text
    (run / "config.json").write_text(text.replace(f'"{field}": {saved}', f'"{field}": {edited}'))
    before = files(run)
    named = "optim.lr" if field == "lr" else field
    assert_refused(cli("train", "--config-file", run / "config.json", "--resume", "--total-steps", "3"), run, before,
                   f"differs from the one it ran with (manifest.json) in {named}", "--init-from")


def test_a_resume_may_change_the_step_budget_cadence_and_quiet(made):
    run = copy(made, "allowed")
    code, _, err = cli("train", "--config-file", run / "config.json", "--resume", "--total-steps", "3",
                       "--checkpoint-every", "5", "--keep-every", "3", "--log.samples-every", "2")
    assert code == 0, err
    changed = json.loads((run / "manifest.json").read_text())["resumes"][-1]["changed"]
    assert set(changed) == {"total_steps", "checkpoint_every", "keep_every", "log.samples_every", "out_dir"}  # a copy


def test_a_copied_run_resumes_in_its_new_place_and_leaves_the_original_alone(made):
    original = copy(made, "original")
    moved = copy(original, "moved")
    before = tree(original)
    code, _, err = cli("train", "--config-file", moved / "config.json", "--resume", "--total-steps", "3")
    assert code == 0, err
    assert tree(original) == before
    assert [json.loads(line)["step"] for line in (moved / "metrics.jsonl").read_text().splitlines()][-1] == 2
    assert json.loads((moved / "config.json").read_text())["out_dir"] == str(moved)
    assert json.loads((moved / "manifest.json").read_text())["status"] == "finished"


def test_the_printed_resume_command_is_absolute_and_quoted(tmp_path, monkeypatch):
    """A relative --out-dir with a space: the line an interrupted run prints works from any directory."""
    import moe_rl.rl.trainer

    rl_step = moe_rl.rl.trainer.Trainer.rl_step

    def step_then_ctrl_c(self, write):
        rl_step(self, write)
        if self.step == 0:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(moe_rl.rl.trainer.Trainer, "rl_step", step_then_ctrl_c)
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(*TRAIN, "--out-dir", "my runs/a", "--total-steps", "3")
    run = tmp_path / "my runs" / "a"
    line = f"interrupted at step 1; resume with: moe-rl train --config-file '{run / 'config.json'}' --resume"
    assert code == 130 and err.splitlines() == [line], err
    assert json.loads((run / "config.json").read_text())["out_dir"] == str(run)
    monkeypatch.undo()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chdir(elsewhere)
    try:
        code, _, err = cli("train", "--config-file", run / "config.json", "--resume")
    finally:
        os.chdir(tmp_path)
    assert code == 0, err
    assert list(elsewhere.iterdir()) == []


def test_a_resumed_runs_config_starts_a_new_run(made, tmp_path):
    """The README's pattern: a new run from a run's config.json, after that run was resumed."""
    run = copy(made, "resumed")
    code, _, err = cli("train", "--config-file", run / "config.json", "--resume", "--total-steps", "3")
    assert code == 0, err
    config = json.loads((run / "config.json").read_text())
    assert config["resume"] is False and config["resume_from"] is None and config["total_steps"] == 3
    code, _, err = cli("train", "--config-file", run / "config.json", "--out-dir", tmp_path / "new", "--total-steps",
                       "1")
    assert code == 0, err
    assert json.loads((tmp_path / "new" / "manifest.json").read_text())["status"] == "finished"


def test_another_runs_checkpoint_at_a_later_step_is_blamed_not_the_metrics(made, tmp_path):
    other = tmp_path / "other"
    code, _, err = cli(*TRAIN, "--out-dir", other, "--total-steps", "4", "--seed", "1")
    assert code == 0, err
    run = copy(made, "foreign_later")
    shutil.copy(other / "checkpoints" / "latest.pt", run / "checkpoints" / "latest.pt")
    before = files(run)
    code, out, err = cli(*TRAIN, "--out-dir", run, "--total-steps", "6", "--resume")
    assert_refused((code, out, err), run, before, "latest.pt is at step 4, but the run saved checkpoints up to "
                   "step 2", "it is not this run's checkpoint")


def test_train_on_an_sft_directory_names_it_as_an_sft_run(tmp_path):
    sft = tmp_path / "sft"
    code, _, err = cli(*SFT, "--out-dir", sft, "--total-steps", "2")
    assert code == 0, err
    before = files(sft)
    for extra in (["--resume"], []):
        assert_refused(cli(*TRAIN, "--out-dir", sft, "--total-steps", "3", *extra), sft, before,
                       "holds a moe-rl sft run, not a train run", f"--init-from {sft / 'checkpoints' / 'latest.pt'}")
    run = tmp_path / "rl"
    code, _, err = cli(*TRAIN, "--out-dir", run, "--total-steps", "1")
    assert code == 0, err
    before = files(run)
    assert_refused(cli(*SFT, "--out-dir", run, "--total-steps", "2"), run, before,
                   "holds a moe-rl train run, not a sft run")
