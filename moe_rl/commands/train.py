"""moe-rl train: RL with verifiable rewards on the native MoE transformer, any objective, any routing mode.

One rollout step (docs/design.md section 2; the step is moe_rl.rl.trainer, the run around it this module):
  sample G completions for each of B prompts (KV cache; the sampler's routing kept for R3 and the rollout probe)
  -> rewards -> group-normalised advantages (DAPO drops zero-std groups; Dr. GRPO skips the std)
  -> shuffle rows, split into `minibatches` chunks
  -> old pass, chunk by chunk, no grad: theta_old log-probs and routing (native; R3 replays the sampler's)
  -> one optimizer step per chunk: forward (native | R2 replays the old pass | R3 replays the sampler)
     -> objective (+ router aux loss, + optional k3 KL to the initial policy) -> backward -> clip -> AdamW
     -> routing probes (moe_rl.rl.probes) -> one metrics.jsonl line.
Every `checkpoint_every` rollout steps the full state is saved atomically; `--resume` continues bit-for-bit.

Under torchrun every rank samples its share of the prompts and trains through DDP (or FSDP2, `--parallel fsdp2`),
with the gradient of the loss over all ranks' rows; rank 0 writes metrics, routing tables and checkpoints, a NaN on
any rank stops every rank, and `--resume` needs the same number of ranks.

    moe-rl train --out-dir runs/grpo --init-from runs/sft/checkpoints/latest.pt              # CPU
    moe-rl train --objective.name gspo --routing-mode R3 --device cuda ...                   # one GPU (bf16)
    torchrun --standalone --nproc_per_node=8 -m moe_rl.cli train --device cuda ...           # many GPUs (DDP, NCCL)
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 -m moe_rl.cli train --device cpu ...   # DDP, gloo
    torchrun --standalone --nproc_per_node=8 -m moe_rl.cli train --parallel fsdp2 --device cuda ...   # sharded (FSDP2)
"""

from __future__ import annotations

import gc
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import torch

from moe_rl.errors import ConfigError
from moe_rl.rl import distributed
from moe_rl.rl.build import build_model_tokenizer, check_sampler_memory, check_task_fits, resolve_device
from moe_rl.rl.run_config import TrainConfig
from moe_rl.rl.trainer import Diverged, Trainer
from moe_rl.routing.mode import RoutingMode
from moe_rl.runs.claim import claim_run_dir, fresh_run_name, open_claimed
from moe_rl.runs.interrupt import Interrupted, StopOnSignal
from moe_rl.runs.progress import Progress, final_eval_line, no_rl_signal_note, rl_step_fields, say
from moe_rl.runs.runlog import RunDir, resume_command
from moe_rl.runs.trackers import check_trackers_installed, make_trackers
from moe_rl.runs.warning import EarlyWarning, warning_line
from moe_rl.tasks import build_task
from moe_rl.tasks.digest import task_digest


def train(cfg: TrainConfig) -> Path:
    """Run (or resume) RL training, in one process or as one rank of a torchrun job; returns the run directory."""
    torch.set_num_threads(cfg.threads)
    with distributed.process_group(resolve_device(cfg.device)) as device, StopOnSignal() as stop:
        cfg.check_data_parallel(distributed.world_size())
        # Absolute: the config.json, the manifest and the printed resume command name the run wherever they are read.
        # `~` too, which a shell leaves as it is after `--out-dir=`.
        cfg = replace(cfg, out_dir=str(Path(run_dir_name(cfg)).expanduser().absolute()))
        _train_on_this_rank(cfg, device, stop)
        # The trainer (and its DDP wrapper, which holds the process group) is gone before the group is destroyed;
        # tearing the group down under a live DDP reducer could abort the process at exit.
        gc.collect()
    return Path(cfg.out_dir)


