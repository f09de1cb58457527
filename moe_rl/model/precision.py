"""The sampler's numerics (`--rollout.sampling.precision`): emulated inference engines, and the zero-mismatch control.

The trainer never changes: fp32 on CPU, bf16 autocast with fp32 routers on GPU. Only the sampler (generation and
held-out evaluation) runs inside `sampler_numerics(model, device, precision)`:

| arm       | activations   | weights                                                          | router gate |
|-----------|---------------|------------------------------------------------------------------|-------------|
| `trainer` | the trainer's | the trainer's                                                    | fp32        |
| `bf16`    | bf16 autocast | bf16 (autocast casts them)                                       | bf16        |
| `fp16`    | fp16 autocast | fp16 (autocast casts them)                                       | fp16        |
| `fp8`     | bf16 autocast | attention and expert matrices float8 e4m3, one scale per matrix  | bf16        |
| `exact`   | the trainer's | the trainer's                                                    | fp32        |

(fp8: each matrix is stored as e4m3 codes and a scale amax / 448, and read back as code x scale for the product,
an engine's per-tensor-scaled fp8 weights; embeddings, norms, router gates, dense FFNs and the LM head stay bf16.)

`exact` samples like `trainer`; the trainer then replaces the sampler's log-probs and routing by its own old pass's
(moe_rl.trainer, docs/design.md section 8), so the two are equal bit for bit by construction: the control arm.

A router inside an emulated engine rounds its input and gate weight to the engine's dtype and produces logits of
that dtype (softmax and top-k then in fp32 of those logits), as an engine's gate does, so near-tied router decisions
flip between sampler and trainer (the mismatch R3 replays away). Not reentrant across threads.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from moe_rl.errors import ConfigError

SAMPLER_PRECISIONS = ("trainer", "bf16", "fp16", "fp8", "exact")
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_ENGINE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # activations and gate
_engine = {"router_dtype": None}  # set only inside sampler_autocast of an emulated engine


def engine_router_dtype() -> torch.dtype | None:
    """The dtype routers compute in inside an emulated inference engine (sampler_autocast), else None."""
    return _engine["router_dtype"]


def trainer_autocast(device: torch.device):
    """The trainer's numerics, layers.autocast_context's rule (bf16 autocast on GPU, none on CPU), restated here
    because layers imports this module (tests/test_precision.py checks the two agree)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def sampler_autocast(device: torch.device, precision: str = "trainer"):
    """The sampler's activations and routers. "trainer" and "exact": the trainer's autocast, so sampler and trainer
    route identically on CPU; an engine arm: autocast in its dtype on any device, and routers in that dtype."""
    if precision in ("trainer", "exact"):
        with trainer_autocast(device):
            yield
        return
    dtype = _ENGINE_DTYPES[precision]
    _engine["router_dtype"] = dtype
    try:
        with torch.autocast(device.type, dtype=dtype):
            yield
    finally:
        _engine["router_dtype"] = None


@contextlib.contextmanager
def sampler_numerics(model: nn.Module, device: torch.device, precision: str = "trainer"):
    """sampler_autocast, and for "fp8" the model's attention and expert matrices replaced by their fp8 round trip
    for the duration of the block (restored after, bit for bit)."""
    with fp8_weights(model) if precision == "fp8" else contextlib.nullcontext(), sampler_autocast(device, precision):
        yield


def fp8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """w stored as float8 e4m3 with a per-matrix scale amax / 448 and read back: (q * scale), in w's dtype. A 3-D
    expert tensor (E, in, out) has one scale per expert matrix, as an engine stores each expert's weights."""
    dims = tuple(range(1, w.dim())) if w.dim() == 3 else tuple(range(w.dim()))
    amax = w.detach().abs().amax(dim=dims, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.detach().float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (q.float() * scale).to(w.dtype)


def fp8_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The matrices an fp8 engine stores in fp8: attention projections and routed experts (not the embeddings,
    norms, router gates, dense or shared feed-forwards, nor the LM head)."""
    return [(name, p) for name, p in model.named_parameters()
            if p.dim() >= 2 and (".attn." in name or ".experts." in name)]


@contextlib.contextmanager
def fp8_weights(model: nn.Module):
    """Swap every fp8_parameters matrix for its fp8 round trip inside the block; the trainer's values come back."""
    params = fp8_parameters(model)
    if not params:
        raise ConfigError(f"sampling.precision='fp8' finds no attention or expert matrices in {type(model).__name__} "
                          "(it knows the native model's parameter names)")
    saved = [p.data for _, p in params]
    with torch.no_grad():
        for _, p in params:
            p.data = fp8_round_trip(p.data)
    try:
        yield
    finally:
        for (_, p), data in zip(params, saved):
            p.data = data
