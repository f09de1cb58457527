"""Routing probes: how far routing moves per update, with staleness, against the sampler, and under replay.

Each probe compares two routings (A, B) of the same tokens (docs/design.md section 5):

| probe     | A                               | B                                  | cadence counted in |
|-----------|---------------------------------|------------------------------------|--------------------|
| update    | theta just before an opt. step  | theta just after it                | optimizer steps    |
| staleness | theta_old (the old pass)        | theta at minibatch j               | optimizer steps    |
| replay    | replayed ids                    | native top-k in the same forward   | optimizer steps    |
| rollout   | the sampler's routing           | the trainer's theta_old pass       | rollout steps      |
| noise     | theta_old                       | theta_old again, same tokens       | rollout steps      |

The `split` probe (opt-in) asks what the others cannot: how much of the log-ratio the objective clips comes from the
routing having moved. At minibatch j it splits each probed token's log w = logp(theta_j, r_j) - logp(theta_old,
r_old) exactly into a routing part, logp(theta_j, r_j) - logp(theta_j, r_old), and a weight part, logp(theta_j,
r_old) - logp(theta_old, r_old), where r is each parameter version's own routing and logp(theta_j, r_old) is a
forward of theta_j replaying theta_old's expert ids (gate weights recomputed from theta_j's router).

All probe forwards are native (no replay), run under no grad on the probe rows (by default a random subsample of 32
sequences per rollout step, drawn from a generator of their own; the whole batch when it is no larger, or with
`sequences=None`), all in one fixed row-chunk layout, so unchanged parameters read exactly 0 on CPU. The training RNG
and the model are untouched.

One native forward after each optimizer step serves the update probe (after vs before), the next step's
"before", the staleness probe (vs theta_old) and the per-update policy change (k3 KL and mean |log w| between
the two parameter versions), so the update probe costs one no-grad forward of the probed tokens per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from moe_rl.errors import ConfigError, check_choice
from moe_rl.objectives.masked import masked_mean
from moe_rl.rl.policy import policy_forward
from moe_rl.routing.churn import churn_stats
from moe_rl.routing.trace import RoutingTrace

PROBE_NAMES = ("update", "staleness", "replay", "rollout", "noise", "split")
DEFAULT_PROBES = ("update", "staleness", "replay", "rollout", "noise")  # split costs a forward per update: opt-in
PER_UPDATE_PROBES = ("update", "staleness", "replay", "split")
GRPO_TRUST_REGION = (0.2, 0.27)
TOKEN_SETS = ("response", "all")


@dataclass
class ProbeConfig:
    """Which routing probes run, how often, and on which tokens."""

    enabled: tuple[Literal[PROBE_NAMES], ...] = DEFAULT_PROBES  # --help lists the choices
    """Probes to run, any of: update, staleness, replay, rollout, noise, split (the log-ratio split into its routing
    and weight parts; not on by default: one more forward of the probe rows per optimizer step). An empty tuple turns
    all off."""
    every: dict[str, int] = field(default_factory=dict)
    """Cadence per probe, e.g. `update 4`: every 4th optimizer step (update, staleness, replay) or rollout step
    (rollout, noise). Probes not listed run every time."""
    sequences: int | None = 32
    """Probe a random subsample of this many sequences per rollout step (under torchrun: this many on each rank, from
    its own rows); None probes the whole batch. The default keeps probes near a fifth of an RL step at 16 x 8 rollouts
    (each probe forward then costs a quarter of an old pass); batches of at most this many rows are probed whole."""
    tokens: Literal[TOKEN_SETS] = "response"  # the tuple spells the choices; --help lists them
    """Tokens compared: 'response' (positions that score a response token) or 'all' real positions."""
    split_per_layer: bool = False
    """With the split probe: also each MoE layer's own routing part (one more forward per layer and update)."""
    split_trust_region: tuple[float, float] = GRPO_TRUST_REGION
    """(e_lo, e_hi): the split probe counts a token as clipped when its ratio leaves [1-e_lo, 1+e_hi] in the direction
    its advantage pushes (GRPO's clip). GRPO's default, whatever the run's objective."""

    def __post_init__(self) -> None:
        self.enabled = tuple(self.enabled)
        for name in (*self.enabled, *self.every):
            check_choice("probes.enabled / probes.every", name, PROBE_NAMES)
        for name, cadence in self.every.items():
            if cadence < 1:
                raise ConfigError(f"probes.every[{name!r}]={cadence} must be >= 1 (to turn a probe off, leave it "
                                  "out of probes.enabled)")
        if self.sequences is not None and self.sequences < 1:
            raise ConfigError(f"probes.sequences={self.sequences} must be >= 1 (or None for the whole batch)")
        check_choice("probes.tokens", self.tokens, TOKEN_SETS)
        e_lo, e_hi = self.split_trust_region
        if not (0 <= e_lo < 1 and e_hi >= 0):
            raise ConfigError(f"probes.split_trust_region={self.split_trust_region} must be (e_lo, e_hi) with "
                              "0 <= e_lo < 1 and e_hi >= 0")

    def due(self, name: str, counter: int) -> bool:
        """Whether probe `name` runs at this optimizer step (or rollout step) `counter`."""
        return name in self.enabled and counter % self.every.get(name, 1) == 0


