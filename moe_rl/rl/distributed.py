"""Data-parallel training under torchrun: the process group, which rank this is, and what the ranks exchange.

    torchrun --standalone --nproc_per_node=N -m moe_rl.cli train ...

starts N copies of the trainer, the ranks. Every rank samples its share of each rollout step's prompts, trains a
DistributedDataParallel (DDP) wrapper of the same model (DDP averages the gradients during backward) and joins a few
small collectives per step; rank 0 alone writes the run directory. A plain `python -m moe_rl.cli train`, or torchrun
with one process, creates no process group: every helper here then answers for a world of one and exchanges nothing,
so a single-process run computes exactly what it computed before this module existed.

`--parallel fsdp2` shards the model instead of replicating it (FSDP2, `fully_shard` per decoder block, see the
section below): the same data-parallel split of rows, losses and metrics, but each rank holds 1/W of the parameters,
gradients and optimizer state between forwards. Checkpoints then hold the whole (unsharded) state, saved by rank 0.

Backend: NCCL when the trainer runs on CUDA (rank r on cuda:LOCAL_RANK), gloo on CPU. Every rank reads and writes the
same run directory path, so all ranks of a multi-node job need one shared file system.

Besides DDP's gradient all-reduce, the ranks exchange (each call made by every rank, in the same order):
- `gather_objects`: small python objects (per-rank row counts and sampling failures, generator states for a
  checkpoint, routing-table rows, metric dicts); `broadcast_object`: how opening the run directory went on rank 0;
- `all_true`: agreement on a yes/no (is this optimizer step finite?), so that a NaN on one rank stops every rank;
- `sum_across_ranks`: counts of sequences and tokens, the loss weights of moe_rl.rl.trainer.

Metric reduction (`reduce_metrics`) goes by the last part of a metric's name (after the last "/"), split at "_":

    the word "max", or any name under time/   -> max over ranks   (ratio/max, ratio/log_abs_max, time/update)
    the word "min", or a flag that holds only  -> min over ranks   (ratio/min, seq_ratio/min,
    when it holds on every rank                                        churn/no_rl_signal)
    anything else                              -> mean over ranks  (loss, reward, kl, churn, grad_norm, ...)

A rank that does not report a metric is left out of its reduction (only rank 0 evaluates; a rank whose rows DAPO
dropped reports no ratio metrics). A NaN on any rank makes the reduced value NaN. Means are unweighted: a token mean
such as `kl` becomes the mean of per-rank token means, which is the token mean over all ranks only when the ranks
hold equally many tokens. Means over sequences with equally many sequences per rank (reward, reward_std,
completions/mean_length, the loss of grpo or gspo) are exact, and `loss` and `loss/total` are exact for every
objective because moe_rl.rl.trainer weights each rank's loss by its share of the batch.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

# FSDP2 and its state-dict helpers are imported where they are used: together they cost about 2 s of CPU per
# process on a 2-core EPYC (a third of a training run's start-up), and only sharded runs need them.

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
PARALLEL_MODES = ("ddp", "fsdp2")
# Rank r draws from generators seeded seed + offset + r * stride: distinct streams per rank, and rank 0 keeps the
# seeds of a single-process run.
RANK_SEED_STRIDE = 104_729


def launched_by_torchrun() -> bool:
    """True in a process that torchrun started as one of more than one rank."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES) and int(os.environ["WORLD_SIZE"]) > 1


def active() -> bool:
    """Whether this process is in a process group (so collectives must be called by every rank)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    """Rank 0: the one rank that writes the run directory."""
    return rank() == 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def rank_seed(seed: int) -> int:
    """The seed of this rank's own random streams (the seed itself on rank 0)."""
    return seed + RANK_SEED_STRIDE * rank()


@contextmanager
def process_group(device: torch.device) -> Iterator[torch.device]:
    """Join torchrun's process group for the block; yields the device this rank runs on (cuda:LOCAL_RANK on CUDA).

    Outside torchrun this yields `device` and does nothing else. A process that already joined a group (a test
    worker) keeps its group: it is used, and left open afterwards."""
    if active() or not launched_by_torchrun():
        yield rank_device(device) if active() else device
        return
    device = rank_device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield device
        # Leave together: a rank that tears down its connections while another still works (rank 0 saving the last
        # checkpoint) can make the other's backend fail. Not after an exception: the others may never get here.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def rank_device(device: torch.device) -> torch.device:
    """On CUDA, the GPU of this rank on its node (torchrun's LOCAL_RANK); other devices as given."""
    return torch.device("cuda", local_rank()) if device.type == "cuda" else device


