"""The sampler's numerics (`--rollout.sampling.precision`): emulated inference engines, and the zero-mismatch control.

The trainer never changes: fp32 on CPU, bf16 autocast with fp32 routers on GPU. Only the sampler (generation and
held-out evaluation) runs inside `sampler_numerics(model, device, precision)`, which yields the `Numerics` the
sampler passes to every forward of the model (`model(ids, valid, cache, numerics=numerics)`), down to the routers:

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
(moe_rl.rl.trainer, docs/design.md section 8), so the two are equal bit for bit by construction: the control arm.

A router inside an emulated engine rounds its input and gate weight to the engine's dtype and produces logits of
that dtype (softmax and top-k then in fp32 of those logits), as an engine's gate does, so near-tied router decisions
flip between sampler and trainer (the mismatch R3 replays away). The router learns its dtype from the `Numerics` it
is handed; the block's autocast and matrix products are torch's own mechanisms (an autocast context and a dispatch
mode), entered by `sampler_numerics` around the sampler's forwards.

On CPU an engine's matrix products (linear, matmul, mm, addmm, bmm, baddbmm and torch._grouped_mm of bf16 or fp16
tensors) are computed by `engine_products` as fp32 products of the rounded operands, rounded once to the engine's
dtype: what an engine's bf16 GEMM does (a product of two bf16 values is exact in fp32, and the sums run in fp32).
Why not torch's bf16 kernels: on a CPU without bf16 instructions they convert and multiply in slow fallback loops,
which made the bf16 sampler about 3x slower (rollouts) and 4x slower (held-out evaluation) than this, measured in
process time on a 2-core AMD EPYC with AVX2 in the length-generalisation regime. The fp32 products run through the
model's own fp32 kernels. They sum in another order than torch's bf16 kernels, so the two round to different bf16
values in about 1 of 2,000-20,000 outputs, by one bf16 ulp (tests/model/test_precision.py); runs with a bf16 sampler
made before this change (moe-rl 2026-12-01, the correction and length-generalisation studies) used torch's kernels.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from moe_rl.errors import ConfigError
from moe_rl.model.moe import grouped_mm
from moe_rl.model.replaceable import Kernels

SAMPLER_PRECISIONS = ("trainer", "bf16", "fp16", "fp8", "exact")
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_ENGINE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # activations and gate


class Numerics(NamedTuple):
    """How one forward of the native model computes, handed down its calls (MoETransformer.forward)."""

    kernels: Kernels | None = None  # the fast implementations its replaceable steps may use (None: torch's code)
    router_dtype: torch.dtype | None = None  # an emulated engine's gate dtype (None: fp32, the trainer's)


def trainer_autocast(device: torch.device):
    """The trainer's numerics, layers.autocast_context's rule (bf16 autocast on GPU, none on CPU), restated here
    because layers imports this module (tests/model/test_precision.py checks the two agree)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def sampler_autocast(device: torch.device, precision: str = "trainer", kernels: Kernels | None = None
                     ) -> Iterator[Numerics]:
    """The sampler's activations and routers. "trainer" and "exact": the trainer's autocast, so sampler and trainer
    route identically on CPU; an engine arm: autocast in its dtype on any device, its products rounded as an
    engine's (CPU), and the Numerics that tell the routers to compute in that dtype."""
    if precision in ("trainer", "exact"):
        with trainer_autocast(device):
            yield Numerics(kernels)
        return
    dtype = _ENGINE_DTYPES[precision]
    # The engine's grouped products in fp32 through the model's own grouped product (its fp32 kernels where they serve)
    products = engine_products(functools.partial(grouped_mm, kernels=kernels)) if device.type == "cpu" \
        else contextlib.nullcontext()
    with torch.autocast(device.type, dtype=dtype), products:
        yield Numerics(kernels, router_dtype=dtype)


_aten = torch.ops.aten
# linear and matmul too: under inference mode the dispatcher hands the mode those composite ops undecomposed
_PRODUCTS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.linear.default,
             _aten.matmul.default}
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class engine_products(TorchDispatchMode):
    """Inside the block, every CPU matrix product of bf16 or fp16 tensors is computed in fp32 from the same operand
    values and rounded once to their dtype; every other op runs as it would (see the module docstring).
    `grouped_product(x_ND, w_EDF, counts_E)` computes the fp32 grouped products."""

    def __init__(self, grouped_product: Callable):
        super().__init__()
        self.grouped_product = grouped_product

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        low = args[0].dtype if args and isinstance(args[0], torch.Tensor) else None
        if low not in _LOW_PRECISION or args[0].device.type != "cpu":
            return func(*args, **kwargs)
        if func in _PRODUCTS:
            with torch.autocast("cpu", enabled=False):
                return func(*(_widen(a) for a in args), **{k: _widen(v) for k, v in kwargs.items()}).to(low)
        if func is _aten._grouped_mm.default:
            return _grouped_in_fp32(self.grouped_product, *args, **kwargs).to(low)
        return func(*args, **kwargs)


def _widen(value):
    """A bf16 or fp16 tensor as fp32 (exactly), anything else as it is."""
    return value.float() if isinstance(value, torch.Tensor) and value.dtype in _LOW_PRECISION else value


def _grouped_in_fp32(grouped_product, x_ND, w_EDF, offs=None, bias=None, out_dtype=None):
    """torch._grouped_mm(x_ND, w_EDF, offs) of 2-D rows by 3-D weights, in fp32 through `grouped_product`."""
    if offs is None or bias is not None or out_dtype is not None or x_ND.dim() != 2 or w_EDF.dim() != 3:
        raise NotImplementedError("engine_products: torch._grouped_mm of 2-D rows by 3-D weights with offsets only")
    ends_E = offs.to(torch.int64)
    counts_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    with torch.autocast("cpu", enabled=False):
        return grouped_product(x_ND.float(), w_EDF.float(), counts_E)


@contextlib.contextmanager
def sampler_numerics(model: nn.Module, device: torch.device, precision: str = "trainer") -> Iterator[Numerics]:
    """sampler_autocast with the model's own kernels, and for "fp8" the model's attention and expert matrices
    replaced by their fp8 round trip for the duration of the block (restored after, bit for bit). Yields the
    Numerics to pass to the model's forwards."""
    kernels = getattr(model, "kernels", None)
    with fp8_weights(model) if precision == "fp8" else contextlib.nullcontext(), \
            sampler_autocast(device, precision, kernels) as numerics:
        yield numerics


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
