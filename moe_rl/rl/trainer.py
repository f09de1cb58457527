"""The RL step: the Trainer holds a run's live objects (model, optimizer, generators) and runs one rollout step and
its optimizer steps; moe_rl.commands.train runs the steps (run directory, metrics file, checkpoints, resume).

One rollout step is drawn in moe_rl.commands.train's docstring (and docs/design.md section 2).

Under torchrun (data parallel, moe_rl.rl.distributed) rank r of W samples its B/W prompts of each step with generators
of its own (seeded by seed and rank), shuffles and splits its rows into the same number of chunks as every other
rank and trains through a DDP wrapper, which averages the gradients. Each rank's loss is weighted by its share of
the global minibatch (`LossShare`), so the averaged gradient is that of the loss over all ranks' rows, whether the
objective averages over sequences, tokens (dapo, cispo) or rows (dr_grpo). The router aux loss is weighted by input
tokens: exact for the z-loss; the load-balancing loss keeps per-rank expert fractions, as in any data-parallel MoE.
A rank left without rows for an update (DAPO dropped its groups) runs a forward and backward of a zero loss, so
every rank joins every all-reduce. Probes run on each rank's rows; metrics and routing tables are reduced over
ranks; rank 0 alone writes metrics, tables, its own rows' samples, evaluations and checkpoints. A NaN on any rank
stops every rank (status diverged). Checkpoints hold every rank's generators: `--resume` with the same number of
ranks continues each rank exactly; a different number is refused.

What it simplifies on purpose: one process samples and trains, the reference model for the optional KL is the initial
policy. The sampler is ours by default; `--rollout.engine vllm` samples with a vLLM engine in the same process
(moe_rl.rl.engines), loaded from the policy and synced before each rollout that follows optimizer steps.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from moe_rl.errors import ConfigError, EngineFailed
from moe_rl.model import MoETransformer
from moe_rl.objectives import get_objective
from moe_rl.objectives.common import loss_denominator_count
from moe_rl.objectives.masked import masked_mean, masked_sum
from moe_rl.rl import distributed
from moe_rl.rl.advantages import group_advantages, reward_stats, zero_std_groups
from moe_rl.rl.build import build_model, build_model_tokenizer, freeze_routers, make_optimizer
from moe_rl.rl.correction import Correction, corrected_loss_inputs, mismatch_metrics, rollout_correction
from moe_rl.rl.engines import build_engine
from moe_rl.rl.heldout import heldout_metrics
from moe_rl.rl.policy import PolicyOutput, policy_forward
from moe_rl.rl.probes import NativeRouting, Prober, probes_whole_batch
from moe_rl.rl.rollout import RolloutBatch, generate_groups, to_rollout_batch
from moe_rl.rl.run_config import TrainConfig
from moe_rl.rl.signals import entropy_from_logits, ratio_signals
from moe_rl.routing.trace import RoutingTrace
from moe_rl.runs.checkpoint import (
    TRAINING_STATE_KEYS,
    load_checkpoint,
    load_latest,
    restore_training_state,
    save_checkpoint,
    training_state,
)
from moe_rl.runs.runlog import resume_command, write_table
from moe_rl.tasks import build_task

ROUTING_TABLE_KEYS = ("update", "minibatch", "probe", "layer")  # a routing/ table row, reduced over ranks


class Diverged(RuntimeError):
    """A non-finite loss or gradient: the run stops with status `diverged`."""


@dataclass(frozen=True)
class LossShare:
    """One rank's weights for one global minibatch under DDP. For a loss term that averages over n items (sequences,
    tokens) the weight is W n_r / N: this rank's n_r of all ranks' N, times the world size W. DDP averages the
    weighted gradients, (1/W) sum_r W (n_r / N) grad L_r = grad (sum_r n_r L_r) / N: the gradient of the term over
    all ranks' rows together."""

    objective: float  # over ObjectiveSpec.loss_denominator: non-empty sequences, response tokens or rows
    kl: float  # over response tokens (the k3 KL to the reference is a token mean)
    aux: float  # over real input tokens (the router losses are means over them)