def _comm_device() -> torch.device:
    """NCCL exchanges CUDA tensors only; gloo CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------------------
# Collectives (no-ops in a single process)


def all_true(flag: bool) -> bool:
    """True only if `flag` is true on every rank."""
    if not active():
        return flag
    flag_1 = torch.tensor([int(flag)], device=_comm_device())
    dist.all_reduce(flag_1, op=dist.ReduceOp.MIN)
    return bool(flag_1.item())


def sum_across_ranks(x: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of `x` over ranks (a new tensor, on x's device)."""
    if not active():
        return x.clone()
    total = x.to(_comm_device(), copy=True)
    dist.all_reduce(total)
    return total.to(x.device)


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if not active():
        return [obj]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` (picklable) on every rank."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------------------------------------------------
# Reductions of metrics and table rows


# 0/1 flags true of the whole step only when every rank's is true: the min over ranks.
ALL_RANKS_FLAGS = ("churn/no_rl_signal",)


def reduction(name: str) -> str:
    """'max', 'min' or 'mean': how metric `name` is reduced over ranks (the rule in the module docstring)."""
    words = name.rsplit("/", 1)[-1].split("_")
    if "max" in words or name.startswith("time/"):
        return "max"
    if "min" in words or name in ALL_RANKS_FLAGS:
        return "min"
    return "mean"


def reduce_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Every metric reduced over the ranks that report it, by `reduction(name)`; one collective."""
    if not active():
        return dict(metrics)
    per_rank = gather_objects(dict(metrics))
    names = dict.fromkeys(name for rank_metrics in per_rank for name in rank_metrics)  # rank 0's order first
    return {name: _reduce(reduction(name), [m[name] for m in per_rank if name in m]) for name in names}


def reduce_table(rows: Sequence[Mapping[str, Any]], by: Sequence[str]) -> list[dict[str, Any]]:
    """Table rows of all ranks, one row per value of the `by` columns, its other columns reduced over the ranks
    that have that row (as `reduce_metrics`). Rows keep rank 0's order."""
    if not active():
        return [dict(row) for row in rows]
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for rank_rows in gather_objects(list(rows)):
        for row in rank_rows:
            groups.setdefault(tuple(row[column] for column in by), []).append(row)
    return [{column: _reduce(reduction(column), [row[column] for row in group]) if column not in by else value
             for column, value in group[0].items()} for group in groups.values()]


def _reduce(how: str, values: list[Any]) -> Any:
    if not all(isinstance(value, (int, float)) for value in values):
        return values[0]  # not a number (a string, None): rank 0's, or the first rank's that has it
    if any(math.isnan(value) for value in values):
        return math.nan
    if how == "max":
        return max(values)
    if how == "min":
        return min(values)
    return sum(values) / len(values)


# ---------------------------------------------------------------------------------------------------------------------
# The model


def parallelize(model: torch.nn.Module, device: torch.device, mode: str = "ddp",
                find_unused_parameters: bool = False) -> torch.nn.Module:
    """The module training forwards go through, by `mode`: 'ddp' wraps `model` (`data_parallel`); 'fsdp2' shards
    `model` itself in place (`shard_fsdp2`) and returns it. Outside a process group: `model`, untouched."""
    if mode == "fsdp2" and active():
        return shard_fsdp2(model)
    return data_parallel(model, device, find_unused_parameters)


def data_parallel(model: torch.nn.Module, device: torch.device, find_unused_parameters: bool = False):
    """The module training forwards go through: `model` wrapped in DDP inside a process group, else `model` itself.

    DDP broadcasts rank 0's parameters and buffers once, here; after that every rank applies the same averaged
    gradients. The model's only buffer (rotary frequencies) never changes, so it is not re-sent before every forward."""
    if not active():
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False,
                                   find_unused_parameters=find_unused_parameters)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DDP wrapper (or `model` itself): the one routing sessions attach to."""
    return model.module if isinstance(model, DistributedDataParallel) else model


# ---------------------------------------------------------------------------------------------------------------------
# FSDP2: parameters, gradients and optimizer state sharded over the ranks
#
# `fully_shard` per decoder block, then on the root (embedding, final norm, output head): a block's parameters are
# all-gathered just before its forward and freed after it, and its gradients reduce-scattered in backward, so each
# rank holds 1/W of the weights, gradients and AdamW moments between forwards. Routing sessions attach to the MoE
# layers as plain attributes and FSDP2 keeps the module objects, so record, replay and every probe work unchanged.
# Every rank must run the same sequence of forwards: the old pass, updates and probes do (equal row chunks on every
# rank); sampling does not (a rank stops when its completions end), so it runs inside `full_parameters`.


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The units FSDP2 shards one by one: `model.decoder_blocks()` where a backend defines it (a wrapped Hugging
    Face model), else the native `model.blocks`."""
    if hasattr(model, "decoder_blocks"):
        return list(model.decoder_blocks())
    if hasattr(model, "blocks"):
        return list(model.blocks)
    raise TypeError(f"{type(model).__name__} exposes neither decoder_blocks() nor blocks; FSDP2 cannot shard it")


def shard_fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    """Shard `model` in place over the process group: each decoder block, then the root. Build the optimizer after
    this (its parameters become DTensors)."""
    from torch.distributed.fsdp import fully_shard

    for block in decoder_blocks(model):
        fully_shard(block)
    fully_shard(model)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    # No module is an FSDPModule before torch.distributed.fsdp is imported (shard_fsdp2 imports it), so a process
    # that never shards does not pay for the import here.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


@contextmanager
def full_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block a sharded model keeps all of its parameters gathered, so its forwards exchange nothing and
    ranks may run different numbers of them (sampling, which stops when a rank's completions end). Every rank must
    enter and leave together. A model that is not sharded: nothing happens."""
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)


def full_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts with every tensor whole, as one process would hold them; a collective under
    FSDP2 (every rank calls it; rank 0 saves). The optimizer's state is keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    whole_on_cpu = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=whole_on_cpu),
            get_optimizer_state_dict(model, optimizer, options=whole_on_cpu))


def load_full_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                          optimizer_state: dict) -> None:
    """Load whole state dicts (from `full_state_dicts`) into a sharded model and its optimizer: each rank keeps its
    shard. Every rank passes the same dicts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def scalar(x: torch.Tensor) -> float:
    """A 0-d tensor's value; a DTensor (FSDP2's gradient norm) is made whole first."""
    return (x.full_tensor() if hasattr(x, "full_tensor") else x).item()
