"""The K cells' prediction and its test (results/churn_law/PREDICTION.md), from committed per-run tables only.

    python results/churn_law/predict.py            # the prediction, from the committed churn_repro law
    python results/churn_law/predict.py --check    # the test: the K cells' runs against that law

Run from the repository root. The law is refit from results/churn_repro/tables/per_run_final.csv (18 runs, one
warm start per architecture; bootstrap over runs, as the prediction was made). --check reads the K cells' runs
from results/churn_law/report/tables/per_run_final.csv and prints analysis.scaling.held_out_check: per cell and lr,
the measured mean beside the law at the cell's own median KL per update, and whether they agree.
"""

from __future__ import annotations

import sys

import pandas as pd

from analysis.scaling import bootstrap_laws, fit_power_law, held_out_check, percentile_interval, set_change_from_slot

LAW_RUNS = "results/churn_repro/tables/per_run_final.csv"
NEW_RUNS = "results/churn_law/report/tables/per_run_final.csv"
K_CELLS = [(4, 64, 2), (4, 8, 4), (4, 128, 8)]  # experiments/churn_repro.py K_CELLS["cpu"], at 4 MoE blocks
KLS = (1e-4, 3e-4, 1e-3)


def prediction(runs: pd.DataFrame) -> None:
    law, boots = fit_power_law(runs, "churn"), bootstrap_laws(runs, "churn")
    print(f"slot churn law on {law.n} runs: intercept {law.intercept:.3f}, "
          + ", ".join(f"{p} {c:.3f}" for p, c in zip(law.predictors, law.coef)) + f"; R^2 {law.r2:.3f}")
    for layers, experts, top_k in K_CELLS:
        for kl in KLS:
            settings = {"kl_median": kl, "model.n_layers": layers, "model.n_experts": experts, "model.top_k": top_k}
            slot, slot_ci = law.predict(settings), percentile_interval([b.predict(settings) for b in boots])
            sets = [set_change_from_slot(b.predict(settings), top_k) for b in boots]
            print(f"{experts}/{top_k} at KL {kl:g}: slot {100 * slot:.3f}% [{100 * slot_ci[0]:.3f}, "
                  f"{100 * slot_ci[1]:.3f}], set {100 * set_change_from_slot(slot, top_k):.2f}% "
                  f"[{100 * percentile_interval(sets)[0]:.2f}, {100 * percentile_interval(sets)[1]:.2f}]")


def check(runs: pd.DataFrame) -> None:
    new = pd.read_csv(NEW_RUNS)
    is_k_cell = pd.Series(False, index=new.index)
    for layers, experts, top_k in K_CELLS:
        is_k_cell |= ((new["model.n_layers"] == layers) & (new["model.n_experts"] == experts)
                      & (new["model.top_k"] == top_k))
    table = held_out_check(runs, new[is_k_cell])
    columns = ["reading", "n_layers", "n_experts", "top_k", "optim.lr", "n_runs", "driver", "measured",
               "predicted", "predicted_ci_low", "predicted_ci_high", "agrees"]
    with pd.option_context("display.width", 200, "display.float_format", "{:.4g}".format):
        print(table[columns].to_string(index=False))


if __name__ == "__main__":
    law_runs = pd.read_csv(LAW_RUNS)
    check(law_runs) if "--check" in sys.argv[1:] else prediction(law_runs)
