"""Grouped matmuls for the experts on CPU: one call to MKL's batched GEMM instead of one matmul per expert.

Shapes: N token-slots sorted by expert, E experts, D input width, F output width; expert e owns rows
starts_E[e] : starts_E[e] + counts_E[e].

Why: torch._grouped_mm on CPU loops over the experts and issues one matrix product per expert. At 128 experts with a
handful of slots each (decode steps, minibatches at the paper's routing shape), the per-product overhead costs more
than the arithmetic. torch's x86 CPU wheels link MKL, whose `cblas_sgemm_batch` multiplies every (rows, weight) pair
of a grouped product in one call. It runs the same sgemm kernels as torch's matmul, so the products are the same
numbers bit for bit, forward and backward (tests/test_grouped_gemm.py checks every group size from 0 to 129
against torch._grouped_mm and its autograd): switching kernels changes no sampled token, gradient or logged value.
The call's per-expert argument arrays are filled by a C kernel (native_kernels.c, expert_sgemm), which makes the call
cheap enough to pay off at any number of experts without autograd (MKL_MIN_EXPERTS_WITH_GRAD says where with it).

Faster still, where it gives the same bits: at the small widths of the paper-shaped models MKL sums each output
element as one chain over the depth, in order, so a C loop (native_kernels.c, exact_products, AVX-512 or AVX2 with
FMA) that chains the same way gives MKL's numbers without MKL's packing of small operands (measured, one thread, at
128 experts, d_model 64, expert width 32: 1.3-1.4x per product on an AVX-512 CPU; on a 2-core AVX2 AMD EPYC 0.92x the
MKL time without autograd and 0.77x with it at 704 tokens, and 1.03-1.04x at 8 experts of width 64). Nothing promises MKL sums that way, so `exact_plan` compares the two on
every group size up to 1,024 once per shape and process, and the loop serves only the sizes where they agreed.

Where MKL or the C kernels are absent (other CPU builds, no C compiler), on CUDA, in other dtypes and at more than
one thread, `grouped_mm` is torch._grouped_mm.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from moe_rl.model.replaceable import family_enabled, implements
from moe_rl.kernels.native import library as native_library

_FORWARD, _INPUT_GRAD, _WEIGHT_GRAD = 0, 1, 2  # the products of native_kernels.c's expert_sgemm
_MAX_MKL_INT = 2**31 - 1  # the LP64 interface takes 32-bit sizes and strides


@functools.cache
def _sgemm_batch() -> int | None:
    """The address of MKL's cblas_sgemm_batch in the torch library that links it, or None. The unsuffixed symbol is
    MKL's LP64 interface (32-bit integers); its ILP64 twin would carry a _64 suffix."""
    if not torch.backends.mkl.is_available():
        return None
    library = {"linux": "libtorch_cpu.so", "darwin": "libtorch_cpu.dylib"}.get(sys.platform, "torch_cpu.dll")
    try:
        function = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / library)).cblas_sgemm_batch
    except (OSError, AttributeError):
        return None
    return ctypes.cast(function, ctypes.c_void_p).value


def mkl_available() -> bool:
    """MKL's batched GEMM and the C kernels that set up its calls (native.py) are both there."""
    return _sgemm_batch() is not None and native_library() is not None


# Passes without autograd (sampling, the old pass, probes) take the batch call at any number of experts: with its
# arguments set up in C it is never slower than torch's loop (measured, one CPU thread, medians: 22 vs 34 us for a
# decode step's 128 slots at E=8, D=64, F=64; 180 vs 364 us at E=128 and 1,024 slots; even at 8,192 slots and at d256).
# With autograd, only from this many experts: there the backward's bookkeeping (the one-slot experts) costs what the
# batch saves at E=8 and E=16 (within +-5%), while at E=32 forward+backward is 9-19% faster and at E=128 up to 2.2x.
MKL_MIN_EXPERTS_WITH_GRAD = 32


@implements("grouped_mm")
def grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """y_NF with the rows of expert e equal to x_ND[rows of e] @ w_EDF[e]: torch._grouped_mm's values and gradients,
    on one CPU thread through MKL batch calls (always without autograd; with it, the forward and the two products
    of the backward, at MKL_MIN_EXPERTS_WITH_GRAD experts or more)."""
    if not _serves(x_ND, w_EDF):
        return NotImplemented
    if torch.is_grad_enabled() and (x_ND.requires_grad or w_EDF.requires_grad):
        if w_EDF.shape[0] < MKL_MIN_EXPERTS_WITH_GRAD:
            return NotImplemented
        return _MKLGroupedMM.apply(x_ND, w_EDF, counts_E)
    return mkl_grouped_mm(x_ND.contiguous(), w_EDF.contiguous(), counts_E)


