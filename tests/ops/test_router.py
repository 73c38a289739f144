"""topk_route and apply_capacity: the reference's contract on CPU, kernels == reference on GPU."""
import math

import pytest
import torch
from hypothesis import given

from qmoe import ops
from qmoe.ops import apply_capacity, topk_route
from qmoe.reference import router as reference
from tests.ops.router_inputs import INF, NAN, router_cases, sprinkle_non_finite
BACKWARD_ARGS = ("score_function", "pre_softmax", "scaling_factor", "normalize_topk_probs")


def _route(logits, k, **kw):
    return reference.topk_route(logits, k, **kw)


# ------------------------------------------------------------------ the contract, on CPU


def test_softmax_after_topk_normalises_over_the_chosen():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs, routing_map = _route(logits, 2)
    assert routing_map.tolist() == [[False, True, True, False]]
    want = torch.softmax(torch.tensor([3.0, 2.0]), 0)
    torch.testing.assert_close(probs[0, 1:3], want, rtol=1e-6, atol=0)


def test_pre_softmax_keeps_the_full_softmax_values():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs, _ = _route(logits, 2, pre_softmax=True)
    full = torch.softmax(logits[0], 0)
    torch.testing.assert_close(probs[0], full * torch.tensor([0.0, 1, 1, 0]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("fn", ["sigmoid", "sqrtsoftplus"])
def test_sigmoid_like_scores_are_normalised_when_k_above_one(fn):
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    probs, _ = _route(logits, 3, score_function=fn, scaling_factor=2.5)
    torch.testing.assert_close(probs.sum(1), torch.full((16,), 2.5), rtol=1e-6, atol=0)
    probs1, routing_map = _route(logits, 1, score_function=fn)
    score = torch.sigmoid(logits) if fn == "sigmoid" else torch.nn.functional.softplus(logits).sqrt()
    torch.testing.assert_close(probs1[routing_map], score[routing_map], rtol=1e-6, atol=0)


@pytest.mark.parametrize("fn,pre", [("softmax", False), ("softmax", True), ("sigmoid", False),
                                    ("sqrtsoftplus", False)], ids=["softmax", "pre_softmax", "sigmoid", "sqrtsoftplus"])
def test_ties_go_to_the_lower_expert(fn, pre):
    probs, routing_map = _route(torch.zeros(3, 8), 3, score_function=fn, pre_softmax=pre)
    assert routing_map[:, :3].all() and not routing_map[:, 3:].any()
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    _, routing_map = _route(logits, 2, score_function=fn, pre_softmax=pre)
    assert routing_map.tolist() == [[False, True, True, False, False]]


def test_minus_inf_columns_are_never_chosen_while_finite_ones_remain():
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    logits[:, [0, 5]] = -INF
    for fn in ["softmax", "sigmoid", "sqrtsoftplus"]:
        probs, routing_map = _route(logits, 6, score_function=fn)
        assert not routing_map[:, [0, 5]].any()
        assert torch.isfinite(probs).all()


def test_all_tokens_to_one_expert():
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    logits[:, 7] = 50.0
    probs, routing_map = _route(logits, 2)
    assert routing_map[:, 7].all()
    assert (probs[:, 7] > 0.99).all()


def test_expert_bias_changes_selection_but_not_probs():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    probs, routing_map = _route(logits, 2, score_function="sigmoid", expert_bias=bias)
    assert routing_map.tolist() == [[True, False, False, True]]
    s = torch.sigmoid(logits[0, [0, 3]])
    torch.testing.assert_close(probs[0, [0, 3]], s / s.sum(), rtol=1e-6, atol=0)


def test_group_limited_routing_picks_from_the_best_groups():
    # 4 groups of 2; group_topk=2, top_k=4 -> a group's score is the sum of its top 2.
    logits = torch.tensor([[9.0, -9.0, 1.0, 1.0, 3.0, 3.0, 0.0, 0.0]])
    _, routing_map = _route(logits, 4, score_function="sigmoid", num_groups=4, group_topk=2)
    # group scores: g0 = s(9)+s(-9) ~ 1.0, g1 = 2 s(1) ~ 1.46, g2 = 2 s(3) ~ 1.9, g3 = 1.0
    assert routing_map.tolist() == [[False, False, True, True, True, True, False, False]]


def test_group_score_topk_sums_that_many_of_a_groups_scores():
    # 4 groups of 2, group_topk=2, top_k=2: Megatron's rule scores a group by its top 1
    # (g0 wins with s(9)); with group_score_topk=2 (DeepSeek-V3) g1 and g2 beat g0's s(9)+s(-9).
    logits = torch.tensor([[9.0, -9.0, 1.0, 1.0, 3.0, 3.0, 0.0, 0.0]])
    kw = dict(score_function="sigmoid", num_groups=4, group_topk=2)
    _, megatron = _route(logits, 2, **kw)
    assert megatron.tolist() == [[True, False, False, False, True, False, False, False]]
    _, top2 = _route(logits, 2, group_score_topk=2, **kw)
    assert top2.tolist() == [[False, False, False, False, True, True, False, False]]
    # top_k need not be a multiple of group_topk when group_score_topk is set
    _, m3 = _route(logits, 3, group_score_topk=2, **kw)
    assert m3.tolist() == [[False, False, True, False, True, True, False, False]]


@pytest.mark.parametrize("fn", ["sigmoid", "sqrtsoftplus"])
def test_normalize_topk_probs_false_keeps_the_raw_scores(fn):
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(5))
    probs, routing_map = _route(logits, 3, score_function=fn, normalize_topk_probs=False, scaling_factor=2.5)
    score = torch.sigmoid(logits) if fn == "sigmoid" else torch.nn.functional.softplus(logits).sqrt()
    torch.testing.assert_close(probs[routing_map], 2.5 * score[routing_map], rtol=1e-6, atol=0)
    # and True normalises even for top_k = 1
    probs1, _ = _route(logits, 1, score_function=fn, normalize_topk_probs=True)
    torch.testing.assert_close(probs1.sum(1), torch.ones(16), rtol=1e-6, atol=0)


@pytest.mark.parametrize("fn", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_masked_expert_gets_zero_gradient_not_nan(fn):
    """A -inf logit (a masked expert) chosen anyway has score 0; its gradient is the limit 0, and the
    other experts' gradients stay finite (autograd of sqrt(softplus) would give inf * 0 = NaN)."""
    logits = torch.tensor([[float("-inf"), -0.29, -2.18, 0.57]], requires_grad=True)
    probs, routing_map = reference.topk_route(logits, 4, score_function=fn)
    assert routing_map.all()
    g = torch.tensor([[0.3, -1.0, 0.5, 2.0]])
    (grad,) = torch.autograd.grad(probs, logits, g)
    assert torch.isfinite(grad).all() and grad[0, 0] == 0
    twin = reference.topk_route_backward(g, logits.detach(), routing_map, 4, score_function=fn)
    torch.testing.assert_close(twin, grad, rtol=1e-6, atol=1e-7)


def test_pre_softmax_normalised_equals_softmax_after_topk():
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(6))
    p_after, m_after = _route(logits, 3)
    p_pre, m_pre = _route(logits, 3, pre_softmax=True, normalize_topk_probs=True)
    assert torch.equal(m_after, m_pre)
    torch.testing.assert_close(p_pre, p_after, rtol=1e-6, atol=1e-7)


def test_scaling_factor_multiplies_probs():
    logits = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    p1, m1 = _route(logits, 2)
    p2, m2 = _route(logits, 2, scaling_factor=3.0)
    assert torch.equal(m1, m2)
    torch.testing.assert_close(p2, p1 * 3.0, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ non-finite values
# The selection order (qmoe/reference/router.py): eligible, then NaN, then larger, then lower index.

SCORE_FUNCTIONS = [("softmax", False), ("softmax", True), ("sigmoid", False), ("sqrtsoftplus", False)]
SCORE_IDS = ["softmax", "pre_softmax", "sigmoid", "sqrtsoftplus"]


@pytest.mark.parametrize("fn,pre", SCORE_FUNCTIONS, ids=SCORE_IDS)
def test_nan_ranks_first_and_a_nan_row_takes_the_lowest_experts(fn, pre):
    logits = torch.tensor([[1.0, NAN, 2.0, 0.0, 3.0],
                           [NAN, NAN, NAN, NAN, NAN],
                           [0.5, 1.0, -1.0, 2.0, 0.0]])
    probs, routing_map = _route(logits, 2, score_function=fn, pre_softmax=pre)
    # pre_softmax: one NaN makes the whole row's softmax NaN, so row 0 ties like row 1
    row0 = [True, True, False, False, False] if pre else [False, True, False, False, True]
    assert routing_map.tolist() == [row0, [True, True, False, False, False], [False, True, False, True, False]]
    assert probs[:2][routing_map[:2]].isnan().all() and (probs[:2][~routing_map[:2]] == 0).all()
    alone, alone_map = _route(logits[2:], 2, score_function=fn, pre_softmax=pre)
    assert torch.equal(alone_map, routing_map[2:]) and torch.equal(alone, probs[2:])


@pytest.mark.parametrize("fn", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_infinities_rank_as_the_extreme_numbers_and_signed_zeros_tie(fn):
    logits = torch.tensor([[-INF, 1.0, INF, 0.0, INF], [-INF, 0.0, -INF, 1.0, 2.0], [-0.0, 0.0, -1.0, -2.0, -3.0],
                           [0.0, -0.0, -1.0, -2.0, -3.0]])
    _, routing_map = _route(logits, 3, score_function=fn)
    assert routing_map.int().tolist() == [[0, 1, 1, 0, 1], [0, 1, 0, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    _, routing_map = _route(logits, 4, score_function=fn)
    assert routing_map[1].int().tolist() == [1, 1, 0, 1, 1]  # -inf ties go to the lower expert
    _, routing_map = _route(logits[2:], 1, score_function=fn)
    assert routing_map[:, 0].all()


def test_experts_outside_the_kept_groups_never_beat_an_eligible_minus_inf():
    # 2 groups of 2, one kept: group 1 (score 5) holds expert 2 (5.0) and expert 3 (-inf); the
    # second choice is expert 3, not a -inf-scored expert of the discarded group 0
    logits = torch.tensor([[-INF, -INF, 5.0, -INF]])
    _, routing_map = _route(logits, 2, num_groups=2, group_topk=1, group_score_topk=1)
    assert routing_map.tolist() == [[False, False, True, True]]


def test_a_group_holding_a_nan_ranks_first():
    logits = torch.tensor([[9.0, 9.0, 0.0, NAN, 1.0, 1.0, 2.0, 2.0]])
    probs, routing_map = _route(logits, 2, score_function="sigmoid", num_groups=4, group_topk=1)
    assert routing_map.tolist() == [[False, False, True, True, False, False, False, False]]
    assert probs[routing_map].isnan().all()


def test_a_nan_expert_bias_entry_is_every_tokens_first_choice_with_finite_probs():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(7))
    bias = torch.tensor([0.0, NAN, 0.0, 0.0])
    probs, routing_map = _route(logits, 2, score_function="sigmoid", expert_bias=bias)
    assert routing_map[:, 1].all() and (routing_map.sum(1) == 2).all()
    assert torch.isfinite(probs).all()


def test_capacity_drops_a_nan_probability_first():
    probs = torch.tensor([[NAN, 0.0], [0.5, 0.0], [0.4, 0.0], [0.3, 0.0]])
    routing_map = torch.tensor([[True, False]] * 4)
    _, kept = apply_capacity(probs, routing_map, 1.0)  # cap = ceil(4 / 2) = 2
    assert kept[:, 0].tolist() == [False, True, True, False]
    _, kept = apply_capacity(probs, routing_map, 2.0)  # room for all
    assert kept[:, 0].all()


@given(router_cases())
def test_reference_invariants(case):
    logits, k, kw = case
    probs, routing_map = reference.topk_route(logits, k, **kw)
    assert (routing_map.sum(1) == k).all()
    assert (probs[~routing_map] == 0).all()
    assert probs.dtype == torch.float32 and routing_map.dtype == torch.bool
    if "num_groups" in kw:
        per_group = routing_map.view(len(logits), kw["num_groups"], -1).any(-1).sum(-1)
        assert (per_group <= kw["group_topk"]).all()
    # a non-finite logit changes its own token only: the finite rows route as they do when
    # every other row is zero (a non-finite expert_bias is shared by all tokens: no such claim)
    finite = torch.isfinite(logits).all(1)
    bias = kw.get("expert_bias")
    if not finite.all() and (bias is None or torch.isfinite(bias).all()):
        clean_probs, clean_map = reference.topk_route(logits.masked_fill(~finite[:, None], 0), k, **kw)
        assert torch.equal(routing_map[finite], clean_map[finite])
        assert torch.equal(probs[finite], clean_probs[finite])


@pytest.mark.parametrize("kw", [
    dict(), dict(pre_softmax=True), dict(score_function="sigmoid", scaling_factor=2.0),
    dict(score_function="sqrtsoftplus"), dict(score_function="sigmoid", num_groups=2, group_topk=1),
    dict(score_function="sigmoid", top_k=1),
    dict(score_function="sigmoid", normalize_topk_probs=False, scaling_factor=2.0),
    dict(pre_softmax=True, normalize_topk_probs=True),
    dict(score_function="sqrtsoftplus", top_k=1, normalize_topk_probs=True),
], ids=["softmax", "pre_softmax", "sigmoid_scaled", "sqrtsoftplus", "groups", "sigmoid_k1", "sigmoid_unnormalised",
        "pre_softmax_normalised", "sqrtsoftplus_k1_normalised"])
def test_gradcheck_fp64_reference(kw):
    kw = dict(kw)
    k = kw.pop("top_k", 2)
    logits = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    logits.requires_grad_(True)
    torch.autograd.gradcheck(lambda x: reference.topk_route(x, k, **kw)[0], (logits,))
    # the hand-written backward twin (what the kernel implements) equals autograd
    probs, routing_map = reference.topk_route(logits, k, **kw)
    g = torch.randn_like(probs)
    (auto,) = torch.autograd.grad(probs, logits, g)
    twin = reference.topk_route_backward(
        g, logits.detach(), routing_map, k,
        **{n: v for n, v in kw.items() if n in BACKWARD_ARGS})
    torch.testing.assert_close(auto, twin)


def test_capacity_keeps_the_highest_probs_per_expert():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])
    routing_map = torch.tensor([[True, False]] * 4)
    kept_probs, kept = apply_capacity(probs * routing_map, routing_map, 1.0)  # cap = ceil(4/2) = 2
    assert kept.tolist() == [[True, False], [True, False], [False, False], [False, False]]
    assert kept_probs[2:].eq(0).all()


def test_capacity_ties_keep_the_lower_token_and_stay_differentiable():
    probs = torch.full((4, 2), 0.5, requires_grad=True)
    routing_map = torch.tensor([[True, False], [True, True], [True, False], [True, True]])
    kept_probs, kept = apply_capacity(probs, routing_map, 1.0)  # 6 assignments -> cap 3
    assert kept[:, 0].tolist() == [True, True, True, False]
    assert kept[:, 1].tolist() == [False, True, False, True]
    kept_probs.sum().backward()
    assert torch.equal(probs.grad, kept.float())


def test_topk_route_capacity_factor_is_dropless_when_large():
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(5))
    p1, m1 = topk_route(logits, 2)
    p2, m2 = topk_route(logits, 2, capacity_factor=4.0)
    assert torch.equal(m1, m2) and torch.equal(p1, p2)
    _, m3 = topk_route(logits, 2, capacity_factor=0.5)
    assert (m3.sum(0) <= math.ceil(16 * 2 * 0.5 / 4)).all()


@pytest.mark.parametrize("args,kw,err,match", [
    ((torch.randn(4, 8), 9), {}, ValueError, "top_k"),
    ((torch.randn(4, 8), 2), dict(score_function="relu"), ValueError, "score_function"),
    ((torch.randn(4, 8), 2), dict(score_function="sigmoid", pre_softmax=True), ValueError, "pre_softmax"),
    ((torch.randn(4, 8), 2), dict(num_groups=3, group_topk=1), ValueError, "num_groups"),
    ((torch.randn(4, 8), 2), dict(num_groups=4), ValueError, "both"),
    ((torch.randn(4, 8), 3), dict(num_groups=4, group_topk=2), ValueError, "multiple"),
    ((torch.randn(4, 8), 2), dict(expert_bias=torch.zeros(7)), ValueError, "expert_bias"),
    ((torch.randn(4, 8, 2), 2), {}, ValueError, "2-D"),
    ((torch.zeros(4, 8, dtype=torch.int32), 2), {}, TypeError, "floating"),
    ((torch.randn(4, 8), 2), dict(capacity_factor=0.0), ValueError, "capacity_factor"),
    ((torch.randn(4, 8), 2), dict(group_score_topk=2), ValueError, "group_score_topk"),
    ((torch.randn(4, 8), 2), dict(num_groups=4, group_topk=2, group_score_topk=3), ValueError, "group_score_topk"),
    ((torch.randn(4, 8), 2), dict(normalize_topk_probs=False), ValueError, "pre_softmax"),
    ((torch.randn(4, 8), 2), dict(normalize_topk_probs=1), TypeError, "normalize_topk_probs"),
], ids=["top_k", "score_fn", "pre_softmax", "groups_divide", "groups_both", "groups_multiple",
        "bias_shape", "rank", "dtype", "capacity", "score_topk_no_groups", "score_topk_too_big",
        "unnormalised_softmax", "normalize_type"])
def test_bad_arguments_raise_clear_errors(args, kw, err, match):
    with pytest.raises(err, match=match):
        topk_route(*args, **kw)


# ------------------------------------------------------------------ kernels == reference, on GPU

GPU_CASES = [
    # (T, E, K, kwargs)
    (1, 8, 1, dict()),
    (33, 8, 2, dict()),
    (100, 64, 6, dict(pre_softmax=True)),
    (257, 128, 8, dict(score_function="sigmoid", expert_bias=True)),
    (512, 256, 8, dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5,
                       expert_bias=True)),  # DeepSeek-V3
    (300, 60, 4, dict(score_function="sqrtsoftplus")),
    (64, 160, 6, dict(num_groups=8, group_topk=3)),
    (17, 4096, 8, dict(pre_softmax=True)),
    (512, 256, 8, dict(score_function="sigmoid", num_groups=8, group_topk=4, group_score_topk=2,
                       normalize_topk_probs=False, scaling_factor=2.5, expert_bias=True)),  # HF DeepSeek-V3
    (100, 64, 6, dict(pre_softmax=True, normalize_topk_probs=True)),  # Qwen, norm_topk_prob
    (77, 64, 6, dict(num_groups=8, group_topk=4, group_score_topk=3)),
]


