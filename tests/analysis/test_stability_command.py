"""`moe-rl stability` (tyro, like every moe-rl command) does what `python -m moe_rl.analysis.stability` did, which
stays as its alias: the committed staleness map is remade from its two sittings' folded rows, and bad input is one
line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moe_rl.analysis.sittings import sitting_table
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
    sittings = [f"{STABILITY}@staleness_1", f"{STABILITY}@staleness_2"]  # rows of results/stability/tables/*.parquet
    assert main(["stability", "--pool", *sittings, "--out", str(tmp_path / "map")]) == 0
    assert "moe-rl stability: 90 runs from 2 report folder(s)" in capsys.readouterr().out
    for table in ("stability_cells", "critical", "paired_cells"):
        committed = sitting_table(STABILITY, table, "staleness")
        again = pd.read_csv(tmp_path / "map" / "tables" / f"{table}.csv")
        assert len(again) == len(committed) > 0, table
        numbers = [c for c in committed.columns if pd.api.types.is_float_dtype(committed[c]) and c in again]
        np.testing.assert_allclose(again[numbers].to_numpy(float), committed[numbers].to_numpy(float), rtol=1e-9,
                                   equal_nan=True, err_msg=table)
    alias = subprocess.run([sys.executable, "-m", "moe_rl.analysis.stability", "--out", str(tmp_path / "x")],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert alias.returncode == 2 and alias.stderr.strip() == (
        "moe-rl stability: error: give a sweep directory (RUNS), report folders to pool (--pool), or both")
