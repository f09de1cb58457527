"""The K-separating cells' prediction (results/churn_law/PREDICTION.md) from the committed churn_repro law:
its per-run table, refit and bootstrapped with analysis/scaling.py. Run from the repository root."""
import pandas as pd
from analysis.scaling import fit_power_law, bootstrap_laws, set_change_from_slot, _interval
runs = pd.read_csv("results/churn_repro/tables/per_run_final.csv")
law = fit_power_law(runs, "churn"); boots = bootstrap_laws(runs, "churn")
print(law.predictors, law.intercept, law.coef, law.r2, law.n, len(boots))
# The K-separating cells of experiments/churn_repro.py (and the two old ones), at three KLs per update.
for L, E, K in [(4, 64, 2), (4, 8, 4), (4, 128, 8), (4, 64, 8), (4, 8, 2)]:
    for kl in (1e-4, 3e-4, 1e-3):
        s = {"kl_median": kl, "model.n_layers": L, "model.n_experts": E, "model.top_k": K}
        c = law.predict(s); ci = _interval([b.predict(s) for b in boots])
        sc = set_change_from_slot(c, K); sci = _interval([set_change_from_slot(b.predict(s), K) for b in boots])
        print(f"L{L} {E}/{K} KL {kl:g}: slot {100*c:.3f}% [{100*ci[0]:.3f}, {100*ci[1]:.3f}]  set {100*sc:.2f}% [{100*sci[0]:.2f}, {100*sci[1]:.2f}]")
