"""A sweep directory that was moved or copied resumes where it now is; a sweep whose jobs fail exits non-zero and
index.csv carries each job's reason in one line (issue 50, item 5)."""

import json
import shutil

import pytest
from test_sweep import experiment

from moe_rl.sweep.command import plan_sweep, sweep_command
from moe_rl.sweep.config import SweepConfig
from moe_rl.sweep.jobs import run_local
from moe_rl.sweep.sweepdir import read_index


def interrupted(run_dir) -> None:
    """Make a finished run look as if SIGINT had stopped it after its last checkpoint (a resume continues it)."""
    path = run_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    step = manifest["checkpoints"]["latest.pt"]["step"]
    manifest.update(status="interrupted", reason=f"SIGINT at step {step}",
                    interrupted={"signal": "SIGINT", "at_step": step, "resumes_from_step": step})
    path.write_text(json.dumps(manifest, indent=2) + "\n")


@pytest.mark.slow
def test_a_moved_sweep_resumes_and_a_failing_resume_exits_non_zero_with_its_reason(tmp_path, capsys):
    tiny = experiment([{"seed": 0}, {"seed": 1}], warm=True)
    plan = plan_sweep(tiny, tmp_path / "s")
    assert run_local(plan, echo=lambda line: None)["status"].tolist() == ["finished", "finished"]
    names = [run.name for run in plan.runs]
    for name in names:
        interrupted(tmp_path / "s" / "runs" / name)
    moved = tmp_path / "moved sweep"
    shutil.move(tmp_path / "s", moved)  # the warm start's path in every run's config changed with it
    (moved / "runs" / names[1] / "metrics.jsonl").unlink()  # this one cannot resume

    with pytest.raises(SystemExit) as stop:
        sweep_command(SweepConfig(experiment="tiny", sweep_dir=str(moved)), experiments={"tiny": tiny})
    assert stop.value.code == 1
    index = read_index(moved)
    assert index["status"].tolist() == ["finished", "failed"], index.to_dict("records")
    assert "metrics.jsonl is missing" in index["reason"][1] and "\n" not in index["reason"][1]
    assert index["run_dir"].tolist() == [f"runs/{name}" for name in names]
    manifest = json.loads((moved / "runs" / names[0] / "manifest.json").read_text())
    assert manifest["status"] == "finished" and len(manifest["resumes"]) == 1
    assert not (tmp_path / "s").exists()  # nothing was written where the sweep used to be
