"""The tree is clean under ruff with the project's configuration (pyproject.toml, [tool.ruff]): import order,
pyflakes, pycodestyle (120 columns), bugbear and pyupgrade, so that a newcomer's editor and CI agree."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


NO_RUFF = importlib.util.find_spec("ruff") is None


@pytest.mark.skipif(NO_RUFF, reason="ruff is in the dev extra: pip install -e '.[dev]'")
def test_ruff_finds_nothing_in_the_tree():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ruff check . found:\n{done.stdout}{done.stderr}"
