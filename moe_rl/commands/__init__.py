"""The entry points behind `moe-rl train`, `sft`, `evaluate`, `probe` and `export` (moe_rl/cli.py dispatches to
them): each reads its config, claims its run directory (export: its output folder) and drives the parts below it."""
