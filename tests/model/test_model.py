"""The native MoE transformer: config validation, dispatch paths, padding, auxiliary losses."""

import numerics
import pytest
import torch
from conftest import tiny_config, tiny_model

from moe_rl.errors import ConfigError
from moe_rl.model.layers import attention_mask, decode_mask, last_positions, positions_from_mask
from moe_rl.model.moe import choose_kernel
from moe_rl.routing.replay import record_routing, replay_routing


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(top_k=7, n_experts=6), "top_k"),
        (dict(d_model=30, n_heads=4), "n_heads"),
        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
        (dict(dispatch="fast"), "dispatch"),
        (dict(n_layers=0), "n_layers"),
        (dict(moe_every=5, n_layers=3), "moe_every"),
    ],
)
def test_invalid_config_names_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        tiny_config(**overrides)


def test_bad_dispatch_lists_choices():
    with pytest.raises(ConfigError, match="'grouped', 'loop'"):
        tiny_config(dispatch="fast")


def _forward_backward(model, ids, valid):
    out = model(ids, valid)
    # A non-uniform upstream gradient so every parameter's gradient is exercised.
    weights = torch.linspace(-1, 1, out.logits_BSV.numel(), dtype=out.logits_BSV.dtype).view_as(out.logits_BSV)
    ((out.logits_BSV * weights).sum() + out.aux_loss).backward()
    return out.logits_BSV.detach(), {n: p.grad for n, p in model.named_parameters()}


def _float64_references(model, ids, valid):
    """Logits and gradients of `model` in float64, and of a copy perturbed by one fp32 rounding (tests/numerics.py),
    both routed as the fp32 model routes (replayed), so that a near-tie cannot send float64 to another expert."""
    with record_routing(model) as recorder, torch.no_grad():
        model(ids, valid)
    trace = recorder.trace()
    model64 = numerics.float64_copy(model)
    with replay_routing(model64, trace):
        reference = _forward_backward(model64, ids, valid)
    perturbed64 = numerics.perturbed_copy(model64)
    with replay_routing(perturbed64, trace), numerics.perturbed_rounding():
        perturbed = _forward_backward(perturbed64, ids, valid)
    return reference, perturbed


def _assert_within_rounding_of_float64(fast_path, ids, valid):
    """Logits and every gradient of `fast_path` within the fp32 bound of the float64 reference."""
    (logits64, grads64), (logits_perturbed, grads_perturbed) = _float64_references(fast_path, ids, valid)
    logits, grads = _forward_backward(fast_path, ids, valid)
    numerics.assert_within_rounding(logits, logits64, logits_perturbed, "logits")
    for name, grad in grads.items():
        numerics.assert_within_rounding(grad, grads64[name], grads_perturbed[name], name)
    return grads


# Every fast path against the float64 reference, at a few-experts and a many-experts shape; "grouped" picks one of
# the other two per call (test_grouped_dispatch_picks_the_kernel_by_shape). The fp32 loop reference must pass the
# same bound (else the bound, not the fast paths, would be what is tested).
DISPATCH = ["grouped", "grouped_mm", "padded", "loop"]
SHAPE_CLASSES = {"few_experts": dict(n_experts=6, top_k=2), "many_experts": dict(n_experts=32, top_k=8)}


@pytest.mark.numerics
@pytest.mark.parametrize("dispatch", DISPATCH)
@pytest.mark.parametrize("shape", list(SHAPE_CLASSES))
@pytest.mark.parametrize("d_shared_expert", [0, 16])
def test_every_dispatch_path_is_within_fp32_rounding_of_float64(dispatch, shape, d_shared_expert):
    model = tiny_model(dispatch=dispatch, d_shared_expert=d_shared_expert, **SHAPE_CLASSES[shape])
    ids = torch.randint(0, 40, (3, 11))
    _assert_within_rounding_of_float64(model, ids, torch.ones(3, 11, dtype=torch.bool))


@pytest.mark.numerics
@pytest.mark.parametrize("dispatch", DISPATCH)
def test_dispatch_paths_are_within_rounding_when_experts_get_no_tokens(dispatch):
    model = tiny_model(n_experts=8, top_k=1, dispatch=dispatch)
    ids, valid = torch.randint(0, 40, (1, 3)), torch.ones(1, 3, dtype=torch.bool)  # 3 tokens, 8 experts
    grads = _assert_within_rounding_of_float64(model, ids, valid)
    w_down = "blocks.0.ffn.experts.w_down"
    idle_experts = (grads[w_down].abs().sum(dim=(1, 2)) == 0).sum()
    assert idle_experts >= 5, "with 3 tokens and top-1, at least 5 of 8 experts must be idle"


def test_the_float64_bound_catches_a_wrong_gradient():
    """The bound is tight enough to see a real error: one token's expert output scaled by 1.001."""
    model = tiny_model(n_experts=8, top_k=2, dispatch="grouped_mm")
    ids, valid = torch.randint(0, 40, (2, 7)), torch.ones(2, 7, dtype=torch.bool)
    (logits64, _), (logits_perturbed, _) = _float64_references(model, ids, valid)
    logits, _ = _forward_backward(model, ids, valid)
    wrong = logits.clone()
    wrong[0, 3] += 1e-3 * logits[0, 3].abs().max()
    numerics.assert_within_rounding(logits, logits64, logits_perturbed)
    with pytest.raises(AssertionError, match="beyond the fp32 bound"):
        numerics.assert_within_rounding(wrong, logits64, logits_perturbed)