@dataclass
class NativeRouting:
    """Native routing and log-probs of the probe rows under one parameter version."""

    trace: RoutingTrace
    logp_BN: torch.Tensor
    update: int  # the global optimizer step count at which these parameters were current


def churn_rows(probe: str, stats, where: dict) -> list[dict]:
    """Per-layer rows for routing/ tables."""
    return [
        {**where, "probe": probe, "layer": layer, "churn": churn, "set_change": stats.set_change_per_layer[layer]}
        for layer, churn in enumerate(stats.churn_per_layer)
    ]


def policy_change(before_BN: torch.Tensor, after_BN: torch.Tensor, mask_BN: torch.Tensor) -> dict[str, float]:
    """How much the policy moved in one update on the probed tokens: k3 KL(before || after), mean |log w|."""
    log_w_BN = (after_BN - before_BN).double()
    return {
        "update/kl": masked_mean(log_w_BN.exp() - 1 - log_w_BN, mask_BN).item(),
        "update/log_ratio_abs_mean": masked_mean(log_w_BN.abs(), mask_BN).item(),
    }


def clipped_BN(log_w_BN: torch.Tensor, advantages_B: torch.Tensor, trust_region: tuple[float, float]) -> torch.Tensor:
    """Tokens whose ratio GRPO's clip cuts: above 1+e_hi with a positive advantage, below 1-e_lo with a negative one."""
    e_lo, e_hi = trust_region
    sign_B1 = advantages_B.sign()[:, None].to(log_w_BN.device)
    above_BN = log_w_BN > math.log1p(e_hi)
    below_BN = log_w_BN < math.log1p(-e_lo)
    return ((sign_B1 > 0) & above_BN) | ((sign_B1 < 0) & below_BN)


def log_ratio_split(routing_BN: torch.Tensor, weights_BN: torch.Tensor, mask_BN: torch.Tensor,
                    advantages_B: torch.Tensor, trust_region: tuple[float, float]) -> dict[str, float]:
    """split/ metrics of one update from the two parts of log w (docs/metrics.md): their sizes, the routing part's
    share, and how many of the tokens GRPO clips would stay inside the trust region without the routing part."""
    routing_BN, weights_BN = routing_BN.double(), weights_BN.double()
    mask_BN = mask_BN.bool()
    routing_abs = masked_mean(routing_BN.abs(), mask_BN).item()
    weights_abs = masked_mean(weights_BN.abs(), mask_BN).item()
    clipped = clipped_BN(routing_BN + weights_BN, advantages_B, trust_region) & mask_BN
    clipped_by_weights = clipped_BN(weights_BN, advantages_B, trust_region) & mask_BN
    n_clipped = int(clipped.sum())
    return {
        "split/log_ratio_abs_mean": masked_mean((routing_BN + weights_BN).abs(), mask_BN).item(),
        "split/routing_abs_mean": routing_abs,
        "split/weights_abs_mean": weights_abs,
        "split/routing_share": routing_abs / (routing_abs + weights_abs) if routing_abs + weights_abs > 0 else 0.0,
        "split/routing_token_frac": masked_mean((routing_BN != 0).double(), mask_BN).item(),
        "split/clip_frac": n_clipped / max(int(mask_BN.sum()), 1),
        # NaN when nothing is clipped: the share is undefined, not 0
        "split/clip_from_routing": (int((clipped & ~clipped_by_weights).sum()) / n_clipped if n_clipped
                                    else math.nan),
    }


