"""The `moe-rl` command: one subcommand per entry point, each config parsed by tyro (so `--help` documents
every field).

    moe-rl --version           moe-rl <version>
    moe-rl sft   --help        supervised warm start (train's names: --total-steps, --optim.*, --log.*)
    moe-rl train --help        RL on the native MoE model
    moe-rl train --config-file runs/x/config.json --out-dir runs/y    a saved config (JSON or YAML), flags override
    moe-rl probe --help        routing churn per update and router margins, or an engine trace vs the trainer
    moe-rl evaluate --help     a checkpoint at its best sampling temperature (chosen on validation) and greedy
    moe-rl export --help       a checkpoint as a Hugging Face model folder (from_pretrained, vLLM)
    moe-rl sweep --help        a named experiment (or an ad-hoc --grid) as a sweep of runs, locally or on SLURM
    moe-rl report --help       figures, tables and a summary of runs or a sweep (analysis/, imported lazily)
    moe-rl stability --help    the stability map of a stability sweep, or of report folders (analysis/stability.py)
    moe-rl early-warning --help  which per-update signal warns of a held-out collapse (analysis/early_warning.py)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from moe_rl.errors import USER_ERRORS, ConfigError, DiskFullError, EngineFailed

# Exit statuses: 0 done, 1 a failed run (or a sweep with one), 2 a user error (one line on stderr), 3 the run diverged,
# 130 / 143 stopped by SIGINT / SIGTERM (status interrupted; the last line says how to resume).
EXIT_FAILED, EXIT_USER_ERROR, EXIT_DIVERGED = 1, 2, 3
CONFIG_FILE_HELP = """
config file (train, sft):
  --config-file PATH, --config-file=PATH
      start from a config saved as JSON or YAML (e.g. runs/<name>/config.json); every other flag overrides its
      fields, wherever it stands on the command line"""


@dataclass(frozen=True)
class Command:
    summary: str
    load: Callable[[], tuple[type, Callable]]  # lazy: (config class, function taking the config)


def _train():
    from moe_rl.commands.train import train
    from moe_rl.rl.run_config import TrainConfig

    return TrainConfig, train


def _sft():
    from moe_rl.commands.sft import sft
    from moe_rl.rl.run_config import SFTConfig

    return SFTConfig, sft


def _probe():
    from moe_rl.commands.probe import ProbeCommandConfig, probe

    return ProbeCommandConfig, probe


def _evaluate():
    from moe_rl.commands.evaluate import EvaluateConfig, evaluate

    return EvaluateConfig, evaluate


def _export():
    from moe_rl.commands.export import ExportConfig, export

    return ExportConfig, export


def _sweep():
    from functools import partial

    from moe_rl.experiments import EXPERIMENTS
    from moe_rl.sweep.command import sweep_command
    from moe_rl.sweep.config import SweepConfig

    return SweepConfig, partial(sweep_command, experiments=EXPERIMENTS)


def _stability():
    from moe_rl.analysis.stability import StabilityConfig, stability_map

    return StabilityConfig, stability_map


def _early_warning():
    from moe_rl.analysis.early_warning import EarlyWarningConfig, early_warning

    return EarlyWarningConfig, early_warning


def _report():
    from moe_rl.analysis.report import ReportConfig, report

    return ReportConfig, report


COMMANDS: dict[str, Command] = {
    "sft": Command("supervised warm start on task solutions (writes a checkpoint for --init-from)", _sft),
    "train": Command("RL with verifiable rewards: any objective, routing mode native | R2 | R3", _train),
    "probe": Command("routing churn and router margins per update from a checkpoint, or engine trace vs trainer",
                     _probe),
    "evaluate": Command("held-out accuracy at the best temperature on validation, and greedy: the baseline row",
                        _evaluate),
    "export": Command("a checkpoint as a Hugging Face model folder: config, safetensors, tokenizer", _export),
    "sweep": Command("a named experiment (experiments/) or an ad-hoc --grid as a sweep of runs: local or SLURM",
                     _sweep),
    "report": Command("figures, CSV tables and a Markdown summary of a run, a folder of runs or a sweep", _report),
    "stability": Command("the stability map of a stability sweep or of report folders (STABILITY.md, tables)",
                         _stability),
    "early-warning": Command("which per-update signal warns of a held-out collapse (fitted on even seeds, tested "
                             "on odd)", _early_warning),
}


def usage() -> str:
    lines = ["usage: moe-rl <command> [--help] [options]   (moe-rl --version: the installed version)", "",
             "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}} {cmd.summary}" for name, cmd in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"moe-rl {version()}")
        return 0
    _never_fail_to_print()
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"moe-rl: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    import tyro

    config_class, run = COMMANDS[name].load()
    module_doc = sys.modules[getattr(run, "func", run).__module__].__doc__
    takes_file = name in ("train", "sft")
    running = False
    try:
        check_renamed_flags(name, rest)
        rest, defaults = _config_file(config_class, rest) if takes_file else (rest, None)
        cfg = _parse(tyro, config_class, rest, name, defaults, module_doc + (CONFIG_FILE_HELP if takes_file else ""))
        _check_environment()
        running = True
        result = run(cfg)
    except USER_ERRORS as err:
        print(f"moe-rl {name}: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # the reader went away: after `--help | head` nothing is lost; during a command it failed
        from moe_rl.runs.progress import say, silence

        silence(sys.stdout)
        if not running:
            return 0
        say(f"moe-rl {name}: error: the output pipe was closed before the command finished", err=True)
        return EXIT_FAILED
    except DiskFullError as err:  # the file being replaced is intact (moe_rl.runs.atomic)
        resume = "; train continues from its checkpoint with --resume" if name == "train" else ""
        print(f"moe-rl {name}: error: {err} (free some space, then run the same command again{resume})",
              file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as err:  # the file system mid-run: permissions, no space left (the run is marked failed)
        where = f"{err.filename}: " if err.filename else ""
        print(f"moe-rl {name}: error: {where}{err.strerror or err} (a file system error: fix it, e.g. permissions or "
              "free space, then run the same command again; train continues from its checkpoint with --resume)",
              file=sys.stderr)
        return EXIT_USER_ERROR
    except EngineFailed as err:  # the run is marked failed; the message ends with the command that resumes it
        print(f"moe-rl {name}: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except (MemoryError, RuntimeError) as err:
        if not _out_of_memory(err):
            raise
        print(f"moe-rl {name}: error: out of memory ({str(err).strip().splitlines()[-1][:200]}); lower "
              "--rollout.sampling.max-new-tokens, the rows per step or the model's size", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt as err:  # outside train's and sft's loops, which end their runs themselves
        print(f"moe-rl {name}: interrupted ({err or 'SIGINT'}) before it finished", file=sys.stderr)
        return _signal_exit_status(str(err) or "SIGINT")
    return _exit_status(result) if takes_file else 0


def version() -> str:
    """The installed distribution's version (pyproject.toml's, through the package metadata)."""
    from importlib.metadata import version as installed_version

    return installed_version("moe-rl")


def check_renamed_flags(name: str, args: list[str]) -> None:
    """A flag spelled as before sft took train's names (--steps, --lr, --trackers, ...): one ConfigError naming the
    flag's name now, rather than tyro's unknown-flag box."""
    if name != "sft":
        return
    from moe_rl.rl.run_config import SFT_RENAMED_FLAGS

    for arg in args:
        if arg == "--":
            return
        flag = arg.partition("=")[0].replace("_", "-") if arg.startswith("--") else ""
        old = flag if flag in SFT_RENAMED_FLAGS else flag.rpartition(".")[0]  # --wandb.project -> --wandb
        if old in SFT_RENAMED_FLAGS:
            new = SFT_RENAMED_FLAGS[old] + flag[len(old):]
            raise ConfigError(f"{arg.partition('=')[0]} is now {new} (sft takes train's names for the flags they "
                              "share)")


def _check_environment() -> None:
    """The environment variables a command reads mid-run, checked before it writes anything: MOE_RL_ISA (read when
    the manifest records the kernels)."""
    from moe_rl.kernels import native

    native.isa_cap()


def _parse(tyro, config_class, args: list[str], name: str, defaults, description: str):
    """tyro.cli, with its error boxes (a bad value, an unknown flag, an invalid choice) turned into the one-line
    ConfigError every other bad input gets; --help and usage go out as tyro writes them."""
    import contextlib
    import io

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            cfg = tyro.cli(config_class, args=args, prog=f"moe-rl {name}", default=defaults, description=description)
    except SystemExit as stop:
        message = _tyro_error_line(captured.getvalue()) if stop.code not in (0, None) else None
        if message is None:
            sys.stderr.write(captured.getvalue())
            raise
        raise ConfigError(f"{message}; see moe-rl {name} --help") from None
    sys.stderr.write(captured.getvalue())  # anything tyro printed on a successful parse (warnings)
    return cfg


def _tyro_error_line(text: str) -> str | None:
    """The message of a tyro error box in one line: its first section, then the flags it suggests, if any. tyro
    draws the box with box characters on a terminal and with dashes elsewhere; both read alike here."""
    lines = [line.strip().strip("│╭╮╰╯").strip() for line in text.splitlines()]
    lines = [line for line in lines if line][1:]  # the first is the box's title
    if not any(_is_rule(line) for line in lines):
        return None  # not a box: leave it as tyro wrote it
    sections: list[list[str]] = [[]]
    for line in lines:
        if _is_rule(line):
            sections.append([])
        else:
            sections[-1].append(line)
    sections = [section for section in sections if section]
    message = " ".join(sections[0]).replace("Error parsing ", "").rstrip(".")
    suggested = [row.split()[0] for section in sections[1:] for row in section if row.startswith("--")]
    if suggested and message.startswith("Unrecognized"):
        message += f" (did you mean {', '.join(dict.fromkeys(suggested))}?)"
    return message


def _is_rule(line: str) -> bool:
    return set(line) <= set("─-") and len(line) >= 3


def _exit_status(run_dir) -> int:
    """From the status in a run directory's manifest.json: 1 failed, 3 diverged, 128 + the signal interrupted (130
    SIGINT, 143 SIGTERM), else 0 (also when there is no manifest to read, e.g. on a rank > 0)."""
    import json
    from pathlib import Path

    try:
        manifest = json.loads((Path(run_dir) / "manifest.json").read_text(encoding="utf-8"))
        status = manifest["status"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    if status == "interrupted":
        return _signal_exit_status((manifest.get("interrupted") or {}).get("signal") or "SIGINT")
    return {"diverged": EXIT_DIVERGED, "failed": EXIT_FAILED}.get(status, 0)


def _out_of_memory(err: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), the CPU allocator's RuntimeError, or Python's MemoryError."""
    text = str(err)
    return isinstance(err, MemoryError) or "out of memory" in text.lower() or "can't allocate memory" in text