@implements("short_block_rows")
def short_block_rows(counts_E: torch.Tensor, capacity: int, d_model: int, d_expert: int, dtype: torch.dtype):
    """Rows per expert block of the padded kernel, max(n_e, m0), where MKL gives the C-row blocks' numbers from
    shorter blocks (exact_min_block_rows); NotImplemented where it might not or cannot (autograd, GPU, other dtypes,
    more than one thread, C below m0)."""
    if torch.is_grad_enabled() or counts_E.device.type != "cpu" or dtype != torch.float32:
        return NotImplemented
    exact_rows = [exact_min_block_rows(d_model, 2 * d_expert, capacity),
                  exact_min_block_rows(d_expert, d_model, capacity)]
    if None in exact_rows or max(exact_rows) >= capacity:
        return NotImplemented
    return counts_E.clamp(min=max(exact_rows))


def _serves(x_ND: torch.Tensor, w_EDF: torch.Tensor) -> bool:
    return (x_ND.device.type == "cpu" and x_ND.dtype == torch.float32 and w_EDF.dtype == torch.float32
            and 0 < x_ND.numel() < _MAX_MKL_INT and w_EDF.numel() < _MAX_MKL_INT and single_threaded_mkl())


def single_threaded_mkl() -> bool:
    """MKL is there and torch runs one thread (the default of every CPU run here). With more threads torch's matmul
    splits one product across threads while the batch call gives each product one thread: the sums would be
    grouped differently, so the batch call would no longer give torch's numbers."""
    return torch.get_num_threads() == 1 and mkl_available()


class _MKLGroupedMM(torch.autograd.Function):
    """The grouped product with autograd: the backward's two grouped products as MKL batch calls."""

    @staticmethod
    def forward(ctx, x_ND, w_EDF, counts_E):
        x_ND, w_EDF = x_ND.contiguous(), w_EDF.contiguous()
        ctx.save_for_backward(x_ND, w_EDF, counts_E)
        return mkl_grouped_mm(x_ND, w_EDF, counts_E)

    @staticmethod
    def backward(ctx, grad_NF):
        x_ND, w_EDF, counts_E = ctx.saved_tensors
        grad_NF = grad_NF.contiguous()
        grad_x_ND = None
        if ctx.needs_input_grad[0]:
            grad_x_ND = _input_grad(grad_NF, w_EDF, counts_E, counts_E.cumsum(0) - counts_E)
        grad_w_EDF = _weight_grad(x_ND, grad_NF, counts_E) if ctx.needs_input_grad[1] else None
        return grad_x_ND, grad_w_EDF, None


