"""The MKL batch path of the experts' grouped matmul: the same numbers and gradients as torch._grouped_mm.

Every test here runs the kernels whatever this machine's measurement chose (kernels_on, conftest.py)."""

import pytest
import torch
from conftest import tiny_config, tiny_model

from moe_rl import kernels
from moe_rl.kernels import grouped_gemm
from moe_rl.kernels.grouped_gemm import MKL_MIN_EXPERTS_WITH_GRAD, exact_min_block_rows, mkl_available, mkl_grouped_mm
from moe_rl.model import MoETransformer
from moe_rl.model.moe import grouped_mm

KERNELS = kernels.machine()  # the model functions' fast paths, as a built model's forward hands them down

needs_mkl = pytest.mark.skipif(not mkl_available(), reason="this torch build does not export MKL's batched GEMM")
pytestmark = [pytest.mark.usefixtures("kernels_on"), pytest.mark.numerics]


def _sorted_rows(counts_E: torch.Tensor, d_in: int, d_out: int):
    x_ND = torch.randn(int(counts_E.sum()), d_in)
    w_EDF = torch.randn(counts_E.numel(), d_in, d_out)
    return x_ND, w_EDF, counts_E.cumsum(0).to(torch.int32)


def _assert_gradients_match_torch(counts_E, x_ND, w_EDF, ends_E):
    """grouped_mm and torch._grouped_mm give the same output and the same gradients of x and w, bit for bit."""
    upstream_NF = torch.randn(x_ND.shape[0], w_EDF.shape[2])
    results = []
    for product in (lambda x, w: grouped_mm(x, w, counts_E, kernels=KERNELS),
                    lambda x, w: torch._grouped_mm(x, w, offs=ends_E)):
        x, w = x_ND.clone().requires_grad_(), w_EDF.clone().requires_grad_()
        y = product(x, w)
        y.backward(upstream_NF)
        results.append((y.detach(), x.grad, w.grad))
    for ours, torchs, name in zip(*results, ("output", "input grad", "weight grad")):
        assert torch.equal(ours, torchs), name


@needs_mkl
@pytest.mark.parametrize("d_in, d_out", [(64, 64), (32, 64), (64, 128), (256, 512), (24, 48)])
def test_batch_call_equals_torch_grouped_mm_at_every_group_size(d_in, d_out):
    counts_E = torch.arange(130)[torch.randperm(130)]  # every group size from 0 (an idle expert) to 129
    x_ND, w_EDF, ends_E = _sorted_rows(counts_E, d_in, d_out)
    with torch.no_grad():
        y_NF = grouped_mm(x_ND, w_EDF, counts_E, kernels=KERNELS)
    assert torch.equal(y_NF, torch._grouped_mm(x_ND, w_EDF, offs=ends_E))


@needs_mkl
def test_batch_call_fills_rows_of_a_single_busy_expert():
    counts_E = torch.zeros(MKL_MIN_EXPERTS_WITH_GRAD, dtype=torch.long)
    counts_E[5] = 7
    x_ND, w_EDF, ends_E = _sorted_rows(counts_E, 16, 8)
    with torch.no_grad():
        assert torch.equal(grouped_mm(x_ND, w_EDF, counts_E, kernels=KERNELS), x_ND @ w_EDF[5])


@needs_mkl
@pytest.mark.parametrize("d_in, d_out", [(64, 64), (32, 64), (64, 32), (256, 512)])
def test_batch_calls_give_torch_grouped_mm_gradients_at_every_group_size(d_in, d_out):
    counts_E = torch.arange(130)[torch.randperm(130)]  # includes the one-slot expert (a matrix-vector product)
    x_ND, w_EDF, ends_E = _sorted_rows(counts_E, d_in, d_out)
    _assert_gradients_match_torch(counts_E, x_ND, w_EDF, ends_E)
    assert "MKLGroupedMM" in type(grouped_mm(x_ND.requires_grad_(), w_EDF, counts_E, kernels=KERNELS).grad_fn).__name__


