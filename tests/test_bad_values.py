"""Nothing silent, round two: numbers that reject NaN and Inf, choices typed as choices, and the inputs that used to
print a traceback, through `moe_rl.cli.main` in this process (the real command's path, without a process start).

Every case asserts the exit status, that the culprit is named, that no traceback is printed and that nothing was
written (no run directory appears, an existing one keeps its bytes).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest

from moe_rl.cli import main
from moe_rl.config import SFTConfig, TrainConfig
from moe_rl.errors import ConfigError, check_finite_fields

TINY = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "4", "--model.n-kv-heads", "2",
        "--model.n-experts", "4", "--model.top-k", "2", "--model.d-expert", "32", "--model.d-dense", "64"]


def run_cli(capsys, argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr on one line) of `moe-rl argv`, as the entry point gives them (tyro exits with 2)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit:
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, " ".join(err.replace("│", " ").split())  # tyro wraps its box at the terminal width


# --- finite checks on every float field, in one place ---------------------------------------------------------------


@pytest.mark.parametrize("command, flag, value, named", [
    ("train", "--optim.grad-clip", "nan", "grad_clip=nan must be a finite number"),
    ("train", "--kl-coef", "nan", "kl_coef=nan must be a finite number"),
    ("train", "--optim.lr", "nan", "lr=nan must be a finite number"),
    ("train", "--optim.lr", "inf", "lr=inf must be a finite number"),
    ("train", "--rollout.sampling.temperature", "nan", "temperature=nan must be a finite number"),
    ("train", "--rollout.sampling.top-p", "nan", "top_p=nan"),
    ("train", "--model.rope-theta", "0", "model.rope_theta=0.0 must be > 0"),
    ("train", "--model.rope-theta", "nan", "rope_theta=nan must be a finite number"),
    ("train", "--objective.clip-high", "inf", "clip_high=inf must be a finite number"),
    ("train", "--task.eval-fraction", "nan", "eval_fraction=nan"),
    ("sft", "--lr", "nan", "lr=nan must be a finite number"),
    ("sft", "--grad-clip", "-inf", "grad_clip=-inf must be a finite number"),
    ("probe", "--optim.lr", "nan", "lr=nan must be a finite number"),
    ("probe", "--low-margin-quantile", "nan", "low_margin_quantile=nan must be a finite number"),
])
def test_nan_and_inf_are_refused_naming_the_field_before_anything_is_written(capsys, tmp_path, command, flag, value,
                                                                              named):
    out = ["--out", tmp_path / "run"] if command == "probe" else ["--out-dir", tmp_path / "run"]
    code, stdout, stderr = run_cli(capsys, [command, *out, flag, value])
    assert code == 2 and named in stderr and "Traceback" not in stderr + stdout, stderr
    assert list(tmp_path.iterdir()) == []


def test_every_float_field_of_every_command_is_checked():
    """The walk reaches each float field of the nested configs (a new field is covered without a new line)."""
    from moe_rl.probe import ProbeCommandConfig

    for config in (TrainConfig(), SFTConfig(), ProbeCommandConfig()):
        paths = float_paths(config)
        assert paths, type(config).__name__
        for path in paths:
            with pytest.raises(ConfigError, match=f"{path.rsplit('.', 1)[-1]}=nan must be a finite number"):
                check_finite_fields(with_value(config, path, math.nan))


def float_paths(config, prefix: str = "") -> list[str]:
    paths = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            paths += float_paths(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) or (isinstance(value, tuple) and value and isinstance(value[0], float)):
            paths.append(f"{prefix}{f.name}")
    return paths


def with_value(config, path: str, value):
    """A copy of `config` with one field set, bypassing validation (object.__setattr__ on copies)."""
    head, _, rest = path.partition(".")
    changed, current = copy.copy(config), getattr(config, head)
    if rest:
        new = with_value(current, rest, value)
    else:
        new = (value,) if isinstance(current, tuple) else value
    object.__setattr__(changed, head, new)
    return changed


@pytest.mark.parametrize("flag, value", [("--device", "tpu"), ("--routing-mode", "R4"), ("--tokens", "some"),
                                         ("--parallel", "zero3")])
def test_probe_choice_fields_are_choices(capsys, tmp_path, flag, value):
    code, stdout, stderr = run_cli(capsys, ["probe", "--out", tmp_path / "p", flag, value])
    assert code == 2 and f"invalid choice '{value}'" in stderr and flag in stderr and "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []
