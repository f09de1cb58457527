"""Docs true: every `moe-rl ...` command line in README.md and docs/*.md parses with the CLI (tyro builds its config,
nothing runs), so a renamed flag or field fails here; and the experiment tables of docs/sweeps.md and
experiments/__init__.py list exactly the registered experiments, with the run count and steps of their defaults.

Commands are taken from fenced code blocks: a line that starts with `moe-rl` or `.venv/bin/moe-rl`, continuation
lines joined, `# comments` dropped. Placeholders read as a path: `<warm start>`, `$W`; a `...` is left out. A usage
synopsis (`[--flag VALUE]`) is checked for its flag names only. `moe-rl sweep` is also checked beyond tyro: the
experiment exists, its --arg names are the function's, and each --set / --grid key is a config field. The README's
"First hour" block also runs, as written, in tests/commands/test_first_hour.py.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
import tyro

from moe_rl.cli import COMMANDS, check_renamed_flags
from moe_rl.errors import ConfigError
from moe_rl.rl.overrides import field_paths, parse_assignments
from moe_rl.rl.run_config import SFTConfig, TrainConfig

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND_LINE = re.compile(r"^(?:\$ )?(?:\.venv/bin/)?moe-rl(?:\s|$)")


def fenced_lines(text: str):
    inside = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            inside = not inside
        elif inside:
            yield line.strip()


def documented_commands(path: Path) -> list[str]:
    """The moe-rl command lines of a Markdown file's code blocks, continuation lines joined, comments dropped."""
    found, pending = [], None
    for line in fenced_lines(path.read_text(encoding="utf-8")):
        if pending is None and not COMMAND_LINE.match(line):
            continue
        pending = line if pending is None else f"{pending} {line}"
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        found.append(pending.split(" #")[0].strip())
        pending = None
    return [c for c in found if not c.split()[1:2] or not c.split()[1].endswith(":")]  # "moe-rl x: error" is output


CASES = [(path.name, command) for path in DOCUMENTS for command in documented_commands(path)]


def arguments(command: str) -> list[str]:
    """The argv after `moe-rl`, placeholders made concrete."""
    command = re.sub(r"<[^>]*>", "X", command).replace("$W", "X")
    return [word for word in shlex.split(command)[1:] if word != "..."]


def test_the_docs_document_commands():
    """The extraction finds the commands (a change of the Markdown layout must not make this test vacuous)."""
    names = {arguments(command)[0] for _, command in CASES if arguments(command)}
    assert {"sft", "train", "probe", "evaluate", "export", "sweep", "report", "stability"} <= names, names
    assert len(CASES) >= 40


def help_text(config_class, name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        tyro.cli(config_class, args=["--help"], prog=f"moe-rl {name}")
    return out.getvalue()


@pytest.mark.parametrize(("document", "command"), CASES, ids=[f"{d}:{c[:60]}" for d, c in CASES])
def test_a_documented_command_parses(document, command):
    argv = arguments(command)
    if argv in ([], ["--help"], ["--version"], ["-V"]):
        return
    name, rest = argv[0], argv[1:]
    assert name in COMMANDS, f"{document}: {command!r}: no command {name!r}"
    config_class, _ = COMMANDS[name].load()
    if "--help" in rest:
        return
    check_renamed_flags(name, rest)
    if "[--" in command:  # a usage synopsis: its flags exist
        flags = {word.strip("[]") for word in rest if word.strip("[]").startswith("--")}
        shown = help_text(config_class, name)
        assert all(re.search(rf"{re.escape(flag)}\b", shown) for flag in flags), (document, command)
        return
    rest = without_config_file(rest)
    cfg = tyro.cli(config_class, args=rest, prog=f"moe-rl {name}")
    if name == "sweep":
        check_sweep(cfg)


def without_config_file(args: list[str]) -> list[str]:
    """The args without `--config-file PATH` (the file is a run's, made by an earlier command of the same page)."""
    for at, arg in enumerate(args):
        if arg == "--config-file":
            return args[:at] + args[at + 2:]
        if arg.startswith("--config-file="):
            return args[:at] + args[at + 1:]
    return args


def check_sweep(cfg) -> None:
    """What tyro cannot see: the experiment, its arguments, and every --set / --grid key."""
    from moe_rl.experiments import EXPERIMENTS
    from moe_rl.sweep.adhoc import grid_axes
    from moe_rl.sweep.command import experiment_arguments

    if cfg.grid or cfg.grid_file:  # the file is the user's: its keys are checked when it is read
        if cfg.grid:
            grid_axes(parse_assignments(cfg.grid, "--grid"), None)
    else:
        assert cfg.experiment in EXPERIMENTS, cfg.experiment
        experiment_arguments(EXPERIMENTS[cfg.experiment], parse_assignments(cfg.arg, "--arg"))
    train_fields, sft_fields = set(field_paths(TrainConfig)), set(field_paths(SFTConfig))
    for key in parse_assignments(cfg.set):
        assert key in train_fields or key.removeprefix("sft.") in sft_fields and key.startswith("sft."), key


# --- the experiment tables ---------------------------------------------------------------------------------------


def table_rows(text: str) -> dict[str, str]:
    """{experiment name: its row} of a Markdown table whose first column is a `name`."""
    rows = {}
    for line in text.splitlines():
        match = re.match(r"^\|\s*`(\w+)`\s*\|", line)
        if match:
            rows[match.group(1)] = line
    return rows


@pytest.fixture(scope="module")
def registry_defaults() -> dict[str, tuple[int, set[int]]]:
    """{name: (runs, total_steps of the runs)} of every registered experiment at its default arguments."""
    from moe_rl.experiments import EXPERIMENTS
    from moe_rl.sweep.command import plan_sweep

    defaults = {}
    for name, fn in EXPERIMENTS.items():
        try:
            plan = plan_sweep(fn, "sweeps/unused")
            defaults[name] = len(plan.runs), {run.config.total_steps for run in plan.runs}
        except ConfigError as err:  # `engine`'s configs build only where vLLM is installed: count its grid
            assert "vLLM" in str(err), err
            exp = fn()
            defaults[name] = len(exp.grid), {point.get("total_steps", exp.base.total_steps) for point in exp.grid}
    return defaults


@pytest.mark.parametrize("where", ["docs/sweeps.md", "experiments/__init__.py"])
def test_the_experiment_tables_list_the_registry_with_its_run_counts(registry_defaults, where):
    rows = table_rows((REPO / where).read_text(encoding="utf-8"))
    missing = {name: f"{runs} runs x {', '.join(map(str, sorted(steps)))} steps"
               for name, (runs, steps) in registry_defaults.items() if name not in rows}
    assert not missing, f"{where}: add a row for each registered experiment: {missing}"
    assert set(rows) == set(registry_defaults), f"{where} lists experiments the registry lacks"
    for name, (runs, steps) in registry_defaults.items():
        counted = re.search(r"(\d+) runs(?: x (\d+) steps)?", rows[name])
        assert counted and int(counted.group(1)) == runs, f"{where}, {name}: the defaults plan {runs} runs"
        if counted.group(2):
            assert steps == {int(counted.group(2))}, f"{where}, {name}: the default runs take {steps} steps"