@needs_mkl
def test_group_sizes_that_do_not_cover_the_rows_are_refused():
    counts_E = torch.full((MKL_MIN_EXPERTS_WITH_GRAD,), 2)
    x_ND, w_EDF, ends_E = _sorted_rows(counts_E, 16, 8)
    with torch.no_grad(), pytest.raises(ValueError, match="sum to 64, but x has 63 rows"):
        grouped_mm(x_ND[:-1], w_EDF, counts_E, kernels=KERNELS)


@pytest.mark.parametrize("n_experts, top_k", [(MKL_MIN_EXPERTS_WITH_GRAD, 2), (MKL_MIN_EXPERTS_WITH_GRAD, 8), (8, 2)])
def test_many_expert_model_gives_torch_kernel_numbers_with_and_without_grad(n_experts, top_k, monkeypatch):
    """At MKL_MIN_EXPERTS_WITH_GRAD experts both the no-grad pass (sampling, old pass, probes) and the training forward
    and backward take the batch calls (below it, the no-grad pass only); logits and gradients must be exactly those of
    torch._grouped_mm, and the logits close to the loop reference."""
    overrides = dict(n_experts=n_experts, top_k=top_k, dispatch="grouped_mm")
    model = tiny_model(**overrides)
    loop = MoETransformer(tiny_config(**{**overrides, "dispatch": "loop"}), kernels=KERNELS)
    loop.load_state_dict(model.state_dict())
    ids = torch.randint(0, 40, (4, 13))

    def passes():
        with torch.no_grad():
            logits_no_grad = model(ids).logits_BSV
        model.zero_grad(set_to_none=True)
        out = model(ids)
        (out.logits_BSV.logsumexp(-1).mean() + out.aux_loss).backward()
        return [logits_no_grad, out.logits_BSV.detach()] + [p.grad for p in model.parameters()]

    ours = passes()
    with kernels.forced(mkl_products=False):  # torch._grouped_mm everywhere
        torchs = passes()
    assert all(torch.equal(a, b) for a, b in zip(ours, torchs))
    with torch.no_grad():
        torch.testing.assert_close(ours[0], loop(ids).logits_BSV, rtol=1e-5, atol=1e-5)


def _experts_and_routing(n_experts: int, top_k: int, tokens: int, hot_share: float):
    """Experts with tokens routed so that groups range from empty to large: a share `hot_share` of the tokens goes to
    expert 0 (the padded kernel's capacity C), the rest spread thinly (groups of 0-3 slots)."""
    from moe_rl.model.moe import Experts

    experts = Experts(n_experts, 32, 16, "padded")
    torch.nn.init.normal_(experts.w_gate_up, std=0.2)
    torch.nn.init.normal_(experts.w_down, std=0.2)
    scores_TE = torch.randn(tokens, n_experts).softmax(-1)
    scores_TE[: int(hot_share * tokens), 0] += 1.0
    ids_TK = scores_TE.topk(top_k, dim=-1).indices
    return experts, torch.randn(tokens, 32), scores_TE.gather(-1, ids_TK), ids_TK


@needs_mkl
@pytest.mark.parametrize("tokens, hot_share", [(16, 0.0), (64, 0.0), (64, 0.5), (200, 0.2), (3, 0.0)])
def test_padded_kernel_in_short_blocks_gives_the_numbers_of_full_blocks(tokens, hot_share):
    experts, x_TD, weights_TK, ids_TK = _experts_and_routing(128, 4, tokens, hot_share)
    with torch.no_grad():  # short blocks: max(n_e, m0) rows per expert
        counts_E = torch.bincount(ids_TK.reshape(-1), minlength=128)
        capacity = int(counts_E.max())
        min_rows = max(exact_min_block_rows(32, 32, capacity), exact_min_block_rows(16, 32, capacity))
        short_blocks = grouped_gemm.short_block_rows(counts_E, capacity, 32, 16, torch.float32)
        assert (short_blocks is not NotImplemented) == (min_rows < capacity)
        short = experts(x_TD, weights_TK, ids_TK, KERNELS)
    full = experts(x_TD, weights_TK, ids_TK, KERNELS)  # with autograd: torch.bmm over (E, C, D) blocks
    assert torch.equal(short, full.detach())


