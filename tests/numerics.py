"""Error bounds for fp32 computations, derived from a float64 reference rather than from one CPU's rounding.

An fp32 result differs from the exact one by the rounding errors of its operations, amplified by how sensitive the
result is to them. Both are measured in float64, on any CPU alike:

- the reference: the computation in float64 (rounding 2^29 times finer than fp32);
- the noise floor: how far the float64 result moves when every parameter and the result of every operation, forward
  and (through autograd) backward, is perturbed by one fp32 rounding (a relative 2^-24, random signs;
  `perturbed_rounding`). That is what an fp32 computation's own roundings do to its result, to first order,
  including cancellations: a gradient that is zero in exact arithmetic (a router under top-1 with renormalised
  weights) comes out of fp32 as rounding noise, and so it does out of the perturbed float64.

An fp32 computation is then correct to rounding when it lies within FLOOR_FACTOR noise floors (plus ULP_FACTOR units
of the tensor's largest value, for results the perturbation happens to leave still) of the reference. A wrong
computation, a dropped token or a misrouted slot, is off by orders of magnitude more.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.overrides import TorchFunctionMode

FP32_UNIT = 2.0**-24  # fp32's unit roundoff: the relative error of one rounding
FLOOR_FACTOR = 16.0  # fp32 results gather more roundings than one perturbation of the inputs
ULP_FACTOR = 64.0


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model in float64; MoE experts on the 'loop' path (one plain matmul chain per expert, in any dtype)."""
    model64 = copy.deepcopy(model).double()
    for module in model64.modules():
        if hasattr(module, "dispatch") and hasattr(module, "w_gate_up"):
            module.dispatch = "loop"
    return model64


def perturbed_copy(model64: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """model64 with every parameter multiplied by (1 +- FP32_UNIT), signs at random."""
    generator = torch.Generator().manual_seed(seed)
    perturbed = copy.deepcopy(model64)
    with torch.no_grad():
        for p in perturbed.parameters():
            signs = torch.randint(0, 2, p.shape, generator=generator, dtype=torch.float64) * 2 - 1
            p.mul_(1 + FP32_UNIT * signs)
    return perturbed


def bound(reference: torch.Tensor, perturbed: torch.Tensor) -> float:
    """The largest absolute error an fp32 result of `reference` may have (module docstring)."""
    floor = (perturbed - reference).abs().max().item()
    scale = reference.abs().max().item()
    return FLOOR_FACTOR * floor + ULP_FACTOR * FP32_UNIT * scale


def assert_within_rounding(actual: torch.Tensor, reference: torch.Tensor, perturbed: torch.Tensor, what: str = ""):
    error = (actual.double() - reference).abs().max().item()
    limit = bound(reference, perturbed)
    assert error <= limit, f"{what}: {error:.3g} from the float64 reference, beyond the fp32 bound {limit:.3g}"


class _PerturbEveryResult(TorchFunctionMode):
    """Every floating-point result of a torch function times (1 +- FP32_UNIT), signs from a seeded generator, and
    the gradient that reaches it in the backward too (a hook): the backward's roundings, of each path on its own,
    are what break a cancellation that exact arithmetic keeps (gradients of renormalised weights)."""

    def __init__(self, seed: int):
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)

    def _rounded(self, x: torch.Tensor) -> torch.Tensor:
        signs = torch.randint(0, 2, x.shape, generator=self.generator, dtype=torch.float64) * 2 - 1
        return x * (1 + FP32_UNIT * signs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.numel():
            out = self._rounded(out)
            if out.requires_grad:
                out.register_hook(self._rounded)
        return out


@contextlib.contextmanager
def perturbed_rounding(seed: int = 1):
    """Inside the block, float64 computations carry one fp32-sized rounding per operation (module docstring)."""
    with _PerturbEveryResult(seed):
        yield
