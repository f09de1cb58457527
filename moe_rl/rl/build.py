"""What every entry point builds a run from: the device, the tokenizer, the model (fresh or from a checkpoint; native
or Hugging Face) and the optimizer.

Shared by `moe-rl train`, `moe-rl sft` and the probes, so that each builds its model the same way.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import torch

from moe_rl import kernels  # the CPU fast paths: loaded before a run writes its manifest, which records them
from moe_rl.errors import ConfigError, DataError
from moe_rl.model import ModelConfig, MoETransformer
from moe_rl.model.config import NON_ARCHITECTURE_FIELDS
from moe_rl.runs.checkpoint import load_checkpoint
from moe_rl.tasks import Tokenizer, build_tokenizer
from moe_rl.tasks.tokenizer import HFTokenizer


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


def build_model(cfg: ModelConfig, device: torch.device, seed: int, init_from: str | None):
    """The native MoETransformer with this machine's kernels (moe_rl.kernels), or with backend 'hf' an HFMoEModel
    (same interface: moe_rl.model.hf)."""
    torch.manual_seed(seed)
    if cfg.backend == "hf":
        model = _hf_model(cfg)
    else:
        model = MoETransformer(cfg, kernels=kernels.machine())
    if init_from is not None:
        load_model_weights(model, init_from)
    return model.to(device)


def _hf_model(cfg: ModelConfig):
    """build_hf_model, with transformers' and safetensors' errors about a checkpoint directory as one line."""
    from moe_rl.model.hf import build_hf_model

    try:
        return build_hf_model(cfg)
    except (ConfigError, DataError):
        raise
    except Exception as err:  # OSError (no weights), SafetensorError (cut short), ValueError (foreign files)
        if cfg.hf_path is None:
            raise
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise DataError(f"hf_path={cfg.hf_path}: the weights cannot be loaded ({type(err).__name__}: {first}); "
                        "expected a directory written by save_pretrained (config.json and model.safetensors)") \
            from None


def _hf_vocab_size(path: str) -> int:
    """The vocab_size of a checkpoint directory's config.json; ConfigError naming it when it is not readable."""
    from moe_rl.model.hf import checkpoint_model_type

    try:
        checkpoint_model_type(path)  # a one-line error for a missing directory, family or transformers
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path, local_files_only=True).vocab_size
    except ConfigError:
        raise
    except (OSError, ValueError) as err:  # transformers: not valid JSON, unknown keys, ...
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(f"hf_path={path}: {Path(path) / 'config.json'} cannot be read ({first})") from None


def build_model_tokenizer(cfg: ModelConfig) -> Tokenizer:
    """The tokenizer of the task prompts: with hf_path, the checkpoint directory's own if it has one; otherwise
    the character tokenizer. Its ids must fit the model's vocabulary."""
    if cfg.backend == "native" or cfg.hf_config is not None:
        return build_tokenizer()
    vocab = _hf_vocab_size(cfg.hf_path)
    from transformers import AutoTokenizer

    if _has_tokenizer(cfg.hf_path):
        try:
            tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(cfg.hf_path, local_files_only=True))
        except ValueError as err:
            raise ConfigError(f"hf_path={cfg.hf_path}: {err}") from None
        which = "its tokenizer"
    else:
        tokenizer, which = build_tokenizer(), "the character tokenizer (the directory has no tokenizer)"
    if tokenizer.vocab_size > vocab:
        raise ConfigError(f"hf_path={cfg.hf_path}: {which} has {tokenizer.vocab_size} ids but the model's "
                          f"vocab_size is {vocab}")
    return tokenizer


def _has_tokenizer(path: str) -> bool:
    return any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                          "tokenizer.model", "vocab.json"))