def probe_metrics(probe: str, a: RoutingTrace, b: RoutingTrace, mask_BS: torch.Tensor, where: dict):
    """(flat metrics under routing/<probe>/, per-layer table rows) for one comparison."""
    stats = churn_stats(a, b, mask_BS)
    return stats.as_metrics(f"routing/{probe}/"), churn_rows(probe, stats, where)


def router_load_metrics(trace: RoutingTrace, entropy_LBS: torch.Tensor | None, mask_BS: torch.Tensor,
                        n_experts: int) -> dict[str, float]:
    """Router entropy and the coefficient of variation of expert load per layer, over the masked tokens."""
    metrics: dict[str, float] = {}
    ids_LTK = trace.ids_LBSK[:, mask_BS.to(trace.ids_LBSK.device)].long()
    if ids_LTK.shape[1] == 0:
        return metrics
    cvs, entropies = [], []
    for layer in range(trace.n_layers):
        load_E = torch.bincount(ids_LTK[layer].reshape(-1), minlength=n_experts).double()
        cvs.append((load_E.std(unbiased=False) / load_E.mean()).item())
        metrics[f"routing/load_cv/L{layer}"] = cvs[-1]
        if entropy_LBS is not None:
            entropies.append(entropy_LBS[layer][mask_BS].mean().item())
            metrics[f"routing/router_entropy/L{layer}"] = entropies[-1]
    metrics["routing/load_cv"] = sum(cvs) / len(cvs)
    if entropies:
        metrics["routing/router_entropy"] = sum(entropies) / len(entropies)
    return metrics


def probes_whole_batch(cfg: ProbeConfig, batch_size: int) -> bool:
    """Whether the probes take every row of a batch of `batch_size`; only then do they reuse the old pass."""
    return cfg.sequences is None or cfg.sequences >= batch_size


