"""moe-rl evaluate: a checkpoint's held-out accuracy at its best decoding (temperature, and optionally a length
control) and greedy: the baseline row an RL gain is stated against.

RL on a warm start can raise sampled accuracy merely by sharpening the policy, which a lower temperature does for
free. So a comparison table needs the warm start's own best: this samples the checkpoint on the task's validation
split at each of `--temperatures`, picks the temperature with the highest validation accuracy (the lowest one on a
tie), and only then measures held-out accuracy at that temperature and greedily. The held-out numbers are never
used for the choice, so they stay unbiased (validation and held-out share no prompt: moe_rl/tasks/gym.py).

A warm start may also be held back by stopping too early, which a decoder fixes for free too. `--min-new-tokens`
sweeps a length control with the temperatures: EOS is banned before that many response tokens (vLLM's min_tokens).
The (temperature, length) pair is chosen on validation as above (ties: the shorter length, then the lower
temperature), and greedy decoding gets its own best length on validation; held-out then reports sampled at the pair,
greedy, and greedy at its best length.

It writes evaluate.json (config, the sweep, the choice, the held-out row) and evaluate.csv (one row per measurement)
to `--out`, by default <run>/evaluate/. Standard errors count prompts, not samples (moe_rl/rl/heldout.py); the
analysis side reads the file with moe_rl.analysis.baseline. It simplifies on purpose: one process, no top-p sweep,
native or Hugging Face models through moe_rl.rl.build as training builds them.

The task and sampler come from the run's config.json (`task`, and `rollout.sampling` or SFT's `sampling`); without
one, the defaults. `--set` overrides them, e.g. longer problems than the warm start saw:

    moe-rl evaluate --checkpoint runs/sft/checkpoints/latest.pt                        # CPU
    moe-rl evaluate --checkpoint runs/sft --heldout-prompts 1024 --samples 4 \\
        --set task.min_terms=7 task.max_terms=7 sampling.max_new_tokens=64
    moe-rl evaluate --checkpoint runs/grpo --device cuda                               # one GPU
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from moe_rl.errors import ConfigError, check_finite_fields, check_positive
from moe_rl.model import ModelConfig
from moe_rl.rl.build import build_model, build_model_tokenizer, check_task_fits, resolve_device
from moe_rl.rl.heldout import Accuracy, accuracy, greedy
from moe_rl.rl.overrides import Assignments, from_dict, parse_assignments, with_overrides
from moe_rl.rl.rollout import SamplingConfig
from moe_rl.rl.run_config import Device
from moe_rl.runs.checkpoint import CHECKPOINTS, LATEST, load_checkpoint
from moe_rl.runs.progress import say
from moe_rl.runs.runlog import read_config
from moe_rl.tasks import TaskConfig, build_task
from moe_rl.tasks.gym import HELD_OUT_RESERVE

TEMPERATURES = (0.3, 0.5, 0.7, 0.85, 1.0, 1.2)
FILES = ("evaluate.json", "evaluate.csv")


@dataclass
class EvaluateConfig:
    """A checkpoint, the temperatures to sweep on validation, and how many prompts and samples to measure."""

    checkpoint: str
    """A checkpoint file (a run's checkpoints/latest.pt) or a run directory (its checkpoints/latest.pt is used)."""
    out: str | None = None
    """Directory for evaluate.json and evaluate.csv; None = <run>/evaluate (beside a checkpoint outside a run)."""
    temperatures: tuple[float, ...] = TEMPERATURES
    """Sampling temperatures swept on the validation split (each > 0, distinct)."""
    min_new_tokens: tuple[int, ...] = (0,)
    """Length controls swept with the temperatures on validation: EOS banned before this many response tokens (each
    >= 0 and below the sampler's max_new_tokens, distinct); (0,) = no length control."""
    validation_prompts: int = 512
    """Validation prompts per temperature."""
    heldout_prompts: int = 1024
    """Held-out prompts (at most HELD_OUT_RESERVE = 2048, the prompts validation is kept apart from)."""
    samples: int = 1
    """Sampled completions per prompt at each temperature, validation and held-out (greedy takes one)."""
    seed: int = 0
    """Seeds the sampler (one generator per measurement, so each number is reproducible on its own)."""
    set: Assignments = ()
    """Overrides of the run's task and sampler, e.g. task.min_terms=7 sampling.max_new_tokens=64."""
    device: Device = "auto"
    """auto, cpu or cuda."""
    threads: int = 1
    """torch CPU threads."""

    def __post_init__(self) -> None:
        check_finite_fields(self)
        for name in ("validation_prompts", "heldout_prompts", "samples", "threads"):
            check_positive(name, getattr(self, name))
        check_positive("seed", self.seed, allow_zero=True)
        if not self.temperatures or any(not t > 0 for t in self.temperatures):
            raise ConfigError(f"temperatures={self.temperatures} must be one or more values > 0")
        if len(set(self.temperatures)) != len(self.temperatures):
            raise ConfigError(f"temperatures={self.temperatures} has a value twice")
        if not self.min_new_tokens or any(n < 0 for n in self.min_new_tokens):
            raise ConfigError(f"min_new_tokens={self.min_new_tokens} must be one or more values >= 0")
        if len(set(self.min_new_tokens)) != len(self.min_new_tokens):
            raise ConfigError(f"min_new_tokens={self.min_new_tokens} has a value twice")
        if self.heldout_prompts > HELD_OUT_RESERVE:
            raise ConfigError(f"heldout_prompts={self.heldout_prompts} is more than the {HELD_OUT_RESERVE} held-out "
                              "prompts validation is kept apart from; use --samples for more power")


@dataclass
class EvalData:
    """What is evaluated: the task and the sampler (the targets of --set)."""

    task: TaskConfig = field(default_factory=TaskConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


def locate(checkpoint: str) -> tuple[Path, Path]:
    """(the checkpoint file, the run directory) for a checkpoint file or a run directory; a checkpoint outside
    checkpoints/ is its own folder's."""
    path = Path(checkpoint)
    if path.is_dir():
        return path / CHECKPOINTS / LATEST, path
    return path, path.parent.parent if path.parent.name == CHECKPOINTS else path.parent


def eval_data(run: Path, overrides: tuple[str, ...]) -> EvalData:
    """The run's task and sampler (config.json of moe-rl train or sft; the defaults without one), then `overrides`."""
    data = EvalData()
    if (run / "config.json").is_file():
        saved = read_config(run)
        sampling = saved.get("rollout", {}).get("sampling", saved.get("sampling", {}))
        data = EvalData(from_dict(TaskConfig, saved.get("task", {})), from_dict(SamplingConfig, sampling))
    return with_overrides(data, parse_assignments(overrides), what="--set") if overrides else data


def read_checkpoint(path: Path) -> tuple[ModelConfig, int | None]:
    """The checkpoint's saved architecture and step (its weights are loaded by moe_rl.rl.build)."""
    state = load_checkpoint(path, mmap=True, require=("model",))
    saved = state.get("model_config")
    if not saved:
        raise ConfigError(f"checkpoint={path} holds no model_config; it was not saved by moe-rl train or sft")
    known = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in known}), state.get("step")


