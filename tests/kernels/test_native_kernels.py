"""The C kernels of the routing hot path (moe_rl/kernels/): the router's top-k gives torch.topk's indices on
every row (including the rows it hands back to torch.topk), the slot sort gives torch's stable argsort, the expert rows,
their sums and the rotary embedding give the torch code's numbers with and without autograd, and the library is built
once per machine. The fp32 sampler's decode attention agrees with torch's to fp32 rounding, and the bf16 sampler never
uses it. The MKL set-up kernel is checked in test_grouped_gemm.py. Every test runs the kernels whatever this
machine's measurement chose (kernels_on, conftest.py)."""

import ctypes
import subprocess

import pytest
import torch
from conftest import spy_kernel, switch_kernels_off, tiny_config, tiny_model

from moe_rl import kernels
from moe_rl.kernels import activation, attention, native, sampler
from moe_rl.model import layers, moe
from moe_rl.model.moe import sort_slots, topk_indices
from moe_rl.rl.rollout import SamplingConfig, generate

KERNELS = kernels.machine()  # the model functions' fast paths, as a built model's forward hands them down

needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler to build the kernels")
pytestmark = [pytest.mark.usefixtures("kernels_on"), pytest.mark.numerics]


def _kernel_unclear_rows(scores_TE: torch.Tensor, k: int) -> list[int]:
    ids_TK = torch.empty(scores_TE.shape[0], k, dtype=torch.int64)
    count = native.library().topk_rows(scores_TE.data_ptr(), *scores_TE.shape, k, ids_TK.data_ptr())
    unclear = (ids_TK[:, 0] < 0).nonzero().squeeze(1).tolist()
    assert count == len(unclear)
    return unclear


@needs_native
@pytest.mark.parametrize("tokens, experts, k", [(1000, 128, 8), (300, 8, 2), (50, 64, 8), (20, 6, 6), (40, 16, 1),
                                                 (10, 100, 64), (30, 33, 15), (30, 47, 16), (30, 257, 8), (30, 32, 3)])
@pytest.mark.parametrize("spread", [0.02, 0.5, 4.0])  # near-uniform scores (a fresh router), typical, peaked
def test_indices_equal_torch_topk(tokens, experts, k, spread):
    """Widths on both sides of the group-maxima bound (it needs 32+ columns and k < 16), with a ragged tail group."""
    scores_TE = torch.randn(tokens, experts).mul(spread).softmax(-1)
    assert torch.equal(topk_indices(scores_TE, k, kernels=KERNELS), scores_TE.topk(k, dim=-1).indices)
    kept_TJ = scores_TE.topk(min(k + 1, experts), dim=-1).values  # near-uniform fp32 scores do tie at times
    tied_rows = (kept_TJ[:, 1:] == kept_TJ[:, :-1]).any(dim=1).nonzero().squeeze(1).tolist()
    assert _kernel_unclear_rows(scores_TE, k) == tied_rows


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
    assert torch.equal(topk_indices(scores_TE, 4, kernels=KERNELS), scores_TE.topk(4, dim=-1).indices)


@needs_native
@pytest.mark.parametrize("width", [130, 128, 256])  # a ragged tail group; whole 16-column vectors (AVX-512 version)
def test_wide_rows_with_ties_or_nan_anywhere_are_redone_by_torch(width):
    """The same on rows wide enough for the group-maxima bound (a NaN in the last column, or below the bound, must
    still mark the row; a tie of two group maxima must not hide a value; a row of equal values gathers every column
    as a candidate)."""
    scores_TE = torch.rand(9, width)
    scores_TE[0, width - 1] = float("nan")
    scores_TE[1, 40] = float("nan")  # a value the bound would skip
    scores_TE[2, [5, 21]] = 3.0  # equal maxima of the same interleaved group
    scores_TE[3, [5, 6]] = 3.0  # equal maxima of neighbouring groups
    scores_TE[4] = 0.5  # every value equal
    scores_TE[5, 60:] = 0.999  # many equal values, the largest
    scores_TE[6, ::2] = scores_TE[6, ::2].round(decimals=1)  # ties below the top 9 only: a clear row
    scores_TE[6, [7, 9, 11, 13, 15, 17, 19, 23, 25]] = torch.arange(2.0, 2.9, 0.1)
    assert _kernel_unclear_rows(scores_TE, 8) == [0, 1, 2, 3, 4, 5]
    assert torch.equal(topk_indices(scores_TE, 8, kernels=KERNELS), scores_TE.topk(8, dim=-1).indices)


