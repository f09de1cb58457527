"""The entry points behind `moe-rl train`, `sft`, `evaluate` and `probe` (moe_rl/cli.py dispatches to them): each
reads its config, claims its run directory and drives the parts below it."""