def run_dir_name(cfg: TrainConfig) -> str:
    """cfg.out_dir, or (none given) a fresh runs/<time>-<objective>-<routing mode>, the same on every rank."""
    if cfg.out_dir is not None:
        return cfg.out_dir
    if cfg.resume_from is not None:
        return str(Path(cfg.resume_from).parent.parent)  # <run>/checkpoints/step_XXXXXX.pt
    if cfg.resume:
        raise ConfigError("--resume needs --out-dir: the directory of the run to continue")
    return distributed.broadcast_object(fresh_run_name(stem=f"{cfg.objective.name}-{cfg.routing_mode}"))


def _train_on_this_rank(cfg: TrainConfig, device: torch.device, stop: StopOnSignal) -> None:
    """Claim the directory (rank 0), check the inputs, build, restore, then open the run: a set-up that fails leaves
    the directory as it was."""
    claim = on_main(lambda: claim_run_dir(cfg.out_dir, resume=cfg.resume, total_steps=cfg.total_steps,
                                          resume_from=cfg.resume_from))
    action, checkpoint = distributed.broadcast_object((claim.action, claim.checkpoint) if claim else None)
    trainer = None
    try:
        if action == "done":
            say(f"nothing to do: {cfg.out_dir} already finished at step {cfg.total_steps}")
            return
        inputs = check_inputs(cfg, device)
        on_main(lambda: claim.check_same_inputs(inputs))
        trainer = Trainer(cfg, device, init_weights=action != "resume")
        if action == "resume":
            trainer.restore(checkpoint)
        run = on_main(lambda: open_claimed(claim, cfg, seed=cfg.seed, device=device, inputs=inputs))
        progress = Progress(cfg.total_steps, start=trainer.step, quiet=cfg.quiet or run is None)
        with run if run is not None else nullcontext():
            with open_metrics(run, trainer, resumed=action == "resume") as metrics:
                _loop(trainer, metrics.write, run, progress, stop)
        if run is not None:
            progress.end(run.status, str(run.path), trainer.step, _ending(run))
    finally:
        if trainer is not None:
            trainer.close()  # the rollout engine, before the process group it may share is torn down
        if claim is not None:
            claim.release()


def check_inputs(cfg: TrainConfig, device: torch.device | None = None) -> dict:
    """What would fail later with a traceback: a tracker not installed, a vocabulary or context the task overflows,
    a KV cache larger than the device. Returns the content hash of the task data, which a resume compares with the
    run's (manifest `inputs`)."""
    check_trackers_installed(cfg.log.trackers)
    cfg.correction.validate()
    RoutingMode.of(cfg.routing_mode, cfg.replay)  # refuses a replay variant the mode has nothing to apply to
    tokenizer = build_model_tokenizer(cfg.model)
    task = build_task(cfg.task, tokenizer)
    check_task_fits(cfg.model, tokenizer, task, cfg.rollout.sampling.max_new_tokens)
    rows = max(cfg.rollout.prompts_per_step * cfg.rollout.group_size, cfg.log.eval_prompts if cfg.log.eval_every else 0)
    if device is not None:
        check_sampler_memory(cfg.model, rows, cfg.rollout.sampling.max_new_tokens, device)
    return task_digest(cfg.task, task)


def on_main(make):
    """`make()` on rank 0 (None on the others). Every rank learns how that went, so an error stops every rank with
    rank 0's error instead of leaving the others waiting for it."""
    result, error = None, None
    if distributed.is_main():
        try:
            result = make()
        except Exception as err:  # re-raised on every rank just below
            error = err
    error = distributed.broadcast_object(error)
    if error is not None:
        raise error
    return result


class _NoMetrics:
    """The metrics writer of ranks other than 0: they compute and reduce every line, and rank 0 writes it."""

    def __enter__(self) -> _NoMetrics:
        return self

    def __exit__(self, *exc_info) -> bool:
        return False

    def write(self, line: dict) -> None:
        pass


