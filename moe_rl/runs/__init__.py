"""The run directory: config, manifest, append-only metrics, routing tables, atomic checkpoints, trackers.

A floor below the RL step: nothing here imports the trainer, the model or the sweep machinery.
See docs/design.md, "Run directory".
"""
