"""results/ as a short paper: the folder stays within its budget (files, bytes, formats), every study has a README,
and the findings table's numbers that no other test recomputes are recomputed here from the committed tables."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
MAX_FILES = 310  # 300 until results/depth_width (issue 54): its runs fold into 3 Parquet tables; summaries derived
MAX_BYTES = 25_000_000
ALLOWED_SUFFIXES = {".md", ".png", ".csv", ".parquet", ".json", ".jsonl", ".py", ".sh"}
# PDFs only beside the handful of figures a paper would use; none is committed now.
PDF_ALLOWED: set[str] = set()


def _committed_files() -> list[Path]:
    """results/ as git tracks it (the working tree's untracked outputs do not count), or every file when git is
    not there (a source tarball)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "results"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return [p for p in RESULTS.rglob("*") if p.is_file()]
    return [ROOT / name for name in listed.stdout.decode().split("\0") if name and (ROOT / name).is_file()]


def test_results_is_within_its_budget_of_files_and_bytes():
    files = _committed_files()
    total = sum(path.stat().st_size for path in files)
    assert len(files) < MAX_FILES, f"results/ holds {len(files)} files; the budget is < {MAX_FILES}"
    assert total < MAX_BYTES, f"results/ holds {total / 1e6:.1f} MB; the budget is < {MAX_BYTES / 1e6:.0f} MB"


def test_results_holds_figures_as_png_and_data_as_tables_only():
    for path in _committed_files():
        relative = path.relative_to(ROOT).as_posix()
        if path.suffix == ".pdf":
            assert relative in PDF_ALLOWED, f"{relative}: figures are PNG (a PDF only beside a paper's figure)"
        else:
            assert path.suffix in ALLOWED_SUFFIXES, f"{relative}: results/ holds {sorted(ALLOWED_SUFFIXES)} only"


def test_every_study_folder_has_a_readme_and_the_top_readme_opens_with_the_findings():
    studies = [p for p in RESULTS.iterdir() if p.is_dir()]
    for study in studies:
        assert (study / "README.md").is_file(), f"{study.name}/: a study folder needs a README.md"
    top = (RESULTS / "README.md").read_text(encoding="utf-8")
    headings = [line for line in top.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Findings" and headings[-1] == "## How this folder is kept", headings


def test_the_length_generalisation_finding_is_recomputed_from_its_per_run_table():
    """Finding 2 of results/README.md: RL beats the warm start at its best temperature, +0.115 [0.103, 0.127]
    (sampled) over 5 seeds, from the committed per-run table and the warm start's evaluation."""
    from moe_rl.analysis.baseline import against_baseline, read_baseline

    folder = RESULTS / "length_generalisation"
    per_run = pd.read_csv(folder / "tables" / "per_run_final.csv")
    again = against_baseline(per_run.assign(group="all runs"), read_baseline(folder / "baseline" / "evaluate.json"))
    committed = pd.read_csv(folder / "tables" / "against_baseline.csv")
    for column in ("final", "diff", "ci_low", "ci_high"):
        assert again[column].to_numpy() == pytest.approx(committed[column].to_numpy(), rel=1e-9), column
    sampled = again.set_index("decoding").loc["sampled"]
    assert (round(sampled["diff"], 3), round(sampled["ci_low"], 3), round(sampled["ci_high"], 3)) == (
        0.115, 0.103, 0.127)


def _mean_and_ci(values, digits: int = 3) -> tuple[float, float, float]:
    """Mean and 95% Student t interval over seeds, rounded to `digits` as the READMEs print them."""
    from scipy import stats

    x = pd.Series(values, dtype=float)
    half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / len(x) ** 0.5
    return round(x.mean(), digits), round(x.mean() - half, digits), round(x.mean() + half, digits)


def test_the_48_block_set_change_is_recomputed_from_its_per_run_table():
    """The claims table's first row (results/README.md): at the GSPO paper's routing shape (48 MoE blocks, 128
    experts, top-8), 6.0% [5.4, 6.7] of top-8 sets change per update at lr 1.5e-4, slot churn 0.76% [0.68, 0.84]."""
    per_run = pd.read_csv(RESULTS / "churn_paper" / "report" / "tables" / "per_run_final.csv")
    deep = per_run[(per_run["model.n_layers"] == 48) & (per_run["optim.lr"] == 1.5e-4)]
    assert len(deep) == 3
    assert _mean_and_ci(deep["set_change"] * 100, 2) == pytest.approx((6.03, 5.41, 6.65), abs=1e-9)
    assert _mean_and_ci(deep["churn"] * 100) == pytest.approx((0.759, 0.68, 0.838), abs=1e-9)


@pytest.mark.parametrize("tables", ["churn_repro/tables", "churn_paper/report/tables"])
def test_the_churn_studies_gains_stay_below_the_warm_starts_greedy(tables):
    """churn_repro and churn_paper call their gains sharpening, not learning: in every cell the held-out accuracy
    at T = 1 after RL (mean over seeds) stays below the warm start's greedy accuracy on the same prompts (the
    runs' step-0 `eval/greedy`, one number per architecture)."""
    per_eval = pd.read_csv(RESULTS / tables / "per_run_eval.csv")
    for group, runs in per_eval.groupby("group"):
        start = runs[runs["step"] == 0]
        final = runs[runs["step"] == runs["step"].max()]
        assert start["eval/greedy"].nunique() == 1, group
        assert final["eval/reward"].mean() < start["eval/greedy"].iloc[0] - 0.15, group


def test_the_dense_twin_moes_gains_are_recomputed_against_its_best_decoding():
    """results/dense_twin, "Against the decoding baselines": the MoE's final held-out at T = 1 minus its warm start's
    best decoding (T = 0.3 with EOS banned before 32 new tokens, 0.061 on held-out) beats it at lr 5e-5 only."""
    from moe_rl.analysis.baseline import against_baseline, read_baseline

    folder = RESULTS / "dense_twin"
    baseline = read_baseline(folder / "baseline" / "min_new_tokens_0_32_40_48" / "evaluate.json")
    assert (baseline["temperature"], round(baseline["heldout"], 3)) == (0.3, 0.061)
    runs = pd.read_csv(folder / "tables" / "per_run.csv")
    moe = runs[runs["architecture"].str.startswith("MoE")]
    table = against_baseline(moe.rename(columns={"eval_final": "eval/reward"}).assign(group=moe["optim.lr"]),
                             baseline).set_index("group")
    assert table["n_runs"].eq(3).all()
    assert (round(table.loc[5e-5, "diff"], 3), round(table.loc[5e-5, "ci_low"], 3)) == (0.040, 0.004)
    assert table.index[table["beats_baseline"]].tolist() == [5e-5]


def _best_decoding(folder: Path) -> dict:
    """A committed `moe-rl evaluate` output as read_baseline reads it, with greedy taken at its best length control
    (evaluate.csv's chosen held-out greedy row with the largest min_new_tokens; the unbanned one when none helps)."""
    from moe_rl.analysis.baseline import read_baseline

    base = read_baseline(folder / "evaluate.json")
    rows = pd.read_csv(folder / "evaluate.csv")
    greedy = rows[(rows["split"] == "heldout") & (rows["decoding"] == "greedy")].sort_values("min_new_tokens")
    return dict(base, greedy=greedy["mean"].iloc[-1], greedy_se=greedy["se"].iloc[-1])


def test_the_length_generalisation_gain_holds_against_length_control():
    """results/length_generalisation, "Against length control too": the warm start rebuilt under AVX2 caps, best at
    T = 0.3 with EOS banned before 40 new tokens (0.034), is beaten by +0.089 [0.071, 0.107] at T = 1 and by +0.164
    [0.143, 0.185] greedy; its unbanned validation rows equal the committed baseline's (the same warm start)."""
    from moe_rl.analysis.baseline import against_baseline

    folder = RESULTS / "length_generalisation"
    rebuilt = pd.read_csv(folder / "baseline" / "length_control" / "evaluate.csv")
    unbanned = rebuilt[(rebuilt["split"] == "validation") & (rebuilt["decoding"] == "sampled")
                       & (rebuilt["min_new_tokens"] == 0)]
    committed = pd.read_csv(folder / "baseline" / "evaluate.csv")
    assert unbanned["mean"].tolist() == committed[committed["split"] == "validation"]["mean"].tolist()
    base = _best_decoding(folder / "baseline" / "length_control")
    assert (base["temperature"], round(base["heldout"], 3), round(base["greedy"], 3)) == (0.3, 0.034, 0.034)
    per_run = pd.read_csv(folder / "tables" / "per_run_final.csv").assign(group="all runs")
    table = against_baseline(per_run, base).set_index("decoding")[["diff", "ci_low", "ci_high"]].round(3)
    assert tuple(table.loc["sampled"]) == (0.089, 0.071, 0.107)
    assert tuple(table.loc["greedy"]) == (0.164, 0.143, 0.185)


def test_the_stability_lr_axis_against_its_best_decoding():
    """results/stability, "Against the decoding baselines": the lr axis's runs (lr_1 .. lr_5, pooled as the map pools
    them) against the warm start's best decoding with length control (0.034): the final held-out at T = 1 beats it
    with a CI above 0 in 7 of 42 cells, all at lr <= 5e-5, and greedy beats its greedy in 9; no mean is above it
    by more than 0.006 at lr >= 4e-4."""
    from moe_rl.analysis.baseline import against_baseline
    from moe_rl.analysis.stability import pooled_frame

    frame, _ = pooled_frame([f"{RESULTS / 'stability'}@lr_{sitting}" for sitting in (1, 2, 3, 4, 5)])
    frame = frame.assign(group=frame["method"] + " " + frame["optim.lr"].map("{:g}".format))
    base = _best_decoding(RESULTS / "length_generalisation" / "baseline" / "length_control")
    table = against_baseline(frame.drop(columns="eval/reward").rename(columns={"eval_final": "eval/reward"}), base)
    lr = table["group"].str.split().str[-1].astype(float)
    sampled, greedy = table["decoding"] == "sampled", table["decoding"] == "greedy"
    assert sampled.sum() == 42
    assert (table["beats_baseline"] & sampled).sum() == 7 and (lr[table["beats_baseline"] & sampled] <= 5e-5).all()
    assert (table["beats_baseline"] & greedy).sum() == 9
    assert (table.loc[sampled & (lr >= 4e-4), "diff"] <= 0.006).all()


def test_the_second_dense_twin_sitting_is_recomputed_from_its_per_run_table():
    """results/dense_twin's primary tests P2, P4 and P5 from the committed per-run rows (paired by RL seed), and the
    repeat of the first sitting equal to the digit."""
    from moe_rl.analysis.stats import paired_t

    second = RESULTS / "dense_twin" / "tables" / "second"
    runs = pd.read_csv(second / "per_run.csv")

    def change(rows: pd.DataFrame) -> pd.Series:
        return rows.set_index(["optim.lr", "seed"])["change"].sort_index()

    routers = runs[runs["item"] == "routers"]
    frontier = routers[routers["optim.lr"].isin([4e-4, 8e-4])]
    frozen, free = (change(frontier[frontier["router_lr_scale"] == scale]) for scale in (0, 1))
    p2 = paired_t(frozen, free)
    fp8 = runs[runs["item"] == "fp8"]
    native = change(fp8[(fp8["routing_mode"] == "native") & (fp8["correction"] == "none")])
    p4 = paired_t(change(fp8[fp8["routing_mode"] == "R3"]), native)
    matched = runs[runs["optim.lr"] == 4e-4]
    gspo = change(matched[(matched["objective"] == "gspo")])
    grpo = change(matched[(matched["objective"] == "grpo") & matched["item"].isin(["gspo matched", "routers"])
                          & (matched["router_lr_scale"] == 1)]).groupby(level=[0, 1]).first()
    p5 = paired_t(gspo, grpo.reindex(gspo.index))
    primary = pd.read_csv(second / "primary.csv").set_index("test")
    for test, diff, n in (("P2", p2, 4), ("P4", p4, 3), ("P5", p5, 5)):
        assert diff.n_a == n
        assert diff.mean_diff == pytest.approx(primary.loc[test, "estimate"], abs=1e-12)
        assert diff.p == pytest.approx(primary.loc[test, "p"], abs=1e-9)
    assert round(p5.mean_diff, 3) == 0.018 and p5.ci_low > 0 and primary.loc["P5", "p_holm"] > 0.05
    assert pd.read_csv(second / "repeat_of_first_sitting.csv")["equal"].all()


def test_the_early_warning_table_is_recomputed_and_churn_does_not_beat_the_learning_rate():
    """results/early_warning: each signal's test-half precision and recall from the per-run rows, and the finding
    (set change and token-any churn below the learning rate alone in F1)."""
    folder = RESULTS / "early_warning"
    table = pd.read_csv(folder / "early_warning.csv").query("runs == 'all'").set_index("signal")
    runs = pd.read_csv(folder / "early_warning_runs.csv")
    test_half = runs[runs["half"] == "test"]
    for signal, rows in test_half.groupby("signal"):
        alarms = int(rows["alarm_step"].notna().sum())
        hits = int(rows["hit"].sum())
        assert (alarms, hits, int(rows["collapsed"].sum())) == tuple(
            table.loc[signal, ["test_alarms", "test_hits", "test_collapsed"]].astype(int))
    assert table.loc["set change", "f1"] < table.loc["learning rate", "f1"]
    assert table.loc["token-any churn", "f1"] < table.loc["learning rate", "f1"]
    assert round(table.loc["learning rate", "f1"], 2) == 0.76 and round(table.loc["set change", "f1"], 2) == 0.67


# results/depth_width/tables/width_critical.csv, to 5 decimals
WIDTH_CRITICAL_D64, WIDTH_CRITICAL_D128 = 0.00023, 0.00051


def test_the_width_finding_is_recomputed_from_its_per_run_tables():
    """results/README.md finding 9 (results/depth_width) from the committed per-run rows, independently of make.py:
    the same share of top-8 sets changes per update at the same lr at d_model 64 and 128 while the KL per update is
    several times smaller at 128; the critical lr of native GRPO doubles; the 48-block pilot beats its warm start at
    its best temperature."""
    from moe_rl.analysis.sittings import sitting_table
    from moe_rl.analysis.stability import run_changes
    from moe_rl.analysis.stats import critical_point

    study = RESULTS / "depth_width"

    def native_runs(*sittings: str) -> pd.DataFrame:
        frames = []
        for sitting in sittings:
            final = sitting_table(study, "per_run_final", sitting)
            modes = sitting_table(study, "runs", sitting)[["run", "routing_mode"]]
            changes = run_changes(sitting_table(study, "per_run_eval", sitting))[["run", "change"]]
            final = final.drop(columns=[c for c in ("routing_mode",) if c in final])
            frames.append(final.merge(modes, on="run").merge(changes, on="run"))
        runs = pd.concat(frames, ignore_index=True)
        return runs[(runs["routing_mode"] == "native") & (runs["status"] == "finished")]

    narrow = native_runs("long_d64_axis")
    wide = native_runs("long_d128", "long_d128_axis")
    by_lr = [runs.groupby("optim.lr")[["set_change", "kl_median"]].mean() for runs in (narrow, wide)]
    ratio = (by_lr[1] / by_lr[0]).loc[[5e-5, 1.5e-4, 4e-4]]
    assert ratio["set_change"].between(0.85, 1.05).all(), ratio
    assert (ratio["kl_median"] < 0.2).all(), ratio
    crit = [critical_point(runs, "optim.lr", "change") for runs in (narrow, wide)]
    assert (round(crit[0].value, 5), round(crit[1].value, 5)) == (WIDTH_CRITICAL_D64, WIDTH_CRITICAL_D128)
    assert crit[0].ci_high < crit[1].ci_low  # the intervals do not overlap
    pilot = sitting_table(study, "per_run_eval", "depth48_pilot")
    final_heldout = pilot[pilot["step"] == 15].set_index("run")["eval/reward"]
    baseline = pd.read_csv(study / "tables" / "depth48_warm_start_evaluate.csv")
    best = baseline[(baseline["split"] == "heldout") & (baseline["decoding"] == "sampled")]["mean"].item()
    assert best < 0.01 and (final_heldout > 5 * best).all()


DEPTH48_AXIS = ("depth48_axis", "depth48_axis_b", "depth48_axis6", "depth48_axis6_c")  # results/depth_width's lr axis


def _depth48_heldout(sittings: tuple[str, ...]) -> pd.DataFrame:
    """One row per finished 48-block run of these sittings: lr, seed, routing mode, objective and `heldout`, the mean
    of its held-out evaluations at steps 5, 10 and 15 at T = 1 (addendum 5's endpoint), from the per-run tables."""
    from moe_rl.analysis.sittings import sitting_table

    study = RESULTS / "depth_width"
    frames = []
    for sitting in sittings:
        evals = sitting_table(study, "per_run_eval", sitting)
        runs = sitting_table(study, "runs", sitting).set_index("run")
        finished = runs.index[runs["status"] == "finished"]
        after = evals[evals["step"].isin([5, 10, 15]) & evals["run"].isin(finished)]
        after = after.groupby("run")["eval/reward"].agg(["mean", "count"])
        assert (after["count"] == 3).all(), sitting
        columns = ["optim.lr", "seed", "routing_mode", "objective.name"]
        frames.append(runs.loc[after.index, columns].assign(heldout=after["mean"], sitting=sitting))
    return pd.concat(frames).reset_index()


def test_the_48_block_rescue_finding_is_recomputed_from_its_per_run_tables():
    """results/README.md finding 9 and results/depth_width (addendum 5), independently of make.py: at 48 MoE blocks
    and lr 8e-4, where native GRPO stops learning, R2 and R3 minus native in held-out (mean of the evaluations at
    steps 5, 10, 15 at T = 1), paired by seed, each lie within the TOST margin 0.03 (their 90% t intervals inside
    +-0.03), and churn there is above a fifth of all top-8 sets per update."""
    from scipy import stats

    from moe_rl.analysis.sittings import sitting_table

    table = _depth48_heldout(("depth48_axis",)).set_index("run")
    at = table[table["optim.lr"] == 8e-4]
    is_grpo = at["objective.name"] == "grpo"
    native = at[is_grpo & (at["routing_mode"] == "native")].set_index("seed")["heldout"]
    assert len(native) == 3 and native.mean() < 0.01  # lr 1e-4 reaches 0.067 (the pilot)
    for mode in ("R2", "R3"):
        replay = at[is_grpo & (at["routing_mode"] == mode)].set_index("seed")["heldout"]
        diff = (replay - native).dropna()
        assert len(diff) == 3, mode
        half = stats.t.ppf(0.95, 2) * diff.std(ddof=1) / math.sqrt(3)
        assert -0.03 < diff.mean() - half and diff.mean() + half < 0.03, (mode, diff.mean(), half)
    final = sitting_table(RESULTS / "depth_width", "per_run_final", "depth48_axis").set_index("run")
    assert (final.loc[at.index, "set_change"] > 0.2).all()


def test_the_48_block_runs_share_one_warm_start():
    """Addendum 6 rebuilt the 48-block warm start on a new machine: every run of every 48-block sitting starts from
    the same held-out evaluation at step 0 for its RL seed (T = 1 and greedy, 1,024 prompts)."""
    from moe_rl.analysis.sittings import sitting_table

    study = RESULTS / "depth_width"
    evals = pd.concat([sitting_table(study, "per_run_eval", sitting) for sitting in ("depth48_pilot", *DEPTH48_AXIS)])
    step0 = evals[evals["step"] == 0].groupby("seed")[["eval/reward", "eval/greedy"]].nunique()
    assert len(step0) == 3 and (step0 == 1).all().all(), step0


def test_each_48_block_method_has_its_lr_frontier_bracketed():
    """results/depth_width (addendum 6) and results/README.md finding 9, independently of make.py: per method the
    seed-mean gain over the warm start at its best temperature (held-out at T = 1, steps 5-15, minus the best
    temperature's) is above 0 at the lower lr of its pair and at most 0 at the upper, 3 RL seeds at each: native GRPO
    and GSPO between 8e-4 and 1.6e-3, R2 and R3 between 4e-4 and 8e-4. At 1.6e-3 every run fails, and seed 1's GRPO
    and GSPO runs are one run: its first rollouts solved nothing, so no update carried an RL signal."""
    from moe_rl.analysis.sittings import sitting_table

    study = RESULTS / "depth_width"
    baseline = pd.read_csv(study / "tables" / "depth48_warm_start_evaluate.csv")
    best = baseline[(baseline["split"] == "heldout") & (baseline["decoding"] == "sampled")]["mean"].item()
    table = _depth48_heldout(DEPTH48_AXIS).assign(gain=lambda frame: frame["heldout"] - best)
    brackets = {("grpo", "native"): (8e-4, 1.6e-3), ("grpo", "R2"): (4e-4, 8e-4), ("grpo", "R3"): (4e-4, 8e-4),
                ("gspo", "native"): (8e-4, 1.6e-3)}
    for (objective, mode), (low, high) in brackets.items():
        runs = table[(table["objective.name"] == objective) & (table["routing_mode"] == mode)]
        gains = runs.groupby("optim.lr")["gain"].agg(["mean", "count"])
        assert gains.loc[[low, high], "count"].tolist() == [3, 3], (objective, mode)
        assert gains.loc[low, "mean"] > 0 >= gains.loc[high, "mean"], (objective, mode, gains)
    top = table[table["optim.lr"] == 1.6e-3]
    assert len(top) == 6 and (top["gain"] <= 0).all()
    final = sitting_table(study, "per_run_final", "depth48_axis6_c").set_index("run")
    seed1 = final.loc[top[top["seed"] == 1]["run"], ["set_change", "churn", "kl_median", "reward_start"]]
    assert len(seed1) == 2 and (seed1.iloc[0] == seed1.iloc[1]).all() and (seed1["reward_start"] == 0).all()