def _signal_exit_status(name: str) -> int:
    from moe_rl.runs.interrupt import exit_status

    try:
        return exit_status(name)
    except KeyError:
        return exit_status("SIGINT")


def _never_fail_to_print() -> None:
    """A path with characters the terminal's encoding lacks (LC_ALL=C, PYTHONIOENCODING=ascii) is printed escaped
    rather than ending a finished run with UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def _config_file(config_class, args: list[str]):
    """`--config-file PATH` or `--config-file=PATH` (train and sft): start from a config saved as JSON or YAML, e.g.
    a run's config.json; the other flags override its fields. Returns (the other args, the defaults)."""
    at = next((i for i, arg in enumerate(args) if arg == "--config-file" or arg.startswith("--config-file=")), None)
    if at is None:
        return args, None
    arg = args[at]
    path = arg.partition("=")[2] if "=" in arg else (args[at + 1] if at + 1 < len(args) else "")
    rest = args[:at] + args[at + (1 if "=" in arg else 2) :]
    again = [a for a in rest if a == "--config-file" or a.startswith("--config-file=")]
    if again:
        raise ConfigError("--config-file is given twice; give one config file (the other flags override its fields)")
    if not path or path.startswith("--"):
        raise ConfigError("--config-file needs a path to a JSON or YAML config (e.g. runs/<name>/config.json)")
    import os

    from moe_rl.rl.overrides import from_dict, read_config_file
    from moe_rl.runs.claim import is_run_manifest

    path = os.path.expanduser(path)  # a shell leaves `--config-file=~/...` as it is
    data = read_config_file(path)
    if is_run_manifest(data):
        raise ConfigError(f"--config-file {path} is a run's manifest.json, not a config: give the config.json beside "
                          "it")
    run_dir = _run_dir_of(path)
    if run_dir is not None:  # a run's own config.json: the run is where the file is (copied or moved, it is the copy)
        data = {**data, "out_dir": str(run_dir.absolute())}
    try:
        return rest, from_dict(config_class, data)
    except ConfigError as err:
        raise ConfigError(f"--config-file {path}: {err}") from None


def _run_dir_of(path: str):
    """The run directory holding `path`, when it is a run's config.json (beside a moe-rl manifest.json), else None."""
    import json
    from pathlib import Path

    from moe_rl.runs.claim import is_run_manifest

    folder = Path(path).parent
    if Path(path).name != "config.json":
        return None
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return folder if is_run_manifest(manifest) else None


if __name__ == "__main__":
    sys.exit(main())