def test_auxiliary_losses_mask_padding_like_dropping_it():
    from moe_rl.model.moe import load_balancing_loss, router_z_loss

    logits_TE = torch.randn(12, 6)
    scores_TE, ids_TK = logits_TE.softmax(-1), logits_TE.topk(2, dim=-1).indices
    valid_T = torch.tensor([True] * 7 + [False] * 5)
    dropped = load_balancing_loss(scores_TE[valid_T], ids_TK[valid_T])
    torch.testing.assert_close(load_balancing_loss(scores_TE, ids_TK, valid_T), dropped)
    torch.testing.assert_close(router_z_loss(logits_TE, valid_T), router_z_loss(logits_TE[valid_T]))
    assert load_balancing_loss(scores_TE, ids_TK, valid_T) != load_balancing_loss(scores_TE, ids_TK)


def test_grouped_dispatch_picks_the_kernel_by_shape():
    cpu = torch.device("cpu")
    balanced_small = torch.full((128,), 4)  # decode-like: 4 slots per expert
    assert choose_kernel(cpu, balanced_small, 512) == ("padded", 4)
    nearly_balanced = balanced_small.clone()
    nearly_balanced[0] = 10
    assert choose_kernel(cpu, nearly_balanced, 518) == ("padded", 10)  # 1280 rows for 518 slots
    assert choose_kernel(cpu, torch.full((8,), 256), 2048) == ("grouped_mm", 0)  # large groups
    skewed = torch.zeros(128, dtype=torch.long)
    skewed[0] = 400
    skewed[1:] = 1
    assert choose_kernel(cpu, skewed, 527) == ("grouped_mm", 0)  # one hot expert: padding would be 97% waste
    # With the widths known, the loop's per-expert overhead buys padding: at d64 F32 (6,144 multiply-adds a row)
    # C = 20 for 512 slots of 128 experts still pads (measured faster), at d256 F256 the same routing does not.
    busy = balanced_small.clone()
    busy[0] = 20
    assert choose_kernel(cpu, busy, 528) == ("grouped_mm", 0)
    assert choose_kernel(cpu, busy, 528, row_macs=3 * 64 * 32) == ("padded", 20)
    assert choose_kernel(cpu, busy, 528, row_macs=3 * 256 * 256) == ("grouped_mm", 0)
    assert choose_kernel(cpu, skewed, 527, row_macs=3 * 64 * 32) == ("grouped_mm", 0)
    assert choose_kernel(torch.device("cuda"), balanced_small, 512) == ("grouped_mm", 0)
    # bf16 grouped_mm on CUDA needs 16-byte aligned rows; odd widths take the padded bmm instead
    assert choose_kernel(torch.device("cuda"), balanced_small, 512, aligned=False) == ("padded", 4)


def test_padding_does_not_change_real_tokens():
    model = tiny_model().eval()
    ids = torch.randint(3, 40, (1, 9))
    unpadded = model(ids).logits_BSV
    padded_ids = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)
    valid = torch.cat([torch.zeros(1, 4, dtype=torch.bool), torch.ones(1, 9, dtype=torch.bool)], dim=1)
    padded = model(padded_ids, valid).logits_BSV[:, 4:]
    torch.testing.assert_close(padded, unpadded, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(model(padded_ids, valid).logits_BSV).all()


def test_moe_every_mixes_dense_and_moe_blocks():
    model = tiny_model(n_layers=4, moe_every=2)
    assert [b.is_moe for b in model.blocks] == [False, True, False, True]
    assert [layer.moe_index for layer in model.moe_layers()] == [0, 1]


def test_load_balancing_loss_is_one_when_balanced():
    from moe_rl.model.moe import load_balancing_loss

    scores_TE = torch.full((4, 4), 0.25)
    ids_TK = torch.tensor([[0], [1], [2], [3]])
    assert load_balancing_loss(scores_TE, ids_TK).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0], [0], [0], [0]])
    assert load_balancing_loss(scores_TE, skewed).item() == pytest.approx(1.0)  # uniform P: f does not matter
    peaked = torch.tensor([[1.0, 0, 0, 0]] * 4)
    assert load_balancing_loss(peaked, skewed).item() == pytest.approx(4.0)


def test_aux_loss_only_counts_valid_tokens_and_is_off_without_grad():
    model = tiny_model()
    ids = torch.randint(0, 40, (2, 8))
    valid = torch.ones(2, 8, dtype=torch.bool)
    full = model(ids, valid).lb_loss
    valid_half = valid.clone()
    valid_half[:, :4] = False
    assert not torch.isclose(model(ids, valid_half).lb_loss, full)
    with torch.no_grad():
        assert model(ids, valid).aux_loss is None


