"""The names the stability map's analysis (analysis/stability.py) and its text (analysis/stability_text.py) share."""

AXES = {"optim.lr": "learning rate", "minibatches": "minibatches per rollout batch"}
REFERENCE = "grpo native"  # the method every other is compared with
ENDPOINT_LABELS = {"change": "T = 1", "greedy_change": "greedy"}
MARGIN = 0.03
"""The equivalence margin of the paired comparisons (held-out accuracy), fixed before the runs in
results/stability/PROTOCOL.md."""
