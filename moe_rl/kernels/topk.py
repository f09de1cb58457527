"""The router's top-k on CPU: a C selection kernel (native_kernels.c), with torch.topk wherever the kernel's answer
could differ.

Why: torch.topk costs about 1.3 us per token at 128 experts on one CPU thread (it copies every row into (value,
index) pairs and partially sorts them), about a tenth of a decode step or of a no-grad pass at the paper's routing
shape. The kernel bounds a row's k+1 largest values from below by the maxima of 16 interleaved column groups,
gathers the few values above the bound and ranks them, without branches (native_kernels.c explains why each step
gives the right answer). Measured (one thread, medians; 704 tokens x 128 experts, top-8, a 32-sequence minibatch at
the paper's routing shape; a new score matrix each call, since a kernel timed on the same matrix over and over
learns its branches): torch.topk 921 us, an insertion kernel (this module's previous version) 493 us, this one 196 us.

Exactness: the kernel only compares and copies, so for a row whose k+1 largest scores are distinct numbers it returns
exactly torch.topk's indices (the k largest, in descending order, are then unique). Where two of them are equal (or a
score is NaN), torch's order among equals is an implementation detail this kernel does not reproduce, so that
row is redone by torch.topk (which treats each row on its own). Routing, traces and every number downstream are
therefore those torch.topk gives. Without the C kernels (native.py), torch.topk is used.
"""

from __future__ import annotations

import torch

from moe_rl.kernels.native import library as native_library
from moe_rl.kernels.registry import implements

MAX_K = 64


@implements("topk_indices")
def topk_indices(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """scores_TE.topk(k, dim=-1).indices, computed by the C kernel where it gives the same answer."""
    kernel = native_library() if _serves(scores_TE, k) else None
    if kernel is None:
        return NotImplemented
    scores_TE = scores_TE.detach().contiguous()
    T, E = scores_TE.shape
    ids_TK = torch.empty(T, k, dtype=torch.int64)
    unclear = kernel.topk_rows(scores_TE.data_ptr(), T, E, k, ids_TK.data_ptr())
    if unclear < 0:  # out of memory for its buffers
        return NotImplemented
    if unclear > 0:
        unclear_U = (ids_TK[:, 0] < 0).nonzero().squeeze(1)
        ids_TK[unclear_U] = scores_TE[unclear_U].topk(k, dim=-1).indices
    return ids_TK


def _serves(scores_TE: torch.Tensor, k: int) -> bool:
    return (scores_TE.device.type == "cpu" and scores_TE.dtype == torch.float32 and scores_TE.dim() == 2
            and 0 < k <= min(MAX_K, scores_TE.shape[1]) and scores_TE.shape[0] > 0)
