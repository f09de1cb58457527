"""moe-rl probe: how much does a model's routing move per RL update? Or: how far is an engine's routing from ours?

Update mode (default). From a checkpoint (or a random init), sample one rollout batch of the task, split it into
`updates` minibatches and take one optimizer step on each with the chosen objective, exactly as one rollout step of
`moe-rl train` (the same Trainer and the same update probe run), and report per update and per MoE layer:

    churn, set_change, token_any     routing before vs after the step on the probed tokens (docs/design.md section 5)
    margin_median, margin_below_t    the router margin (k-th minus (k+1)-th router score) before the step
    churn_low_margin, churn_rest     slot churn of the tokens in the lowest-margin quantile vs the others
    changes_in_low_margin            the share of changed decisions that were low-margin tokens
    no_rl_signal                     1 when every advantage of the update's rows was zero (equal rewards in each
                                     group): that churn is the load-balancing loss's, not RL's (a line says so)

Trace mode (`--trace FILE`). Read an inference engine's routed experts (vLLM `routed_experts`, SGLang's equivalent;
layouts in moe_rl/routing/engine_traces.py), run the model natively over the same tokens and report engine vs trainer
routing per layer: the R3 paper's set_change and token_any, and slot churn.

Both print a table and write probe.csv and probe.json to --out (update mode also writes the per-layer routing table
under routing/, as a training run does). It simplifies on purpose: one rollout batch, no evaluation, no checkpoint.

    moe-rl probe --checkpoint runs/sft/checkpoints/latest.pt --optim.lr 1e-3 --updates 4 --out runs/probe   # CPU
    moe-rl probe --checkpoint runs/sft/checkpoints/latest.pt --trace rollouts.parquet --out runs/probe_trace
    moe-rl probe --checkpoint ckpt.pt --device cuda --objective.name gspo ...                     # one GPU
    torchrun --standalone --nproc_per_node=8 -m moe_rl.cli probe --parallel fsdp2 --device cuda ...   # sharded
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Literal

import torch

from moe_rl.errors import ConfigError, check_choice, check_positive
from moe_rl.model import ModelConfig
from moe_rl.objectives import ObjectiveConfig
from moe_rl.rl import distributed
from moe_rl.rl.build import build_model, resolve_device
from moe_rl.rl.distributed import PARALLEL_MODES
from moe_rl.rl.policy import policy_forward
from moe_rl.rl.probes import NativeRouting, ProbeConfig, Prober
from moe_rl.rl.run_config import (
    ROUTING_MODES,
    Device,
    LogConfig,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
    check_numbers,
)
from moe_rl.rl.trainer import Trainer
from moe_rl.routing.engine_traces import compare_with_model
from moe_rl.routing.margins import LOW_MARGIN_QUANTILE, MARGIN_THRESHOLDS, margin_churn, record_margins
from moe_rl.routing.mode import ModeName
from moe_rl.routing.trace import RoutingTrace
from moe_rl.runs.checkpoint import load_checkpoint
from moe_rl.runs.progress import NO_RL_SIGNAL, NOTE_EXPLANATIONS, no_rl_signal_note, say
from moe_rl.tasks import TaskConfig


@dataclass
class ProbeCommandConfig:
    """One probe: a model, a task, an objective and a learning rate; or a model and an engine trace."""

    checkpoint: str | None = None
    """Checkpoint to probe (a run's checkpoints/latest.pt); its saved architecture replaces --model.*. None: a
    random init of --model.*."""
    out: str = "runs/probe"
    """Directory for probe.csv, probe.json (and, in update mode, routing/)."""
    trace: str | None = None
    """Engine routing trace (.parquet, .pt, .npy, or .jsonl of vLLM 0.3x / SGLang HTTP responses; see
    moe_rl/routing/engine_traces.py) to compare with the model's routing of the same tokens, instead of probing
    updates."""
    updates: int = 4
    """Optimizer steps on minibatches of one rollout batch (the batch must split evenly)."""
    seed: int = 0
    """Seeds sampling and minibatch shuffling (and the model without a checkpoint), as in moe-rl train."""
    routing_mode: ModeName = "native"
    """native, R2 or R3 for the updates (as moe-rl train)."""
    tokens: Literal["response", "all"] = "response"
    """Tokens compared: 'response' (positions that score a response or output token) or 'all' (every position;
    in trace mode every position the engine reported)."""
    margin_thresholds: tuple[float, ...] = MARGIN_THRESHOLDS
    """Report the share of router margins below each of these values."""
    low_margin_quantile: float = LOW_MARGIN_QUANTILE
    """Tokens at or below this quantile of a layer's margins form the low-margin group."""
    device: Device = "auto"
    """auto, cpu or cuda."""
    threads: int = 1
    """torch CPU threads."""
    parallel: Literal[PARALLEL_MODES] = "ddp"  # the tuple spells the choices; --help lists them
    """Under torchrun: 'ddp' or 'fsdp2' (as moe-rl train)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(prompts_per_step=8))
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        check_numbers(self)
        check_positive("updates", self.updates)
        check_choice("routing_mode", self.routing_mode, ROUTING_MODES)
        check_choice("tokens", self.tokens, ("response", "all"))
        if not 0 < self.low_margin_quantile < 1:
            raise ConfigError(f"low_margin_quantile={self.low_margin_quantile} must be in (0, 1)")

    def model_config(self) -> ModelConfig:
        """The checkpoint's saved architecture (it must have one), else --model.*.

        The seam for other backends: whatever fields ModelConfig holds (a backend and its source) come back from the
        checkpoint, and moe_rl.rl.build.build_model builds the model from them."""
        if self.checkpoint is None:
            return self.model
        saved = load_checkpoint(self.checkpoint).get("model_config")
        if not saved:
            raise ConfigError(f"checkpoint={self.checkpoint} holds no model_config; pass the architecture as --model.*"
                              " and the weights through a checkpoint saved by moe-rl train or sft")
        known = {f.name for f in fields(ModelConfig)}
        return ModelConfig(**{k: v for k, v in saved.items() if k in known})

    def train_config(self) -> TrainConfig:
        """The one rollout step of `moe-rl train` this probe runs: `updates` minibatches, the update probe only."""
        rows = self.rollout.prompts_per_step * self.rollout.group_size
        if rows % self.updates:  # TrainConfig would blame `minibatches`, a flag probe does not have
            raise ConfigError(f"updates={self.updates} must divide the rollout batch prompts_per_step x group_size = "
                              f"{rows}; change --updates or --rollout.prompts-per-step / --rollout.group-size")
        return TrainConfig(out_dir=self.out, seed=self.seed, total_steps=1, minibatches=self.updates,
                           routing_mode=self.routing_mode, init_from=self.checkpoint, device=self.device,
                           threads=self.threads, parallel=self.parallel, model=self.model_config(), task=self.task,
                           rollout=self.rollout, objective=self.objective, optim=self.optim,
                           probes=ProbeConfig(enabled=("update",), tokens=self.tokens),
                           log=LogConfig(samples_every=0))


class MarginProber(Prober):
    """The trainer's Prober, whose native forwards also record router margins; after each probed update it adds
    one row per layer (and one pooled row) to `sink`. Its routing and metrics are the Prober's, unchanged."""

    def __init__(self, *args, sink: list, thresholds=MARGIN_THRESHOLDS, low_quantile=LOW_MARGIN_QUANTILE):
        super().__init__(*args)
        self.sink, self.thresholds, self.low_quantile = sink, thresholds, low_quantile
        self.margins: dict[int, torch.Tensor] = {}  # margin_LBS of the probe rows, by parameter version

    @torch.no_grad()
    def native(self, model, update: int, with_entropy: bool = False):
        """Prober.native's forwards (same rows, same chunks), with the margins kept too."""
        traces, logps, margins, entropies = [], [], [], []
        for chunk in self.chunks:
            with record_margins(distributed.unwrap(model), with_entropy) as rec:
                out = policy_forward(model, self.batch.rows(chunk), self.temperature)
            traces.append(rec.trace())
            logps.append(out.logp_BN)
            margins.append(rec.margin_LBS())
            if with_entropy:
                entropies.append(rec.router_entropy_LBS())
        self.margins[update] = torch.cat(margins, dim=1)
        routing = NativeRouting(RoutingTrace.cat(traces), torch.cat(logps), update)
        return routing, torch.cat(entropies, dim=1) if with_entropy else None

    def before_update(self, model, update: int, minibatch: int) -> dict:
        metrics = super().before_update(model, update, minibatch)
        if self.cfg.due("update", update) and update not in self.margins:  # theta_old came from the old pass
            self.native(model, update)
        return metrics

    def after_update(self, model, update: int, minibatch: int) -> dict:
        before = self._current(model, update)
        metrics = super().after_update(model, update, minibatch)
        if not metrics:
            return metrics
        pooled, per_layer = margin_churn(self.margins.pop(update), before.trace, self.current.trace, self.mask_BS,
                                         self.thresholds, self.low_quantile)
        layer_rows = [row for row in self.tables[-len(per_layer):] if row["probe"] == "update"]
        where = {"update": update, "minibatch": minibatch}
        self.sink.append({**where, "layer": "all", "churn": metrics["routing/update/churn"],
                          "set_change": metrics["routing/update/set_change"],
                          "token_any": metrics["routing/update/token_any"],
                          "layers_changed": metrics["routing/update/layers_changed"],
                          "update_kl": metrics["update/kl"], **pooled})
        self.sink.extend({**where, "layer": str(l), "churn": row["churn"], "set_change": row["set_change"],
                          "token_any": row["set_change"], **margins}
                         for l, (row, margins) in enumerate(zip(layer_rows, per_layer)))
        return metrics


# ----------------------------------------------------------------------------------------------------------
# The command


def probe(cfg: ProbeCommandConfig) -> list[dict]:
    """Run the probe (update or trace mode), print its table and write it to cfg.out; returns the rows."""
    torch.set_num_threads(cfg.threads)
    with distributed.process_group(resolve_device(cfg.device)) as device:
        rows = probe_trace(cfg, device) if cfg.trace is not None else probe_updates(cfg, device)
        if distributed.is_main():
            write_rows(Path(cfg.out), rows, cfg)
            say(format_table(rows))  # written already: a reader that went away loses only this printout
            note = no_rl_signal_note([{"churn/no_rl_signal": row["no_rl_signal"]} for row in rows
                                      if "no_rl_signal" in row])
            if note:
                say(f"{note}: {NOTE_EXPLANATIONS[NO_RL_SIGNAL]}")
    return rows


def probe_updates(cfg: ProbeCommandConfig, device: torch.device) -> list[dict]:
    """One rollout step of the trainer with a MarginProber; rows reduced over ranks under torchrun."""
    train_cfg = cfg.train_config()
    train_cfg.check_data_parallel(distributed.world_size())
    trainer = Trainer(train_cfg, device)
    rows: list[dict] = []
    trainer.prober_factory = partial(MarginProber, sink=rows, thresholds=cfg.margin_thresholds,
                                     low_quantile=cfg.low_margin_quantile)
    lines: list[dict] = []
    trainer.rl_step(lines.append)
    flags = {line["minibatch"]: line["churn/no_rl_signal"] for line in lines if "churn/no_rl_signal" in line}
    for row in rows:
        if row["layer"] == "all":
            row["no_rl_signal"] = flags.get(row["minibatch"], math.nan)
    return distributed.reduce_table(rows, by=("update", "minibatch", "layer"))


def probe_trace(cfg: ProbeCommandConfig, device: torch.device) -> list[dict]:
    """Engine trace vs the model's native routing of the same tokens: one pooled row and one row per layer."""
    model = build_model(cfg.model_config(), device, cfg.seed, cfg.checkpoint).eval()
    stats, batch = compare_with_model(cfg.trace, model, tokens=cfg.tokens)
    pooled = {"layer": "all", "churn": stats.churn, "set_change": stats.set_change, "token_any": stats.token_any,
              "layers_changed": stats.layers_changed, "tokens": stats.n_tokens, "requests": len(batch.request_ids)}
    return [pooled] + [{"layer": str(l), "churn": churn, "set_change": stats.set_change_per_layer[l],
                        "token_any": stats.set_change_per_layer[l], "tokens": stats.n_tokens}
                       for l, churn in enumerate(stats.churn_per_layer)]


def write_rows(out: Path, rows: list[dict], cfg: ProbeCommandConfig) -> None:
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out / "probe.csv", index=False)
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
             for row in rows]
    (out / "probe.json").write_text(json.dumps({"config": asdict(cfg), "rows": clean}, indent=1))


TABLE_COLUMNS = ("update", "layer", "churn", "set_change", "token_any", "margin_median", "churn_low_margin",
                 "churn_rest", "changes_in_low_margin", "no_rl_signal")


def format_table(rows: list[dict]) -> str:
    """A fixed-width table of the main columns present in `rows`."""
    columns = [c for c in TABLE_COLUMNS if any(c in row for row in rows)]
    columns += [c for c in rows[0] if c.startswith("margin_below_")] if rows else []

    def cell(value) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    widths = [max(len(c), *(len(cell(row.get(c, ""))) for row in rows)) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(cell(row.get(c, "")).rjust(w) for c, w in zip(columns, widths)) for row in rows]
    return "\n".join(lines)
