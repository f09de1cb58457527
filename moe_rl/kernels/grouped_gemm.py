"""Grouped matmuls for the experts on CPU: one call to MKL's batched GEMM instead of one matmul per expert.

Shapes: N token-slots sorted by expert, E experts, D input width, F output width; expert e owns rows
starts_E[e] : starts_E[e] + counts_E[e].

Why: torch._grouped_mm on CPU loops over the experts and issues one matrix product per expert. At 128 experts with a
handful of slots each (decode steps, minibatches at the paper's routing shape), the per-product overhead costs more
than the arithmetic. torch's x86 CPU wheels link MKL, whose `cblas_sgemm_batch` multiplies every (rows, weight) pair
of a grouped product in one call. It runs the sgemm kernels torch's matmul runs for all but the smallest products;
which group sizes round differently is a property of the CPU (on a 2-core AMD EPYC the one-row input gradient, which
torch computes as a matrix-vector product; on an Intel Xeon with AVX-512 the one-row forward too), so
`torch_group_sizes` finds them on this machine, once per product and shape, by comparing the batch call with torch's
own product on every group size it checks, and those experts are computed by torch's product after the batch call.
The result is torch._grouped_mm's numbers bit for bit, forward and backward (tests/kernels/test_grouped_gemm.py checks
every group size from 0 to 129 against torch._grouped_mm and its autograd): switching kernels changes no sampled token,
gradient or logged value. The call's per-expert argument arrays are filled by a C kernel (native_kernels.c,
expert_sgemm), which makes the call cheap enough to pay off at any number of experts without autograd
(MKL_MIN_EXPERTS_WITH_GRAD says where with it).

Faster still, where it gives the same bits: at the small widths of the paper-shaped models MKL sums each output
element as one chain over the depth, in order, so a C loop (native_kernels.c, exact_products, AVX-512 or AVX2 with
FMA) that chains the same way gives torch's numbers without MKL's packing of small operands (measured, one thread, at
128 experts, d_model 64, expert width 32: 1.3-1.4x per product on an AVX-512 CPU; on a 2-core AVX2 AMD EPYC 0.92x the
MKL time without autograd and 0.77x with it at 704 tokens, and 1.03-1.04x at 8 experts of width 64). Nothing promises
MKL sums that way, and where it starts fusing the multiply-adds differs between CPUs, so `exact_plan` compares the
loop with torch's product on every checked group size up to 1,024 once per shape and process, for each way of
rounding the first rows the loop offers, and the loop serves only the sizes where they agreed. It also prefetches
the next expert's block while it computes one (native_kernels.c, next_block; the AVX-512 version in the input
gradient only): a hint that changes no number, worth 1.0-1.9x per product where a model's 48 layers of weights come
from memory (benchmarks/bench_prefetch.py).

Where MKL or the C kernels are absent (other CPU builds, no C compiler), on CUDA, in other dtypes and at more than
one thread, `grouped_mm` is torch._grouped_mm.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from moe_rl.kernels.native import library as native_library
from moe_rl.kernels.native import torch_cpu_function
from moe_rl.kernels.registry import KernelSet, implements

_FORWARD, _INPUT_GRAD, _WEIGHT_GRAD = 0, 1, 2  # the products of native_kernels.c's expert_sgemm
_PRODUCTS = (_FORWARD, _INPUT_GRAD, _WEIGHT_GRAD)
_MAX_MKL_INT = 2**31 - 1  # the LP64 interface takes 32-bit sizes and strides


@functools.cache
def _sgemm_batch() -> int | None:
    """The address of MKL's cblas_sgemm_batch in the torch library that links it, or None. The unsuffixed symbol is
    MKL's LP64 interface (32-bit integers); its ILP64 twin would carry a _64 suffix."""
    if not torch.backends.mkl.is_available():
        return None
    return torch_cpu_function("cblas_sgemm_batch")


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
def grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
    """y_NF with the rows of expert e equal to x_ND[rows of e] @ w_EDF[e]: torch._grouped_mm's values and gradients,
    on one CPU thread through MKL batch calls (always without autograd; with it, the forward and the two products
    of the backward, at MKL_MIN_EXPERTS_WITH_GRAD experts or more); the C loop inside where `kernels` has
    exact_products on."""
    with_grad = torch.is_grad_enabled() and (x_ND.requires_grad or w_EDF.requires_grad)
    if not _serves(x_ND, w_EDF, _PRODUCTS if with_grad else (_FORWARD,)):
        return NotImplemented
    if with_grad:
        if w_EDF.shape[0] < MKL_MIN_EXPERTS_WITH_GRAD:
            return NotImplemented
        return _MKLGroupedMM.apply(x_ND, w_EDF, counts_E, kernels.enabled("exact_products"))
    return mkl_grouped_mm(x_ND.contiguous(), w_EDF.contiguous(), counts_E, kernels.enabled("exact_products"))