@needs_native
def test_bf16_router_scores_with_many_ties_match_torch():
    logits_TE = torch.randn(500, 64).bfloat16().float()  # an emulated bf16 engine's gate: coarse, often tied
    scores_TE = logits_TE.softmax(-1)
    assert torch.equal(topk_indices(scores_TE, 8, kernels=KERNELS), scores_TE.topk(8, dim=-1).indices)


def test_inputs_the_kernel_does_not_serve_go_to_torch():
    scores = torch.randn(30, 128)
    for tensor, k in [(scores.double(), 8), (scores.T, 8), (scores, 100), (scores[:0], 8)]:
        assert torch.equal(topk_indices(tensor, k, kernels=KERNELS), tensor.topk(k, dim=-1).indices)


@needs_native
def test_build_compiles_once_into_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    library = native.build()
    assert library.parent == tmp_path / "moe-rl" and library.exists()
    built_at = library.stat().st_mtime_ns
    assert native.build() == library and library.stat().st_mtime_ns == built_at
    assert [p.name for p in (tmp_path / "moe-rl").iterdir()] == [library.name]  # no build folder left behind
    loaded = ctypes.CDLL(str(library))
    assert loaded.topk_rows and loaded.sort_slots and loaded.expert_sgemm


@needs_native
def test_a_flag_set_the_compiler_refuses_falls_back_to_the_next(tmp_path, monkeypatch):
    """As on a toolchain without function multi-versioning: the first flag set fails, leaves a marker, and the
    library is built from the next; a later build goes straight to it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    refused = (*native.FLAGS, "-fno-such-flag-moe-rl")
    library = native.build((refused, native.ONE_VERSION_FLAGS))
    assert library.exists() and ctypes.CDLL(str(library)).rotate_half
    assert sorted(p.suffix for p in (tmp_path / "moe-rl").iterdir()) == [".failed", ".so"]
    assert native.build((refused, native.ONE_VERSION_FLAGS)) == library
    with pytest.raises(subprocess.CalledProcessError):
        native.build((refused,))


@pytest.mark.parametrize("tokens, experts, k", [(1, 8, 2), (64, 8, 2), (704, 128, 8), (300, 300, 4), (5, 128, 8)])
def test_slot_sort_is_torch_stable_argsort(tokens, experts, k):
    ids_TK = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    ids_TK[: tokens // 2] = ids_TK[: tokens // 2] % 3  # crowded experts, to exercise stability (ids repeat per token)
    slots = sort_slots(ids_TK, experts, kernels=KERNELS)
    ids_N = ids_TK.reshape(-1)
    order_N = ids_N.argsort(stable=True)
    assert torch.equal(slots.order_N, order_N)
    assert torch.equal(slots.ids_N, ids_N[order_N])
    assert torch.equal(slots.token_N, order_N // k)
    assert torch.equal(slots.counts_E, torch.bincount(ids_N, minlength=experts))


@needs_native
def test_slot_sort_refuses_out_of_range_expert_ids():
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\); got 0..8"):
        sort_slots(torch.tensor([[0, 8], [1, 2]]), 8, kernels=KERNELS)


def _routed_slots(tokens: int, experts: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    scores_TE = torch.randn(tokens, experts, generator=g).softmax(-1)
    scores_TE[: tokens // 3, 0] += 1.0  # one crowded expert, several idle ones
    ids_TK = scores_TE.topk(k, dim=-1).indices
    return (torch.randn(tokens, 24, generator=g), scores_TE.gather(-1, ids_TK),
            sort_slots(ids_TK, experts, kernels=KERNELS))


@needs_native
@pytest.mark.parametrize("padding", ["none", "short blocks", "uniform"])
def test_expert_rows_and_their_sum_equal_the_torch_code(padding, monkeypatch):
    """The buffer rows and the combined output from the C kernels are the torch code's, bit for bit: rows, tokens and
    weights copied, and the per-token sums added in the same order as index_add."""

    x_TD, weights_TK, slots = _routed_slots(tokens=50, experts=16, k=4)
    counts_E = slots.counts_E
    block_rows_E = {"none": None, "short blocks": counts_E.clamp(min=3),
                    "uniform": counts_E.new_full(counts_E.shape, int(counts_E.max()))}[padding]
    with torch.no_grad():
        native_rows = moe.expert_rows(x_TD, weights_TK, slots, block_rows_E, kernels=KERNELS)
        y_RD = torch.randn(native_rows.x_RD.shape[0], 24)
        native_sum = moe.combine_rows(y_RD, native_rows.token_R, 50, kernels=KERNELS)
        switch_kernels_off(monkeypatch)
        torch_rows = moe.expert_rows(x_TD, weights_TK, slots, block_rows_E, kernels=KERNELS)
        torch_sum = moe.combine_rows(y_RD, torch_rows.token_R, 50, kernels=KERNELS)
    for name, ours, torchs in zip(moe.ExpertRows._fields, native_rows, torch_rows):
        assert torch.equal(ours, torchs), name
    assert torch.equal(native_sum, torch_sum)
    assert (native_rows.token_R == 50).sum() == (0 if block_rows_E is None else int((block_rows_E - counts_E).sum()))


@needs_native
def test_expert_rows_refuse_blocks_shorter_than_their_groups():

    x_TD, weights_TK, slots = _routed_slots(tokens=20, experts=8, k=2)
    with torch.no_grad(), pytest.raises(ValueError, match="shorter than their groups"):
        moe.expert_rows(x_TD, weights_TK, slots, slots.counts_E - 1, kernels=KERNELS)
    one_more_E = slots.counts_E.clone()
    one_more_E[0] += 1  # would read past the sorted slots
    with torch.no_grad(), pytest.raises(ValueError, match="do not add up"):
        moe.expert_rows(x_TD, weights_TK, slots._replace(counts_E=one_more_E), kernels=KERNELS)
    with torch.no_grad(), pytest.raises(ValueError, match="outside"):
        moe.combine_rows(torch.randn(3, 24), torch.tensor([0, 21, 1]), 20, kernels=KERNELS)


@needs_native
@pytest.mark.parametrize("padding", [False, True])
def test_expert_rows_and_their_sum_with_autograd_equal_the_torch_code(padding, monkeypatch):
    """With autograd the rows are gathered and summed by autograd Functions whose backwards are C sums and copies;
    values and input gradients are those of index_select and index_add, bit for bit."""

    x_TD, weights_TK, slots = _routed_slots(tokens=50, experts=16, k=4)
    block_rows_E = slots.counts_E.clamp(min=5) if padding else None
    grad_seed_TD = torch.randn(50, 24)

    def forward_backward():
        x = x_TD.clone().requires_grad_()
        rows = moe.expert_rows(x, weights_TK, slots, block_rows_E, kernels=KERNELS)
        y_RD = rows.x_RD * torch.linspace(0.5, 2.0, rows.x_RD.shape[0])[:, None]  # rows differ, as expert outputs do
        out_TD = moe.combine_rows(y_RD, rows.token_R, 50, kernels=KERNELS)
        (out_TD * grad_seed_TD).sum().backward()
        return out_TD.detach(), x.grad

    native_out, native_grad = forward_backward()
    switch_kernels_off(monkeypatch)
    torch_out, torch_grad = forward_backward()
    assert torch.equal(native_out, torch_out)
    assert torch.equal(native_grad, torch_grad)


@needs_native
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("grads", ["rows and weights", "rows only", "weights only", "none"])
@pytest.mark.parametrize("width", [24, 256])  # 256: the weights' gradient is torch's vectorised row sum
def test_weighted_sum_of_rows_equals_the_torch_code_forward_and_backward(padding, grads, width, monkeypatch):
    """The gate weights multiplied into the rows inside the C sum (forward) and inside one C pass of the backward
    give the product's and index_add's numbers bit for bit: values, the rows' gradient and the weights' gradient,
    with special values (signed zeros, infinities, NaN, huge products) in rows, weights and the incoming gradient."""

    x_TD, weights_TK, slots = _routed_slots(tokens=50, experts=16, k=4)
    block_rows_E = slots.counts_E.clamp(min=5) if padding else None
    with torch.no_grad():
        rows = moe.expert_rows(x_TD, weights_TK, slots, block_rows_E, kernels=KERNELS)
    g = torch.Generator().manual_seed(3)
    y_RD = torch.randn(rows.x_RD.shape[0], width, generator=g) * 3
    weight_R = rows.weight_R.clone()
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3e38, -1e-45])
    y_RD[0, :7], y_RD[1, 3], weight_R[2], weight_R[3] = special, -0.0, -0.0, 3e38
    y_RD[rows.token_R == 50, 5] = float("inf")  # a padding row's gradient is zero times the row: NaN here
    grad_seed_TD = torch.randn(50, width, generator=g)
    grad_seed_TD[rows.token_R[4], :7] = special
    served = spy_kernel(monkeypatch, "combine_weighted_rows")

    def forward_backward():
        y, w = y_RD.clone().requires_grad_("rows" in grads), weight_R.clone().requires_grad_("weights" in grads)
        out_TD = moe.combine_weighted_rows(y, w, rows.token_R, 50, kernels=KERNELS)
        if grads != "none":
            out_TD.backward(grad_seed_TD)
        with torch.no_grad():
            no_grad_TD = moe.combine_weighted_rows(y, w, rows.token_R, 50, kernels=KERNELS)
        return out_TD.detach(), no_grad_TD, y.grad, w.grad

    native = forward_backward()
    assert len(served) == 2  # with and without autograd
    with pytest.raises(ValueError, match="outside"):
        moe.combine_weighted_rows(torch.randn(3, 24), torch.ones(3), torch.tensor([0, 21, 1]), 20, kernels=KERNELS)
    with pytest.raises(ValueError, match="one token and one weight per row"):
        moe.combine_weighted_rows(torch.randn(3, 24), torch.ones(2), torch.tensor([0, 1, 1]), 20, kernels=KERNELS)
    with pytest.raises(ValueError, match="one token and one weight per row"):
        moe.combine_rows(torch.randn(3, 24), torch.tensor([0, 1]), 20, kernels=KERNELS)
    switch_kernels_off(monkeypatch)
    reference = forward_backward()
    for name, ours, torchs in zip(("values", "values without autograd", "rows' gradient", "weights' gradient"),
                                  native, reference):
        assert (ours is None) == (torchs is None), name
        if ours is not None:
            assert activation.same_bits(ours, torchs), name
    assert reference[0].isnan().any() and reference[0].isinf().any()  # the special values reached the output
    if padding:
        assert (rows.token_R == 50).any()


@needs_native
@pytest.mark.parametrize("width", [24, 64, 100, 256])  # 100: mean's division by d is not a power of two
@pytest.mark.parametrize("grads", ["input and weight", "input", "weight"])
@pytest.mark.parametrize("values", ["ordinary", "special"])
def test_rms_norm_with_autograd_equals_the_torch_composite(width, grads, values, monkeypatch):
    """The norm as the model uses it, x also feeding a residual sum (so x's gradient is three terms that autograd
    adds in its order): output, x's gradient and the weight's gradient are torch's bit for bit, with ordinary values
    at three scales, and with special values (zeros, signed zeros, infinities, NaN, values whose square overflows,
    subnormals) in x, the weight and the incoming gradient. (A row of x with NaN or an infinity makes that row's
    product with the gradient NaN, and so every column of the weight's gradient: the ordinary case checks it.)"""
    g = torch.Generator().manual_seed(5)
    x_BSD = torch.randn(3, 5, width, generator=g) * torch.tensor([0.01, 1.0, 40.0])[:, None, None]
    weight_D = 1 + 0.3 * torch.randn(width, generator=g)
    grad_BSD = torch.randn(3, 5, width, generator=g)
    if values == "special":
        x_BSD[0, 0] = 0.0  # rstd = 1 / sqrt(eps)
        x_BSD[0, 1, :3] = torch.tensor([-0.0, float("inf"), 1e-42])
        x_BSD[0, 2, 5] = float("nan")
        x_BSD[1, 0, 1] = 3e20  # its square overflows: rstd 0
        x_BSD[1, 1, :4] = torch.tensor([-0.0, 0.0, 1e-45, -1e-44])
        weight_D[:3] = torch.tensor([-0.0, 0.0, 1e30])  # (an infinite weight would make every row's x gradient NaN)
        grad_BSD[2, 0, :3] = torch.tensor([float("nan"), -0.0, float("-inf")])
    residual_BSD = torch.randn(3, 5, width, generator=g)
    served = spy_kernel(monkeypatch, "rms_norm")

    def forward_backward():
        x = x_BSD.clone().requires_grad_("input" in grads)
        norm = layers.RMSNorm(width, 1e-6)
        with torch.no_grad():
            norm.weight.copy_(weight_D)
        norm.weight.requires_grad_("weight" in grads)
        y = norm(x, KERNELS) + x * residual_BSD
        y.backward(grad_BSD)
        return y.detach(), x.grad, norm.weight.grad

    native = forward_backward()
    assert len(served) == 1
    switch_kernels_off(monkeypatch)
    reference = forward_backward()
    for name, ours, torchs in zip(("values", "x's gradient", "weight's gradient"), native, reference):
        assert (ours is None) == (torchs is None), name
        if ours is not None:
            assert activation.same_bits(ours, torchs), name
    if values == "special":
        assert reference[0].isnan().any()  # the special values reached the output
        if "input" in grads:
            assert reference[1].isfinite().sum() > 0.5 * reference[1].numel()  # most rows' gradients are numbers
    else:
        assert all(t.isfinite().all() for t in reference if t is not None)


@needs_native
@pytest.mark.parametrize("layout", ["contiguous", "every other head block"])  # q, and k as a slice of the kv output
def test_rotary_embedding_equals_the_torch_ops_forward_and_backward(layout, monkeypatch):
    B, S, H, Dh = 3, 7, 4, 16
    g = torch.Generator().manual_seed(0)
    rotary = layers.Rotary(Dh, 10_000.0)
    cos_BSDh, sin_BSDh = rotary.cos_sin(torch.randint(0, 50, (B, S), generator=g))
    source = torch.randn(B, S, 2, H, Dh, generator=g) if layout != "contiguous" else torch.randn(B, S, H, Dh,
                                                                                                  generator=g)
    grad_BSHDh = torch.randn(B, S, H, Dh, generator=g)

    def rotate():
        leaf = source.clone().requires_grad_()
        x_BSHDh = leaf[:, :, 0] if layout != "contiguous" else leaf
        out = layers.apply_rotary(x_BSHDh, cos_BSDh, sin_BSDh, kernels=KERNELS)
        (out * grad_BSHDh).sum().backward()
        with torch.no_grad():
            no_grad_out = layers.apply_rotary(x_BSHDh, cos_BSDh, sin_BSDh, kernels=KERNELS)
        return out.detach(), no_grad_out, leaf.grad

    native_results = rotate()
    switch_kernels_off(monkeypatch)
    torch_results = rotate()
    for ours, torchs in zip(native_results, torch_results):
        assert torch.equal(ours, torchs)


@needs_native
@pytest.mark.parametrize("n_experts, top_k, dispatch", [(64, 8, "grouped"), (64, 8, "padded"), (8, 2, "grouped")])
def test_models_give_the_same_numbers_without_the_c_kernels(n_experts, top_k, dispatch, monkeypatch):
    """What a machine without a C compiler runs (torch's kernels everywhere) gives the very numbers the kernels give:
    no-grad logits, sampled tokens, log-probs and routing, and a training step's gradients. (Head dim 8: the fp32
    sampler's decode attention kernel, which agrees to rounding only, does not serve; it is tested below.)"""

    model = tiny_model(n_experts=n_experts, top_k=top_k, dispatch=dispatch)
    ids_BS = torch.randint(3, 40, (6, 11))
    valid_BS = torch.ones_like(ids_BS, dtype=torch.bool)
    valid_BS[1, :3] = False

    def passes():
        with torch.no_grad():
            logits = model(ids_BS, valid_BS).logits_BSV
        gen = generate(model, ids_BS, valid_BS, SamplingConfig(max_new_tokens=8), eos_id=2, pad_id=0,
                       generator=torch.Generator().manual_seed(0), record=True)
        model.zero_grad(set_to_none=True)
        out = model(ids_BS, valid_BS)
        (out.logits_BSV.logsumexp(-1).mean() + out.aux_loss).backward()
        return [logits, gen.tokens_BS, gen.logprobs_BN, gen.routing.ids_LBSK] + [p.grad for p in model.parameters()]

    with_kernels = passes()
    switch_kernels_off(monkeypatch)
    without_kernels = passes()
    assert all(torch.equal(a, b) for a, b in zip(with_kernels, without_kernels))


def test_the_kernels_can_be_switched_off(monkeypatch):
    """MOE_RL_NATIVE=0 gives no library, so every caller runs its torch code (library() itself is cached per process;
    its undecorated body is what a fresh process would run)."""
    monkeypatch.setenv("MOE_RL_NATIVE", "0")
    assert native.library.__wrapped__() is None


# --- the sampler's decode attention ------------------------------------------------------------------------------


def _decode_inputs(B, H, G, Dh, P, max_len, seed=0):
    """q (B, H, 1, Dh); (keys, values) of P positions as a cache of each key layout returns them; a padding mask."""
    g = torch.Generator().manual_seed(seed)
    cfg = tiny_config(d_model=H * Dh, n_heads=H, n_kv_heads=G, n_layers=1)
    k_BGPDh, v_BGPDh = torch.randn(B, G, P, Dh, generator=g), torch.randn(B, G, P, Dh, generator=g)
    views = []
    for transposed in (False, True):
        cache = layers.KVCache(cfg, B, max_len, "cpu", torch.float32, keys_transposed=transposed)
        keys, values = cache.append(0, k_BGPDh, v_BGPDh)
        assert torch.equal(keys, k_BGPDh) and torch.equal(values, v_BGPDh)  # either layout returns the same keys
        views.append((keys, values))
    q_BH1Dh = torch.randn(B, 1, H, Dh, generator=g).mul(2).transpose(1, 2)  # as Attention makes it
    valid_BP = torch.ones(B, P, dtype=torch.bool)
    valid_BP[1 % B, : P // 2] = False  # left padding
    valid_BP[-1, :] = False  # a row whose query sees only itself
    return q_BH1Dh, views[0], views[1], layers.decode_mask(valid_BP)


@needs_native
@pytest.mark.parametrize("B, H, G, Dh, P, max_len", [(64, 4, 2, 16, 48, 80), (5, 4, 2, 16, 17, 17),
                                                     (3, 8, 2, 32, 16, 16), (4, 4, 4, 64, 100, 130),
                                                     (2, 6, 1, 16, 1, 5), (7, 4, 2, 48, 33, 40)])
@pytest.mark.parametrize("masked", [True, False])
def test_decode_attention_kernel_agrees_with_torch_to_rounding(B, H, G, Dh, P, max_len, masked, monkeypatch):
    """Positions on both sides of the 16-lane blocks, grouped and plain heads, head dims 16 to 64, padding rows and a
    row that sees one key: the kernel's output is as close to a float64 reference as torch's two-matmul path is."""
    q_BH1Dh, (k_BGPDh, v_BGPDh), (kt_BGPDh, vt_BGPDh), mask_B11P = _decode_inputs(B, H, G, Dh, P, max_len)
    mask_B11P = mask_B11P if masked else None
    calls = spy_kernel(monkeypatch, "decode_attention")
    with torch.inference_mode():
        ours = layers.decode_attention(q_BH1Dh, kt_BGPDh, vt_BGPDh, mask_B11P, kernels=KERNELS)
        torchs = layers.decode_attention(q_BH1Dh, k_BGPDh, v_BGPDh, mask_B11P, kernels=KERNELS)
        exact = layers.decode_attention(q_BH1Dh.double(), k_BGPDh.double(), v_BGPDh.double(), mask_B11P,
                                        kernels=KERNELS)
    assert calls == [1], "the transposed cache must go to the kernel, the plain one to torch"
    torch_error = (torchs.double() - exact).abs().max().item()
    our_error = (ours.double() - exact).abs().max().item()
    assert our_error <= max(2 * torch_error, 1e-6), (our_error, torch_error)


@needs_native
def test_only_the_fp32_sampler_uses_the_sampler_kernels(monkeypatch):
    """The emulated bf16 engine samples under autocast: its cache keeps the plain key layout, its experts take the
    grouped path, and its numbers are torch's, bit for bit, whether the kernels exist or not. The fp32 sampler at the
    same shape uses both kernels."""
    model = tiny_model(d_model=64, d_expert=32).eval()  # head dim 16 and expert width 32, which the kernels serve
    ids_BS = torch.randint(3, 40, (6, 7))
    valid_BS = torch.ones_like(ids_BS, dtype=torch.bool)
    valid_BS[2, :3] = False
    calls = spy_kernel(monkeypatch, "decode_attention")
    expert_calls = spy_kernel(monkeypatch, "routed_experts")

    def sample(precision: str):
        gen = generate(model, ids_BS, valid_BS, SamplingConfig(max_new_tokens=8, precision=precision), eos_id=2,
                       pad_id=0, generator=torch.Generator().manual_seed(0), record=True)
        return [gen.tokens_BS, gen.logprobs_BN, gen.routing.ids_LBSK]

    sample("trainer")
    assert len(calls) == 7 * model.cfg.n_layers  # every decode step of every layer
    assert len(expert_calls) == 8 * model.cfg.n_layers  # and the prompt's pass
    calls.clear()
    expert_calls.clear()
    bf16 = sample("bf16")
    assert calls == [] and expert_calls == []
    switch_kernels_off(monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(bf16, sample("bf16")))


# --- the sampler's experts -----------------------------------------------------------------------------------------


def _experts_and_routing(E, K, D, F, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    experts = moe.Experts(E, D, F, "grouped")
    with torch.no_grad():
        experts.w_gate_up.normal_(0, D**-0.5, generator=g)
        experts.w_down.normal_(0, F**-0.5, generator=g)
    x_TD = torch.randn(T, D, generator=g)
    scores_TE = torch.randn(T, E, generator=g).mul(3).softmax(-1)  # uneven loads: some experts idle, some busy
    weights_TK, ids_TK = scores_TE.topk(K, dim=-1)
    return experts, x_TD, weights_TK, ids_TK


def _experts_in_float64(experts, x_TD, weights_TK, ids_TK) -> torch.Tensor:
    """The reference: each expert's SwiGLU on its tokens, weighted and summed, in float64."""
    out_TD = torch.zeros(x_TD.shape, dtype=torch.float64)
    for e in range(experts.n_experts):
        token_S, slot_S = (ids_TK == e).nonzero(as_tuple=True)
        gate_SF, up_SF = (x_TD[token_S].double() @ experts.w_gate_up[e].double()).chunk(2, dim=-1)
        y_SD = (torch.nn.functional.silu(gate_SF) * up_SF) @ experts.w_down[e].double()
        out_TD.index_add_(0, token_S, y_SD * weights_TK[token_S, slot_S].double()[:, None])
    return out_TD


@needs_native
@pytest.mark.parametrize("E, K, D, F, T", [(128, 8, 64, 32, 64), (8, 2, 64, 64, 64), (128, 8, 64, 32, 700),
                                           (16, 4, 32, 16, 5), (6, 6, 16, 48, 3), (64, 1, 48, 32, 1)])
def test_sampler_experts_kernel_agrees_with_the_grouped_path_to_rounding(E, K, D, F, T, monkeypatch):
    """Decode- and prompt-sized calls, idle experts, groups of every size mod 4, one token: under inference mode the
    kernel serves, and its output is as close to a float64 reference as the grouped path's."""
    experts, x_TD, weights_TK, ids_TK = _experts_and_routing(E, K, D, F, T)
    calls = spy_kernel(monkeypatch, "routed_experts")
    with torch.inference_mode():
        ours = experts(x_TD, weights_TK, ids_TK, KERNELS)
    with torch.no_grad():  # the trainer's passes: the grouped path
        grouped = experts(x_TD, weights_TK, ids_TK, KERNELS)
        exact = _experts_in_float64(experts, x_TD, weights_TK, ids_TK)
    assert calls == [1]
    grouped_error = (grouped.double() - exact).abs().max().item()
    our_error = (ours.double() - exact).abs().max().item()
    assert our_error <= max(2 * grouped_error, 1e-6), (our_error, grouped_error)


@needs_native
def test_sampler_experts_kernel_serves_only_the_fp32_sampler_at_widths_of_16():
    experts, x_TD, _, _ = _experts_and_routing(8, 2, 64, 32, 10)
    params = list(experts.parameters())
    with torch.inference_mode():
        assert sampler.serves(x_TD, *params)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not sampler.serves(x_TD, *params)
        narrow, *_ = _experts_and_routing(8, 2, 64, 24, 10)
        assert not sampler.serves(x_TD, *narrow.parameters())
    with torch.no_grad():
        assert not sampler.serves(x_TD, *params)


@needs_native
def test_sampler_experts_kernel_refuses_slots_outside_the_batch():
    experts, x_TD, weights_TK, ids_TK = _experts_and_routing(8, 2, 64, 32, 10)
    slots = sort_slots(ids_TK, 8, kernels=KERNELS)
    outside = slots._replace(token_N=slots.token_N.clone().index_fill_(0, torch.tensor([3]), 10))
    with torch.inference_mode(), pytest.raises(ValueError, match="sampler experts kernel"):
        sampler.sampler_experts(x_TD, weights_TK, outside, experts.w_gate_up, experts.w_down)


@needs_native
def test_the_sampler_experts_kernels_prefetching_changes_no_number(tmp_path, monkeypatch):
    """The kernel asks for the next expert's weights while it computes (native_kernels.c, bring_ahead): a hint, so
    the kernels built without it (-DMOE_RL_NO_PREFETCH, what benchmarks/bench_prefetch.py compares with) give the
    same bits, with idle experts (an empty expert is passed over, its successor not brought), a last expert with
    slots (nothing after it to bring) and blocks of every size mod 4."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    without = native.load(native.build(tuple((*flags, "-DMOE_RL_NO_PREFETCH")
                                             for flags in native.ISA_CAPS[native.isa_cap()])))
    calls, last_expert_busy, some_expert_idle = [], [], []
    for E, K, D, F, T in ((128, 8, 64, 32, 128), (8, 2, 64, 64, 33), (16, 4, 48, 80, 7)):
        experts, x_TD, weights_TK, ids_TK = _experts_and_routing(E, K, D, F, T)
        slots = sort_slots(ids_TK, E, kernels=KERNELS)
        calls.append(lambda experts=experts, x_TD=x_TD, weights_TK=weights_TK, slots=slots: sampler.sampler_experts(
            x_TD, weights_TK, slots, experts.w_gate_up, experts.w_down))
        last_expert_busy.append(bool(slots.counts_E[-1] > 0))
        some_expert_idle.append(bool((slots.counts_E == 0).any()))
    assert any(last_expert_busy) and any(some_expert_idle), "the cases the docstring names"
    with torch.inference_mode():
        prefetched = [call() for call in calls]
        monkeypatch.setattr(sampler, "native_library", lambda: without)
        not_prefetched = [call() for call in calls]
    for number, (a, b) in enumerate(zip(prefetched, not_prefetched)):
        assert torch.equal(a, b), number


@needs_native
def test_the_sampler_kernels_round_alike_in_the_widest_and_the_baseline_build(tmp_path, monkeypatch):
    """The sampler's kernels are written as 16-lane vector arithmetic so that the AVX-512, AVX2 and baseline versions
    give the same bits (sampling on two CPUs of a cluster differs only where torch's own kernels do): the loaded build
    (the widest version this CPU has) against a baseline-only build (-DMOE_RL_ONE_VERSION)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    baseline = ctypes.CDLL(str(native.build((native.ONE_VERSION_FLAGS,))))
    for name, argtypes in native._SIGNATURES.items():
        getattr(baseline, name).argtypes, getattr(baseline, name).restype = argtypes, ctypes.c_int64
    q_BH1Dh, _, (kt_BGPDh, vt_BGPDh), mask_B11P = _decode_inputs(9, 4, 2, 32, 37, 48)
    experts, x_TD, weights_TK, ids_TK = _experts_and_routing(16, 4, 64, 32, 50)
    slots = sort_slots(ids_TK, 16, kernels=KERNELS)

    def both_kernels():
        with torch.inference_mode():
            return (attention.decode_attention(q_BH1Dh, kt_BGPDh, vt_BGPDh, mask_B11P),
                    sampler.sampler_experts(x_TD, weights_TK, slots, experts.w_gate_up, experts.w_down))

    widest = both_kernels()
    for module in (attention, sampler):
        monkeypatch.setattr(module, "native_library", lambda: baseline)
    assert all(torch.equal(a, b) for a, b in zip(widest, both_kernels()))


@needs_native
def test_the_sampler_kernels_16_and_8_float_versions_round_alike(tmp_path, monkeypatch):
    """The AVX-512 versions of the sampler's kernels hold 16-float vectors, the AVX2 and baseline ones 8-float
    halves (16 registers hold no more, and GCC spills wider vectors); every lane still sees the same operations in the
    same order, so both must give the same bits. A build that forces the 16-float code into every version
    (-DMOE_RL_WIDE_TILES) against the loaded one, at decode and prompt sizes."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    wide = ctypes.CDLL(str(native.build(((*native.FLAGS, "-DMOE_RL_WIDE_TILES"),))))
    for name, argtypes in native._SIGNATURES.items():
        getattr(wide, name).argtypes, getattr(wide, name).restype = argtypes, ctypes.c_int64
    cases = []
    for E, K, D, F, T in ((128, 8, 64, 32, 64), (8, 2, 64, 64, 33), (16, 4, 48, 80, 7)):
        experts, x_TD, weights_TK, ids_TK = _experts_and_routing(E, K, D, F, T)
        slots = sort_slots(ids_TK, E, kernels=KERNELS)
        cases.append(lambda experts=experts, x_TD=x_TD, weights_TK=weights_TK, slots=slots: sampler.sampler_experts(
            x_TD, weights_TK, slots, experts.w_gate_up, experts.w_down))
    for B, H, G, Dh, P, max_len in ((64, 4, 2, 16, 48, 80), (7, 4, 2, 48, 33, 40), (3, 8, 2, 32, 16, 16)):
        q_BH1Dh, _, (kt_BGPDh, vt_BGPDh), mask_B11P = _decode_inputs(B, H, G, Dh, P, max_len)
        cases.append(lambda q=q_BH1Dh, k=kt_BGPDh, v=vt_BGPDh, m=mask_B11P: attention.decode_attention(q, k, v, m))
    with torch.inference_mode():
        loaded = [case() for case in cases]
        for module in (attention, sampler):
            monkeypatch.setattr(module, "native_library", lambda: wide)
        sixteen_float = [case() for case in cases]
    for number, (a, b) in enumerate(zip(loaded, sixteen_float)):
        assert torch.equal(a, b), number
