"""analysis/sittings.py: a study's sittings folded into one Parquet per table give each sitting's CSV back exactly,
and pool like the report folders they replace."""

from __future__ import annotations

import pandas as pd
import pytest

from moe_rl.analysis.sittings import fold_sittings, sitting_table, sittings, source_name
from moe_rl.errors import DataError


def _csv(folder, name: str, frame: pd.DataFrame):
    folder.mkdir(parents=True, exist_ok=True)
    frame.to_csv(folder / f"{name}.csv", index=False)


def test_each_sitting_comes_back_with_its_own_columns_values_and_dtypes(tmp_path):
    # n_runs is whole in one sitting and fractional in the other: the first must come back as int, not 3.0.
    first = pd.DataFrame({"run": ["a", "b"], "n_runs": [3, 4], "lr": [1e-4, 2.5e-5], "learns": [True, False]})
    second = pd.DataFrame({"run": ["c"], "n_runs": [2.5], "extra": ["x|y"], "lr": [0.1 + 0.2]})
    _csv(tmp_path / "one", "learning", first)
    _csv(tmp_path / "two", "learning", second)
    fold_sittings({"one": tmp_path / "one", "two": tmp_path / "two"}, tmp_path / "study" / "tables")
    assert sittings(tmp_path / "study", "learning") == ["one", "two"]
    for name in ("one", "two"):
        pd.testing.assert_frame_equal(sitting_table(tmp_path / "study", "learning", name),
                                      pd.read_csv(tmp_path / name / "learning.csv"), check_exact=True)
    stored = pd.read_parquet(tmp_path / "study" / "tables" / "learning.parquet")
    assert list(stored["sitting"]) == ["one", "one", "two"] and stored["lr"].dtype == "float64"
    with pytest.raises(DataError, match="sitting 'three' has no learning table; sittings with one: one, two"):
        sitting_table(tmp_path / "study", "learning", "three")


def test_a_sitting_pools_like_the_report_folder_it_replaces(tmp_path):
    from moe_rl.analysis.stability import pooled_frame

    runs = pd.DataFrame({"run": ["r0", "r1"], "objective.name": "grpo", "routing_mode": "native", "optim.lr": 4e-4,
                         "minibatches": 4})
    final = pd.DataFrame({"run": ["r0", "r1"], "seed": [0, 1], "status": "finished"})
    evals = pd.DataFrame([(r, s, 0.1 if s == 0 else v, 0.01) for r, v in (("r0", 0.2), ("r1", 0.05))
                          for s in (0, 5, 10, 15)], columns=["run", "step", "eval/reward", "eval/reward_se"])
    for name, frame in (("runs", runs), ("per_run_final", final), ("per_run_eval", evals)):
        _csv(tmp_path / "lr_1" / "tables", name, frame)
    fold_sittings({"lr_1": tmp_path / "lr_1" / "tables"}, tmp_path / "study" / "tables")
    assert source_name(f"{tmp_path / 'study'}@lr_1") == "lr_1"
    from_folder, _ = pooled_frame([tmp_path / "lr_1"])
    from_sitting, _ = pooled_frame([f"{tmp_path / 'study'}@lr_1"])
    pd.testing.assert_frame_equal(from_sitting, from_folder)
    assert from_sitting.set_index("run")["change"].round(6).to_dict() == {"r0": 0.1, "r1": -0.05}