class Prober:
    """The probes of one rollout step. The trainer calls `start` after the old pass, then `before_update` and
    `after_update` around every optimizer step; each returns flat metrics for that step's metrics line, and
    per-layer rows accumulate in `tables` for routing/step_XXXXXX.parquet."""

    def __init__(self, cfg: ProbeConfig, batch, chunks: list[torch.Tensor], temperature: float, seed: int,
                 step: int):
        self.cfg, self.temperature, self.step = cfg, temperature, step
        self.full_batch = probes_whole_batch(cfg, batch.size)
        if self.full_batch:
            self.rows, self.chunks = torch.arange(batch.size), chunks
        else:  # a generator of its own, seeded by (seed, step): the training RNG is not touched
            g = torch.Generator().manual_seed(seed * 1_000_003 + step)
            self.rows = torch.randperm(batch.size, generator=g)[: cfg.sequences].sort().values
            self.chunks = list(self.rows.split(max(len(c) for c in chunks)))
        self.batch = batch
        probed = batch.rows(self.rows)
        self.mask_BS = probed.token_mask_BS(cfg.tokens)
        self.response_mask_BN = probed.response_mask_BN
        self.tables: list[dict] = []
        self.base: NativeRouting | None = None
        self.current: NativeRouting | None = None

    @property
    def active(self) -> bool:
        return bool(self.cfg.enabled)

    @torch.no_grad()
    def native(self, model, update: int, with_entropy: bool = False):
        """Native routing and log-probs of the probe rows under the current parameters."""
        outs = [policy_forward(model, self.batch.rows(chunk), self.temperature, record=True,
                               with_entropy=with_entropy) for chunk in self.chunks]
        routing = NativeRouting(RoutingTrace.cat([o.trace for o in outs]), torch.cat([o.logp_BN for o in outs]),
                                update)
        entropy = torch.cat([o.router_entropy_LBS for o in outs], dim=1) if with_entropy else None
        return routing, entropy

    def start(self, model, update: int, old_native: NativeRouting | None, old_entropy, n_experts: int) -> dict:
        """Set theta_old's native routing (reusing the old pass when it covers exactly the probe rows) and run
        the rollout-level probes: noise, rollout, router load."""
        if old_native is None or not self.full_batch:
            old_native, old_entropy = self.native(model, update, with_entropy=True)
        self.base = self.current = old_native
        metrics = router_load_metrics(old_native.trace, old_entropy, self.mask_BS, n_experts)
        where = {"update": update, "minibatch": -1}
        if self.cfg.due("noise", self.step):
            again, _ = self.native(model, update)
            metrics.update(self._compare("noise", old_native.trace, again.trace, where))
        sampler = self.batch.sampler_routing
        if self.cfg.due("rollout", self.step) and sampler is not None:
            metrics.update(self._compare("rollout", sampler.rows(self.rows), old_native.trace, where))
        return metrics

    def before_update(self, model, update: int, minibatch: int) -> dict:
        metrics = {}
        if self.cfg.due("staleness", update):
            current = self._current(model, update)
            metrics.update(self._compare("staleness", self.base.trace, current.trace,
                                         {"update": update, "minibatch": minibatch}))
        if self.cfg.due("split", update) and update != self.base.update:  # at minibatch 0 log w is 0: no split
            metrics.update(self.split(model, update))
        return metrics

    @torch.no_grad()
    def split(self, model, update: int) -> dict:
        """The split probe: theta_j's log-ratio to theta_old in its routing and weight parts (module docstring)."""
        current = self._current(model, update)
        replayed_BN = self.replayed_logp(model, self.base.trace)
        metrics = log_ratio_split(current.logp_BN - replayed_BN, replayed_BN - self.base.logp_BN,
                                  self.response_mask_BN, self.batch.advantages_B[self.rows],
                                  self.cfg.split_trust_region)
        if self.cfg.split_per_layer:
            for layer in range(current.trace.n_layers):
                # theta_j with its own routing everywhere but `layer`, which replays theta_old's
                ids_LBSK = current.trace.ids_LBSK.clone()
                ids_LBSK[layer] = self.base.trace.ids_LBSK[layer]
                layer_BN = current.logp_BN - self.replayed_logp(model, RoutingTrace(ids_LBSK))
                metrics[f"split/routing_abs_mean/L{layer}"] = masked_mean(layer_BN.double().abs(),
                                                                          self.response_mask_BN).item()
        return metrics

    def replayed_logp(self, model, trace: RoutingTrace) -> torch.Tensor:
        """Log-probs of the probe rows under the current parameters with `trace`'s expert ids (rows of the probe)."""
        offsets = torch.cumsum(torch.tensor([0] + [len(c) for c in self.chunks]), 0).tolist()
        return torch.cat([
            policy_forward(model, self.batch.rows(chunk), self.temperature,
                           replay=trace.rows(slice(offsets[i], offsets[i + 1]))).logp_BN
            for i, chunk in enumerate(self.chunks)
        ])

    def after_update(self, model, update: int, minibatch: int) -> dict:
        """Run after optimizer step `update` (the parameters are now those of update + 1)."""
        if not self.cfg.due("update", update):
            return {}
        before = self._current(model, update)  # cached from the previous probe, or theta_old
        after, _ = self.native(model, update + 1)
        self.current = after
        where = {"update": update, "minibatch": minibatch}
        metrics = self._compare("update", before.trace, after.trace, where)
        metrics.update(policy_change(before.logp_BN, after.logp_BN, self.response_mask_BN))
        return metrics

    def replay(self, replayed: RoutingTrace, native: RoutingTrace, mask_BS, update: int, minibatch: int) -> dict:
        if not self.cfg.due("replay", update):
            return {}
        return self._compare("replay", replayed, native, {"update": update, "minibatch": minibatch}, mask_BS)

    def _current(self, model, update: int) -> NativeRouting:
        """Native routing under the parameters of `update`; recomputed only if no probe saw them yet."""
        if self.current is None or self.current.update != update:
            self.current, _ = self.native(model, update)
        return self.current

    def _compare(self, probe, a, b, where, mask_BS=None) -> dict:
        metrics, rows = probe_metrics(probe, a, b, self.mask_BS if mask_BS is None else mask_BS, where)
        self.tables.extend(rows)
        return metrics