@implements("short_block_rows")
def short_block_rows(counts_E: torch.Tensor, capacity: int, d_model: int, d_expert: int, dtype: torch.dtype):
    """Rows per expert block of the padded kernel, max(n_e, m0), where MKL gives the C-row blocks' numbers from
    shorter blocks (exact_min_block_rows); NotImplemented where it might not or cannot (autograd, GPU, other dtypes,
    more than one thread, C below m0)."""
    if torch.is_grad_enabled() or counts_E.device.type != "cpu" or dtype != torch.float32:
        return NotImplemented
    widths = [(d_model, 2 * d_expert), (d_expert, d_model)]
    if any(torch_group_sizes(_FORWARD, d_in, d_out) is None for d_in, d_out in widths):
        return NotImplemented  # grouped_mm would not take the batch call, whose blocks exact_min_block_rows checked
    exact_rows = [exact_min_block_rows(d_model, 2 * d_expert, capacity),
                  exact_min_block_rows(d_expert, d_model, capacity)]
    if None in exact_rows or max(exact_rows) >= capacity:
        return NotImplemented
    return counts_E.clamp(min=max(exact_rows))


def _serves(x_ND: torch.Tensor, w_EDF: torch.Tensor, products: tuple[int, ...]) -> bool:
    """CPU fp32 operands within MKL's 32-bit sizes, one thread, and a batch call that gives torch's numbers for each
    of `products` at this shape (torch_group_sizes)."""
    if not (x_ND.device.type == "cpu" and x_ND.dtype == torch.float32 and w_EDF.dtype == torch.float32
            and 0 < x_ND.numel() < _MAX_MKL_INT and w_EDF.numel() < _MAX_MKL_INT and single_threaded_mkl()):
        return False
    _, D, F = w_EDF.shape
    return all(torch_group_sizes(product, D, F) is not None for product in products)


def single_threaded_mkl() -> bool:
    """MKL is there and torch runs one thread (the default of every CPU run here). With more threads torch's matmul
    splits one product across threads while the batch call gives each product one thread: the sums would be
    grouped differently, so the batch call would no longer give torch's numbers."""
    return torch.get_num_threads() == 1 and mkl_available()


class _MKLGroupedMM(torch.autograd.Function):
    """The grouped product with autograd: the backward's two grouped products as MKL batch calls."""

    @staticmethod
    def forward(ctx, x_ND, w_EDF, counts_E, exact_loop: bool):
        x_ND, w_EDF = x_ND.contiguous(), w_EDF.contiguous()
        ctx.save_for_backward(x_ND, w_EDF, counts_E)
        ctx.exact_loop = exact_loop
        return mkl_grouped_mm(x_ND, w_EDF, counts_E, exact_loop)

    @staticmethod
    def backward(ctx, grad_NF):
        x_ND, w_EDF, counts_E = ctx.saved_tensors
        grad_NF = grad_NF.contiguous()
        grad_x_ND = None
        if ctx.needs_input_grad[0]:
            grad_x_ND = _input_grad(grad_NF, w_EDF, counts_E, ctx.exact_loop)
        grad_w_EDF = _weight_grad(x_ND, grad_NF, counts_E, ctx.exact_loop) if ctx.needs_input_grad[1] else None
        return grad_x_ND, grad_w_EDF, None, None


