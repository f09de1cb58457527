"""Rebuild results/engine/ (runs.csv, tables.md, three figures) from the `engine` sweep's folder.

    .venv/bin/python results/engine/make.py sweeps/engine "sweeps/engine,regime=long,steps=10"   # results/engine/
    .venv/bin/python results/engine/make.py sweeps/engine --out outputs/engine                     # one regime

Reads every run with moe_rl.analysis.load.load_runs, names its arm from its config (ARMS below), and summarises
each run's metrics three ways: at rollout step 0 (every arm's weights are the warm start's, its prompts the
seed's), as the mean over its rollout steps, and at the end (held-out reward after the last step). Intervals are
95% Student t over the seeds (df = seeds - 1); paired differences pair runs of one seed; ratios are the
exponentiated mean of the per-seed log-ratios with the t interval of that mean.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from moe_rl.analysis.aggregate import t_ci  # noqa: E402
from moe_rl.analysis.load import load_runs  # noqa: E402
from moe_rl.analysis.stats import mdd_paired, paired_t  # noqa: E402

# (engine, sampler precision, routing mode, correction level) -> the arm's name, in the README's order.
ARMS = {
    ("vllm", "bf16", "native", "none"): "(a) vLLM bf16, GRPO",
    ("vllm", "bf16", "R3", "none"): "(b) vLLM bf16, GRPO + R3",
    ("vllm", "bf16", "native", "token"): "(c) vLLM bf16, GRPO + TIS",
    ("vllm", "trainer", "native", "none"): "(d) vLLM fp32, GRPO",
    ("native", "bf16", "native", "none"): "(e) emulated bf16, GRPO",
}
REAL, EMULATED = ARMS[("vllm", "bf16", "native", "none")], ARMS[("native", "bf16", "native", "none")]
MISMATCH = {"rollout/kl": "k3 per token", "rollout/chi2_token": "chi2 per token",
            "rollout/extreme_frac": "extreme-token fraction", "rollout/ess_deficit": "1 - ESS of token ratios",
            "routing/rollout/set_change": "router set change", "routing/rollout/token_any": "tokens with a change",
            "correction/truncated_frac": "TIS truncated fraction"}
COLORS = dict(zip(ARMS.values(), ["tab:red", "tab:blue", "tab:orange", "tab:gray", "tab:green"], strict=True))


def arm_of(runs: pd.DataFrame) -> pd.Series:
    keys = zip(runs["rollout.engine"], runs["rollout.sampling.precision"], runs["routing_mode"],
               runs["correction.is_level"], strict=True)
    return pd.Series([ARMS[key] for key in keys], index=runs.index)


def per_layer_set_change(routing: pd.DataFrame) -> pd.DataFrame:
    """(run, step) rows with one `routing/rollout/set_change/L{l}` column per MoE layer (the rollout probe)."""
    rollout = routing[routing["probe"] == "rollout"]
    wide = rollout.pivot_table(index=["run", "step"], columns="layer", values="set_change", aggfunc="first")
    wide.columns = [f"routing/rollout/set_change/L{layer}" for layer in wide.columns]
    return wide.reset_index()


def run_summaries(sweep: Path) -> pd.DataFrame:
    """runs.csv: one row per run x metric: arm, seed, value at step 0, mean over the rollout steps, last value."""
    data = load_runs(sweep / "runs")
    arms = data.runs.assign(arm=arm_of(data.runs))[["run", "arm", "seed"]]
    steps = data.steps.merge(per_layer_set_change(data.routing), on=["run", "step"], how="left")
    steps["rollout/ess_deficit"] = 1 - steps["rollout/ess"]  # ESS sits within 1e-3 of 1: its distance reads better
    metrics = [*MISMATCH, *sorted(c for c in steps if c.startswith("routing/rollout/set_change/L")), "reward",
               "eval/reward"]
    rows = []
    for run, frame in steps.groupby("run"):
        trained = frame[frame["n_updates"] > 0].sort_values("step")
        for metric in metrics:
            if metric not in frame:
                continue
            values = trained[metric] if metric != "eval/reward" else frame.sort_values("step")[metric].dropna()
            rows.append({"run": run, "metric": metric, "step0": values.iloc[0] if len(values) else math.nan,
                         "mean": values.mean(), "last": values.iloc[-1] if len(values) else math.nan,
                         "steps": len(values)})
    return arms.merge(pd.DataFrame(rows), on="run").sort_values(["arm", "seed", "metric"], ignore_index=True)


def values(summary: pd.DataFrame, arm: str, metric: str, column: str) -> pd.Series:
    """One value per seed, indexed by seed."""
    rows = summary[(summary["arm"] == arm) & (summary["metric"] == metric)]
    return rows.set_index("seed")[column].sort_index()


def mean_ci_text(x: pd.Series, fmt: str = ".3g") -> str:
    low, high = t_ci(x.to_numpy())
    return f"{x.mean():{fmt}} [{low:{fmt}}, {high:{fmt}}]"


def ratio_ci_text(a: pd.Series, b: pd.Series) -> str:
    """Geometric mean of the per-seed ratios a / b with its 95% t interval (computed on the log-ratios)."""
    ratios = (a / b).to_numpy()
    if len(ratios) < 2 or not (np.isfinite(ratios) & (ratios > 0)).all():
        return "n/a"  # a zero or negative estimate (no extreme token in a batch, a chi2 below 0) has no log-ratio
    logs = np.log(ratios)
    low, high = t_ci(logs)
    return f"{math.exp(logs.mean()):.2f} [{math.exp(low):.2f}, {math.exp(high):.2f}]"


def real_vs_emulated_table(summary: pd.DataFrame) -> str:
    """Item 4: the vLLM bf16 engine (a) against the emulated bf16 sampler (e), same warm start and seeds."""
    metrics = [m for m in summary["metric"].unique() if m.startswith(("rollout/", "routing/"))]
    lines = ["| metric | when | (a) vLLM bf16 engine | (e) emulated bf16 | ratio (a)/(e) |", "|---|---|---|---|---|"]
    for metric in sorted(metrics, key=lambda m: (not m.startswith("rollout/kl"), m)):
        for column, when in (("step0", "step 0 (warm start)"), ("mean", "mean over steps")):
            real, emulated = values(summary, REAL, metric, column), values(summary, EMULATED, metric, column)
            lines.append(f"| `{metric}` | {when} | {mean_ci_text(real)} | {mean_ci_text(emulated)} | "
                         f"{ratio_ci_text(real, emulated)} |")
    return "\n".join(lines)


def mismatch_table(summary: pd.DataFrame) -> str:
    """Each arm's mismatch metrics, mean over rollout steps, mean [95% CI] over seeds."""
    head = "| arm | " + " | ".join(MISMATCH.values()) + " |"
    lines = [head, "|---" * (len(MISMATCH) + 1) + "|"]
    for arm in ARMS.values():
        cells = [mean_ci_text(values(summary, arm, metric, "mean")) for metric in MISMATCH]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(summary: pd.DataFrame) -> str:
    """Each bf16 arm's mismatch over rollout steps as a ratio to arm (a)'s, paired by seed."""
    metrics = ["rollout/kl", "rollout/extreme_frac", "routing/rollout/set_change"]
    lines = ["| arm | " + " | ".join(f"`{m}` / (a)'s" for m in metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for arm in ARMS.values():
        if arm in (REAL, ARMS[("vllm", "trainer", "native", "none")]):
            continue
        cells = [ratio_ci_text(values(summary, arm, m, "mean"), values(summary, REAL, m, "mean")) for m in metrics]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reward_table(summary: pd.DataFrame) -> str:
    """Held-out reward before RL and after the last step per arm; the final and the gain paired against (a)."""
    lines = ["| arm | held-out before RL | after RL | gain | final - (a)'s [95% CI], p | MDD (80% power) | "
             "training reward, last 5 steps |", "|---|---|---|---|---|---|---|"]
    ref = values(summary, REAL, "eval/reward", "last")
    for arm in ARMS.values():
        before, after = values(summary, arm, "eval/reward", "step0"), values(summary, arm, "eval/reward", "last")
        diff = paired_t(after.to_numpy(), ref.reindex(after.index).to_numpy())
        d = after - ref.reindex(after.index)
        paired = "-" if arm == REAL else f"{diff.mean_diff:+.3f} [{diff.ci_low:+.3f}, {diff.ci_high:+.3f}], " \
                                          f"p = {diff.p:.2f}"
        mdd = "-" if arm == REAL else f"{mdd_paired(len(d), float(d.std(ddof=1))):.3f}"
        train = last_k_reward(summary, arm)
        lines.append(f"| {arm} | {mean_ci_text(before)} | {mean_ci_text(after)} | {mean_ci_text(after - before)} "
                     f"| {paired} | {mdd} | {train} |")
    return "\n".join(lines)


def last_k_reward(summary: pd.DataFrame, arm: str) -> str:
    return mean_ci_text(values(summary, arm, "reward", "last5"))


def add_last5(summary: pd.DataFrame, steps_by_run: dict[str, pd.Series]) -> pd.DataFrame:
    summary = summary.copy()
    summary["last5"] = [steps_by_run[run].tail(5).mean() if metric == "reward" else math.nan
                        for run, metric in zip(summary["run"], summary["metric"], strict=True)]
    return summary


def same_tokens_table(path: Path) -> str:
    """The vLLM bf16 engine's tokens scored by the trainer, the engine and the emulation (experiments/engine_tokens.py
    output, one JSON line per seed): k3 and set change against the trainer, and the emulation against the engine."""
    seeds = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    pairs = {"real": "engine vs trainer", "emulated": "emulation vs trainer", "emulated_vs_real": "emulation vs engine"}
    lines = ["| comparison | k3 per token | router set change | set change L0 / L1 / L2 / L3 |", "|---|---|---|---|"]
    for key, label in pairs.items():
        k3 = pd.Series([s[key]["k3"] for s in seeds])
        change = pd.Series([s[key]["set_change"] for s in seeds])
        layers = np.array([s[key]["set_change_per_layer"] for s in seeds]).mean(axis=0)
        lines.append(f"| {label} | {mean_ci_text(k3)} | {mean_ci_text(change)} | "
                     + " / ".join(f"{v:.4f}" for v in layers) + " |")
    real, emulated = (pd.Series([s[key]["k3"] for s in seeds]) for key in ("real", "emulated"))
    real_sc, emulated_sc = (pd.Series([s[key]["set_change"] for s in seeds]) for key in ("real", "emulated"))
    corr = pd.Series([s["log_ratio_corr"] for s in seeds])
    tokens = sum(s["tokens"] for s in seeds)
    lines += ["", f"Ratio engine / emulation over seeds: k3 {ratio_ci_text(real, emulated)}, set change "
              f"{ratio_ci_text(real_sc, emulated_sc)}. Correlation over tokens of log pi_trainer - log pi_engine with "
              f"log pi_trainer - log pi_emulated: {mean_ci_text(corr, '.2f')} (per seed "
              + ", ".join(f"{c:.2f}" for c in corr) + f"). {len(seeds)} seeds, {tokens} response tokens in all."]
    return "\n".join(lines)


# -- figures ----------------------------------------------------------------------------------------------------


def arm_steps(sweep: Path) -> pd.DataFrame:
    data = load_runs(sweep / "runs")
    steps = data.steps[data.steps["n_updates"] > 0]
    return steps.merge(data.runs.assign(arm=arm_of(data.runs))[["run", "arm"]], on="run")


def regime_name(sweep: Path) -> str:
    """The regime a sweep ran, from its first run's config: 'small' (the Qwen3-MoE default) or 'long'."""
    config = json.loads(next((sweep / "runs").glob("*/config.json")).read_text())
    return "small" if config["model"]["backend"] == "hf" else "long"


REGIME_TITLES = {"small": "small regime: Qwen3-MoE, 16 experts top-4, 30 steps of 16 x 8",
                 "long": "long regime: native model, 64 experts top-8, 10 steps of 64 x 8"}


def figure_mismatch_over_steps(regimes: dict, out: Path) -> None:
    """k3 per token and router set change over rollout steps, per arm (mean over seeds, band = min-max); one row of
    panels per regime."""
    fig, axes = plt.subplots(len(regimes), 2, figsize=(11, 3.8 * len(regimes)), squeeze=False)
    for row, (regime, (_, steps)) in zip(axes, regimes.items(), strict=True):
        for ax, metric, label in ((row[0], "rollout/kl", "k3 per token, log scale"),
                                  (row[1], "routing/rollout/set_change", "router decisions that differ")):
            for arm in ARMS.values():
                by_step = steps[steps["arm"] == arm].groupby("step")[metric]
                mean, low, high = by_step.mean(), by_step.min(), by_step.max()
                if metric == "rollout/kl":
                    mean, low, high = (s.clip(lower=1e-16) for s in (mean, low, high))
                ax.plot(mean.index, mean, color=COLORS[arm], label=arm)
                ax.fill_between(mean.index, low, high, color=COLORS[arm], alpha=0.2, linewidth=0)
            ax.set_xlabel("rollout step")
            ax.set_ylabel(label)
        row[0].set_yscale("log")
        row[0].set_title(f"Token mismatch ({regime} regime)")
        row[1].set_title(f"Routing mismatch vs the trainer's native routing ({regime})")
    axes[0][1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
    fig.suptitle("Sampler vs trainer mismatch per rollout step (line: mean of 3 seeds; band: lowest to highest seed)")
    fig.tight_layout()
    fig.savefig(out / "mismatch_over_steps.png", dpi=130, bbox_inches="tight")
    plt.close(fig)


def figure_real_vs_emulated_layers(regimes: dict, out: Path) -> None:
    """Set change per MoE layer and k3, real engine vs emulation, means over steps, with seed points; one row per
    regime."""
    fig, axes = plt.subplots(len(regimes), 2, figsize=(11, 3.8 * len(regimes)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    for row, (regime, (summary, _)) in zip(axes, regimes.items(), strict=True):
        layers = sorted(m for m in summary["metric"].unique() if m.startswith("routing/rollout/set_change/L"))
        x = np.arange(len(layers))
        for shift, arm in ((-0.2, REAL), (0.2, EMULATED)):
            means = [values(summary, arm, m, "mean") for m in layers]
            row[0].bar(x + shift, [v.mean() for v in means], width=0.38, color=COLORS[arm], alpha=0.7, label=arm)
            for i, v in enumerate(means):
                row[0].scatter(np.full(len(v), x[i] + shift), v, color="black", s=10, zorder=3)
            k3 = values(summary, arm, "rollout/kl", "mean")
            row[1].bar(shift * 2.5, k3.mean(), width=0.9, color=COLORS[arm], alpha=0.7)
            row[1].scatter(np.full(len(k3), shift * 2.5), k3, color="black", s=10, zorder=3)
        row[0].set_xticks(x, [f"MoE layer {m.rsplit('L', 1)[1]}" for m in layers])
        row[0].set_ylabel("router decisions that differ")
        row[0].set_title(f"Routing mismatch per layer, mean over steps ({regime} regime)")
        row[0].legend(frameon=False, loc="upper left")
        row[1].set_xticks([-0.5, 0.5], ["vLLM bf16", "emulated bf16"])
        row[1].set_ylabel("k3 per token")
        row[1].set_title(f"Token mismatch ({regime})")
    fig.suptitle("The real engine against the emulation (bars: mean of 3 seeds; dots: seeds)")
    fig.tight_layout()
    fig.savefig(out / "real_vs_emulated.png", dpi=130, bbox_inches="tight")
    plt.close(fig)


def figure_reward(regimes: dict, out: Path) -> None:
    """Held-out reward before RL and after it per arm, seeds joined by lines; one panel per regime."""
    fig, axes = plt.subplots(1, len(regimes), figsize=(7.5 * len(regimes), 4.2), squeeze=False)
    for ax, (regime, (summary, _)) in zip(axes[0], regimes.items(), strict=True):
        for i, arm in enumerate(ARMS.values()):
            before, after = values(summary, arm, "eval/reward", "step0"), values(summary, arm, "eval/reward", "last")
            for seed in after.index:
                ax.plot([i - 0.15, i + 0.15], [before[seed], after[seed]], color=COLORS[arm], marker="o", alpha=0.8)
        ax.set_xticks(range(len(ARMS)), [arm.replace(", ", ",\n") for arm in ARMS.values()], fontsize=8)
        ax.set_ylabel("held-out reward (256 prompts, sampled)")
        ax.set_title(REGIME_TITLES[regime], fontsize=10)
    fig.suptitle("Held-out reward before RL (left point) and after it (right point), one line per seed")
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=130, bbox_inches="tight")
    plt.close(fig)


def regime_tables(regime: str, summary: pd.DataFrame, out: Path) -> list[str]:
    tables = [f"# {REGIME_TITLES[regime]}",
              "## Item 4: vLLM bf16 engine vs emulated bf16, paired by seed", real_vs_emulated_table(summary),
              "## Mismatch per arm (mean over rollout steps)", mismatch_table(summary),
              "## Each bf16 arm's mismatch against (a)'s, ratio of means over steps, paired by seed",
              ratio_table(summary),
              "## Held-out reward", reward_table(summary)]
    same_tokens = out / ("same_tokens.jsonl" if regime == "small" else f"same_tokens_{regime}.jsonl")
    if same_tokens.is_file():
        tables[3:3] = ["## Item 4 on the same tokens: the engine's batch scored by the emulation",
                       same_tokens_table(same_tokens)]
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweeps", type=Path, nargs="+", help="the engine sweeps' folders (sweeps/engine, ...)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent, help="where to write (results/engine)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    regimes = {}
    for sweep in args.sweeps:
        steps = arm_steps(sweep)
        summary = add_last5(run_summaries(sweep), {run: f.sort_values("step")["reward"]
                                                   for run, f in steps.groupby("run")})
        regimes[regime_name(sweep)] = (summary, steps)
    runs = pd.concat([summary.assign(regime=regime) for regime, (summary, _) in regimes.items()], ignore_index=True)
    runs.to_csv(args.out / "runs.csv", index=False, float_format="%.6g")
    tables = [table for regime, (summary, _) in regimes.items() for table in regime_tables(regime, summary, args.out)]
    (args.out / "tables.md").write_text("\n\n".join(tables) + "\n")
    figure_mismatch_over_steps(regimes, args.out)
    figure_real_vs_emulated_layers(regimes, args.out)
    figure_reward(regimes, args.out)
    print((args.out / "tables.md").read_text())


if __name__ == "__main__":
    main()
