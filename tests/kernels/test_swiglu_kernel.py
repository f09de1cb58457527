"""The experts' activation in one C pass (moe_rl/kernels/activation.py): torch's bits forward and backward wherever it
serves, including the special values; the load-time check tells the two ways of rounding apart; it serves one torch
thread only; and the experts' forward and backward are the same numbers with it and without. Run under each ISA cap
by `make test-numerics` (the kernel follows torch's dispatch: 16 lanes on AVX-512, 8 on AVX2, scalar at the
baseline)."""

import pytest
import torch
from conftest import spy_kernel

from moe_rl import kernels
from moe_rl.kernels import activation, native
from moe_rl.model.moe import Experts, swiglu, weighted_swiglu

KERNELS = kernels.machine()  # the model functions' fast paths, as a built model's forward hands them down

needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler to build the kernels")
pytestmark = [pytest.mark.usefixtures("kernels_on"), pytest.mark.numerics, needs_native]
LANES = {"AVX512": 16, "AVX2": 8, "DEFAULT": 1}.get(torch.backends.cpu.get_cpu_capability())


def _served_widths() -> set[int]:
    """The widths this machine's torch dispatch lets the kernel take: every one at the baseline; with vectors, the
    multiples of two vectors (torch's scalar code computes what is left of a row)."""
    if LANES is None:
        return set()
    return {f for f in (4, 16, 32, 40, 64, 256) if LANES == 1 or f % (2 * LANES) == 0}


def _gate_up(rows: int, d_expert: int) -> torch.Tensor:
    gate_up_N2F = torch.randn(rows, 2 * d_expert) * 6
    if rows >= 2:  # the specials in a gate and in an up, wherever the row is long enough for them
        specials = torch.tensor(activation._SPECIAL[:d_expert])
        gate_up_N2F[0, :len(specials)] = specials
        gate_up_N2F[1, d_expert:d_expert + len(specials)] = specials.flip(0)
    return gate_up_N2F


@pytest.mark.parametrize("d_expert", [4, 16, 32, 40, 64, 256])
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
def test_the_kernel_gives_torchs_bits_forward_and_backward(d_expert, rows, monkeypatch):
    served = spy_kernel(monkeypatch, "swiglu")
    gate_up_N2F, grad_NF = _gate_up(rows, d_expert), torch.randn(rows, d_expert)
    ours = gate_up_N2F.clone().requires_grad_()
    hidden_NF = swiglu(ours, kernels=KERNELS)
    hidden_NF.backward(grad_NF)
    theirs = gate_up_N2F.clone().requires_grad_()
    reference_NF = swiglu.reference(theirs)
    reference_NF.backward(grad_NF)
    assert activation.same_bits(hidden_NF.detach(), reference_NF.detach())
    assert activation.same_bits(ours.grad, theirs.grad)
    with torch.no_grad():
        assert activation.same_bits(swiglu(gate_up_N2F, kernels=KERNELS), reference_NF.detach())
    assert len(served) == (2 if d_expert in _served_widths() else 0), "the kernel served where it should not, or not"


@pytest.mark.parametrize("d_expert", [4, 16, 32, 40, 64, 256])
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("grads", ["gate_up and weights", "gate_up", "weights"])
def test_the_weighted_kernel_gives_torchs_bits_forward_and_backward(d_expert, rows, grads, monkeypatch):
    """swiglu(gate_up) * weight[:, None] (the experts' path where the gate weight scales the down product's input):
    values with and without autograd and both gradients are torch's bits, with the special values in gate_up and
    zeros of both signs, a huge weight and an infinite gradient beside them."""
    served = spy_kernel(monkeypatch, "weighted_swiglu")
    gate_up_N2F, grad_NF, weight_N = _gate_up(rows, d_expert), torch.randn(rows, d_expert), torch.rand(rows)
    if rows >= 7:
        weight_N[2:5] = torch.tensor([0.0, -0.0, 3e38])
        grad_NF[5, 0] = float("inf")

    def forward_backward(fn):
        gate_up = gate_up_N2F.clone().requires_grad_("gate_up" in grads)
        weight = weight_N.clone().requires_grad_("weights" in grads)
        out_NF = fn(gate_up, weight)
        out_NF.backward(grad_NF)
        with torch.no_grad():
            no_grad_NF = fn(gate_up_N2F, weight_N)
        return out_NF.detach(), no_grad_NF, gate_up.grad, weight.grad

    ours = forward_backward(lambda gate_up, weight: weighted_swiglu(gate_up, weight, kernels=KERNELS))
    theirs = forward_backward(lambda gate_up, weight: swiglu.reference(gate_up) * weight[:, None])
    for name, a, b in zip(("values", "values without autograd", "gate_up's gradient", "weights' gradient"), ours,
                          theirs):
        assert (a is None) == (b is None), name
        assert a is None or activation.same_bits(a, b), name
    assert len(served) == (2 if d_expert in _served_widths() else 0), "the kernel served where it should not, or not"


@pytest.mark.skipif(LANES in (None, 1), reason="only the vector versions have two ways to round")
def test_the_check_at_load_tells_the_fused_and_unfused_ways_apart():
    """The way exact_variant picked matches torch on its check block and the other way does not: the check can
    catch a torch build whose compiler made the other choice."""
    variant = activation.exact_variant(32)
    assert variant is not None
    gate_up_N2F, grad_NF = activation._check_block(32)
    reference = gate_up_N2F.clone().requires_grad_()
    swiglu.reference(reference).backward(grad_NF)
    other = variant._replace(fused=not variant.fused)
    assert activation.same_bits(activation._swiglu(variant, gate_up_N2F, grad_NF), reference.grad)
    assert not activation.same_bits(activation._swiglu(other, gate_up_N2F, grad_NF), reference.grad)


def test_a_negative_zero_is_not_a_zero_and_nan_is_nan():
    assert not activation.same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert activation.same_bits(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))


def test_it_serves_one_torch_thread_only(monkeypatch):
    served = spy_kernel(monkeypatch, "swiglu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        swiglu(torch.randn(8, 64), kernels=KERNELS)
        assert served == []
    finally:
        torch.set_num_threads(threads)
    swiglu(torch.randn(8, 64), kernels=KERNELS)
    assert len(served) == (1 if 32 in _served_widths() else 0)


@pytest.mark.parametrize("dispatch", ["grouped_mm", "padded"])
@pytest.mark.parametrize("d_expert", [32, 16])  # 16 < d_model: the gate weight scales the down product's input
def test_the_experts_give_the_same_numbers_with_the_kernel_and_without(dispatch, d_expert):
    torch.manual_seed(0)
    experts = Experts(n_experts=8, d_model=32, d_expert=d_expert, dispatch=dispatch)
    torch.nn.init.normal_(experts.w_gate_up, std=0.2)
    torch.nn.init.normal_(experts.w_down, std=0.2)
    x_TD = torch.randn(40, 32)
    weights_TK, ids_TK = torch.randn(40, 8).softmax(-1).topk(2, dim=-1)

    def forward_backward(on: bool):
        experts.zero_grad(set_to_none=True)
        x, weights = x_TD.clone().requires_grad_(), weights_TK.clone().requires_grad_()
        with kernels.forced(swiglu=on):
            out_TD = experts(x, weights, ids_TK, KERNELS)
        out_TD.square().sum().backward()
        return out_TD.detach(), x.grad, weights.grad, experts.w_gate_up.grad, experts.w_down.grad

    for with_kernel, without in zip(forward_backward(True), forward_backward(False)):
        assert torch.equal(with_kernel, without)
