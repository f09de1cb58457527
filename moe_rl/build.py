"""What every entry point builds a run from: the device, the model (fresh or from a checkpoint) and the optimizer.

Shared by `moe-rl train`, `moe-rl sft` and the probes, so that each builds its model the same way.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from moe_rl.errors import ConfigError, DataError
from moe_rl.model import ModelConfig, MoETransformer
from moe_rl.model.config import NON_ARCHITECTURE_FIELDS
from moe_rl.runs.checkpoint import load_checkpoint


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA device is available; use device='cpu' or 'auto'")
    return torch.device(name)


def load_model_weights(model: MoETransformer, path: str) -> None:
    """Load a checkpoint's model weights, refusing one saved for a different architecture (loss coefficients and
    the dispatch path may differ: NON_ARCHITECTURE_FIELDS)."""
    state = load_checkpoint(path, what="init_from", require=("model",))
    saved = state.get("model_config") or {}
    asked = asdict(model.cfg)
    diff = {k: (saved[k], v) for k, v in asked.items()
            if k in saved and saved[k] != v and k not in NON_ARCHITECTURE_FIELDS}
    if diff:
        raise ConfigError(f"init_from={path} was saved for a different architecture; (saved, asked): {diff}")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError:  # missing, unexpected or mis-shaped weights: name them, not torch's whole report
        missing, unexpected = _key_mismatch(model, state["model"])
        keys = missing or unexpected
        more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        what = (f"lacks {', '.join(keys[:3])}{more}" if missing else f"has unknown weights {', '.join(keys[:3])}{more}"
                if unexpected else "has weights of other shapes")
        raise DataError(f"init_from={path}: the checkpoint {what} for this model; was it saved for another "
                        "architecture?") from None


def _key_mismatch(model, weights) -> tuple[list[str], list[str]]:
    ours, theirs = set(model.state_dict()), set(weights) if isinstance(weights, dict) else set()
    return sorted(ours - theirs), sorted(theirs - ours)


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


def check_task_fits(cfg: ModelConfig, tokenizer, task, max_new_tokens: int, probe: int = 64) -> None:
    """Refuse, before anything is written, a model whose vocabulary is smaller than the tokenizer's, or whose
    max_seq_len cannot hold a prompt (of the first `probe` training and held-out problems) plus a response."""
    if cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer.vocab_size} tokens); use --model.vocab-size {tokenizer.vocab_size} or more")
    for split in ("train", "eval"):
        for problem in task.problems(split, 0, min(probe, task.num_problems(split) or probe)):
            need = 1 + len(tokenizer.encode(problem.prompt)) + max_new_tokens  # BOS, prompt, response
            if need > cfg.max_seq_len:
                raise ConfigError(
                    f"model.max_seq_len={cfg.max_seq_len} is too short: a {split} prompt of the task takes "
                    f"{need - max_new_tokens} tokens, plus max_new_tokens={max_new_tokens} for the response = "
                    f"{need}; raise --model.max-seq-len or shorten the prompts")
