"""`moe-rl stability` (tyro, like every moe-rl command) does what `python -m moe_rl.analysis.stability` did, which
stays as its alias: the committed staleness map is remade from its two sittings' report folders byte for byte, and
bad input is one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.cli import main

REPO = Path(__file__).resolve().parents[2]
STABILITY = REPO / "results" / "stability"


@pytest.mark.parametrize(("argv", "message"), [
    (["--out", "x"], "give a sweep directory (RUNS), report folders to pool (--pool), or both"),
    (["--pool", "a", "--out", "x", "--baseline", "b"], "--baseline belongs to the generic report of RUNS"),
    (["runs", "--out", "x", "--confirm-seeds", "1,a"], "confirm_seeds='1,a': give comma-separated seeds"),
    (["runs"], "--out is required"),
])
def test_bad_input_is_one_line(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["stability", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_the_committed_staleness_map_is_remade_from_its_sittings(tmp_path, capsys):
    sittings = [str(STABILITY / "staleness_1"), str(STABILITY / "staleness_2")]
    assert main(["stability", "--pool", *sittings, "--out", str(tmp_path / "map")]) == 0
    assert "moe-rl stability: 90 runs from 2 report folder(s)" in capsys.readouterr().out
    committed = sorted((STABILITY / "staleness" / "tables").glob("*.csv"))
    assert len(committed) == 5
    for table in committed:
        assert (tmp_path / "map" / "tables" / table.name).read_bytes() == table.read_bytes(), table.name
    alias = subprocess.run([sys.executable, "-m", "moe_rl.analysis.stability", "--out", str(tmp_path / "x")],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert alias.returncode == 2 and alias.stderr.strip() == (
        "moe-rl stability: error: give a sweep directory (RUNS), report folders to pool (--pool), or both")