def make_optimizer(model, cfg) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with linear warmup to a constant learning rate; the routers in a group of their own at lr x
    `router_lr_scale` (frozen routers, see `freeze_routers`, have no group). Fused (one kernel over all parameters)
    where torch has it: about 3x faster than the default per-parameter loop on CPU for a 39M-parameter model
    (benchmarks/)."""
    params = [p for p in model.parameters() if p.requires_grad]
    router_ids = {id(p) for p in router_parameters(model)} if cfg.router_lr_scale != 1 else set()
    groups = [{"params": [p for p in params if id(p) not in router_ids]}]
    routers = [p for p in params if id(p) in router_ids]
    if routers:
        groups.append({"params": routers, "lr": cfg.lr * cfg.router_lr_scale})
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, fused=_fused_adamw_supported(params))
    warmup = cfg.warmup_steps

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) if warmup else 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def router_parameters(model) -> list[torch.nn.Parameter]:
    """Every parameter of the model's routers (the gate, and a family's router bias where it has one)."""
    return [p for site in model.moe_layers() for p in site.router.parameters()]


def freeze_routers(model) -> None:
    """`router_lr_scale` 0: the routers take no gradient, so the optimizer, the gradient norm and data-parallel
    all-reduces leave them out. Called before the model is wrapped for data parallelism."""
    for p in router_parameters(model):
        p.requires_grad_(False)


def _fused_adamw_supported(params) -> bool:
    return all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)


def check_task_fits(cfg: ModelConfig, tokenizer, task, max_new_tokens: int, probe: int = 64) -> None:
    """Refuse, before anything is written, a model whose vocabulary is not the tokenizer's, or whose
    max_seq_len cannot hold a prompt (of every row of a file task; of the first `probe` training and held-out
    problems of a generator) plus a response."""
    if cfg.hf_path is not None:  # a checkpoint directory's own config sets its vocabulary and context, not ours
        _check_hf_vocab_decodes(cfg, tokenizer)
        return
    if cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer.vocab_size} tokens); use --model.vocab-size {tokenizer.vocab_size}")
    if cfg.vocab_size > tokenizer.vocab_size:  # the sampler would draw ids the tokenizer cannot decode
        raise ConfigError(f"model.vocab_size={cfg.vocab_size} is larger than the tokenizer's vocabulary "
                          f"({tokenizer.vocab_size} tokens): the model would sample ids no text has; use "
                          f"--model.vocab-size {tokenizer.vocab_size}")
    for split in ("train", "eval"):
        # Every row of a file (a long prompt at row 5000 would otherwise fail when the sampler reaches it); the first
        # `probe` problems of an unbounded generator, whose prompts share one format.
        for problem in task.problems(split, 0, task.num_problems(split) or probe):
            need = 1 + len(tokenizer.encode(problem.prompt)) + max_new_tokens  # BOS, prompt, response
            if need > cfg.max_seq_len:
                raise ConfigError(
                    f"model.max_seq_len={cfg.max_seq_len} is too short: a {split} prompt of the task takes "
                    f"{need - max_new_tokens} tokens, plus max_new_tokens={max_new_tokens} for the response = "
                    f"{need}; raise --model.max-seq-len or shorten the prompts")


def _check_hf_vocab_decodes(cfg: ModelConfig, tokenizer) -> None:
    """A checkpoint directory without tokenizer files gets the character tokenizer; a model whose vocabulary is
    larger samples ids that tokenizer cannot decode (a crash in the first rollout), so refuse it here. (A smaller one
    is refused by build_model_tokenizer.)"""
    if cfg.backend != "hf" or _has_tokenizer(cfg.hf_path):
        return
    vocab = _hf_vocab_size(cfg.hf_path)
    if vocab != tokenizer.vocab_size:
        raise ConfigError(
            f"hf_path={cfg.hf_path}: the directory has no tokenizer files, so prompts use the character tokenizer "
            f"({tokenizer.vocab_size} ids), but the model's vocab_size is {vocab}: it would sample ids the tokenizer "
            "cannot decode; save the model's tokenizer into the directory (tokenizer.json or tokenizer_config.json) "
            f"or use a checkpoint with vocab_size {tokenizer.vocab_size}")


def check_sampler_memory(cfg: ModelConfig, rows: int, max_new_tokens: int, device: torch.device,
                         prompt_tokens: int = 64) -> None:
    """Refuse, before anything is written, a rollout whose KV cache alone exceeds the device's memory: keys and values
    of every layer for `rows` sequences of (prompt + max_new_tokens) positions, in fp32. Without this check a huge
    max_new_tokens ends in the allocator's traceback after the run directory was opened."""
    if cfg.backend != "native":
        return
    positions = prompt_tokens + max_new_tokens
    need = 2 * cfg.n_layers * rows * cfg.n_kv_heads * cfg.head_dim * positions * 4
    have = _device_memory(device)
    if have is not None and need > have:
        raise ConfigError(
            f"rollout.sampling.max_new_tokens={max_new_tokens}: the sampler's KV cache needs about "
            f"{need / 2**30:.1f} GiB "
            f"(2 x {cfg.n_layers} layers x {rows} rows x {cfg.n_kv_heads} kv heads x {cfg.head_dim} dims x "
            f"{positions} positions x 4 bytes) but the {device.type} has {have / 2**30:.1f} GiB; lower "
            "--rollout.sampling.max-new-tokens or the rows per step (prompts_per_step x group_size, eval_prompts)")


def _device_memory(device: torch.device) -> int | None:
    """Total memory of the device in bytes (physical memory for the CPU), or None when it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
