"""Sweeps: experiments expanded into grids of runs, the sweep directory, a local worker pool and SLURM arrays.

The top floor next to `moe_rl.cli`: it imports the trainer and the run directory, never the other way round.
`moe_rl.sweep.command` is the `moe-rl sweep` command; see docs/sweeps.md.
"""