def mkl_grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor,
                   exact_loop: bool = True) -> torch.Tensor:
    """Per expert, (n_e, D) @ (D, F) into the rows of y_NF, in one MKL call. Contiguous fp32 CPU tensors, no
    autograd; `mkl_available()` must be true. `exact_loop`: the C loop takes the group sizes where it gives torch's
    numbers (exact_plan), where this CPU has it."""
    E, D, F = w_EDF.shape
    y_NF = x_ND.new_empty(x_ND.shape[0], F)
    _expert_products(_FORWARD, counts_E, D, F, x_ND, w_EDF, y_NF, exact_loop)
    return y_NF


def _input_grad(grad_NF, w_EDF, counts_E, exact_loop: bool):
    """Per expert, (n_e, F) @ (D, F)^T. torch's matmul computes a one-row product against a transposed matrix as a
    matrix-vector product, which rounds differently from the batch call's general product on every CPU seen so far,
    so expert_sgemm leaves the one-slot experts out of the batch (m = 0); torch_group_sizes then finds size 1 and
    _expert_products computes them with torch's product."""
    E, D, F = w_EDF.shape
    grad_ND = grad_NF.new_empty(grad_NF.shape[0], D)
    _expert_products(_INPUT_GRAD, counts_E, D, F, grad_NF, w_EDF, grad_ND, exact_loop)
    return grad_ND


def _weight_grad(x_ND, grad_NF, counts_E, exact_loop: bool):
    """Per expert, (n_e, D)^T @ (n_e, F); an expert without slots gets zeros (k = 0 with beta = 0)."""
    E, D, F = counts_E.numel(), x_ND.shape[1], grad_NF.shape[1]
    grad_EDF = x_ND.new_empty(E, D, F)
    _expert_products(_WEIGHT_GRAD, counts_E, D, F, x_ND, grad_NF, grad_EDF, exact_loop)
    return grad_EDF


def _expert_products(mode: int, counts_E: torch.Tensor, D: int, F: int, a, b, c, exact_loop: bool = True) -> None:
    """The products of `mode` (native_kernels.c, expert_sgemm, says which): the group sizes where the C loop gives
    torch's numbers (`exact_plan`) in C, the others in one MKL batch call set up in C, and of those the sizes where
    the batch call rounds unlike torch (`torch_group_sizes`) again with torch's product.
    MKL and the C loop read raw addresses: rows that do not add up, shapes that do not fit, or strided memory, would
    make them read the wrong numbers (or past the end of a tensor) without an error, so all three are refused here."""
    if not (a.is_contiguous() and b.is_contiguous() and c.is_contiguous()):
        raise ValueError("the MKL grouped matmul needs contiguous operands")
    counts_E = counts_E.to(torch.int64).contiguous()
    rows, E = a.shape[0], counts_E.numel()
    expected = operand_shapes(mode, rows, E, D, F)
    shapes = tuple(tuple(t.shape) for t in (a, b, c))
    if shapes != expected:
        raise ValueError(f"grouped matmul operands of shapes {shapes}, expected {expected}")
    skip_min_rows, skip_max_rows = 1, 0  # an empty range: MKL computes every expert
    plan = exact_plan(mode, D, F) if exact_loop else None
    if plan is not None:
        left = _exact_products(mode, counts_E, rows, D, F, a, b, c, plan)
        if left == 0:
            return
        if left > 0:  # else (-3: it could not run) MKL computes every expert
            skip_min_rows, skip_max_rows = plan.min_rows, plan.max_rows
    status = native_library().expert_sgemm(_sgemm_batch(), mode, E, counts_E.data_ptr(), rows, D, F, a.data_ptr(),
                                           b.data_ptr(), c.data_ptr(), skip_min_rows, skip_max_rows)
    _raise_for_status(status, counts_E, rows)
    sizes = torch_group_sizes(mode, D, F)
    redo = [size for size in sizes or () if not skip_min_rows <= size <= skip_max_rows]
    if redo:
        chosen_E = counts_E == redo[0] if len(redo) == 1 else torch.isin(counts_E, torch.tensor(redo))
        _torch_products_of(mode, counts_E, a, b, c, chosen_E)


