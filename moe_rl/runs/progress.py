"""What a running command prints: one line per rollout step (train), every n steps (sft), per finished job (sweep),
and a last line with the run's status and directory. Printed by rank 0 only, to stdout, flushed at once so that a
sweep's per-job log fills as the run goes; `--quiet` silences the progress lines (a divergence is still reported,
on stderr).

    step 12/50  reward 0.438  eval 0.406  churn 0.091  kl 2.1e-04  1.83 s/step  ETA 1m10s
    step  1/50  reward 0.000  churn 0.041  kl 0.00e+00  no RL signal  1.83 s/step  ETA 1m30s
      no RL signal: every group's rewards were equal, so ... (once, the first time: where that churn comes from)
    final evaluation (held-out, 64 prompts, after step 50): reward 0.422 +- 0.031, greedy 0.453 +- 0.031
    finished: 50 steps in 1m32s -> runs/grpo
    diverged at step 7: non-finite loss (nan) or gradient norm (nan) at step 7, minibatch 2 -> runs/grpo
    interrupted at step 3; resume with: moe-rl train --config-file runs/grpo/config.json --resume
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Mapping


def duration(seconds: float) -> str:
    """12.3 s -> '12s', 95 -> '1m35s', 4000 -> '1h06m'."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _number(value: float) -> str:
    return f"{value:.2e}" if value != 0 and abs(value) < 1e-3 else f"{value:.3f}"


class Progress:
    """Prints `step i/total  <fields>  s/step  ETA` lines; the rate counts only the steps this process ran."""

    def __init__(self, total: int, *, start: int = 0, quiet: bool = False, unit: str = "step"):
        self.total, self.start, self.quiet, self.unit = total, start, quiet, unit
        self.t0 = time.perf_counter()
        self.explained: set[str] = set()  # the notes whose explanation has been printed

    def step(self, done: int, fields: Mapping[str, float | None], note: str | None = None) -> None:
        """`done` steps are complete; `fields` (None values left out) and `note` go between the count and the
        timing. The first time a note from NOTE_EXPLANATIONS appears, its explanation follows on its own line."""
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.t0
        rate = elapsed / max(1, done - self.start)
        shown = "  ".join(f"{k} {_number(v)}" for k, v in fields.items() if v is not None and math.isfinite(v))
        shown += f"  {note}" if note else ""
        width = len(str(self.total))
        say(f"{self.unit} {done:>{width}}/{self.total}  {shown}  {rate:.2f} s/{self.unit}  "
            f"ETA {duration(rate * (self.total - done))}")
        kind = note.split(" in ")[0] if note else None
        if kind in NOTE_EXPLANATIONS and kind not in self.explained:
            self.explained.add(kind)
            say(f"  {kind}: {NOTE_EXPLANATIONS[kind]}")

    def line(self, text: str) -> None:
        """A line of its own among the progress lines (silenced by quiet like them)."""
        if not self.quiet:
            say(text)

    def end(self, status: str, run_dir: str, step: int, reason: str | None = None) -> None:
        """The last line: how the run ended, and where it lives."""
        if status == "diverged":
            say(f"diverged at {self.unit} {step}: {reason} -> {run_dir}", err=True)
        elif status == "interrupted":  # `reason` says how to continue
            say(f"interrupted at {self.unit} {step}; {reason}", err=True)
        elif not self.quiet:
            ran = step - self.start
            say(f"{status}: {ran} {self.unit}s in {duration(time.perf_counter() - self.t0)} -> {run_dir}")


def rl_step_fields(lines: Iterable[Mapping]) -> dict[str, float | None]:
    """The progress fields of one rollout step from its metrics lines: the rollout's reward, the held-out reward
    when it was evaluated, and the mean over its optimizer steps of the update churn and the k3 KL(old || new)."""
    lines = list(lines)

    def first(key: str):
        return next((line[key] for line in lines if isinstance(line.get(key), (int, float))), None)

    def mean(key: str):
        values = [line[key] for line in lines if isinstance(line.get(key), (int, float))]
        return sum(values) / len(values) if values else None

    return {"reward": first("reward"), "eval": first("eval/reward"), "churn": mean("routing/update/churn"),
            "kl": mean("kl")}


def final_eval_line(line: Mapping, step: int, prompts: int) -> str:
    """The held-out evaluation after training in one line: sampled reward and greedy accuracy, each +- its SE over
    prompts (moe_rl.rl.heldout); greedy only when it was measured."""
    def reading(name: str, key: str) -> str | None:
        value, se = line.get(key), line.get(f"{key}_se")
        if not isinstance(value, (int, float)):
            return None
        return f"{name} {value:.3f}" + (f" +- {se:.3f}" if isinstance(se, (int, float)) else "")

    shown = ", ".join(r for r in (reading("reward", "eval/reward"), reading("greedy", "eval/greedy")) if r)
    return f"final evaluation (held-out, {prompts} prompts, after step {step}): {shown}"


NO_RL_SIGNAL = "no RL signal"
NOTE_EXPLANATIONS = {
    NO_RL_SIGNAL: "every group's rewards were equal, so every advantage was zero and the objective gave no gradient; "
                  "this step's routing churn comes from the load-balancing loss alone (and the KL term when "
                  "kl_coef > 0), and every objective would have made the same update (metric churn/no_rl_signal)",
}


def no_rl_signal_note(lines: Iterable[Mapping]) -> str | None:
    """'no RL signal' when no optimizer step of a rollout step had a nonzero advantage (churn/no_rl_signal = 1 on
    each), 'no RL signal in i/n updates' when some had none, None when every one had some (or none was logged)."""
    flags = [line["churn/no_rl_signal"] for line in lines if isinstance(line.get("churn/no_rl_signal"), (int, float))]
    without = sum(1 for flag in flags if flag == 1)
    if not without:
        return None
    return NO_RL_SIGNAL if without == len(flags) else f"{NO_RL_SIGNAL} in {without}/{len(flags)} updates"


def say(line: str, err: bool = False) -> None:
    """Print one line, flushed. A reader that went away (`moe-rl train ... | head -1`) does not end the run: the
    stream is pointed at os.devnull and the run goes on silently (its metrics and manifest say how it went)."""
    stream = sys.stderr if err else sys.stdout
    try:
        print(line, file=stream, flush=True)
    except BrokenPipeError:
        silence(stream)


def silence(stream) -> None:
    """Point a stream whose reader closed the pipe at os.devnull, so that no later write or the flush at exit fails
    ("Exception ignored ... BrokenPipeError", exit status 120)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor (a StringIO in tests): nothing to redirect
        pass
