"""Grouped matmuls for the experts on CPU: one call to MKL's batched GEMM instead of one matmul per expert.

Shapes: N token-slots sorted by expert, E experts, D input width, F output width; expert e owns rows
starts_E[e] : starts_E[e] + counts_E[e].

Why: torch._grouped_mm on CPU loops over the experts and issues one matrix product per expert. At 128 experts with a
handful of slots each (decode steps, minibatches at the paper's routing shape), the per-product overhead costs more
than the arithmetic. torch's x86 CPU wheels link MKL, whose `cblas_sgemm_batch` multiplies every (rows, weight) pair
of a grouped product in one call. It runs the same sgemm kernels as torch's matmul, so the products are the same
numbers bit for bit (tests/test_grouped_gemm.py checks every group size from 0 to 129 against torch._grouped_mm):
switching kernels changes no sampled token and no logged value.

Where MKL is absent (other CPU builds), on CUDA, in other dtypes and wherever autograd is on, `grouped_mm` is
torch._grouped_mm.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import torch

_ROW_MAJOR, _NO_TRANS = 101, 111  # CBLAS enum values
_FLOAT_BYTES = 4
_MAX_MKL_INT = 2**31 - 1  # the LP64 interface takes 32-bit sizes and strides


@functools.cache
def _sgemm_batch():
    """MKL's cblas_sgemm_batch from the torch library that links it, or None."""
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
# costs more than it saves. Measured forward, one CPU thread, D=64 F=64, interleaved medians: E=128 saves 120-150 us
# per call at 128-2,048 slots and is even at 8,192; E=64 saves 50 us up to 2,048 slots; E=32 gains nothing; E=8 and
# E=16 (d256) lose 15-30 us.
MKL_MIN_EXPERTS = 64


def grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor,
               group_ends_E: torch.Tensor) -> torch.Tensor:
    """y_NF with the rows of expert e equal to x_ND[rows of e] @ w_EDF[e]: torch._grouped_mm(x, w, offs=group_ends_E).

    Passes without autograd (sampling, the old-policy pass, probes) at many experts go through one MKL batch call
    (the same values). Training keeps torch._grouped_mm and its backward: there the batch call's weight-gradient
    product was no faster, and the input gradient of a one-slot expert rounds differently in it."""
    needs_grad = torch.is_grad_enabled() and (x_ND.requires_grad or w_EDF.requires_grad)
    if needs_grad or w_EDF.shape[0] < MKL_MIN_EXPERTS or not _serves(x_ND, w_EDF):
        return torch._grouped_mm(x_ND, w_EDF, offs=group_ends_E)
    return mkl_grouped_mm(x_ND.contiguous(), w_EDF.contiguous(), counts_E)


def _serves(x_ND: torch.Tensor, w_EDF: torch.Tensor) -> bool:
    return (x_ND.device.type == "cpu" and x_ND.dtype == torch.float32 and w_EDF.dtype == torch.float32
            and 0 < x_ND.numel() < _MAX_MKL_INT and w_EDF.numel() < _MAX_MKL_INT and single_threaded_mkl())


def single_threaded_mkl() -> bool:
    """MKL is there and torch runs one thread (the default of every CPU run here). With more threads torch's matmul
    splits one product across threads while the batch call gives each product one thread: the sums would be
    grouped differently, so the batch call would no longer give torch's numbers."""
    return torch.get_num_threads() == 1 and mkl_available()


def mkl_grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Per expert, (n_e, D) @ (D, F) into the rows of y_NF, each expert its own group of one product, in one MKL call.
    Contiguous fp32 CPU tensors, no autograd; `mkl_available()` must be true."""
    E, D, F = w_EDF.shape
    if int(counts_E.sum()) != x_ND.shape[0]:  # MKL would read and write past the ends of x and y
        raise ValueError(f"group sizes sum to {int(counts_E.sum())}, but x has {x_ND.shape[0]} rows")
    y_NF = x_ND.new_empty(x_ND.shape[0], F)
    starts_E = counts_E.cumsum(0) - counts_E
    m_E = counts_E.to(torch.int32)
    a_E = _row_pointers(x_ND, starts_E)
    b_E = _expert_offsets(E, D * F * _FLOAT_BYTES) + w_EDF.data_ptr()
    c_E = _row_pointers(y_NF, starts_E)
    no_trans, n, k, one, zero = (_constant(E, v) for v in (_NO_TRANS, F, D, 1.0, 0.0))
    # layout, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, group count, group sizes
    _sgemm_batch()(_ROW_MAJOR, no_trans.data_ptr(), no_trans.data_ptr(), m_E.data_ptr(), n.data_ptr(), k.data_ptr(),
                   one.data_ptr(), a_E.data_ptr(), k.data_ptr(), b_E.data_ptr(), n.data_ptr(), zero.data_ptr(),
                   c_E.data_ptr(), n.data_ptr(), E, _constant(E, 1).data_ptr())
    return y_NF


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