@needs_mkl
def test_short_blocks_serve_the_model_widths():
    """Blocks shorter than the largest group are exact at the widths the bench and study models use (else the padded
    kernel would silently keep all its padding)."""
    for d_in, d_out in [(64, 64), (32, 64), (64, 128), (128, 64), (256, 512), (512, 256)]:
        assert exact_min_block_rows(d_in, d_out, capacity=32) < 32, (d_in, d_out)


@needs_mkl
def test_strided_operands_are_refused():
    counts_E = torch.full((MKL_MIN_EXPERTS_WITH_GRAD,), 2)
    x_ND, w_EDF, _ = _sorted_rows(counts_E, 16, 8)
    with pytest.raises(ValueError, match="contiguous"):
        mkl_grouped_mm(x_ND, w_EDF.transpose(1, 2).contiguous().transpose(1, 2), counts_E)


@needs_mkl
@pytest.mark.parametrize("d_in, d_out", [(16, 8), (64, 64)])  # the MKL batch call; the C loop (exact_products)
def test_weight_gradient_of_an_idle_expert_is_written_as_zeros(d_in, d_out):
    """The weight gradient starts as uninitialised memory: the batch call (k = 0, beta = 0) and the C loop (a zero
    accumulator) must overwrite an idle expert's block rather than leave whatever was there."""

    counts_E = torch.zeros(MKL_MIN_EXPERTS_WITH_GRAD, dtype=torch.long)
    counts_E[3] = 5
    x_ND, grad_NF = torch.randn(5, d_in), torch.randn(5, d_out)
    grad_EDF = torch.full((MKL_MIN_EXPERTS_WITH_GRAD, d_in, d_out), float("nan"))
    grouped_gemm._expert_products(grouped_gemm._WEIGHT_GRAD, counts_E, d_in, d_out, x_ND, grad_NF, grad_EDF)
    assert torch.equal(grad_EDF[3], x_ND.T @ grad_NF)
    assert not grad_EDF.isnan().any() and (grad_EDF.sum(dim=(1, 2)) != 0).sum() == 1


@needs_mkl
def test_operands_whose_shapes_do_not_fit_are_refused():
    """MKL would read past a weight of the wrong width without an error."""
    counts_E = torch.full((MKL_MIN_EXPERTS_WITH_GRAD,), 2)
    x_ND, w_EDF, _ = _sorted_rows(counts_E, 16, 8)
    with pytest.raises(ValueError, match="expected"):
        mkl_grouped_mm(x_ND[:, :12].contiguous(), w_EDF, counts_E)


needs_c_loop = pytest.mark.skipif(not mkl_available() or not grouped_gemm.c_loop_runs(),
                                  reason="the C loop of the grouped products needs AVX-512 or AVX2 with FMA, and a "
                                         "kernel build that has them (not MOE_RL_ISA=baseline)")


def _random_operands(mode: int, counts_E, d_in: int, d_out: int):
    """rows, random a and b for the product `mode` over groups of counts_E rows, and an output full of NaN (so that
    a group the loop skipped shows)."""
    rows = int(counts_E.sum())
    a_shape, b_shape, c_shape = grouped_gemm.operand_shapes(mode, rows, counts_E.numel(), d_in, d_out)
    return rows, torch.randn(a_shape), torch.randn(b_shape), torch.full(c_shape, float("nan"))


