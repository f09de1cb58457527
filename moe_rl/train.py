"""moe-rl train: RL with verifiable rewards on the native MoE transformer, any objective, any routing mode.

One rollout step (DESIGN.md section 2):
  sample G completions for each of B prompts (KV cache; the sampler's routing kept for R3 and the rollout probe)
  -> rewards -> group-normalised advantages (DAPO drops zero-std groups; Dr. GRPO skips the std)
  -> shuffle rows, split into `minibatches` chunks
  -> old pass, chunk by chunk, no grad: theta_old log-probs and routing (native; R3 replays the sampler's)
  -> one optimizer step per chunk: forward (native | R2 replays the old pass | R3 replays the sampler)
     -> objective (+ router aux loss, + optional k3 KL to the initial policy) -> backward -> clip -> AdamW
     -> routing probes (moe_rl.probes) -> one metrics.jsonl line.
Every `checkpoint_every` rollout steps the full state is saved atomically; `--resume` continues bit-for-bit.

What it simplifies on purpose: one process samples and trains (no separate inference engine), the sampler is
ours, and the reference model for the optional KL is the initial policy.

    moe-rl train --out-dir runs/grpo --init-from runs/sft/checkpoints/latest.pt              # CPU
    moe-rl train --objective.name gspo --routing-mode R3 --device cuda ...                   # one GPU (bf16)
    torchrun --nproc_per_node=4 -m moe_rl.cli train ...                                      # many GPUs (DDP)
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from moe_rl.advantages import group_advantages, reward_stats, zero_std_groups
from moe_rl.checkpoint import load_checkpoint, load_latest, restore_training_state, save_checkpoint, training_state
from moe_rl.config import TrainConfig
from moe_rl.errors import ConfigError
from moe_rl.masked import masked_mean
from moe_rl.model import ModelConfig, MoETransformer
from moe_rl.model.config import NON_ARCHITECTURE_FIELDS
from moe_rl.objectives import get_objective
from moe_rl.policy import policy_forward
from moe_rl.probes import NativeRouting, Prober
from moe_rl.rollout import RolloutBatch, generate_groups, to_rollout_batch
from moe_rl.routing import RoutingTrace
from moe_rl.runlog import RunDir, write_table
from moe_rl.signals import entropy_from_logits, ratio_signals
from moe_rl.tasks import build_task, build_tokenizer
from moe_rl.trackers import make_trackers


class Diverged(RuntimeError):
    """A non-finite loss or gradient: the run stops with status `diverged`."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA device is available; use device='cpu' or 'auto'")
    return torch.device(name)


def load_model_weights(model: MoETransformer, path: str) -> None:
    """Load a checkpoint's model weights, refusing one saved for a different architecture (loss coefficients and
    the dispatch path may differ: NON_ARCHITECTURE_FIELDS)."""
    state = load_checkpoint(path)
    saved = state.get("model_config") or {}
    asked = asdict(model.cfg)
    diff = {k: (saved[k], v) for k, v in asked.items()
            if k in saved and saved[k] != v and k not in NON_ARCHITECTURE_FIELDS}
    if diff:
        raise ConfigError(f"init_from={path} was saved for a different architecture; (saved, asked): {diff}")
    model.load_state_dict(state["model"])


def build_model(cfg: ModelConfig, device: torch.device, seed: int, init_from: str | None) -> MoETransformer:
    torch.manual_seed(seed)
    model = MoETransformer(cfg)
    if init_from is not None:
        load_model_weights(model, init_from)
    return model.to(device)


