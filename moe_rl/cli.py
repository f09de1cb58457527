"""The `moe-rl` command: one subcommand per entry point, each config parsed by tyro (so `--help` documents
every field).

    moe-rl sft   --help        supervised warm start
    moe-rl train --help        RL on the native MoE model
    moe-rl train --config-file runs/x/config.json --out-dir runs/y    a saved config, flags override its fields
    moe-rl probe --help        routing churn per update and router margins, or an engine trace vs the trainer
    moe-rl sweep --help        a named experiment as a sweep of runs, locally or on SLURM
    moe-rl report --help       figures, tables and a summary of runs or a sweep (analysis/, imported lazily)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from moe_rl.errors import ConfigError, DataError, RoutingError

# Errors that are the user's input, not a bug: printed as one line, exit status 2. FileNotFoundError covers a
# missing data file and a resume with nothing to resume; FileExistsError a run directory that is already used.
USER_ERRORS = (ConfigError, DataError, RoutingError, FileNotFoundError, FileExistsError)


@dataclass(frozen=True)
class Command:
    summary: str
    load: Callable[[], tuple[type, Callable]]  # lazy: (config class, function taking the config)


def _train():
    from moe_rl.config import TrainConfig
    from moe_rl.train import train

    return TrainConfig, train


def _sft():
    from moe_rl.config import SFTConfig
    from moe_rl.sft import sft

    return SFTConfig, sft


def _probe():
    from moe_rl.probe import ProbeCommandConfig, probe

    return ProbeCommandConfig, probe


def _sweep():
    from functools import partial

    from experiments import EXPERIMENTS
    from moe_rl.sweep.command import sweep_command
    from moe_rl.sweep.config import SweepConfig

    return SweepConfig, partial(sweep_command, experiments=EXPERIMENTS)


def _report():
    from analysis.report import ReportConfig, report

    return ReportConfig, report


COMMANDS: dict[str, Command] = {
    "sft": Command("supervised warm start on task solutions (writes a checkpoint for --init-from)", _sft),
    "train": Command("RL with verifiable rewards: any objective, routing mode native | R2 | R3", _train),
    "probe": Command("routing churn and router margins per update from a checkpoint, or engine trace vs trainer",
                     _probe),
    "sweep": Command("a named experiment (experiments/) as a sweep of runs: local workers or SLURM", _sweep),
    "report": Command("figures, CSV tables and a Markdown summary of a run, a folder of runs or a sweep", _report),
}


def usage() -> str:
    lines = ["usage: moe-rl <command> [--help] [options]", "", "commands:"]
    lines += [f"  {name:<8} {cmd.summary}" for name, cmd in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"moe-rl: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    import tyro

    config_class, run = COMMANDS[name].load()
    module_doc = sys.modules[getattr(run, "func", run).__module__].__doc__
    try:
        rest, defaults = _config_file(config_class, rest)
        cfg = tyro.cli(config_class, args=rest, prog=f"moe-rl {name}", description=module_doc, default=defaults)
        run(cfg)
    except USER_ERRORS as err:
        print(f"moe-rl {name}: error: {err}", file=sys.stderr)
        return 2
    return 0


def _config_file(config_class, args: list[str]):
    """`--config-file PATH` (train and sft): start from a config saved as JSON, e.g. a run's config.json or one
    written from an experiment; the other flags override its fields. Returns (the other args, the defaults)."""
    if "--config-file" not in args:
        return args, None
    at = args.index("--config-file")
    if at + 1 >= len(args):
        raise ConfigError("--config-file needs a path to a JSON config (e.g. runs/<name>/config.json)")
    import json

    from moe_rl.sweep.overrides import from_dict

    path = args[at + 1]
    with open(path, encoding="utf-8") as file:
        defaults = from_dict(config_class, json.load(file))
    return args[:at] + args[at + 2 :], defaults


if __name__ == "__main__":
    sys.exit(main())