@dataclass
class OldPass:
    """theta_old on this rank's rows, in the order of the shuffled batch."""

    logp_BN: torch.Tensor
    trace: RoutingTrace  # recorded (native), or the sampler's under R3
    native: NativeRouting | None  # reused by the probes when native
    router_entropy_LBS: torch.Tensor | None
    ref_logp_BN: torch.Tensor | None  # the reference policy's log-probs, with a KL penalty
    first_update: PolicyOutput | None = None  # update 0's forward, when the old pass ran it (Trainer.old_pass)
    correction: Correction | None = None  # sampler vs theta_old weights and rejection mask (moe_rl.rl.correction)


class Trainer:
    """The live objects of one run and the RL step. `moe_rl.commands.train.train(cfg)` is the entry point."""

    prober_factory = Prober  # `moe-rl probe` substitutes a Prober that also measures router margins

    def __init__(self, cfg: TrainConfig, device: torch.device, init_weights: bool = True):
        self.cfg, self.device = cfg, device
        self.out_dir = Path(cfg.out_dir)  # rank 0 writes here; every rank reads checkpoints from here
        self.tokenizer = build_model_tokenizer(cfg.model)
        self.task = build_task(cfg.task, self.tokenizer)
        self.spec = get_objective(cfg.objective.name)
        self.routing = cfg.routing  # what the sampler records, the old pass and each update replay
        self.objective_cfg = replace(cfg.objective, max_response_len=cfg.objective.max_response_len
                                          or cfg.rollout.sampling.max_new_tokens)
        # A resume takes the weights from its checkpoint, so it does not need init_from to still exist.
        self.model = build_model(cfg.model, device, cfg.seed, cfg.init_from if init_weights else None)
        self.ref_model = self._frozen_copy() if cfg.kl_coef > 0 else None
        if cfg.optim.router_lr_scale == 0:
            freeze_routers(self.model)
        self.reuse_first_forward = True  # _old_pass_runs_first_update; off only to compare the two paths
        # Training forwards go through DDP under torchrun; sampling, the old pass and probes use self.model, no grad.
        # The loop dispatch skips experts without tokens, so DDP must look for parameters without a gradient.
        # --parallel fsdp2 shards self.model in place instead (moe_rl.rl.distributed, FSDP2).
        self.train_model = distributed.parallelize(self.model, device, cfg.parallel, cfg.model.dispatch == "loop")
        self.optimizer, self.scheduler = make_optimizer(self.model, cfg.optim)
        seed = distributed.rank_seed(cfg.seed)
        self.generators = {name: torch.Generator().manual_seed(seed + offset)
                           for offset, name in enumerate(("sample", "shuffle"))}
        self.placeholder = placeholder_row(self.tokenizer, device)  # for `idle_update`
        self.step = 0  # completed rollout steps
        self.updates = 0  # completed optimizer steps
        self.engine = None  # the rollout engine (moe_rl.rl.engines), built at the first rollout

    def _frozen_copy(self) -> MoETransformer:
        ref = copy.deepcopy(self.model).eval()
        ref.requires_grad_(False)
        return ref

    # -- checkpoints ------------------------------------------------------------------------------------------

    def save(self) -> None:
        """Rank 0 saves; every rank must call this, since the checkpoint holds every rank's generator states."""
        generators_by_rank = distributed.gather_objects({name: g.get_state() for name, g in self.generators.items()})
        full = distributed.full_state_dicts(self.model, self.optimizer) if self.sharded else None  # a collective
        if not distributed.is_main():
            return
        state = training_state(self.model, self.optimizer, scheduler=self.scheduler,
                               data_position=self.step * self.cfg.rollout.prompts_per_step,
                               generators=self.generators)
        state.update(updates=self.updates, model_config=asdict(self.cfg.model), world_size=len(generators_by_rank))
        if full is not None:
            state.update(model=full[0], optimizer=full[1], parallel="fsdp2")
        if len(generators_by_rank) > 1:
            state["generators_by_rank"] = generators_by_rank
        if self.ref_model is not None:
            state["ref_model"] = self.ref_model.state_dict()
        save_checkpoint(self.out_dir, self.step, state, keep_every=self.cfg.keep_every)

    def restore(self, checkpoint: Path | None = None) -> None:
        """Every rank loads the latest checkpoint (or `checkpoint`, one of the run's own): the same weights and
        optimizer state, its own generators."""
        require = (*TRAINING_STATE_KEYS, "updates")
        state = load_latest(self.out_dir, map_location=self.device, require=require) if checkpoint is None else \
            load_checkpoint(checkpoint, map_location=self.device, what="the checkpoint to resume from",
                            require=require)
        saved, ranks = state.get("world_size", 1), distributed.world_size()
        if saved != ranks:
            raise ConfigError(
                f"cannot resume {self.out_dir}: its checkpoint was saved by {saved} rank(s) and this run has {ranks}; "
                f"each rank's sampling stream continues only on as many ranks (torchrun --nproc_per_node={saved}, "
                "or no torchrun for 1). Start a new run to change the number of ranks"
            )
        if self.sharded:  # whole tensors in the file; each rank keeps its shard, then the rest restores as usual
            distributed.load_full_state_dicts(self.model, self.optimizer, state["model"], state["optimizer"])
            state = {**state, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        self.step = restore_training_state(state, self.model, self.optimizer, scheduler=self.scheduler,
                                           generators=self.generators)
        if saved > 1:  # the generators restored above are rank 0's
            for name, generator in self.generators.items():
                generator.set_state(state["generators_by_rank"][distributed.rank()][name].cpu())
        self.updates = state["updates"]
        if self.ref_model is not None:
            self.ref_model.load_state_dict(state["ref_model"])

    # -- one rollout step -------------------------------------------------------------------------------------

    def rollout(self) -> tuple[RolloutBatch, dict]:
        """This rank's share of the step's prompts (all of them in a single process), sampled, scored, advantaged."""
        cfg = self.cfg
        share = cfg.rollout.prompts_per_step // distributed.world_size()
        first = self.step * cfg.rollout.prompts_per_step + distributed.rank() * share
        problems = self.task.problems("train", first, share)
        record = self.routing.replays_sampler or "rollout" in cfg.probes.enabled
        self.model.eval()
        engine = self.rollout_engine()
        try:
            t_sync = time.perf_counter()
            engine.sync(self.model, self.updates)  # the policy after this run's optimizer steps so far
            sync_s = time.perf_counter() - t_sync
            with distributed.full_parameters(self.model):  # FSDP2: ranks stop sampling at different steps
                gen, rewards_B, completions = generate_groups(self.model, self.task, self.tokenizer, problems,
                                                              cfg.rollout.group_size, cfg.rollout.sampling,
                                                              self.generators["sample"], record,
                                                              record_weights=self.routing.sampler_records_weights,
                                                              engine=engine)
        except FloatingPointError as err:
            raise Diverged(f"{err} at step {self.step}") from err
        except (ConfigError, KeyboardInterrupt):
            raise
        except Exception as err:
            if engine.name == "native":
                raise
            first = (str(err).strip().splitlines() or [""])[0][:200]
            raise EngineFailed(f"rollout engine {engine.name} failed at rollout step {self.step} on rank "
                               f"{distributed.rank()} ({type(err).__name__}: {first}); the run continues from its last "
                               f"checkpoint with: {resume_command(self.out_dir, distributed.world_size())}") from err
        rewards_NG = rewards_B.view(len(problems), cfg.rollout.group_size)
        advantages_B = group_advantages(rewards_NG, scale_by_std=self.spec.normalize_adv_by_std).reshape(-1)
        prompts = [p.prompt for p in problems for _ in range(cfg.rollout.group_size)]
        batch = to_rollout_batch(gen, rewards_B, advantages_B, cfg.rollout.group_size, prompts, completions)
        metrics = {**reward_stats(rewards_NG), **length_stats(batch, cfg.rollout.sampling.max_new_tokens),
                   "time/sync": sync_s}
        if self.spec.drop_zero_std_groups:
            keep_B = ~zero_std_groups(rewards_NG).repeat_interleave(cfg.rollout.group_size)
            metrics["dapo/kept_frac"] = keep_B.float().mean().item()
            batch = batch.rows(keep_B.nonzero().squeeze(1).to(gen.tokens_BS.device))
        return batch, metrics

    def rollout_engine(self):
        """The engine that samples rollouts (`--rollout.engine`), built once from the current model; under torchrun
        every rank builds its own, for its own prompts (moe_rl.rl.vllm_engine, "Under torchrun")."""
        if self.engine is None:
            self.engine = build_engine(self.cfg.rollout.engine, self.model, self.cfg.rollout.sampling,
                                       seed=self.cfg.seed, version=self.updates)
        return self.engine

    def close(self) -> None:
        """Shut the rollout engine down (a vLLM engine holds memory and, under torchrun, groups of the ranks' process
        group)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def rollout_on_all_ranks(self) -> tuple[RolloutBatch, dict, int]:
        """This rank's rollout, and the number of optimizer steps of this rollout step, the same on every rank:
        min(minibatches, the most rows any rank kept). A divergence or a failed engine while sampling on any rank
        stops every rank with that rank's error."""
        try:
            batch, metrics = self.rollout()
            failure = None
        except (Diverged, EngineFailed) as err:
            batch, metrics, failure = None, {}, err
        reports = distributed.gather_objects((0 if batch is None else batch.size,
                                              failure and (type(failure).__name__, str(failure))))
        if failure is not None:
            raise failure
        for rank, (_, report) in enumerate(reports):
            if report is None:
                continue
            kind, message = report
            if kind == "EngineFailed":  # its message names the rank
                raise EngineFailed(message)
            raise Diverged(f"rank {rank}: {message}")
        return batch, metrics, min(self.cfg.minibatches, max(rows for rows, _ in reports))

    def minibatch_chunks(self, batch: RolloutBatch, n_chunks: int) -> tuple[RolloutBatch, list[torch.Tensor]]:
        """Shuffle the rows (own generator) and split them into `n_chunks` contiguous chunks. Empty chunks (fewer rows
        than chunks, after DAPO's drop) are left out: they can only be the last ones."""
        order = torch.randperm(batch.size, generator=self.generators["shuffle"]).to(batch.input_ids_BS.device)
        batch = batch.rows(order)
        chunks = [c for c in torch.arange(batch.size, device=order.device).tensor_split(n_chunks) if len(c)]
        return batch, chunks

    def loss_shares(self, batch: RolloutBatch, chunks, n_updates: int, keep_BN=None) -> list[LossShare | None]:
        """This rank's LossShare of each update's global minibatch (U updates); None each in a single process.
        `keep_BN`: the tokens the rollout correction keeps (the loss averages over those)."""
        ranks = distributed.world_size()
        if ranks == 1:
            return [None] * n_updates
        counts_U3 = torch.zeros(n_updates, 3, dtype=torch.float64)  # a rank without rows for update j counts 0
        for j, chunk in enumerate(chunks):
            mask_BN = batch.response_mask_BN[chunk] if keep_BN is None else keep_BN[chunk]
            counts_U3[j, 0] = loss_denominator_count(self.spec.loss_denominator, mask_BN)
            counts_U3[j, 1] = mask_BN.sum().item()
            counts_U3[j, 2] = batch.input_valid_BS[chunk].sum().item()
        shares_U3 = ranks * counts_U3 / distributed.sum_across_ranks(counts_U3).clamp(min=1)
        return [LossShare(*share) for share in shares_U3.tolist()]

    @torch.no_grad()
    def old_pass(self, batch: RolloutBatch, chunks) -> OldPass:
        """theta_old log-probs and routing, chunk by chunk (the same chunks the updates use). Where update 0's forward
        would repeat chunk 0's (`_old_pass_runs_first_update`), chunk 0 runs once, with autograd, for both."""
        temp = self.cfg.rollout.sampling.temperature
        # Router entropy serves only the probes' router-load metrics, and only when they reuse this pass.
        with_entropy = probes_whole_batch(self.cfg.probes, batch.size)
        logps, traces, entropies, first_update = [], [], [], None
        for j, chunk in enumerate(chunks):
            rows = batch.rows(chunk)
            replay = self.routing.old_pass_replay(rows.sampler_routing)
            if j == 0 and self._old_pass_runs_first_update():
                out = first_update = self._first_update_forward(rows, with_entropy)
            elif replay is not None:
                out = policy_forward(self.model, rows, temp, replay=replay, replay_options=self.routing.replay)
            else:
                out = policy_forward(self.model, rows, temp, record=True, with_entropy=with_entropy)
            if replay is None and with_entropy:
                entropies.append(out.router_entropy_LBS)
            logps.append(out.logp_BN.detach())
            traces.append(out.trace)
        old_logp_BN, old_trace = torch.cat(logps), RoutingTrace.cat(traces)
        native = None if self.routing.replays_sampler else NativeRouting(old_trace, old_logp_BN, self.updates)
        entropy = torch.cat(entropies, dim=1) if entropies else None
        ref_logp_BN = self._ref_logprobs(batch, chunks) if self.ref_model is not None else None
        return OldPass(old_logp_BN, old_trace, native, entropy, ref_logp_BN, first_update)

    @torch.no_grad()
    def exact_sampler(self, batch: RolloutBatch, chunks) -> RolloutBatch:
        """`sampling.precision exact`: the sampler's log-probs and routing replaced by the trainer's own forward of
        theta_old, chunk by chunk in the old pass's chunks (native routing, recorded with gate weights when R3 replays
        them). The old pass then computes the same function on the same rows in the same layout (under R3 replaying
        this very routing), so the sampler's and the old pass's log-probs are equal bit for bit on CPU: the
        zero-mismatch control. The tokens were still drawn by the KV-cached sampler (the same fp32 function up to
        rounding)."""
        temp, logps, traces = self.cfg.rollout.sampling.temperature, [], []
        for chunk in chunks:
            out = policy_forward(self.model, batch.rows(chunk), temp, record=True,
                                 record_weights=self.routing.sampler_records_weights)
            logps.append(out.logp_BN)
            traces.append(out.trace)
        logp_BN = torch.where(batch.response_mask_BN, torch.cat(logps), 0.0)
        return replace(batch, sampler_logp_BN=logp_BN, sampler_routing=RoutingTrace.cat(traces))

    def _old_pass_runs_first_update(self) -> bool:
        """Whether chunk 0 of the old pass is also update 0's forward. Both run theta_old on the same rows, in the same
        layout, with the same routing (native ids, which R2 then replays; or the sampler's, under R3), and on CPU a
        forward with autograd gives a forward without it bit for bit, so one forward serves both: the step saves a
        forward of one minibatch (about 3% of a paper-shape step) and no number changes (tests/rl/test_train.py checks
        metrics and weights with and without). Only on CPU (where that equality is what the tests check; on a GPU
        the graph of chunk 0 would also be held through evaluation's sampling), in one process (DDP and FSDP2
        forwards go through wrappers with collectives of their own) and for the native model, whose forward does not
        depend on train/eval mode (the old pass runs in eval mode, the updates in train mode; a Hugging Face model
        may have dropout)."""
        return (self.reuse_first_forward and self.device.type == "cpu" and not distributed.active()
                and isinstance(self.model, MoETransformer))

    def _first_update_forward(self, rows: RolloutBatch, with_entropy: bool) -> PolicyOutput:
        """Update 0's forward (with autograd, train mode), recording what the old pass records: the native routing
        (R2 replays it at update 0, so it is also the replay probe's native trace) or, under R3, the native routing
        beside the sampler's replayed one when the replay probe is due."""
        temp = self.cfg.rollout.sampling.temperature
        self.model.train()
        replay = self.routing.old_pass_replay(rows.sampler_routing)
        with torch.enable_grad():
            if replay is not None:
                record_native = self.cfg.probes.due("replay", self.updates)
                return policy_forward(self.train_model, rows, temp, replay=replay, record_native=record_native,
                                      replay_options=self.routing.replay)
            out = policy_forward(self.train_model, rows, temp, record=True, with_entropy=with_entropy)
        # R2 replays this very routing at update 0, so it is also the replay probe's native trace.
        return replace(out, native_trace=out.trace) if self.routing.replays_old_pass else out

    def _ref_logprobs(self, batch, chunks) -> torch.Tensor:
        temp = self.cfg.rollout.sampling.temperature
        return torch.cat([policy_forward(self.ref_model, batch.rows(c), temp).logp_BN for c in chunks])

    def update(self, mb: RolloutBatch, old_logp_BN, replay: RoutingTrace | None, ref_logp_BN, prober: Prober,
               minibatch: int, share: LossShare | None = None, forward: PolicyOutput | None = None,
               correction: Correction | None = None) -> dict:
        """Forward (unless `forward` is its output, run by the old pass), backward and gradient clipping on minibatch
        `mb` (this rank's rows of it); returns its metrics. The caller takes the optimizer step. `correction` (the
        minibatch's rows of it) weights and masks the objective's tokens."""
        self.model.train()
        record_native = replay is not None and prober.cfg.due("replay", self.updates)
        out = forward
        if out is None:
            out = policy_forward(self.train_model, mb, self.cfg.rollout.sampling.temperature, replay=replay,
                                 record_native=record_native, replay_options=self.routing.replay)
        mask_BN = mb.response_mask_BN
        total, metrics = self._loss(out, mb, old_logp_BN, ref_logp_BN, share, correction)
        metrics.update({"loss/total": total.item(), "grad_norm": self._backward(total),
                        "lr": self.scheduler.get_last_lr()[0],
                        "aux_loss": out.aux_loss.item() if out.aux_loss is not None else 0.0})
        metrics.update(ratio_signals(out.logp_BN.detach(), old_logp_BN, mask_BN))
        metrics["entropy"] = entropy_from_logits(out.logits_BNV.detach(), mask_BN)
        if record_native:
            metrics.update(prober.replay(replay, out.native_trace, mb.token_mask_BS(prober.cfg.tokens),
                                         self.updates, minibatch))
            if "routing/replay/set_change" in metrics:  # the replay's replace rate, under its standard name
                metrics["routing/replay/replace_rate"] = metrics["routing/replay/set_change"]
        if out.replay_stats is not None:
            metrics.update(out.replay_stats)
        return metrics

    def _loss(self, out, mb: RolloutBatch, old_logp_BN, ref_logp_BN, share: LossShare | None,
              correction: Correction | None = None):
        """objective + router aux loss (+ kl_coef * k3 KL to the reference); under DDP each term weighted by `share`.
        With a rollout correction the objective sees token advantages A_i * w_it and the kept tokens only
        (moe_rl.rl.correction.corrected_loss_inputs)."""
        advantages, mask_BN = mb.advantages_B, mb.response_mask_BN
        if correction is not None:
            advantages, mask_BN = corrected_loss_inputs(advantages, mask_BN, correction)
        loss, metrics = self.spec(out.logp_BN, old_logp_BN, advantages, mask_BN, self.objective_cfg)
        aux_loss = out.aux_loss if out.aux_loss is not None else 0.0
        kl_coef = self.cfg.kl_coef
        if share is not None:
            loss, aux_loss, kl_coef = loss * share.objective, aux_loss * share.aux, kl_coef * share.kl
            metrics["loss"] = loss.item()  # the mean over ranks is the loss over all ranks' rows
        total = loss + aux_loss
        if ref_logp_BN is not None:
            kl_ref = k3(ref_logp_BN, out.logp_BN, mb.response_mask_BN)
            total = total + kl_coef * kl_ref
            metrics["kl_ref"] = kl_ref.item()
        return total, metrics

    def _backward(self, total: torch.Tensor) -> float:
        """Gradients of `total` (averaged over ranks by DDP), clipped; returns the norm before clipping."""
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        return distributed.scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def idle_update(self) -> dict:
        """This rank's part of an update for which it has no rows (DAPO dropped them). DDP's all-reduce needs every
        rank, so it runs a forward and backward of zero times the loss of a placeholder row: its gradient counts as
        zero in the average, as its LossShare would. It reports only what is not about its rows."""
        self.model.train()
        out = policy_forward(self.train_model, self.placeholder, self.cfg.rollout.sampling.temperature)
        zero = 0.0 * (masked_sum(out.logp_BN, self.placeholder.response_mask_BN) + out.aux_loss)
        grad_norm = self._backward(zero)
        return {"loss": 0.0, "loss/total": 0.0, "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0]}

    def train_update(self, j: int, batch: RolloutBatch, chunk, old: OldPass | None, prober: Prober | None,
                     share: LossShare | None) -> tuple[dict, bool]:
        """Optimizer step j of this rollout step on this rank: probes before, forward and backward on its chunk (or
        idle: chunk None), the step if every rank's loss and gradient norm are finite, probes after. Returns this
        rank's metrics (not yet reduced) and whether the step was taken."""
        t_probe = time.perf_counter()
        metrics = dict(prober.before_update(self.model, self.updates, j)) if prober else {}
        t_update = time.perf_counter()
        metrics["churn/no_rl_signal"] = no_rl_signal(batch, chunk)
        if chunk is None:
            metrics.update(self.idle_update())
        else:
            replay = self.routing.update_replay(batch.sampler_routing, old.trace)
            replay = replay.rows(chunk) if replay is not None else None
            ref = old.ref_logp_BN[chunk] if old.ref_logp_BN is not None else None
            forward = old.first_update if j == 0 else None
            old.first_update = None  # its graph is not held past update 0
            correction = old.correction
            if correction is not None:
                correction = Correction(correction.weights_BT[chunk], correction.keep_BT[chunk], {})
            metrics.update(self.update(batch.rows(chunk), old.logp_BN[chunk], replay, ref, prober, j, share,
                                       forward, correction))
        # Every rank agrees, so a NaN in one rank's loss stops every rank (their gradients are all-reduced already).
        finite = distributed.all_true(math.isfinite(metrics["loss/total"]) and math.isfinite(metrics["grad_norm"]))
        if finite:  # a non-finite step is never taken; rl_step logs it and stops the run
            t_optimizer = time.perf_counter()
            self.optimizer.step()
            self.scheduler.step()
            metrics["time/optimizer"] = time.perf_counter() - t_optimizer
        metrics["time/update"] = time.perf_counter() - t_update
        if finite:
            t_after = time.perf_counter()
            if prober:
                metrics.update(prober.after_update(self.model, self.updates, j))
            metrics["time/probes"] = time.perf_counter() - t_after + (t_update - t_probe)
        return metrics, finite

    def rl_step(self, write) -> None:
        """One rollout step and its optimizer steps; `write(line)` appends each metrics line as it is made (rank 0;
        the other ranks' `write` drops it). Every rank makes the same collective calls in the same order.

        Raises Diverged after logging the line of a non-finite optimizer step."""
        cfg, t0 = self.cfg, time.perf_counter()
        batch, rollout_metrics, n_updates = self.rollout_on_all_ranks()
        t1 = time.perf_counter()
        if n_updates == 0:  # DAPO dropped every group (of every rank): nothing to learn from this batch
            rollout_metrics = distributed.reduce_metrics({**rollout_metrics, "time/rollout": t1 - t0})
            write({"step": self.step, "minibatch": -1, "update": self.updates, "update/skipped": 1, **rollout_metrics})
            return
        batch, chunks = self.minibatch_chunks(batch, n_updates)
        old, prober = None, None
        if chunks:  # always, except on a data-parallel rank whose groups DAPO all dropped: it takes part idle
            if cfg.rollout.sampling.precision == "exact":
                batch = self.exact_sampler(batch, chunks)
            old = self.old_pass(batch, chunks)
            rollout_metrics.update(self._correct(batch, old))
            t2 = time.perf_counter()
            prober = self.prober_factory(cfg.probes, batch, chunks, cfg.rollout.sampling.temperature, cfg.seed,
                                         self.step)
            rollout_metrics.update(prober.start(self.model, self.updates, old.native, old.router_entropy_LBS,
                                                self.model.moe_layers()[0].n_experts))
            rollout_metrics.update({"time/old_pass": t2 - t1, "time/rollout_probes": time.perf_counter() - t2})
        shares = self.loss_shares(batch, chunks, n_updates, old.correction.keep_BT if old and old.correction else None)
        rollout_metrics["time/rollout"] = t1 - t0
        if self._eval_due() and self.evaluates_here:
            rollout_metrics.update(self.evaluate())
        rollout_metrics = distributed.reduce_metrics(rollout_metrics)
        for j in range(n_updates):
            line = {"step": self.step, "minibatch": j, "update": self.updates, **rollout_metrics}
            rollout_metrics = {k: v for k, v in rollout_metrics.items() if not k.startswith("eval/")}
            chunk = chunks[j] if j < len(chunks) else None  # None: this rank has no rows left for update j
            metrics, finite = self.train_update(j, batch, chunk, old, prober, shares[j])
            line.update(distributed.reduce_metrics(metrics))
            if not finite:
                write(line)
                raise Diverged(f"non-finite loss ({line['loss/total']}) or gradient norm ({line['grad_norm']}) "
                               f"at step {self.step}, minibatch {j}")
            self.updates += 1
            write(line)
        tables = distributed.reduce_table(prober.tables if prober else [], by=ROUTING_TABLE_KEYS)
        if distributed.is_main():
            if tables:
                write_table(self.out_dir, "routing", self.step, tables)
            if chunks:
                self._write_samples(batch)

    def _correct(self, batch: RolloutBatch, old: OldPass) -> dict:
        """Mismatch metrics of the sampler vs theta_old, and the rollout correction the updates apply (kept in
        `old.correction` when it changes the loss; its metrics are logged either way)."""
        log_ratio_BN = old.logp_BN - batch.sampler_logp_BN
        correction = rollout_correction(log_ratio_BN, batch.response_mask_BN, self.cfg.correction)
        old.correction = correction if self.cfg.correction.active else None
        return {**mismatch_metrics(log_ratio_BN, batch.response_mask_BN), **correction.metrics}

    @property
    def sharded(self) -> bool:
        return distributed.is_sharded(self.model)

    @property
    def evaluates_here(self) -> bool:
        """Rank 0 evaluates; under FSDP2 every rank does (gathering the parameters is a collective)."""
        return distributed.is_main() or self.sharded

    def _eval_due(self) -> bool:
        every = self.cfg.log.eval_every
        return bool(every) and self.step % every == 0

    def _write_samples(self, batch: RolloutBatch) -> None:
        every, keep = self.cfg.log.samples_every, self.cfg.log.samples_per_step
        if not every or self.step % every:
            return
        rows = [{"prompt": batch.prompts[i], "completion": batch.completions[i],
                 "reward": batch.rewards_B[i].item(), "advantage": batch.advantages_B[i].item()}
                for i in range(min(keep, batch.size))]
        write_table(self.out_dir, "samples", self.step, rows)

    def evaluate(self) -> dict:
        """Held-out accuracy, sampled (`log.eval_samples` per prompt) and greedy, with SEs (moe_rl.rl.heldout; fixed
        generator: comparable over steps)."""
        log = self.cfg.log
        with distributed.full_parameters(self.model):
            return heldout_metrics(self.model, self.task, self.tokenizer, self.cfg.rollout.sampling,
                                   log.eval_prompts, log.eval_samples, log.eval_greedy, self.cfg.seed)


def no_rl_signal(batch: RolloutBatch, chunk: torch.Tensor | None) -> float:
    """1.0 when every advantage of the update's rows is zero (each of their groups got equal rewards; a rank without
    rows has none), else 0.0. Every objective scales its terms by the advantage, so such an update's gradient is the
    load-balancing loss's (and the KL term's when kl_coef > 0): its routing churn owes nothing to the rewards."""
    if chunk is None:
        return 1.0
    return float(not batch.advantages_B[chunk].any().item())


def k3(ref_logp_BN, logp_BN, mask_BN) -> torch.Tensor:
    """k3 estimate of KL(pi || pi_ref) per token, masked mean: exp(ref - logp) - (ref - logp) - 1."""
    delta = ref_logp_BN - logp_BN
    return masked_mean(delta.exp() - delta - 1, mask_BN)


def placeholder_row(tokenizer, device: torch.device) -> RolloutBatch:
    """A one-row batch, prompt BOS and response EOS, for a forward whose loss counts zero (`Trainer.idle_update`)."""
    one_11 = torch.ones(1, 1, dtype=torch.bool, device=device)
    zero_1 = torch.zeros(1, device=device)
    return RolloutBatch(
        input_ids_BS=torch.full((1, 1), tokenizer.bos_id, device=device), input_valid_BS=one_11, prompt_len=1,
        response_BN=torch.full((1, 1), tokenizer.eos_id, device=device), response_mask_BN=one_11,
        sampler_logp_BN=torch.zeros(1, 1, device=device), rewards_B=zero_1, advantages_B=zero_1,
        group_B=torch.zeros(1, dtype=torch.long, device=device), sampler_routing=None, prompts=[""], completions=[""],
    )


def length_stats(batch: RolloutBatch, max_new_tokens: int) -> dict:
    lengths_B = batch.response_mask_BN.sum(1).float()
    return {"completions/mean_length": lengths_B.mean().item(),
            "completions/clipped_ratio": (lengths_B >= max_new_tokens).float().mean().item()}