def operand_shapes(mode: int, rows: int, experts: int, d: int, f: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of a, b and c in the products of `mode` (native_kernels.c, expert_sgemm): x @ w, grad @ w^T, and
    x^T @ grad per expert."""
    return {_FORWARD: ((rows, d), (experts, d, f), (rows, f)), _INPUT_GRAD: ((rows, f), (experts, d, f), (rows, d)),
            _WEIGHT_GRAD: ((rows, d), (rows, f), (experts, d, f))}[mode]


def _torch_products(mode: int, counts_E: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The products of `mode` as torch computes them: torch._grouped_mm forward, and the two products its autograd
    takes for the input and weight gradients (the reference every fast path here is checked against)."""
    ends_E = counts_E.cumsum(0).to(torch.int32)
    if mode == _FORWARD:
        return torch._grouped_mm(a, b, offs=ends_E)
    if mode == _INPUT_GRAD:
        return torch._grouped_mm(a, b.transpose(-2, -1), offs=ends_E)
    return torch._grouped_mm(a.t(), b, offs=ends_E)


def _torch_products_of(mode: int, counts_E, a, b, c, chosen_E: torch.Tensor) -> None:
    """Overwrite the chosen experts' part of c with torch's products. torch._grouped_mm multiplies each group on its
    own, so a call on these experts' rows gives the numbers a call on all of them would."""
    experts_S = chosen_E.nonzero().squeeze(1)
    if experts_S.numel() == 0:
        return
    counts_S = counts_E[experts_S]
    rows_R = _group_rows(counts_E.cumsum(0)[experts_S] - counts_S, counts_S)
    if mode == _WEIGHT_GRAD:
        c[experts_S] = _torch_products(mode, counts_S, a[rows_R], b[rows_R])
    else:
        c[rows_R] = _torch_products(mode, counts_S, a[rows_R], b[experts_S])


def _group_rows(starts_S: torch.Tensor, counts_S: torch.Tensor) -> torch.Tensor:
    """The rows of groups that start at starts_S and hold counts_S rows each, in order. The groups torch computes
    again are mostly of one row (a decode step's experts), whose rows are their starts."""
    if bool((counts_S == 1).all()):
        return starts_S
    ends_S = counts_S.cumsum(0)
    within_R = torch.arange(int(ends_S[-1])) - torch.repeat_interleave(ends_S - counts_S, counts_S)
    return torch.repeat_interleave(starts_S, counts_S) + within_R


def _raise_for_status(status: int, counts_E: torch.Tensor, rows: int) -> None:
    if status == -1 and bool((counts_E < 0).any()):
        raise ValueError(f"group sizes must be >= 0; got {counts_E.min()}")
    if status == -1:
        raise ValueError(f"group sizes sum to {int(counts_E.sum())}, but x has {rows} rows")
    if status == -2:
        raise MemoryError("the grouped matmul could not allocate its call arguments")


class ExactPlan(NamedTuple):
    """The group sizes the C loop (native_kernels.c, exact_products) computes for one product and shape, with torch's
    numbers: min_rows <= n_e <= max_rows, a fused multiply-add chain from fused_from rows up."""

    min_rows: int
    max_rows: int
    fused_from: int


# The group sizes the checks below compare on, and the ways the C loop can round a group's first rows that exact_plan
# tries: MKL multiplies and rounds each product before adding in its smallest products, and fuses the multiply-adds
# from a size that depends on the CPU (from 4 rows in the forward on a 2-core AMD EPYC, from 2 on an Intel Xeon with
# AVX-512); fused_from 0 fuses every row.
_CHECKED_SIZES = (*range(0, 201), 224, 256, 320, 384, 512, 768, 1024)
_FUSED_FROM = (0, 1, 2, 3, 4)
_LOWEST_SIZE = {_FORWARD: 1, _INPUT_GRAD: 1, _WEIGHT_GRAD: 0}  # a weight gradient of 0 rows is a block of zeros
_MIN_SERVED_SIZE = 64  # a plan that agrees with torch only on smaller groups is not worth its second code path
_MAX_TORCH_SIZE = 8  # the batch call serves a shape only where it rounds like torch on every larger group


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


def _checked_operands(mode: int, d: int, f: int):
    """One group of every size in _CHECKED_SIZES with random operands (a fixed draw: the order in which a matrix
    kernel sums is the same for all values, and random values make a different order show in almost every
    element), and torch's products of them."""
    counts_E = torch.tensor(_CHECKED_SIZES, dtype=torch.int64)
    rows, E = int(counts_E.sum()), counts_E.numel()
    generator = torch.Generator().manual_seed(0)
    shapes = operand_shapes(mode, rows, E, d, f)
    a, b = (torch.randn(shape, generator=generator) for shape in shapes[:2])
    return counts_E, a, b, torch.zeros(shapes[2]), _torch_products(mode, counts_E, a, b)


def _equal_sizes(mode: int, ours: torch.Tensor, torchs: torch.Tensor) -> list[bool]:
    """Per checked size, whether its group came out bit-identical."""
    split = (lambda t: t.split(_CHECKED_SIZES)) if mode != _WEIGHT_GRAD else (lambda t: t.unbind())
    return [torch.equal(x, y) for x, y in zip(split(ours), split(torchs))]


@_found_once_per_shape
def torch_group_sizes(mode: int, d: int, f: int) -> frozenset[int] | None:
    """The group sizes at which MKL's batch call rounds unlike torch's product on this machine (computed again by
    torch after the batch call), or None where that includes a size above _MAX_TORCH_SIZE: then the batch call does
    not serve this product and shape at all. A few ms per shape."""
    counts_E, a, b, by_mkl, by_torch = _checked_operands(mode, d, f)
    rows = a.shape[0]
    _raise_for_status(native_library().expert_sgemm(_sgemm_batch(), mode, counts_E.numel(), counts_E.data_ptr(),
                                                    rows, d, f, a.data_ptr(), b.data_ptr(), by_mkl.data_ptr(), 1, 0),
                      counts_E, rows)
    unlike = frozenset(size for size, equal in zip(_CHECKED_SIZES, _equal_sizes(mode, by_mkl, by_torch)) if not equal)
    return None if any(size > _MAX_TORCH_SIZE for size in unlike) else unlike


@_found_once_per_shape
def exact_plan(mode: int, d: int, f: int) -> ExactPlan | None:
    """The C loop's plan for this product and shape on this machine, or None where it must not serve.

    The loop and torch's product run on one group of every checked size, once for each way of rounding the first
    rows (_FUSED_FROM); a plan serves the longest stretch of consecutive checked sizes on which the loop came out
    bit-identical to torch (_longest_agreeing_stretch says which stretches count), and the rounding whose stretch is
    longest wins. Smaller groups go to MKL's batch call (and torch_group_sizes). A few ms."""
    counts_E, a, b, by_loop, by_torch = _checked_operands(mode, d, f)
    best = None
    for fused_from in _FUSED_FROM:
        widest = ExactPlan(_LOWEST_SIZE[mode], _CHECKED_SIZES[-1], fused_from)
        if _exact_products(mode, counts_E, a.shape[0], d, f, a, b, by_loop.zero_(), widest) < 0:
            return None
        plan = _longest_agreeing_stretch(_equal_sizes(mode, by_loop, by_torch), _LOWEST_SIZE[mode], fused_from)
        if plan is not None and (best is None or (plan.max_rows - plan.min_rows, -plan.min_rows)
                                 > (best.max_rows - best.min_rows, -best.min_rows)):
            best = plan
    return best


def _longest_agreeing_stretch(equal: list[bool], lowest: int, fused_from: int) -> ExactPlan | None:
    """The plan over the longest run of consecutive checked sizes (from `lowest` up) that all agreed, if it starts
    within the first _MAX_TORCH_SIZE rows and reaches _MIN_SERVED_SIZE rows. A run that starts further up means MKL's
    order changes with the group size (seen with MKL's AVX2 kernels on an Intel Xeon: agreement at 152-156 rows and
    at 224 rows and up, nowhere else), and then agreement at the checked sizes says nothing of those between them."""
    best, start = None, None
    for size, agreed in zip(_CHECKED_SIZES, equal):
        if size < lowest or not agreed:
            start = None
            continue
        start = size if start is None else start
        if best is None or size - start > best.max_rows - best.min_rows:
            best = ExactPlan(start, size, fused_from)
    if best is None or best.min_rows > _MAX_TORCH_SIZE or best.max_rows < _MIN_SERVED_SIZE:
        return None
    return best


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