def mkl_grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Per expert, (n_e, D) @ (D, F) into the rows of y_NF, in one MKL call. Contiguous fp32 CPU tensors, no
    autograd; `mkl_available()` must be true."""
    E, D, F = w_EDF.shape
    y_NF = x_ND.new_empty(x_ND.shape[0], F)
    _expert_products(_FORWARD, counts_E, D, F, x_ND, w_EDF, y_NF)
    return y_NF


def _input_grad(grad_NF, w_EDF, counts_E, starts_E):
    """Per expert, (n_e, F) @ (D, F)^T. torch's matmul computes a one-row product against a transposed matrix as a
    matrix-vector product, which rounds differently from the batch call's general product; so the experts with one
    slot are left out of the batch (m = 0) and computed by torch.bmm, which matches torch here."""
    E, D, F = w_EDF.shape
    grad_ND = grad_NF.new_empty(grad_NF.shape[0], D)
    _expert_products(_INPUT_GRAD, counts_E, D, F, grad_NF, w_EDF, grad_ND)
    experts_S = (counts_E == 1).nonzero().squeeze(1)
    if experts_S.numel():
        rows_S = starts_E[experts_S]
        grad_ND[rows_S] = torch.bmm(grad_NF[rows_S, None], w_EDF[experts_S].transpose(1, 2)).squeeze(1)
    return grad_ND


def _weight_grad(x_ND, grad_NF, counts_E):
    """Per expert, (n_e, D)^T @ (n_e, F); an expert without slots gets zeros (k = 0 with beta = 0)."""
    E, D, F = counts_E.numel(), x_ND.shape[1], grad_NF.shape[1]
    grad_EDF = x_ND.new_empty(E, D, F)
    _expert_products(_WEIGHT_GRAD, counts_E, D, F, x_ND, grad_NF, grad_EDF)
    return grad_EDF


def _expert_products(mode: int, counts_E: torch.Tensor, D: int, F: int, a, b, c) -> None:
    """The products of `mode` (native_kernels.c, expert_sgemm, says which): the group sizes where the C loop gives
    MKL's numbers (`exact_plan`) in C, the others in one MKL batch call set up in C.
    MKL and the C loop read raw addresses: rows that do not add up, shapes that do not fit, or strided memory, would
    make them read the wrong numbers (or past the end of a tensor) without an error, so all three are refused here."""
    if not (a.is_contiguous() and b.is_contiguous() and c.is_contiguous()):
        raise ValueError("the MKL grouped matmul needs contiguous operands")
    counts_E = counts_E.to(torch.int64).contiguous()
    rows, E = a.shape[0], counts_E.numel()
    expected = {_FORWARD: ((rows, D), (E, D, F), (rows, F)), _INPUT_GRAD: ((rows, F), (E, D, F), (rows, D)),
                _WEIGHT_GRAD: ((rows, D), (rows, F), (E, D, F))}[mode]
    shapes = tuple(tuple(t.shape) for t in (a, b, c))
    if shapes != expected:
        raise ValueError(f"grouped matmul operands of shapes {shapes}, expected {expected}")
    skip_min_rows, skip_max_rows = 1, 0  # an empty range: MKL computes every expert
    plan = exact_plan(mode, D, F) if family_enabled("exact_products") else None
    if plan is not None:
        left = _exact_products(mode, counts_E, rows, D, F, a, b, c, plan)
        if left == 0:
            return
        if left > 0:  # else (-3: it could not run) MKL computes every expert
            skip_min_rows, skip_max_rows = plan.min_rows, plan.max_rows
    status = native_library().expert_sgemm(_sgemm_batch(), mode, E, counts_E.data_ptr(), rows, D, F, a.data_ptr(),
                                           b.data_ptr(), c.data_ptr(), skip_min_rows, skip_max_rows)
    _raise_for_status(status, counts_E, rows)


def _raise_for_status(status: int, counts_E: torch.Tensor, rows: int) -> None:
    if status == -1 and bool((counts_E < 0).any()):
        raise ValueError(f"group sizes must be >= 0; got {counts_E.min()}")
    if status == -1:
        raise ValueError(f"group sizes sum to {int(counts_E.sum())}, but x has {rows} rows")
    if status == -2:
        raise MemoryError("the grouped matmul could not allocate its call arguments")


class ExactPlan(NamedTuple):
    """The group sizes the C loop (native_kernels.c, exact_products) computes for one product and shape, with MKL's
    numbers: min_rows <= n_e <= max_rows, a fused multiply-add chain from fused_from rows up."""

    min_rows: int
    max_rows: int
    fused_from: int


# Per product, what the check starts from: (smallest group size the C loop may take, group size from which MKL uses
# fused multiply-adds). Measured with torch 2.13's MKL on AVX-512: a forward product of 1-3 rows takes a path that
# rounds each product before adding; an input-gradient product of 2-3 rows takes yet another order (and one row is
# torch's matrix-vector product, see _input_grad), so those stay with MKL; weight gradients chain over the rows at any
# size up to MKL's depth block (192 rows), beyond which MKL splits the sum and the check stops the C loop.
_PLAN_START = {_FORWARD: (1, 4), _INPUT_GRAD: (4, 4), _WEIGHT_GRAD: (0, 0)}
_CHECKED_SIZES = (*range(0, 201), 224, 256, 320, 384, 512, 768, 1024)
_MIN_SERVED_SIZE = 64  # a plan that agrees with MKL only on smaller groups is not worth its second code path


def _found_once_per_shape(find):
    """`find`, a search for how MKL rounds at one shape, run once per shape and process (cached), without autograd,
    and only where MKL runs on one thread: what it finds holds for that thread count. None where MKL does not."""
    cached = functools.cache(find)

    @functools.wraps(find)
    def at_one_thread(*shape, **named_shape):
        if not single_threaded_mkl():
            return None
        with torch.no_grad():
            return cached(*shape, **named_shape)

    at_one_thread.cache_clear = cached.cache_clear  # for tests that change what the search starts from
    return at_one_thread


@_found_once_per_shape
def exact_plan(mode: int, d: int, f: int) -> ExactPlan | None:
    """The C loop's plan for this product and shape on this machine, or None where it must not serve.

    Both kernels run on the same random operands with one group of every size in _CHECKED_SIZES; the plan serves the
    sizes from its start up to the largest checked size below which every group came out bit-identical. The order
    in which a matrix kernel sums is the same for all values, so one draw shows it (random values make a different
    order show in almost every element). A few ms."""
    min_rows, fused_from = _PLAN_START[mode]
    counts_E = torch.tensor(_CHECKED_SIZES, dtype=torch.int64)
    rows, E = int(counts_E.sum()), counts_E.numel()
    generator = torch.Generator().manual_seed(0)
    shapes = {_FORWARD: ((rows, d), (E, d, f), (rows, f)), _INPUT_GRAD: ((rows, f), (E, d, f), (rows, d)),
              _WEIGHT_GRAD: ((rows, d), (rows, f), (E, d, f))}[mode]
    a, b = (torch.randn(shape, generator=generator) for shape in shapes[:2])
    by_mkl, by_loop = torch.zeros(shapes[2]), torch.zeros(shapes[2])
    _raise_for_status(native_library().expert_sgemm(_sgemm_batch(), mode, E, counts_E.data_ptr(), rows, d, f,
                                                    a.data_ptr(), b.data_ptr(), by_mkl.data_ptr(), 1, 0),
                      counts_E, rows)
    widest = ExactPlan(min_rows, _CHECKED_SIZES[-1], fused_from)
    if _exact_products(mode, counts_E, rows, d, f, a, b, by_loop, widest) < 0:
        return None
    groups = by_mkl.split(_CHECKED_SIZES) if mode != _WEIGHT_GRAD else by_mkl.unbind()
    loop_groups = by_loop.split(_CHECKED_SIZES) if mode != _WEIGHT_GRAD else by_loop.unbind()
    max_rows = None
    for size, mkl_group, loop_group in zip(_CHECKED_SIZES, groups, loop_groups):
        if size < min_rows:
            continue
        if not torch.equal(mkl_group, loop_group):
            break
        max_rows = size
    if max_rows is None or max_rows < _MIN_SERVED_SIZE:
        return None
    return ExactPlan(min_rows, max_rows, fused_from)


def c_loop_runs() -> bool:
    """Whether the C loop runs on this CPU and build (AVX-512, or AVX2 with FMA, and a kernel build that has them:
    MOE_RL_ISA=baseline leaves both out), asked of the C code itself on a product of whole vectors."""
    if native_library() is None:
        return False
    counts_E = torch.tensor([4])
    a, b, c = torch.zeros(4, 16), torch.zeros(1, 16, 16), torch.empty(4, 16)
    return _exact_products(_FORWARD, counts_E, 4, 16, 16, a, b, c, ExactPlan(1, 4, 4)) != -3


def _exact_products(mode: int, counts_E, rows: int, D: int, F: int, a, b, c, plan: ExactPlan) -> int:
    """The C loop's products for the groups the plan covers; returns how many experts it left to MKL, or -3 where it
    cannot run (neither AVX-512 nor AVX2 with FMA, or widths that are not whole vectors: multiples of 16 with AVX-512,
    of 8 with AVX2)."""
    status = native_library().exact_products(mode, counts_E.numel(), counts_E.data_ptr(), rows, D, F, a.data_ptr(),
                                             b.data_ptr(), c.data_ptr(), plan.min_rows, plan.max_rows,
                                             plan.fused_from)
    if status != -3:
        _raise_for_status(status, counts_E, rows)
    return status


@_found_once_per_shape
def exact_min_block_rows(d_in: int, d_out: int, capacity: int) -> int | None:
    """The smallest m0 such that, on this machine, every row of an m-row block product (m0 <= m <= capacity, one MKL
    batch call) equals the same row of torch.bmm over capacity-row blocks; None where MKL cannot serve.

    Why it exists: matrix kernels pick their inner kernel by the number of rows, and MKL rounds a block of 1-3 rows
    differently from a longer one (measured at every width used here; torch's own kernel takes over for the tiniest
    products). The padded expert kernel multiplies blocks of C rows (the largest group) with torch.bmm; an expert's
    real rows come out the same from a shorter block of at least m0 rows, so the padded kernel's numbers can be
    computed without most of its padding (moe.Experts._padded). Found by trying, once per shape."""
    generator = torch.Generator().manual_seed(0)
    x_2CD = torch.randn(2, capacity, d_in, generator=generator)
    w_2DF = torch.randn(2, d_in, d_out, generator=generator)
    reference_CF = torch.bmm(x_2CD, w_2DF)[0]  # a batch of two, as the padded kernel's bmm is a batched call
    min_rows = None
    for rows in range(capacity, 0, -1):
        block_RF = mkl_grouped_mm(x_2CD[0, :rows].contiguous(), w_2DF[:1].contiguous(), torch.tensor([rows]))
        if not torch.equal(block_RF, reference_CF[:rows]):
            break
        min_rows = rows
    return min_rows
