"""Resume that verifies what it continues (issue 25): lost or shortened metrics, a task file replaced under the same
path, a deleted latest.pt beside kept checkpoints, unreadable config.json / manifest.json, a foreign checkpoint, and
--resume-from. Each refusal is one line naming the file and what to do, exit status 2, and leaves every byte of the
run directory as it was.

The runs go through `moe_rl.cli.main` in this process (the command's own path, no process start): a tiny model,
about a second per run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import cli

TINY = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "4", "--model.n-kv-heads", "2",
        "--model.n-experts", "4", "--model.top-k", "2", "--model.d-expert", "32", "--model.d-dense", "64"]
TRAIN = ["train", *TINY, "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", "--minibatches", "2",
         "--rollout.sampling.max-new-tokens", "4", "--keep-every", "2", "--checkpoint-every", "1", "--quiet"]


def files(run: Path) -> dict[str, bytes]:
    """Every file of a run directory (but its lock) and its bytes."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
            and p.name != ".lock"}


def problems(path: Path, op: str) -> Path:
    with path.open("w") as file:
        for a in range(10):
            for b in range(10):
                file.write(json.dumps({"prompt": f"{a}{op}{b}=", "answer": str(eval(f"{a}{op}{b}"))}) + "\n")
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A finished 4-step run on a task file (task.jsonl: a+b), checkpoints at every step, step 2 and 4 kept."""
    work = tmp_path_factory.mktemp("guard")
    problems(work / "add.jsonl", "+")
    problems(work / "mul.jsonl", "*")
    shutil.copy(work / "add.jsonl", work / "task.jsonl")
    code, _, err = cli(*TRAIN, "--out-dir", work / "run", "--total-steps", "4", *task(work))
    assert code == 0, err
    return work / "run"


def task(work: Path) -> list:
    return ["--task.source", "file", "--task.path", work / "task.jsonl"]


def resume(run: Path, *extra, steps: int = 6) -> tuple[int, str, str]:
    return cli(*TRAIN, "--out-dir", run, "--total-steps", steps, *task(run.parent), *extra)


def copy(made: Path, name: str) -> Path:
    return Path(shutil.copytree(made, made.parent / name))


def assert_refused(result, run: Path, before: dict, *named: str) -> None:
    code, out, err = result
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err + out, err
    for text in named:
        assert text in lines[0], lines[0]
    assert files(run) == before  # config.json and manifest.json byte-identical, every checkpoint kept


def test_the_manifest_records_the_task_data_the_metrics_and_every_checkpoint(made):
    from moe_rl.runs.digest import file_sha256, metrics_digest

    manifest = json.loads((made / "manifest.json").read_text())
    assert manifest["inputs"] == {"task.path": {"what": f"task.path {made.parent / 'task.jsonl'}",
                                                "sha256": file_sha256(made.parent / "add.jsonl")}}
    records = manifest["checkpoints"]
    assert sorted(records) == ["latest.pt", "step_000002.pt", "step_000004.pt"]
    assert records["latest.pt"] == records["step_000004.pt"]
    assert records["step_000002.pt"]["sha256"] == file_sha256(made / "checkpoints" / "step_000002.pt")
    assert records["step_000002.pt"]["metrics"] == metrics_digest(made, 2)
    assert (records["step_000002.pt"]["metrics"]["lines"], records["latest.pt"]["metrics"]["lines"]) == (4, 8)


def test_a_resume_without_metrics_is_refused(made):
    run = copy(made, "no_metrics")
    (run / "metrics.jsonl").unlink()
    before = files(run)
    assert_refused(resume(run, "--resume"), run, before, "metrics.jsonl is missing", "checkpoint is at step 4",
                   "--init-from")


def test_a_resume_with_metrics_shorter_than_the_checkpoint_is_refused(made):
    run = copy(made, "short_metrics")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:3]))
    before = files(run)
    assert_refused(resume(run, "--resume"), run, before, "metrics.jsonl holds steps up to 1",
                   "checkpoint is at step 4")


def test_a_resume_with_edited_metrics_is_refused(made):
    run = copy(made, "edited_metrics")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    first = json.loads(lines[0])
    lines[0] = json.dumps({**first, "reward": 0.999}) + "\n"
    (run / "metrics.jsonl").write_text("".join(lines))
    before = files(run)
    assert_refused(resume(run, "--resume"), run, before, "lines of steps 0-3 changed since the checkpoint")


def test_a_task_file_replaced_under_the_same_path_is_refused_and_the_original_resumes(made):
    run = copy(made, "task_changed")
    shutil.copy(made.parent / "mul.jsonl", made.parent / "task.jsonl")
    before = files(run)
    try:
        assert_refused(resume(run, "--resume"), run, before, f"task.path {made.parent / 'task.jsonl'} changed since "
                       "the run started", "would train on other data", "--init-from")
    finally:
        shutil.copy(made.parent / "add.jsonl", made.parent / "task.jsonl")
    code, _, err = resume(run, "--resume")
    assert code == 0, err
    assert json.loads((run / "manifest.json").read_text())["status"] == "finished"


def test_latest_deleted_beside_kept_checkpoints_is_refused_then_resume_from_continues(made):
    run = copy(made, "no_latest")
    (run / "checkpoints" / "latest.pt").unlink()
    before = files(run)
    newest = run / "checkpoints" / "step_000004.pt"
    for extra in (["--resume"], []):  # without --resume it used to start over, deleting both kept checkpoints
        assert_refused(resume(run, *extra), run, before, "latest.pt is gone but step_000002.pt, step_000004.pt "
                       "remain", f"--resume-from {newest}")
    older = run / "checkpoints" / "step_000002.pt"
    assert_refused(resume(run, "--resume-from", older), run, before, "holds newer checkpoints (step_000004.pt)")
    assert_refused(resume(run, "--resume-from", made / "checkpoints" / "step_000004.pt"), run, before,
                   f"is not in {run / 'checkpoints'}", "--init-from")

    kept = {name: before[name] for name in ("checkpoints/step_000002.pt", "checkpoints/step_000004.pt")}
    metrics = (run / "metrics.jsonl").read_text().splitlines()
    code, _, err = cli(*TRAIN, "--total-steps", 6, *task(made.parent), "--resume-from", newest)  # out_dir: its run
    assert code == 0, err
    after = files(run)
    assert {name: after[name] for name in kept} == kept
    assert (run / "metrics.jsonl").read_text().splitlines()[: len(metrics)] == metrics
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == \
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    manifest = json.loads(after["manifest.json"])
    assert manifest["status"] == "finished"
    assert manifest["resumes"][-1]["from"] == {"checkpoint": "step_000004.pt", "step": 4}
    assert sorted(manifest["checkpoints"]) == ["latest.pt", "step_000002.pt", "step_000004.pt", "step_000006.pt"]


@pytest.mark.parametrize("name, damage, named", [
    ("manifest.json", lambda text: text[: len(text) // 2], "manifest.json:"),
    ("manifest.json", lambda text: "[]\n", "manifest.json holds a JSON list"),
    ("config.json", lambda text: text[: len(text) // 2], "config.json:"),
    ("config.json", lambda text: "[]\n", "config.json holds a JSON list"),
])
def test_a_resume_with_an_unreadable_config_or_manifest_names_it_and_changes_nothing(made, name, damage, named):
    run = copy(made, f"broken_{name}_{len(list(made.parent.iterdir()))}")
    (run / name).write_text(damage((run / name).read_text()))
    before = files(run)
    assert_refused(resume(run, "--resume"), run, before, named, "restore it")


def test_a_foreign_checkpoint_under_the_runs_name_is_refused(made, tmp_path):
    other = tmp_path / "other"
    code, _, err = cli(*TRAIN, "--out-dir", other, "--total-steps", "4", "--seed", "1", *task(made.parent))
    assert code == 0, err
    run = copy(made, "foreign")
    shutil.copy(other / "checkpoints" / "latest.pt", run / "checkpoints" / "latest.pt")
    before = files(run)
    assert_refused(resume(run, "--resume"), run, before, "is not the checkpoint this run saved at step 4")


def test_a_refused_init_from_leaves_no_directory(tmp_path):
    code, _, err = cli(*TRAIN, "--out-dir", tmp_path / "new", "--total-steps", "1", "--init-from",
                       tmp_path / "nothing.pt")
    assert code == 2 and "nothing.pt does not exist" in err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()  # a directory the user made is left, empty as it was
    code, _, _ = cli(*TRAIN, "--out-dir", tmp_path / "kept", "--total-steps", "1", "--init-from",
                     tmp_path / "nothing.pt")
    assert code == 2 and [p.name for p in tmp_path.iterdir()] == ["kept"]
    assert [p.name for p in (tmp_path / "kept").iterdir()] in ([], [".lock"])


def test_a_generated_task_is_hashed_by_its_problems():
    from moe_rl.tasks import TaskConfig, build_task
    from moe_rl.tasks.digest import task_digest

    def digest(**kw):
        cfg = TaskConfig(**kw)
        return task_digest(cfg, build_task(cfg))["task"]["sha256"]

    assert digest() == digest()
    assert digest(seed=1) != digest()
    assert digest(max_terms=4) != digest()


def test_latest_replaced_by_an_older_checkpoint_is_refused_and_a_rollback_resumes(made):
    run = copy(made, "older_latest")
    shutil.copy(run / "checkpoints" / "step_000002.pt", run / "checkpoints" / "latest.pt")
    before = files(run)
    assert_refused(resume(run, "--resume"), run, before, "latest.pt is at step 2 but step_000004.pt is newer",
                   "--resume-from")
    (run / "checkpoints" / "step_000004.pt").unlink()
    before = files(run)
    assert_refused(resume(run, "--resume"), run, before, "latest.pt is at step 2, but the run saved step 4 last")

    # a rollback on purpose: the newer checkpoint moved away, then --resume-from the older one
    (run / "checkpoints" / "latest.pt").unlink()
    code, _, err = resume(run, "--resume-from", run / "checkpoints" / "step_000002.pt", steps=3)
    assert code == 0, err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == \
        [0, 0, 1, 1, 2, 2]
    assert {r["step"] for r in json.loads((run / "manifest.json").read_text())["checkpoints"].values()} == {2, 3}
    code, _, err = resume(run, "--resume", steps=4)  # the rolled-back run resumes as usual
    assert code == 0, err
