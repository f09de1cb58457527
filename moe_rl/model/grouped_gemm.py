"""Grouped matmuls for the experts on CPU: one call to MKL's batched GEMM instead of one matmul per expert.

Shapes: N token-slots sorted by expert, E experts, D input width, F output width; expert e owns rows
starts_E[e] : starts_E[e] + counts_E[e].

Why: torch._grouped_mm on CPU loops over the experts and issues one matrix product per expert. At 128 experts with a
handful of slots each (decode steps, minibatches at the paper's routing shape), the per-product overhead costs more
than the arithmetic. torch's x86 CPU wheels link MKL, whose `cblas_sgemm_batch` multiplies every (rows, weight) pair
of a grouped product in one call. It runs the same sgemm kernels as torch's matmul, so the products are the same
numbers bit for bit, forward and backward (tests/test_grouped_gemm.py checks every group size from 0 to 129
against torch._grouped_mm and its autograd): switching kernels changes no sampled token, gradient or logged value.

Where MKL is absent (other CPU builds), on CUDA, in other dtypes and at more than one thread, `grouped_mm` is
torch._grouped_mm.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import torch

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS enum values
_FLOAT_BYTES = 4
_MAX_MKL_INT = 2**31 - 1  # the LP64 interface takes 32-bit sizes and strides


@functools.cache
def _sgemm_batch():
    """MKL's cblas_sgemm_batch from the torch library that links it, or None. The unsuffixed symbol is MKL's LP64
    interface (32-bit integers); its ILP64 twin would carry a _64 suffix."""
    if not torch.backends.mkl.is_available():
        return None
    library = {"linux": "libtorch_cpu.so", "darwin": "libtorch_cpu.dylib"}.get(sys.platform, "torch_cpu.dll")
    try:
        function = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / library)).cblas_sgemm_batch
    except (OSError, AttributeError):
        return None
    pointer = ctypes.c_void_p
    # layout, transa[], transb[], m[], n[], k[], alpha[], a[], lda[], b[], ldb[], beta[], c[], ldc[], groups, size[]
    function.argtypes = [ctypes.c_int] + [pointer] * 13 + [ctypes.c_int, pointer]
    function.restype = None
    return function


def mkl_available() -> bool:
    return _sgemm_batch() is not None


# Below this many experts the loop's per-expert overhead is small and the batch call's set-up (a few small tensor ops)
# costs more than it saves. Measured, one CPU thread, interleaved medians: at E=128, D=64, F=64 the forward saves
# 120-150 us per call at 128-2,048 slots and is even at 8,192, and forward+backward is 4-29% faster (8,192 to 1,024
# slots); at E=64 the forward saves 50 us up to 2,048 slots; at E=32 nothing; at E=8 and E=16 (d256) it loses 15-30 us.
MKL_MIN_EXPERTS = 64


def grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor,
               group_ends_E: torch.Tensor) -> torch.Tensor:
    """y_NF with the rows of expert e equal to x_ND[rows of e] @ w_EDF[e]: torch._grouped_mm(x, w, offs=group_ends_E),
    with the same values and gradients; at MKL_MIN_EXPERTS experts or more on one CPU thread, through MKL batch calls
    (forward, and the two products of the backward)."""
    if w_EDF.shape[0] < MKL_MIN_EXPERTS or not _serves(x_ND, w_EDF):
        return torch._grouped_mm(x_ND, w_EDF, offs=group_ends_E)
    if torch.is_grad_enabled() and (x_ND.requires_grad or w_EDF.requires_grad):
        return _MKLGroupedMM.apply(x_ND, w_EDF, counts_E)
    return mkl_grouped_mm(x_ND.contiguous(), w_EDF.contiguous(), counts_E)


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
        starts_E = counts_E.cumsum(0) - counts_E
        grad_x_ND = _input_grad(grad_NF, w_EDF, counts_E, starts_E) if ctx.needs_input_grad[0] else None
        grad_w_EDF = _weight_grad(x_ND, grad_NF, counts_E, starts_E) if ctx.needs_input_grad[1] else None
        return grad_x_ND, grad_w_EDF, None


def mkl_grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Per expert, (n_e, D) @ (D, F) into the rows of y_NF, in one MKL call. Contiguous fp32 CPU tensors, no
    autograd; `mkl_available()` must be true."""
    E, D, F = w_EDF.shape
    _check_operands(counts_E, x_ND, w_EDF)
    y_NF = x_ND.new_empty(x_ND.shape[0], F)
    starts_E = counts_E.cumsum(0) - counts_E
    _batch(_NO_TRANS, _NO_TRANS, m=counts_E, n=F, k=D, a_E=_row_pointers(x_ND, starts_E), lda=D,
           b_E=_matrix_pointers(w_EDF), ldb=F, c_E=_row_pointers(y_NF, starts_E), ldc=F)
    return y_NF


