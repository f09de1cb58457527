"""The router's C top-k: torch.topk's indices on every row, including the rows it hands back to torch.topk."""

import ctypes

import pytest
import torch

from moe_rl.model import cpu_topk
from moe_rl.model.cpu_topk import native_available, topk_indices

needs_native = pytest.mark.skipif(not native_available(), reason="no C compiler to build the top-k kernel")


def _kernel_unclear_rows(scores_TE: torch.Tensor, k: int) -> list[int]:
    ids_TK = torch.empty(scores_TE.shape[0], k, dtype=torch.int64)
    count = cpu_topk._kernel()(scores_TE.data_ptr(), *scores_TE.shape, k, ids_TK.data_ptr())
    unclear = (ids_TK[:, 0] < 0).nonzero().squeeze(1).tolist()
    assert count == len(unclear)
    return unclear


@needs_native
@pytest.mark.parametrize("tokens, experts, k", [(1000, 128, 8), (300, 8, 2), (50, 64, 8), (20, 6, 6), (40, 16, 1),
                                                 (10, 100, 64)])
def test_indices_equal_torch_topk(tokens, experts, k):
    scores_TE = torch.randn(tokens, experts).mul(0.5).softmax(-1)
    assert torch.equal(topk_indices(scores_TE, k), scores_TE.topk(k, dim=-1).indices)
    assert _kernel_unclear_rows(scores_TE, k) == []


@needs_native
def test_rows_with_equal_or_missing_values_are_redone_by_torch():
    scores_TE = torch.rand(6, 32)
    scores_TE[1, [3, 9]] = 2.0  # the two largest are equal: their order is torch's
    scores_TE[2, :] = 0.0  # every value equal (a router whose softmax underflowed everywhere but one)
    scores_TE[2, 7] = 1.0
    top5 = scores_TE[3].topk(5).values
    scores_TE[3, (scores_TE[3] == top5[4]).nonzero()[0]] = top5[3]  # 4th and 5th largest equal: the boundary of k=4
    scores_TE[4, 0] = float("nan")
    assert _kernel_unclear_rows(scores_TE, 4) == [1, 2, 3, 4]
    assert torch.equal(topk_indices(scores_TE, 4), scores_TE.topk(4, dim=-1).indices)


@needs_native
def test_bf16_router_scores_with_many_ties_match_torch():
    logits_TE = torch.randn(500, 64).bfloat16().float()  # an emulated bf16 engine's gate: coarse, often tied
    scores_TE = logits_TE.softmax(-1)
    assert torch.equal(topk_indices(scores_TE, 8), scores_TE.topk(8, dim=-1).indices)


def test_inputs_the_kernel_does_not_serve_go_to_torch():
    scores = torch.randn(30, 128)
    for tensor, k in [(scores.double(), 8), (scores.T, 8), (scores, 100), (scores[:0], 8)]:
        assert torch.equal(topk_indices(tensor, k), tensor.topk(k, dim=-1).indices)


@needs_native
def test_build_compiles_once_into_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    library = cpu_topk._build()
    assert library.parent == tmp_path / "moe-rl" and library.exists()
    built_at = library.stat().st_mtime_ns
    assert cpu_topk._build() == library and library.stat().st_mtime_ns == built_at
    assert [p.name for p in (tmp_path / "moe-rl").iterdir()] == [library.name]  # no build folder left behind
    assert ctypes.CDLL(str(library)).topk_rows
