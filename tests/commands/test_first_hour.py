"""README "First hour", run as written: its commands, from an empty folder, with the `.venv/bin/moe-rl` this test's
Python belongs to (a fresh clone's `.venv` after `make test`). A change to the README block is tested as it stands.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def first_hour_commands() -> list[list[str]]:
    """The lines of the first ```bash block under "## First hour", continuation lines joined."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## First hour\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_first_hour_block_is_what_a_new_user_types():
    commands = first_hour_commands()
    assert [c[0] for c in commands] == [".venv/bin/moe-rl"] * 4
    assert [c[1] for c in commands] == ["sft", "train", "train", "report"]
    assert "--out" not in commands[-1]  # the report's default folder is the one the README names


@pytest.mark.slow
def test_the_readme_first_hour_runs_end_to_end(tmp_path):
    executable = Path(sys.executable).parent / "moe-rl"  # the venv's entry point
    assert executable.is_file(), f"{executable}: the package is not installed in this environment (make test)"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::SyntaxWarning"}
    outputs = []
    for command in first_hour_commands():
        done = subprocess.run([str(executable), *command[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{shlex.join(command)}:\n{done.stderr[-2000:]}"
        assert "Traceback" not in done.stderr
        outputs.append(done.stdout)
    run = tmp_path / "runs" / "first" / "grpo"
    assert outputs[0].splitlines()[-1].startswith("finished: 40 steps")
    assert [line.split()[1] for line in outputs[1].splitlines() if line.startswith("step ")] == ["1/2", "2/2"]
    assert "eval " in outputs[1] and outputs[2].splitlines()[-1].startswith("finished: 1 steps")
    steps = {json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()}
    assert steps == {0, 1, 2, 3}  # 3 rollout steps, then the evaluation after the last (step = total_steps)
    assert (run / "report" / "README.md").is_file() and not (tmp_path / "results").exists()
    assert json.loads((run / "manifest.json").read_text())["status"] == "finished"