def open_metrics(run: RunDir | None, trainer: Trainer, resumed: bool):
    """Rank 0's metrics.jsonl writer (and trackers); a writer that drops every line on the other ranks."""
    if run is None:
        return _NoMetrics()
    log = trainer.cfg.log
    trackers = make_trackers(log.trackers, run.path, config=run.config, wandb=asdict(log.wandb),
                             run_id=run.manifest.get("tracker_id"))
    resume_from = trainer.step - 1 if resumed else None
    return run.open_metrics(resume_from_step=resume_from, trackers=trackers, tracker_step_key="update")


def _ending(run: RunDir) -> str | None:
    """What the last line adds to the status: the reason, or for an interrupted run how to continue it."""
    if run.status != "interrupted":
        return run.manifest.get("reason")
    if (run.manifest.get("interrupted") or {}).get("resumes_from_step") is None:
        return f"no checkpoint yet: the same command starts it over ({run.path})"
    return f"resume with: {resume_command(run.path, run.manifest.get('world_size', 1))}"


def _loop(trainer: Trainer, write, run: RunDir | None, progress: Progress, stop: StopOnSignal) -> None:
    """Rollout steps until total_steps; eval lines and checkpoints on their cadence; a progress line per step.
    A first SIGINT or SIGTERM ends the run after the step in flight, with a checkpoint; a second one abandons the
    step (moe_rl.runs.interrupt). `run` is None on ranks other than 0."""
    cfg = trainer.cfg
    saved = trainer.step if trainer.step > 0 else None  # the step of the checkpoint on disk
    warning = EarlyWarning(cfg.log.warn_metric, cfg.log.warn_threshold,
                           fired=run is not None and "early_warning" in run.manifest)
    try:
        while trainer.step < cfg.total_steps:
            lines: list[dict] = []
            try:
                trainer.rl_step(lambda line, lines=lines: (lines.append(line), write(line)))
            except Diverged as err:  # raised on every rank together
                if run is not None:
                    run.mark_diverged(str(err))
                return
            trainer.step += 1
            if trainer.step == cfg.total_steps and cfg.log.eval_every and trainer.evaluates_here:
                # The policy after the last update; step = total_steps marks "after training".
                lines.append({"step": trainer.step, "minibatch": -1, "update": trainer.updates, **trainer.evaluate()})
                write(lines[-1])
            signal_name = distributed.broadcast_object(stop.signal_name)  # rank 0's, so every rank stops together
            if trainer.step % cfg.checkpoint_every == 0 or trainer.step == cfg.total_steps or signal_name:
                trainer.save()
                saved = trainer.step
                if run is not None:
                    run.record_checkpoint(trainer.step)
            progress.step(trainer.step, rl_step_fields(lines), note=no_rl_signal_note(lines))
            if run is not None:
                warn(warning, lines, run)
            if trainer.step == cfg.total_steps and lines and lines[-1]["minibatch"] == -1 \
                    and "eval/reward" in lines[-1]:  # the evaluation after training, not a skipped step's line
                progress.line(final_eval_line(lines[-1], trainer.step, cfg.log.eval_prompts))
            if signal_name and trainer.step < cfg.total_steps:
                if run is not None:
                    run.mark_interrupted(signal_name, trainer.step, resumes_from=saved)
                return
    except Interrupted as err:  # a second signal: the step in flight is abandoned, the last checkpoint stands
        if run is not None:
            run.mark_interrupted(str(err), trainer.step, resumes_from=saved)


def warn(warning: EarlyWarning, lines: list[dict], run: RunDir) -> None:
    """The early warning (moe_rl.runs.warning) on one rollout step's lines: printed, even with --quiet, and kept in
    the manifest; a metric name never logged is said once."""
    unknown = warning.unknown_metric(lines)
    if unknown:
        say(unknown, err=True)
    event = warning.check(lines)
    if event is not None:
        say(warning_line(event), err=True)
        run.record_warning(event)
