"""The baseline row of a comparison table: the warm start at its best sampling temperature (chosen on the
validation split) and greedy, read from what `moe-rl evaluate` wrote (evaluate.json).

    base = read_baseline("runs/sft/evaluate")          # or the evaluate.json itself
    table = learning_table(data, last_k=5)            # moe_rl.analysis.learning: final = held-out at the training T
    with_baseline(table, base)                        # the same table, the baseline first (final = held-out at T*)
    with_baseline(learning_table(data, 5, metric="eval/greedy"), base, decoding="greedy")
    baseline_markdown([base])                         # a Markdown table of baselines, with SEs
    against_baseline(per_run, base)                   # per group: final held-out minus the baseline, with a CI

RL that only sharpens the policy beats the warm start at T = 1 but not the warm start at its own best temperature,
so a method's held-out accuracy is read against this row. Its standard errors count prompts (moe_rl/rl/heldout.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

DECODINGS = ("sampled", "greedy")
EXTRA_COLUMNS = ["baseline_decoding", "baseline_temperature", "baseline_se", "baseline_prompts", "baseline_samples"]


def read_baseline(path: str | Path, label: str = "warm start") -> dict:
    """evaluate.json (a file, or the directory holding it) as one flat row: label, checkpoint, step, temperature
    (the best on validation), heldout and heldout_se (at that temperature), greedy and greedy_se, prompts, samples."""
    path = Path(path)
    result = json.loads((path / "evaluate.json" if path.is_dir() else path).read_text(encoding="utf-8"))
    sampled, argmax = result["heldout"]["sampled"], result["heldout"]["greedy"]
    return {"label": label, "checkpoint": result["checkpoint"], "step": result["step"],
            "temperature": result["best_temperature"], "heldout": sampled["mean"], "heldout_se": sampled["se"],
            "greedy": argmax["mean"], "greedy_se": argmax["se"], "prompts": sampled["prompts"],
            "samples": sampled["samples"]}


def with_baseline(table: pd.DataFrame, baseline: dict, decoding: str = "sampled", value: str = "final",
                  group: str = "group") -> pd.DataFrame:
    """`table` with the baseline as its first row: `group` = its label, `value` = its held-out accuracy (at the best
    temperature, or greedy), the baseline_* columns (EXTRA_COLUMNS) saying how it was measured; every other column
    of that row is empty (NaN), and the baseline_* columns are empty on the table's own rows."""
    if decoding not in DECODINGS:
        raise ValueError(f"decoding={decoding!r} must be one of {DECODINGS}")
    greedy = decoding == "greedy"
    how = "greedy" if greedy else f"T={baseline['temperature']:g}, best on validation"
    label = f"{baseline['label']} ({how})"
    row = {group: label, value: baseline["greedy" if greedy else "heldout"], "baseline_decoding": decoding,
           "baseline_temperature": math.nan if greedy else baseline["temperature"],
           "baseline_se": baseline["greedy_se" if greedy else "heldout_se"], "baseline_prompts": baseline["prompts"],
           "baseline_samples": 1 if greedy else baseline["samples"]}
    columns = list(table.columns) + [c for c in EXTRA_COLUMNS if c not in table.columns]
    return pd.concat([pd.DataFrame([row]), table], ignore_index=True).reindex(columns=columns)


def baseline_markdown(baselines: Sequence[dict]) -> str:
    """One line per baseline: best temperature, held-out accuracy there and greedy, each +- its SE."""
    if not baselines:
        return ""
    lines = ["| baseline | best T (validation) | held-out at best T | held-out greedy | prompts x samples |",
             "|---|---|---|---|---|"]
    lines += [f"| {b['label']} | {b['temperature']:g} | {b['heldout']:.3f} +- {b['heldout_se']:.3f} | "
              f"{b['greedy']:.3f} +- {b['greedy_se']:.3f} | {b['prompts']} x {b['samples']} |" for b in baselines]
    return "\n".join(lines) + "\n"


AGAINST_COLUMNS = ["group", "decoding", "n_runs", "final", "baseline", "baseline_se", "diff", "ci_low", "ci_high",
                   "beats_baseline"]
_FINAL_OF = {"sampled": "eval/reward", "greedy": "eval/greedy"}  # per_run_final's columns: held-out after RL


def against_baseline(per_run: pd.DataFrame, baseline: dict, alpha: float = 0.05) -> pd.DataFrame:
    """Per group and decoding (sampled at the training temperature against the baseline at its best one; greedy
    against greedy): the mean over runs of the final held-out accuracy minus the baseline's, with a (1 - alpha) CI
    that carries both uncertainties: the seeds' spread (SE of the mean over runs) and the baseline's own SE (over its
    prompts), added in quadrature, with Student t at n_runs - 1 degrees of freedom (conservative: the baseline's SE
    rests on far more prompts than there are seeds). beats_baseline: the CI lies above 0 (never with one run).
    `per_run` is moe_rl.analysis.per_run.per_run_final's table (columns group, eval/reward, eval/greedy)."""
    rows = []
    for decoding, column in _FINAL_OF.items():
        if column not in per_run:
            continue
        base = baseline["greedy" if decoding == "greedy" else "heldout"]
        base_se = baseline["greedy_se" if decoding == "greedy" else "heldout_se"]
        for group, values in per_run.groupby("group", sort=False)[column]:
            x = values.dropna().to_numpy(dtype=float)
            n = len(x)
            diff = float(x.mean()) - base if n else math.nan
            low = high = math.nan
            if n > 1:
                half = stats.t.ppf(1 - alpha / 2, n - 1) * math.sqrt(x.var(ddof=1) / n + base_se ** 2)
                low, high = diff - half, diff + half
            rows.append({"group": group, "decoding": decoding, "n_runs": n, "final": float(x.mean()) if n else
                         math.nan, "baseline": base, "baseline_se": base_se, "diff": diff, "ci_low": low,
                         "ci_high": high, "beats_baseline": bool(np.isfinite(low) and low > 0)})
    return pd.DataFrame(rows, columns=AGAINST_COLUMNS)