def pick_best(sweep: dict) -> Any:
    """The setting of the highest validation accuracy; on a tie the smallest setting: the lowest temperature, or for
    (min_new_tokens, temperature) pairs the shortest length control, then the lowest temperature."""
    best = max(acc.mean for acc in sweep.values())
    return min(key for key, acc in sweep.items() if acc.mean == best)


def evaluate(cfg: EvaluateConfig) -> dict:
    """Sweep, choose, measure held-out; print the result and write it to cfg.out. Returns evaluate.json's dict."""
    torch.set_num_threads(cfg.threads)
    path, run = locate(cfg.checkpoint)
    data = eval_data(run, cfg.set)
    for n in cfg.min_new_tokens:  # the sampler's own check, naming this command's field
        if n >= data.sampling.max_new_tokens:
            raise ConfigError(f"min_new_tokens={n} must be < the sampler's max_new_tokens="
                              f"{data.sampling.max_new_tokens}")
    model_cfg, step = read_checkpoint(path)
    tokenizer = build_model_tokenizer(model_cfg)
    task = build_task(data.task, tokenizer)
    check_task_fits(model_cfg, tokenizer, task, data.sampling.max_new_tokens)
    model = build_model(model_cfg, resolve_device(cfg.device), cfg.seed, str(path)).eval()

    def measure(split: str, prompts: int, sampling: SamplingConfig, samples: int = cfg.samples) -> Accuracy:
        return accuracy(model, task, tokenizer, split, prompts, sampling, samples, cfg.seed)

    def decoding(length: int, temperature: float) -> SamplingConfig:
        return replace(data.sampling, temperature=temperature, min_new_tokens=length)

    lengths = sorted(cfg.min_new_tokens)
    sweep = {(n, t): measure("validation", cfg.validation_prompts, decoding(n, t))
             for n in lengths for t in sorted(cfg.temperatures)}
    best_length, best = pick_best(sweep)
    sampled = measure("eval", cfg.heldout_prompts, decoding(best_length, best))
    argmax = measure("eval", cfg.heldout_prompts, greedy(data.sampling), samples=1)
    result = {"checkpoint": str(path), "step": step, "config": asdict(cfg), "task": asdict(data.task),
              "sampling": asdict(data.sampling),
              "validation": [{"temperature": t, "min_new_tokens": n, **asdict(acc)} for (n, t), acc in sweep.items()],
              "best_temperature": best, "best_min_new_tokens": best_length,
              "heldout": {"sampled": {"temperature": best, "min_new_tokens": best_length, **asdict(sampled)},
                          "greedy": asdict(argmax)}}
    if lengths != [0]:
        greedy_sweep = {n: measure("validation", cfg.validation_prompts,
                                   replace(greedy(data.sampling), min_new_tokens=n), samples=1) for n in lengths}
        greedy_length = pick_best(greedy_sweep)
        result["validation_greedy"] = [{"min_new_tokens": n, **asdict(acc)} for n, acc in greedy_sweep.items()]
        result["heldout"]["greedy_length"] = {
            "min_new_tokens": greedy_length,
            **asdict(measure("eval", cfg.heldout_prompts, replace(greedy(data.sampling),
                                                                  min_new_tokens=greedy_length), samples=1))}
    out = Path(cfg.out) if cfg.out else run / "evaluate"
    write_result(out, result)
    say(format_result(result, out))  # written already: a reader that went away loses only this printout
    return result