def _plan_or_skip(mode: int, d_in: int, d_out: int):
    """This machine's plan for the product, or a skip where there is none: where MKL does not sum as one chain (seen
    with MKL's AVX2 kernels on an Intel Xeon) the loop must not serve, and test_c_loop_stays_within_the_float64_bound
    still tests its arithmetic."""
    plan = grouped_gemm.exact_plan(mode, d_in, d_out)
    if plan is None:
        pytest.skip(f"no plan for product {mode} at {d_in}x{d_out} here: MKL's order is not the loop's chain")
    return plan


def test_c_loop_runs_wherever_the_cpu_and_the_build_have_its_vectors():
    """The skip above asks the C code whether it runs; this keeps that from hiding a build that lost its vector
    kernels: on a CPU with AVX2 and FMA (or AVX-512) the C loop must run unless the kernels' ISA is capped to the
    baseline."""
    from moe_rl.kernels import native, selection

    if native.library() is None:
        pytest.skip("no C kernels built")
    flags = set(selection.cpu_description()["features"])
    vectors = "avx512f" in flags or {"avx2", "fma"} <= flags
    assert grouped_gemm.c_loop_runs() == (vectors and native.isa_cap() != "baseline")


@needs_c_loop
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("d_in, d_out", [(64, 64), (32, 64)])
def test_c_loop_gives_torch_numbers_at_every_group_size_of_its_plan(d_in, d_out, mode):
    """At d_model 64 and expert width 32 (the bench and study models) every product has a plan that starts at a few
    rows and reaches MKL's depth block, and the loop gives torch's numbers at every group size inside it, not only
    at the sizes the search checked (which skip from 200 rows to 224, 256, ...)."""
    from moe_rl.kernels.grouped_gemm import _exact_products, _torch_products

    plan = _plan_or_skip(mode, d_in, d_out)
    assert plan.min_rows <= 4 and plan.max_rows >= 96, plan
    counts_E = torch.arange(plan.min_rows, plan.max_rows + 1)
    rows, a, b, by_loop = _random_operands(mode, counts_E, d_in, d_out)
    assert _exact_products(mode, counts_E, rows, d_in, d_out, a, b, by_loop, plan) == 0  # it took every group
    assert torch.equal(by_loop, _torch_products(mode, counts_E, a, b))


@needs_c_loop
def test_prefetching_changes_no_number(monkeypatch):
    """The loop's prefetch of the next expert's block (native_kernels.c, next_block) is a hint: the kernels built
    without it (-DMOE_RL_NO_PREFETCH, what benchmarks/bench_prefetch.py compares with) give the same bits in every
    product, with groups of every size its plan serves spread over many experts."""
    from moe_rl.kernels import native

    without = native.load(native.build(tuple((*flags, "-DMOE_RL_NO_PREFETCH")
                                             for flags in native.ISA_CAPS[native.isa_cap()])))
    for mode in (grouped_gemm._FORWARD, grouped_gemm._INPUT_GRAD, grouped_gemm._WEIGHT_GRAD):
        plan = _plan_or_skip(mode, 64, 64)
        counts_E = torch.arange(plan.min_rows, plan.max_rows + 1)[torch.randperm(plan.max_rows - plan.min_rows + 1)]
        rows, a, b, prefetched = _random_operands(mode, counts_E, 64, 64)
        assert grouped_gemm._exact_products(mode, counts_E, rows, 64, 64, a, b, prefetched, plan) == 0
        not_prefetched = torch.full_like(prefetched, float("nan"))
        with monkeypatch.context() as patched:
            patched.setattr(grouped_gemm, "native_library", lambda: without)
            assert grouped_gemm._exact_products(mode, counts_E, rows, 64, 64, a, b, not_prefetched, plan) == 0
        assert torch.equal(prefetched, not_prefetched), mode