def _input_grad(grad_NF, w_EDF, counts_E, starts_E):
    """Per expert, (n_e, F) @ (D, F)^T. torch's matmul computes a one-row product against a transposed matrix as a
    matrix-vector product, which rounds differently from the batch call's general product; so the experts with one
    slot are left out of the batch (m = 0) and computed by torch.bmm, which matches torch here."""
    E, D, F = w_EDF.shape
    grad_ND = grad_NF.new_empty(grad_NF.shape[0], D)
    single_E = counts_E == 1
    _batch(_NO_TRANS, _TRANS, m=counts_E.masked_fill(single_E, 0), n=D, k=F, a_E=_row_pointers(grad_NF, starts_E),
           lda=F, b_E=_matrix_pointers(w_EDF), ldb=F, c_E=_row_pointers(grad_ND, starts_E), ldc=D)
    experts_S = single_E.nonzero().squeeze(1)
    if experts_S.numel():
        rows_S = starts_E[experts_S]
        grad_ND[rows_S] = torch.bmm(grad_NF[rows_S, None], w_EDF[experts_S].transpose(1, 2)).squeeze(1)
    return grad_ND


def _weight_grad(x_ND, grad_NF, counts_E, starts_E):
    """Per expert, (n_e, D)^T @ (n_e, F); an expert without slots gets zeros (k = 0 with beta = 0)."""
    E, D, F = counts_E.numel(), x_ND.shape[1], grad_NF.shape[1]
    grad_EDF = x_ND.new_empty(E, D, F)
    _batch(_TRANS, _NO_TRANS, m=D, n=F, k=counts_E, a_E=_row_pointers(x_ND, starts_E), lda=D,
           b_E=_row_pointers(grad_NF, starts_E), ldb=F, c_E=_matrix_pointers(grad_EDF), ldc=F)
    return grad_EDF


def _check_operands(counts_E, x_ND, w_EDF):
    """MKL reads raw addresses: rows that do not add up, or strided memory, would make it read the wrong numbers (or
    past the end of a tensor) without an error."""
    if int(counts_E.sum()) != x_ND.shape[0]:
        raise ValueError(f"group sizes sum to {int(counts_E.sum())}, but x has {x_ND.shape[0]} rows")
    if not (x_ND.is_contiguous() and w_EDF.is_contiguous()):
        raise ValueError("the MKL grouped matmul needs contiguous operands")


def _batch(transa: int, transb: int, m, n, k, a_E, lda: int, b_E, ldb: int, c_E, ldc: int) -> None:
    """C_e = op(A_e) @ op(B_e) for every expert e (row-major, alpha 1, beta 0), each expert its own group of one
    product. Sizes are ints (the same for every expert) or int64 tensors; a/b/c are int64 address tensors."""
    E = a_E.numel()
    per_expert = [size.to(torch.int32) if isinstance(size, torch.Tensor) else _constant(E, size) for size in (m, n, k)]
    arrays = [_constant(E, transa), _constant(E, transb), *per_expert, _constant(E, 1.0), a_E, _constant(E, lda),
              b_E, _constant(E, ldb), _constant(E, 0.0), c_E, _constant(E, ldc)]
    _sgemm_batch()(_ROW_MAJOR, *(array.data_ptr() for array in arrays), E, _constant(E, 1).data_ptr())


def _matrix_pointers(w_EDF: torch.Tensor) -> torch.Tensor:
    """Address of each expert's matrix in a contiguous (E, D, F) tensor."""
    E, D, F = w_EDF.shape
    return _expert_offsets(E, D * F * _FLOAT_BYTES) + w_EDF.data_ptr()


def _row_pointers(matrix: torch.Tensor, starts_E: torch.Tensor) -> torch.Tensor:
    """Address of row starts_E[e] of a contiguous fp32 matrix, per expert."""
    return starts_E * (matrix.shape[1] * _FLOAT_BYTES) + matrix.data_ptr()


@functools.lru_cache(maxsize=64)
def _expert_offsets(n_experts: int, matrix_bytes: int) -> torch.Tensor:
    """Byte offset of each expert's matrix in a contiguous (E, D, F) tensor."""
    return torch.arange(n_experts, dtype=torch.int64) * matrix_bytes


@functools.lru_cache(maxsize=256, typed=True)  # typed: the int 1 and the float 1.0 are different arguments
def _constant(n_experts: int, value: int | float) -> torch.Tensor:
    """A per-group argument that is the same for every expert (transpose flag, sizes, leading dimensions, alpha,
    beta, group size): int32 (MKL's LP64 integers) or float32."""
    dtype = torch.float32 if isinstance(value, float) else torch.int32
    return torch.full((n_experts,), value, dtype=dtype)


def exact_min_block_rows(d_in: int, d_out: int, capacity: int) -> int | None:
    """The smallest m0 such that, on this machine, every row of an m-row block product (m0 <= m <= capacity, one MKL
    batch call) equals the same row of torch.bmm over capacity-row blocks; None where MKL cannot serve.

    Why it exists: matrix kernels pick their inner kernel by the number of rows, and MKL rounds a block of 1-3 rows
    differently from a longer one (measured at every width used here; torch's own kernel takes over for the tiniest
    products). The padded expert kernel multiplies blocks of C rows (the largest group) with torch.bmm; an expert's
    real rows come out the same from a shorter block of at least m0 rows, so the padded kernel's numbers can be
    computed without most of its padding (moe.Experts._padded). Found by trying, once per shape."""
    if not single_threaded_mkl():
        return None
    with torch.no_grad():
        return _exact_min_block_rows(d_in, d_out, capacity)


@functools.cache
def _exact_min_block_rows(d_in: int, d_out: int, capacity: int) -> int | None:
    # Only called at one thread (single_threaded_mkl), so the answer does not depend on the thread count.
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