def test_decode_step_mask_and_position_equal_the_full_ones():
    """A decode step (one query) builds its mask and position with shortcuts; they must equal the general ones for
    left, right and mixed padding, rows without any valid token, and a query that is itself padding."""
    g = torch.Generator().manual_seed(0)
    for P in (1, 2, 7, 33):
        valid_BP = torch.rand(16, P, generator=g) < 0.6
        valid_BP[0], valid_BP[1] = False, True
        assert torch.equal(decode_mask(valid_BP), attention_mask(valid_BP, 1))
        assert torch.equal(last_positions(valid_BP), positions_from_mask(valid_BP)[:, -1:])
    # and through the model: one cached step equals the same step with the general mask (P-wide)
    model = tiny_model().eval()
    ids_BS, valid_BS = torch.randint(3, 20, (4, 9), generator=g), torch.rand(4, 9, generator=g) < 0.7
    with torch.no_grad():
        cache = model.new_cache(4, 16)
        model(ids_BS[:, :8], valid_BS[:, :8], cache)
        step_BV = model(ids_BS[:, 8:], valid_BS, cache).logits_BSV[:, -1]
        full_BV = model(ids_BS, valid_BS).logits_BSV[:, -1]
    torch.testing.assert_close(step_BV, full_BV, rtol=1e-5, atol=1e-5)


def test_a_decode_step_without_padding_skips_the_mask_and_gives_the_masked_numbers(monkeypatch):
    """A decode step whose rows have no padding runs attention without a mask (an all-true one would change nothing),
    to the same bits as with the mask; a step with padding keeps its mask."""
    from moe_rl.model import layers

    masks, masked_attention = [], layers.decode_attention

    def attention_checking_the_mask(q_BH1Dh, k_BGPDh, v_BGPDh, mask_B11P, kernels=None):
        masks.append(mask_B11P)
        out = masked_attention(q_BH1Dh, k_BGPDh, v_BGPDh, mask_B11P, kernels=kernels)
        if mask_B11P is None:
            all_true_B11P = torch.ones(k_BGPDh.shape[0], 1, 1, k_BGPDh.shape[2], dtype=torch.bool)
            assert torch.equal(out, masked_attention(q_BH1Dh, k_BGPDh, v_BGPDh, all_true_B11P, kernels=kernels))
        return out

    monkeypatch.setattr(layers, "decode_attention", attention_checking_the_mask)
    model = tiny_model().eval()
    ids_BS = torch.randint(3, 20, (4, 9))
    for padded in (False, True):
        valid_BS = torch.ones(4, 9, dtype=torch.bool)
        valid_BS[1, :3] = not padded  # left padding in row 1
        masks.clear()
        with torch.no_grad():
            cache = model.new_cache(4, 16)
            model(ids_BS[:, :8], valid_BS[:, :8], cache)
            model(ids_BS[:, 8:], valid_BS, cache)
        assert len(masks) == model.cfg.n_layers
        assert all((mask is None) == (not padded) for mask in masks)


def test_z_loss_at_coefficient_zero_is_skipped_without_changing_the_loss_or_gradients():
    """With z_loss_coef = 0 the z-loss is not computed (it would add 0 to the loss and zeros to the gradients): the
    loss and gradients are those of the model that computes it, bit for bit; with a coefficient it is computed."""
    ids, valid = torch.randint(0, 40, (3, 10)), torch.ones(3, 10, dtype=torch.bool)

    def loss_and_grads(model):
        out = model(ids, valid)
        loss = out.logits_BSV.logsumexp(-1).mean() + out.aux_loss
        loss.backward()
        return out, loss.detach(), [p.grad for p in model.parameters()]

    skipped, loss_skipped, grads_skipped = loss_and_grads(tiny_model())
    computing = tiny_model()
    for layer in computing.moe_layers():
        layer.computes_z_loss = True
    computed, loss_computed, grads_computed = loss_and_grads(computing)
    assert skipped.z_loss is None and computed.z_loss > 0
    assert torch.equal(loss_skipped, loss_computed)
    assert all(torch.equal(a, b) for a, b in zip(grads_skipped, grads_computed))
    assert tiny_model(z_loss_coef=1e-3)(ids, valid).z_loss.requires_grad


def test_init_depth_holds_the_residual_init_scale_while_depth_changes():
    """GPT-2's init scales the residual output projections by 1/sqrt(2 L): a deeper model starts with smaller
    residual branches. init_depth fixes the L in that scale, so a depth sweep can hold it fixed."""
    def out_std(**kw):
        model = tiny_model(d_model=64, **kw)
        return torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith(("out.weight",
                                                                                         "w_down"))]).std().item()

    init = tiny_config().init_std
    assert out_std(n_layers=2) == pytest.approx(init / 2, rel=0.05)
    assert out_std(n_layers=8) == pytest.approx(init / 4, rel=0.05)
    assert out_std(n_layers=8, init_depth=2) == pytest.approx(init / 2, rel=0.05)
    with pytest.raises(ConfigError, match="init_depth"):
        tiny_config(init_depth=-1)