@needs_c_loop
@pytest.mark.parametrize("d_in, d_out", [(64, 64), (32, 64), (64, 32)])
def test_c_loop_and_mkl_together_give_torch_grouped_mm_numbers_and_gradients(d_in, d_out, monkeypatch):
    """Group sizes on both sides of every plan's edges (1-3 rows, 4, 192 and 193, 1,024 and beyond) in one call, so
    each product splits its experts between the C loop and MKL; values and gradients must be torch's, and the C loop
    must have run and left some experts to MKL."""

    for mode in (grouped_gemm._FORWARD, grouped_gemm._INPUT_GRAD, grouped_gemm._WEIGHT_GRAD):
        _plan_or_skip(mode, d_in, d_out)  # found (and cached) before the spy: the search calls the loop too
    left_to_mkl = []
    real = grouped_gemm._exact_products

    def spy(*args):
        left_to_mkl.append(real(*args))
        return left_to_mkl[-1]

    monkeypatch.setattr(grouped_gemm, "_exact_products", spy)
    counts_E = torch.tensor([0, 1, 2, 3, 4, 5, 17, 191, 192, 193, 250, 1024, 1100] + [2] * 20)
    counts_E = counts_E[torch.randperm(counts_E.numel())]
    x_ND, w_EDF, ends_E = _sorted_rows(counts_E, d_in, d_out)
    _assert_gradients_match_torch(counts_E, x_ND, w_EDF, ends_E)
    assert len(left_to_mkl) == 3 and all(left > 0 for left in left_to_mkl)


@needs_c_loop
def test_a_plan_serves_only_where_its_rounding_agrees_with_torch(monkeypatch):
    """Offered only a rounding that leaves the first 99 rows of a group unfused (MKL fuses from a few rows), the
    search must not let the loop serve groups smaller than 100 rows; and with no stretch long enough to be worth it,
    there is no plan and the products are MKL's, still torch's numbers."""
    monkeypatch.setattr(grouped_gemm, "_FUSED_FROM", (100,))
    grouped_gemm.exact_plan.cache_clear()
    try:
        plan = grouped_gemm.exact_plan(grouped_gemm._FORWARD, 64, 64)
        assert plan is None or plan.min_rows >= 100, plan
        monkeypatch.setattr(grouped_gemm, "_MIN_SERVED_SIZE", 10_000)
        grouped_gemm.exact_plan.cache_clear()
        assert all(grouped_gemm.exact_plan(mode, 64, 64) is None for mode in grouped_gemm._PRODUCTS)
        counts_E = torch.tensor([0, 1, 2, 3, 4, 17, 193, 300] + [1] * 30)
        x_ND, w_EDF, ends_E = _sorted_rows(counts_E, 64, 64)
        _assert_gradients_match_torch(counts_E, x_ND, w_EDF, ends_E)
    finally:
        grouped_gemm.exact_plan.cache_clear()


@needs_mkl
def test_batch_call_serves_a_shape_only_where_it_rounds_like_torch_above_a_few_rows():
    """torch_group_sizes: the sizes MKL's batch call leaves to torch are a few rows at most (else None: the batch call
    does not serve the shape), and the one-row input gradient, which expert_sgemm never computes, is among them."""
    for d_in, d_out in [(64, 64), (32, 64), (256, 512)]:
        for mode in grouped_gemm._PRODUCTS:
            sizes = grouped_gemm.torch_group_sizes(mode, d_in, d_out)
            assert sizes is None or max(sizes, default=0) <= grouped_gemm._MAX_TORCH_SIZE
        assert 1 in grouped_gemm.torch_group_sizes(grouped_gemm._INPUT_GRAD, d_in, d_out)


def _float64_products(mode: int, counts_E, a, b):
    """The products of `mode` group by group in float64 (torch._grouped_mm takes no float64)."""
    groups = zip(a.split(counts_E.tolist()), b.split(counts_E.tolist()) if mode == 2 else b.unbind())
    if mode == 0:
        return torch.cat([x @ w for x, w in groups])
    if mode == 1:
        return torch.cat([g @ w.T for g, w in groups])
    return torch.stack([x.T @ g for x, g in groups])


