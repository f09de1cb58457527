"""The MKL batch path of the experts' grouped matmul: the same numbers as torch._grouped_mm, used only where it serves."""

import pytest
import torch

from conftest import tiny_config, tiny_model
from moe_rl.model import MoETransformer
from moe_rl.model.grouped_gemm import MKL_MIN_EXPERTS, grouped_mm, mkl_available

needs_mkl = pytest.mark.skipif(not mkl_available(), reason="this torch build does not export MKL's batched GEMM")


def _sorted_rows(counts_E: torch.Tensor, d_in: int, d_out: int):
    x_ND = torch.randn(int(counts_E.sum()), d_in)
    w_EDF = torch.randn(counts_E.numel(), d_in, d_out)
    return x_ND, w_EDF, counts_E.cumsum(0).to(torch.int32)


@needs_mkl
@pytest.mark.parametrize("d_in, d_out", [(64, 64), (32, 64), (64, 128), (256, 512), (24, 48)])
def test_batch_call_equals_torch_grouped_mm_at_every_group_size(d_in, d_out):
    counts_E = torch.arange(130)[torch.randperm(130)]  # every group size from 0 (an idle expert) to 129
    x_ND, w_EDF, ends_E = _sorted_rows(counts_E, d_in, d_out)
    with torch.no_grad():
        y_NF = grouped_mm(x_ND, w_EDF, counts_E, ends_E)
    assert torch.equal(y_NF, torch._grouped_mm(x_ND, w_EDF, offs=ends_E))


@needs_mkl
def test_batch_call_fills_rows_of_a_single_busy_expert():
    counts_E = torch.zeros(MKL_MIN_EXPERTS, dtype=torch.long)
    counts_E[5] = 7
    x_ND, w_EDF, ends_E = _sorted_rows(counts_E, 16, 8)
    with torch.no_grad():
        assert torch.equal(grouped_mm(x_ND, w_EDF, counts_E, ends_E), x_ND @ w_EDF[5])


def test_training_keeps_torch_kernel_and_its_backward():
    counts_E = torch.full((MKL_MIN_EXPERTS,), 3)
    x_ND, w_EDF, ends_E = _sorted_rows(counts_E, 16, 8)
    w_EDF.requires_grad_()
    y_NF = grouped_mm(x_ND, w_EDF, counts_E, ends_E)
    assert "GroupedMm" in type(y_NF.grad_fn).__name__


@needs_mkl
def test_group_sizes_that_do_not_cover_the_rows_are_refused():
    counts_E = torch.full((MKL_MIN_EXPERTS,), 2)
    x_ND, w_EDF, ends_E = _sorted_rows(counts_E, 16, 8)
    with torch.no_grad(), pytest.raises(ValueError, match="sum to 128, but x has 127 rows"):
        grouped_mm(x_ND[:-1], w_EDF, counts_E, ends_E)


@pytest.mark.parametrize("top_k", [2, 8])
def test_many_expert_passes_without_grad_equal_the_training_forward_and_the_loop(top_k):
    """At MKL_MIN_EXPERTS experts the no-grad pass (sampling, old pass, probes) takes the batch call; its logits
    must be exactly those of the grad-enabled forward (torch._grouped_mm), and close to the loop reference."""
    overrides = dict(n_experts=MKL_MIN_EXPERTS, top_k=top_k, dispatch="grouped_mm")
    model = tiny_model(**overrides)
    loop = MoETransformer(tiny_config(**{**overrides, "dispatch": "loop"}))
    loop.load_state_dict(model.state_dict())
    ids = torch.randint(0, 40, (4, 13))
    with torch.no_grad():
        logits_no_grad = model(ids).logits_BSV
        logits_loop = loop(ids).logits_BSV
    logits_grad = model(ids).logits_BSV
    assert torch.equal(logits_no_grad, logits_grad.detach())
    torch.testing.assert_close(logits_no_grad, logits_loop, rtol=1e-5, atol=1e-5)