def _materialise(kw, e, device):
    kw = dict(kw)
    if kw.get("expert_bias") is True:
        kw["expert_bias"] = torch.randn(e, device=device) * 0.1
    return kw


def _compare_on_gpu(logits, k, kw):
    from qmoe.kernels import router as kernels
    p_ref, m_ref = reference.topk_route(logits, k, **kw)
    p_k, m_k = kernels.topk_route(logits, k, **kw)
    assert (m_k.sum(1) == k).all()
    assert torch.equal(m_k, m_ref)
    torch.testing.assert_close(p_k, p_ref, rtol=1e-5, atol=1e-7, equal_nan=True)
    g = torch.randn_like(p_ref)
    bkw = {n: v for n, v in kw.items() if n in BACKWARD_ARGS}
    d_ref = reference.topk_route_backward(g, logits, m_ref, k, **bkw)
    d_k = kernels.topk_route_backward(g, logits, m_ref, k, **bkw)
    # the logits' gradient is stored in the logits' dtype: fp32 sums in another order may round a
    # bf16 value to its neighbour, so one unit in the last place (2**-7 relative at most) is allowed there
    rtol = 2.0 ** -7 if logits.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(d_k, d_ref, rtol=rtol, atol=1e-6, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k,kw", GPU_CASES, ids=[f"T{c[0]}-E{c[1]}-K{c[2]}" for c in GPU_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(t, e, k, kw, dtype):
    torch.manual_seed(t + e)
    logits = (torch.randn(t, e, device="cuda") * 2).to(dtype)
    _compare_on_gpu(logits, k, _materialise(kw, e, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k,kw", GPU_CASES, ids=[f"T{c[0]}-E{c[1]}-K{c[2]}" for c in GPU_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_with_non_finite_logits(t, e, k, kw, dtype):
    # rows of NaN, +inf and -inf, and 5 % of the other entries non-finite
    logits = sprinkle_non_finite(torch.randn(t, e, generator=torch.Generator().manual_seed(t)) * 2, 0.05, seed=t)
    _compare_on_gpu(logits.to("cuda", dtype), k, _materialise(kw, e, "cuda"))


@pytest.mark.gpu
@given(router_cases())
def test_kernel_equals_reference_hypothesis(case):
    logits, k, kw = case
    kw = {n: (v.cuda() if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}
    _compare_on_gpu(logits.cuda(), k, kw)


@pytest.mark.gpu
def test_op_gradients_match_reference():
    torch.manual_seed(0)
    logits = torch.randn(512, 256, device="cuda", requires_grad=True)
    kw = dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5)
    probs, _ = topk_route(logits, 8, **kw)
    g = torch.randn_like(probs)
    (got,) = torch.autograd.grad(probs, logits, g)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref_probs, _ = reference.topk_route(ref_logits, 8, **kw)
    (want,) = torch.autograd.grad(ref_probs, ref_logits, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


OP_CASES = [
    (16384, 128, 8, dict()),  # Qwen3
    (1000, 64, 6, dict(pre_softmax=True, scaling_factor=2.0)),
    (777, 160, 6, dict(score_function="sqrtsoftplus", num_groups=8, group_topk=3, expert_bias=True)),
    (999, 256, 6, dict(score_function="sigmoid", num_groups=8, group_topk=4, group_score_topk=2,
                       normalize_topk_probs=False, expert_bias=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k,kw", OP_CASES, ids=[f"T{c[0]}-E{c[1]}-K{c[2]}" for c in OP_CASES])
def test_op_forward_and_backward_match_reference(t, e, k, kw):
    # Through the autograd Function, which calls the kernels' unchecked launchers with the
    # arguments topk_route validated once.
    torch.manual_seed(t + k)
    kw = _materialise(kw, e, "cuda")
    logits = (torch.randn(t, e, device="cuda") * 2).requires_grad_(True)
    ref_logits = logits.detach().clone().requires_grad_(True)
    probs, routing_map = topk_route(logits, k, **kw)
    ref_probs, ref_map = reference.topk_route(ref_logits, k, **kw)
    assert torch.equal(routing_map, ref_map) and routing_map.dtype == torch.bool
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-7)
    g = torch.randn_like(probs)
    (got,) = torch.autograd.grad(probs, logits, g)
    (want,) = torch.autograd.grad(ref_probs, ref_logits, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- router logits

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_router_logits_match_autograd_of_the_fp32_matmul(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 24, generator=g).to(dtype)
    w = torch.randn(6, 24, generator=g)
    dlogits = torch.randn(37, 6, generator=g)
    got_x, got_w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want_x, want_w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    got = ops.router_logits(got_x, got_w)
    want = want_x.float() @ want_w.t()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    (got * dlogits).sum().backward()
    (want * dlogits).sum().backward()
    assert got_x.grad.dtype == dtype and torch.equal(got_x.grad, want_x.grad)
    torch.testing.assert_close(got_w.grad, want_w.grad, rtol=1e-6, atol=1e-6)


def test_router_logits_keep_no_fp32_copy_of_a_bf16_input():
    x = torch.randn(16, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        ops.router_logits(x, w)
    assert sorted(saved, key=str) == sorted([(torch.bfloat16, (16, 8)), (torch.float32, (4, 8))], key=str)


def test_router_logits_bias_adds_to_the_logits_and_gets_its_gradient():
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    g = torch.randn(6, 4)
    got = ops.router_logits(x, w, b)
    want = x @ w.t() + b
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(got, (x, w, b), g)
    ref = torch.autograd.grad(want, (x, w, b), g)
    for a, r in zip(grads, ref):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="bias"):
        ops.router_logits(x, w, torch.zeros(5))


def test_router_logits_reject_mismatched_shapes():
    with pytest.raises(ValueError, match=r"router_logits needs x \[T, H\] and weight \[E, H\]"):
        ops.router_logits(torch.zeros(3, 5), torch.zeros(2, 4))