@needs_c_loop
@pytest.mark.parametrize("fused_from", [0, 4])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_c_loop_stays_within_the_float64_bound(mode, fused_from):
    """Whatever MKL does on this CPU, the loop's arithmetic is checked against float64: every element of a k-term
    dot product is within gamma_k = k u / (1 - k u) of the exact value, relative to the sum of |terms| (u = 2^-24),
    the textbook bound for recursive summation; every group size 0-200 and some larger, both roundings."""
    from moe_rl.kernels.grouped_gemm import ExactPlan, _exact_products

    d_in, d_out = 64, 32
    counts_E = torch.tensor([*range(0, 201), 256, 512, 1024])
    rows, a, b, by_loop = _random_operands(mode, counts_E, d_in, d_out)
    plan = ExactPlan(0 if mode == 2 else 1, 1024, fused_from)
    assert _exact_products(mode, counts_E, rows, d_in, d_out, a, b, by_loop, plan) == 0
    exact, magnitude = (_float64_products(mode, counts_E, a.double().abs() if absolute else a.double(),
                                          b.double().abs() if absolute else b.double()) for absolute in (False, True))
    depth = {0: d_in, 1: d_out, 2: None}[mode]
    u = 2.0**-24
    if depth is None:  # a weight gradient sums over its expert's rows
        depth_E = counts_E.clamp(min=1).double()[:, None, None]
        bound = depth_E * u / (1 - depth_E * u) * magnitude
    else:
        bound = depth * u / (1 - depth * u) * magnitude
    assert torch.isfinite(by_loop).all()
    assert ((by_loop.double() - exact).abs() <= bound).all()


@needs_c_loop
def test_c_loop_refuses_widths_it_cannot_vectorise_and_counts_that_do_not_add_up():
    from moe_rl.kernels.grouped_gemm import ExactPlan

    plan = ExactPlan(1, 1024, 4)
    counts_E = torch.tensor([3, 5])
    x_ND = torch.randn(8, 64)
    narrow = grouped_gemm._exact_products(grouped_gemm._FORWARD, counts_E, 8, 64, 12, x_ND, torch.randn(2, 64, 12),
                                          torch.empty(8, 12), plan)
    assert narrow == -3  # 12 columns are not whole vectors (of 16 with AVX-512, of 8 with AVX2): MKL's job
    with pytest.raises(ValueError, match="sum to 8, but x has 9 rows"):
        grouped_gemm._exact_products(grouped_gemm._FORWARD, counts_E, 9, 64, 64, torch.randn(9, 64),
                                     torch.randn(2, 64, 64), torch.empty(9, 64), plan)


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_torch_recomputes_the_chosen_experts_of_any_size_in_place(mode):
    """_torch_products_of overwrites the chosen experts' part of c with torch's products and leaves the others: groups
    of one row (their rows are their starts) and of several (the general path), on every CPU."""
    counts_E = torch.tensor([3, 1, 0, 5, 1, 2, 1])
    rows, E, d, f = int(counts_E.sum()), counts_E.numel(), 16, 8
    a, b = (torch.randn(shape) for shape in grouped_gemm.operand_shapes(mode, rows, E, d, f)[:2])
    expected = grouped_gemm._torch_products(mode, counts_E, a, b)
    for chosen in ([1, 4, 6], [0, 3, 4], [2, 5]):
        chosen_E = torch.zeros(E, dtype=torch.bool)
        chosen_E[chosen] = True
        c = torch.full(grouped_gemm.operand_shapes(mode, rows, E, d, f)[2], float("nan"))
        grouped_gemm._torch_products_of(mode, counts_E, a, b, c, chosen_E)
        ends_E = counts_E.cumsum(0)
        for e in range(E):
            ours, torchs = (c[e], expected[e]) if mode == 2 else (c[ends_E[e] - counts_E[e]:ends_E[e]],
                                                                     expected[ends_E[e] - counts_E[e]:ends_E[e]])
            if chosen_E[e]:
                assert torch.equal(ours, torchs), (chosen, e)
            else:
                assert bool(ours.isnan().all()), (chosen, e)
