"""Analysis of moe-rl run directories: loaders, aggregation over seeds, figures and the `moe-rl report` command.

Reads run directories only; the trainer never imports this package (docs/design.md section 2). See docs/analysis.md.

    from moe_rl.analysis import load_runs, group_keys, add_groups, mean_ci, final_scores
    data = load_runs("runs/")                         # a run, a folder of runs, or a sweep
    data = add_groups(data, group_keys(data))         # group by the config fields that vary (seed excluded)
    mean_ci(data.steps, "reward", x="step")           # mean and 95% CI (Student t) per group and rollout step

Figures live in moe_rl.analysis.plots (matplotlib is imported only there and in moe_rl.analysis.report).
"""

from moe_rl.analysis.aggregate import (
                                add_groups,
                                bootstrap_ci,
                                final_scores,
                                group_keys,
                                iqm,
                                layer_churn,
                                mean_ci,
                                run_finals,
                                run_initials,
                                summarize,
                                t_ci,
)
from moe_rl.analysis.cells import churn_vs_lr_depth, run_summary
from moe_rl.analysis.load import NoRunsError, RunSet, find_runs, load_runs, per_step

__all__ = ["NoRunsError", "RunSet", "add_groups", "bootstrap_ci", "churn_vs_lr_depth", "final_scores", "find_runs",
           "group_keys", "iqm", "layer_churn", "load_runs", "mean_ci", "per_step", "run_finals", "run_initials",
           "run_summary", "summarize", "t_ci"]