def csv_rows(result: dict) -> list[dict]:
    """One row per measurement: split, decoding, temperature, min_new_tokens, mean, se, prompts, samples, chosen."""
    best = (result.get("best_min_new_tokens", 0), result["best_temperature"])
    rows = [{"split": "validation", "decoding": "sampled", "min_new_tokens": 0, **r,
             "chosen": (r.get("min_new_tokens", 0), r["temperature"]) == best} for r in result["validation"]]
    rows.append({"split": "heldout", "decoding": "sampled", "min_new_tokens": 0, **result["heldout"]["sampled"],
                 "chosen": True})
    rows.append({"split": "heldout", "decoding": "greedy", "temperature": None, "min_new_tokens": 0,
                 **result["heldout"]["greedy"], "chosen": True})
    if "greedy_length" in result["heldout"]:
        chosen = result["heldout"]["greedy_length"]["min_new_tokens"]
        rows += [{"split": "validation", "decoding": "greedy", "temperature": None, **r,
                  "chosen": r["min_new_tokens"] == chosen} for r in result["validation_greedy"]]
        rows.append({"split": "heldout", "decoding": "greedy", "temperature": None,
                     **result["heldout"]["greedy_length"], "chosen": True})
    return rows


def write_result(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / FILES[0]).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    rows = csv_rows(result)
    with open(out / FILES[1], "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def format_result(result: dict, out: Path) -> str:
    def cell(acc: dict) -> str:
        return f"{acc['mean']:.3f} +- {acc['se']:.3f}"

    def length(row: dict) -> str:
        return f" min_new_tokens={row['min_new_tokens']}" if row.get("min_new_tokens") else ""

    best = (result.get("best_min_new_tokens", 0), result["best_temperature"])
    first = result["validation"][0]
    lines = [f"validation ({first['prompts']} prompts x {first['samples']} samples):"]
    lines += [f"  T={r['temperature']:<5g}{length(r)} {cell(r)}"
              + ("   <- best" if (r.get("min_new_tokens", 0), r["temperature"]) == best else "")
              for r in result["validation"]]
    sampled, argmax = result["heldout"]["sampled"], result["heldout"]["greedy"]
    lines.append(f"held-out ({sampled['prompts']} prompts): T={sampled['temperature']:g}{length(sampled)} "
                 f"{cell(sampled)} ({sampled['samples']} samples each); greedy {cell(argmax)}")
    if "greedy_length" in result["heldout"]:
        chosen = result["heldout"]["greedy_length"]
        lines.append(f"held-out greedy at its best length control on validation:{length(chosen) or ' none'} "
                     f"{cell(chosen)}")
    lines.append(f"wrote {out / FILES[0]} and {out / FILES[1]}")
    return "\n".join(lines)