def make_optimizer(model, cfg) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with linear warmup to a constant learning rate."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay)
    warmup = cfg.warmup_steps

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) if warmup else 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Trainer:
    """The live objects of one run and the RL step. `train(cfg)` is the entry point."""

    def __init__(self, cfg: TrainConfig, run: RunDir, device: torch.device):
        self.cfg, self.run, self.device = cfg, run, device
        self.tokenizer = build_tokenizer()
        self.task = build_task(cfg.task, self.tokenizer)
        self.spec = get_objective(cfg.objective.name)
        self.objective_cfg = replace(cfg.objective, max_response_len=cfg.objective.max_response_len
                                          or cfg.rollout.sampling.max_new_tokens)
        self.model = build_model(cfg.model, device, cfg.seed, cfg.init_from)
        self.ref_model = self._frozen_copy() if cfg.kl_coef > 0 else None
        self.optimizer, self.scheduler = make_optimizer(self.model, cfg.optim)
        self.generators = {name: torch.Generator().manual_seed(cfg.seed + offset)
                           for offset, name in enumerate(("sample", "shuffle"))}
        self.step = 0  # completed rollout steps
        self.updates = 0  # completed optimizer steps

    def _frozen_copy(self) -> MoETransformer:
        ref = copy.deepcopy(self.model).eval()
        ref.requires_grad_(False)
        return ref

    # -- checkpoints ------------------------------------------------------------------------------------------

    def save(self) -> None:
        state = training_state(self.model, self.optimizer, scheduler=self.scheduler,
                               data_position=self.step * self.cfg.rollout.prompts_per_step,
                               generators=self.generators)
        state.update(updates=self.updates, model_config=asdict(self.cfg.model))
        if self.ref_model is not None:
            state["ref_model"] = self.ref_model.state_dict()
        save_checkpoint(self.run.path, self.step, state, keep_every=self.cfg.keep_every)

    def restore(self) -> None:
        state = load_latest(self.run.path, map_location=self.device)
        self.step = restore_training_state(state, self.model, self.optimizer, scheduler=self.scheduler,
                                           generators=self.generators)
        self.updates = state["updates"]
        if self.ref_model is not None:
            self.ref_model.load_state_dict(state["ref_model"])

    # -- one rollout step -------------------------------------------------------------------------------------

    def rollout(self) -> tuple[RolloutBatch, dict]:
        cfg = self.cfg
        problems = self.task.problems("train", self.step * cfg.rollout.prompts_per_step, cfg.rollout.prompts_per_step)
        record = cfg.routing_mode == "R3" or "rollout" in cfg.probes.enabled
        self.model.eval()
        try:
            gen, rewards_B, completions = generate_groups(self.model, self.task, self.tokenizer, problems,
                                                          cfg.rollout.group_size, cfg.rollout.sampling,
                                                          self.generators["sample"], record)
        except FloatingPointError as err:
            raise Diverged(f"{err} at step {self.step}") from err
        rewards_NG = rewards_B.view(len(problems), cfg.rollout.group_size)
        advantages_B = group_advantages(rewards_NG, scale_by_std=self.spec.normalize_adv_by_std).reshape(-1)
        prompts = [p.prompt for p in problems for _ in range(cfg.rollout.group_size)]
        batch = to_rollout_batch(gen, rewards_B, advantages_B, cfg.rollout.group_size, prompts, completions)
        metrics = {**reward_stats(rewards_NG), **length_stats(batch, cfg.rollout.sampling.max_new_tokens)}
        if self.spec.drop_zero_std_groups:
            keep_B = ~zero_std_groups(rewards_NG).repeat_interleave(cfg.rollout.group_size)
            metrics["dapo/kept_frac"] = keep_B.float().mean().item()
            batch = batch.rows(keep_B.nonzero().squeeze(1).to(gen.tokens_BS.device))
        return batch, metrics

    def minibatch_chunks(self, batch: RolloutBatch) -> tuple[RolloutBatch, list[torch.Tensor]]:
        """Shuffle the rows (own generator) and split them into `minibatches` contiguous chunks."""
        order = torch.randperm(batch.size, generator=self.generators["shuffle"]).to(batch.input_ids_BS.device)
        batch = batch.rows(order)
        chunks = [c for c in torch.arange(batch.size, device=order.device).tensor_split(self.cfg.minibatches)
                  if len(c)]
        return batch, chunks

    @torch.no_grad()
    def old_pass(self, batch: RolloutBatch, chunks):
        """theta_old log-probs and routing, chunk by chunk (the same chunks the updates use)."""
        mode, temp = self.cfg.routing_mode, self.cfg.rollout.sampling.temperature
        logps, traces, entropies = [], [], []
        for chunk in chunks:
            rows = batch.rows(chunk)
            if mode == "R3":
                out = policy_forward(self.model, rows, temp, replay=rows.sampler_routing)
            else:
                out = policy_forward(self.model, rows, temp, record=True, with_entropy=True)
                entropies.append(out.router_entropy_LBS)
            logps.append(out.logp_BN)
            traces.append(out.trace)
        old_logp_BN, old_trace = torch.cat(logps), RoutingTrace.cat(traces)
        native = None if mode == "R3" else NativeRouting(old_trace, old_logp_BN, self.updates)
        entropy = torch.cat(entropies, dim=1) if entropies else None
        ref_logp_BN = self._ref_logprobs(batch, chunks) if self.ref_model is not None else None
        return old_logp_BN, old_trace, native, entropy, ref_logp_BN

    def _ref_logprobs(self, batch, chunks) -> torch.Tensor:
        temp = self.cfg.rollout.sampling.temperature
        return torch.cat([policy_forward(self.ref_model, batch.rows(c), temp).logp_BN for c in chunks])

    def update(self, mb: RolloutBatch, old_logp_BN, replay: RoutingTrace | None, ref_logp_BN, prober: Prober,
               minibatch: int) -> dict:
        """One optimizer step on minibatch `mb`; returns its metrics."""
        cfg = self.cfg
        self.model.train()
        record_native = replay is not None and prober.cfg.due("replay", self.updates)
        out = policy_forward(self.model, mb, cfg.rollout.sampling.temperature, replay=replay,
                             record_native=record_native)
        mask_BN = mb.response_mask_BN
        loss, metrics = self.spec(out.logp_BN, old_logp_BN, mb.advantages_B, mask_BN, self.objective_cfg)
        total = loss + (out.aux_loss if out.aux_loss is not None else 0.0)
        if ref_logp_BN is not None:
            kl_ref = k3(ref_logp_BN, out.logp_BN, mask_BN)
            total = total + cfg.kl_coef * kl_ref
            metrics["kl_ref"] = kl_ref.item()
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        metrics.update({"loss/total": total.item(), "grad_norm": grad_norm.item(),
                        "lr": self.scheduler.get_last_lr()[0],
                        "aux_loss": out.aux_loss.item() if out.aux_loss is not None else 0.0})
        metrics.update(ratio_signals(out.logp_BN.detach(), old_logp_BN, mask_BN))
        metrics["entropy"] = entropy_from_logits(out.logits_BNV.detach(), mask_BN)
        if record_native:
            metrics.update(prober.replay(replay, out.native_trace, mb.token_mask_BS(prober.cfg.tokens),
                                         self.updates, minibatch))
        if math.isfinite(metrics["loss/total"]) and math.isfinite(metrics["grad_norm"]):
            self.optimizer.step()  # a non-finite step is never taken; rl_step logs it and stops the run
            self.scheduler.step()
        return metrics

    def rl_step(self, write) -> None:
        """One rollout step and its optimizer steps; `write(line)` appends each metrics line as it is made.

        Raises Diverged after logging the line of a non-finite optimizer step."""
        cfg, t0 = self.cfg, time.perf_counter()
        batch, rollout_metrics = self.rollout()
        t1 = time.perf_counter()
        if batch.size == 0:  # DAPO dropped every group: nothing to learn from this batch
            write({"step": self.step, "minibatch": -1, "update": self.updates, "update/skipped": 1,
                   **rollout_metrics, "time/rollout": t1 - t0})
            return
        batch, chunks = self.minibatch_chunks(batch)
        old_logp_BN, old_trace, native, entropy, ref_logp_BN = self.old_pass(batch, chunks)
        rollout_metrics.update(sampler_mismatch(batch, old_logp_BN))
        t2 = time.perf_counter()
        prober = Prober(cfg.probes, batch, chunks, cfg.rollout.sampling.temperature, cfg.seed, self.step)
        rollout_metrics.update(prober.start(self.model, self.updates, native, entropy, cfg.model.n_experts))
        rollout_metrics.update({"time/rollout": t1 - t0, "time/old_pass": t2 - t1,
                                "time/rollout_probes": time.perf_counter() - t2})
        if self._eval_due():
            rollout_metrics.update(self.evaluate())
        for j, chunk in enumerate(chunks):
            line = {"step": self.step, "minibatch": j, "update": self.updates, **rollout_metrics}
            rollout_metrics = {k: v for k, v in rollout_metrics.items() if not k.startswith("eval/")}
            t_probe = time.perf_counter()
            line.update(prober.before_update(self.model, self.updates, j))
            t_update = time.perf_counter()
            replay = self._replay_trace(batch, old_trace, chunk)
            ref = ref_logp_BN[chunk] if ref_logp_BN is not None else None
            line.update(self.update(batch.rows(chunk), old_logp_BN[chunk], replay, ref, prober, j))
            line["time/update"] = time.perf_counter() - t_update
            if not (math.isfinite(line["loss/total"]) and math.isfinite(line["grad_norm"])):
                write(line)
                raise Diverged(f"non-finite loss ({line['loss/total']}) or gradient norm ({line['grad_norm']}) "
                               f"at step {self.step}, minibatch {j}")
            t_after = time.perf_counter()
            line.update(prober.after_update(self.model, self.updates, j))
            line["time/probes"] = time.perf_counter() - t_after + (t_update - t_probe)
            self.updates += 1
            write(line)
        if prober.tables:
            write_table(self.run.path, "routing", self.step, prober.tables)
        self._write_samples(batch)

    def _eval_due(self) -> bool:
        every = self.cfg.log.eval_every
        return bool(every) and self.step % every == 0

    def _replay_trace(self, batch: RolloutBatch, old_trace: RoutingTrace, chunk) -> RoutingTrace | None:
        if self.cfg.routing_mode == "R2":
            return old_trace.rows(chunk)
        if self.cfg.routing_mode == "R3":
            return batch.sampler_routing.rows(chunk)
        return None

    def _write_samples(self, batch: RolloutBatch) -> None:
        every, keep = self.cfg.log.samples_every, self.cfg.log.samples_per_step
        if not every or self.step % every:
            return
        rows = [{"prompt": batch.prompts[i], "completion": batch.completions[i],
                 "reward": batch.rewards_B[i].item(), "advantage": batch.advantages_B[i].item()}
                for i in range(min(keep, batch.size))]
        write_table(self.run.path, "samples", self.step, rows)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean reward of one sampled completion per held-out prompt (fixed generator: comparable over steps)."""
        from moe_rl.rollout import encode_prompts, generate

        problems = self.task.problems("eval", 0, self.cfg.log.eval_prompts)
        ids, valid = encode_prompts([p.prompt for p in problems], self.tokenizer, self.device)
        self.model.eval()
        gen = generate(self.model, ids, valid, self.cfg.rollout.sampling, self.tokenizer.eos_id,
                       self.tokenizer.pad_id, torch.Generator().manual_seed(self.cfg.seed))
        texts = [self.tokenizer.decode(row) for row in gen.response_BN.tolist()]
        rewards = [self.task.reward(p, t) for p, t in zip(problems, texts)]
        return {"eval/reward": sum(rewards) / len(rewards)}


def k3(ref_logp_BN, logp_BN, mask_BN) -> torch.Tensor:
    """k3 estimate of KL(pi || pi_ref) per token, masked mean: exp(ref - logp) - (ref - logp) - 1."""
    delta = ref_logp_BN - logp_BN
    return masked_mean(delta.exp() - delta - 1, mask_BN)


def length_stats(batch: RolloutBatch, max_new_tokens: int) -> dict:
    lengths_B = batch.response_mask_BN.sum(1).float()
    return {"completions/mean_length": lengths_B.mean().item(),
            "completions/clipped_ratio": (lengths_B >= max_new_tokens).float().mean().item()}


def sampler_mismatch(batch: RolloutBatch, old_logp_BN: torch.Tensor) -> dict:
    """Sampler vs trainer log-probs of the same tokens under the same parameters (0 up to rounding on CPU)."""
    delta = (old_logp_BN - batch.sampler_logp_BN).double()
    mask = batch.response_mask_BN
    return {"rollout/log_ratio_abs_mean": masked_mean(delta.abs(), mask).item(),
            "rollout/kl": masked_mean(delta.exp() - 1 - delta, mask).item()}


def train(cfg: TrainConfig) -> Path:
    """Run (or resume) RL training; returns the run directory."""
    torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    run = RunDir(cfg.out_dir, cfg, resume=cfg.resume, seed=cfg.seed, device=device)
    with run:
        trainer = Trainer(cfg, run, device)
        if cfg.resume:
            trainer.restore()
        trackers = make_trackers(cfg.log.trackers, run.path, config=run.config)
        resume_from = trainer.step - 1 if cfg.resume else None
        with run.open_metrics(resume_from_step=resume_from, trackers=trackers, tracker_step_key="update") as metrics:
            _loop(trainer, metrics, run)
    return run.path


def _loop(trainer: Trainer, metrics, run: RunDir) -> None:
    """Rollout steps until total_steps; eval lines and checkpoints on their cadence."""
    cfg = trainer.cfg
    while trainer.step < cfg.total_steps:
        try:
            trainer.rl_step(metrics.write)
        except Diverged as err:
            run.mark_diverged(str(err))
            return
        trainer.step += 1
        if trainer.step == cfg.total_steps and cfg.log.eval_every:
            # The policy after the last update; step = total_steps marks "after training".
            metrics.write({"step": trainer.step, "minibatch": -1, "update": trainer.updates, **trainer.evaluate()})
        if trainer.step % cfg.checkpoint_every == 0 or trainer.step == cfg.total_steps:
            trainer.save()
