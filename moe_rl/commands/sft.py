"""moe-rl sft: supervised warm start on task solutions, so RL starts from a policy with partial success.

Real RL post-training starts from a pretrained model that already solves some problems; a randomly initialised
tiny model solves none, and with all-zero rewards every group-normalised advantage is zero. This trains the
model with teacher forcing on `[BOS] prompt solution [EOS]` (loss on the solution and EOS only) and saves
`checkpoints/latest.pt`, which `moe-rl train --init-from` loads.

    moe-rl sft --out-dir runs/sft --total-steps 300           # CPU, about a minute for the default tiny model
    moe-rl sft --out-dir runs/sft --optim.lr 1e30             # diverges: says at which step and why, exit status 3
    moe-rl sft --device cuda --model.d-model 512 ...          # one GPU
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from moe_rl.model.layers import autocast_context
from moe_rl.rl.build import build_model, build_model_tokenizer, check_sampler_memory, check_task_fits, resolve_device
from moe_rl.rl.rollout import sampled_reward
from moe_rl.rl.run_config import SFTConfig
from moe_rl.runs.checkpoint import save_checkpoint
from moe_rl.runs.claim import claim_run_dir, fresh_run_name, open_claimed
from moe_rl.runs.interrupt import Interrupted, StopOnSignal
from moe_rl.runs.progress import Progress
from moe_rl.runs.trackers import check_trackers_installed, make_trackers
from moe_rl.tasks import build_task
from moe_rl.tasks.digest import task_digest


def sft_batch(problems, task, tokenizer, device):
    """Right-padded `[BOS] prompt solution [EOS]` rows: (input_ids_BS, valid_BS, targets_BS, loss_mask_BS)."""
    rows, prompt_lens = [], []
    for p in problems:
        prompt = [tokenizer.bos_id, *tokenizer.encode(p.prompt)]
        rows.append(prompt + tokenizer.encode(task.solution(p)) + [tokenizer.eos_id])
        prompt_lens.append(len(prompt))
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (row, n_prompt) in enumerate(zip(rows, prompt_lens)):
        tokens[i, : len(row)] = torch.tensor(row)
        loss_mask[i, n_prompt : len(row)] = True  # the solution tokens and EOS are what the model must learn
    valid = tokens != tokenizer.pad_id
    tokens, valid, loss_mask = tokens.to(device), valid.to(device), loss_mask.to(device)
    return tokens[:, :-1], valid[:, :-1], tokens[:, 1:], loss_mask[:, 1:]


def cosine_with_warmup(warmup: int, total: int, floor: float = 0.1):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def sft_step(model, optimizer, scheduler, batch, grad_clip: float) -> dict:
    """One optimizer step; a non-finite loss or gradient norm is not stepped on (the caller stops the run)."""
    input_ids, valid, targets, loss_mask = batch
    model.train()
    with autocast_context(input_ids.device):
        out = model(input_ids, valid)
    token_loss = F.cross_entropy(out.logits_BSV.float().transpose(1, 2), targets, reduction="none")
    loss = token_loss[loss_mask].mean()
    optimizer.zero_grad(set_to_none=True)
    (loss + out.aux_loss).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    line = {"loss": loss.item(), "aux_loss": out.aux_loss.item(), "grad_norm": grad_norm.item(),
            "lr": scheduler.get_last_lr()[0]}
    if math.isfinite(line["loss"]) and math.isfinite(line["grad_norm"]):
        optimizer.step()
        scheduler.step()
    return line


def sft(cfg: SFTConfig) -> Path:
    """Train the warm start; returns the run directory (its checkpoints/latest.pt holds the model)."""
    torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    cfg = replace(cfg, out_dir=str(Path(cfg.out_dir or fresh_run_name(stem="sft")).expanduser().absolute()))
    claim = claim_run_dir(cfg.out_dir, resume=False, total_steps=cfg.total_steps, resume_flag=None, kind="sft")
    with StopOnSignal() as stop:
        return _sft_in_claim(cfg, claim, device, stop)


def _sft_in_claim(cfg: SFTConfig, claim, device, stop: StopOnSignal) -> Path:
    """Check the inputs, build, open the run, train and save, in a claimed directory (released at the end)."""
    try:
        check_trackers_installed(cfg.log.trackers)
        tokenizer = build_model_tokenizer(cfg.model)
        task = build_task(cfg.task, tokenizer)
        check_task_fits(cfg.model, tokenizer, task, cfg.sampling.max_new_tokens)
        check_sampler_memory(cfg.model, cfg.log.eval_prompts, cfg.sampling.max_new_tokens, device)
        model = build_model(cfg.model, device, cfg.seed, None)
        run = open_claimed(claim, cfg, seed=cfg.seed, device=device, inputs=task_digest(cfg.task, task))
        progress = Progress(cfg.total_steps, quiet=cfg.quiet)
        trackers = make_trackers(cfg.log.trackers, run.path, config=run.config, wandb=asdict(cfg.log.wandb),
                                 run_id=run.manifest.get("tracker_id"))
        with run, run.open_metrics(trackers=trackers) as metrics:
            done = _sft_loop(cfg, model, task, tokenizer, device, metrics, run, progress, stop)
            if run.status == "running":
                state = {"model": model.state_dict(), "model_config": asdict(cfg.model)}
                save_checkpoint(run.path, cfg.total_steps, state)
                run.record_checkpoint(cfg.total_steps)
        ending = f"sft has no resume: the same command starts it over ({run.path})" \
            if run.status == "interrupted" else run.manifest.get("reason")
        progress.end(run.status, str(run.path), done, ending)
    finally:
        claim.release()
    return run.path


def _sft_loop(cfg: SFTConfig, model, task, tokenizer, device, metrics, run, progress: Progress,
              stop: StopOnSignal) -> int:
    """The SFT steps; returns how many were taken. A non-finite loss marks the run diverged and stops it; SIGINT or
    SIGTERM marks it interrupted after the step in flight (a second signal: at once)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
    schedule = cosine_with_warmup(cfg.optim.warmup_steps, cfg.total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    step = 0
    try:
        for step in range(cfg.total_steps):
            if stop.requested:
                run.mark_interrupted(stop.signal_name, step, resumes_from=None)
                return step
            problems = task.problems("train", step * cfg.batch_size, cfg.batch_size)
            batch = sft_batch(problems, task, tokenizer, device)
            line = sft_step(model, optimizer, scheduler, batch, cfg.optim.grad_clip)
            if not (math.isfinite(line["loss"]) and math.isfinite(line["grad_norm"])):
                metrics.write(line, step=step)
                run.mark_diverged(f"non-finite loss ({line['loss']}) or gradient norm ({line['grad_norm']}) at step "
                                  f"{step}")
                return step
            if (step + 1) % cfg.log.eval_every == 0 or step + 1 == cfg.total_steps:
                line["eval/reward"] = sampled_reward(model, task, tokenizer, cfg.sampling, cfg.log.eval_prompts,
                                                     cfg.seed)
            metrics.write(line, step=step)
            if (step + 1) % cfg.log.print_every == 0 or step + 1 == cfg.total_steps:
                progress.step(step + 1, {"loss": line["loss"], "eval": line.get("eval/reward")})
    except Interrupted as err:  # a second signal: the step in flight is abandoned
        run.mark_interrupted(str(err), step, resumes_from=None)
        return step
    return cfg.total_steps
