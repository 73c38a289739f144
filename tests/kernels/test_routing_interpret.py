"""Routing kernels == their references on CPU, through Triton's interpreter, at tiny sizes.

`TRITON_INTERPRET` must be set before Triton decorates the kernels, so the one test that runs
in the normal session starts a fresh interpreter with TRITON_INTERPRET=1 and QMOE_BACKEND=triton
(kernels forced on CPU tensors) on this same file; there the other tests run and the launcher
test skips. In the normal session those tests skip. The GPU proves the same equalities at real
sizes (tests/ops, `-m gpu`); this catches kernel logic errors without a GPU.
"""
import warnings

import pytest
import torch
from hypothesis import given

from tests.kernels.interpret import INTERPRETING, inside, launcher, run_under_interpreter  # noqa: F401
from tests.ops.router_inputs import router_cases, sprinkle_non_finite


@launcher
def test_routing_kernels_under_the_interpreter():
    proc = run_under_interpreter(__file__)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


@pytest.fixture(autouse=True)
def _quiet_numpy():
    # Padded rows of a tile are all -inf in the interpreter's numpy too; their NaNs are masked.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


ROUTER_CASES = [
    (5, 8, 2, dict()),
    (3, 8, 3, dict(pre_softmax=True, scaling_factor=2.0)),
    (6, 8, 2, dict(score_function="sigmoid", num_groups=4, group_topk=2, bias=True)),
    (4, 12, 4, dict(score_function="sqrtsoftplus", num_groups=3, group_topk=2)),
    (5, 6, 1, dict(score_function="sigmoid", bias=True)),
    (6, 8, 3, dict(score_function="sigmoid", num_groups=4, group_topk=2, group_score_topk=2, bias=True,
                   normalize_topk_probs=False, scaling_factor=2.5)),
    (5, 8, 3, dict(pre_softmax=True, normalize_topk_probs=True)),
    (4, 12, 1, dict(score_function="sqrtsoftplus", normalize_topk_probs=True)),
]


@inside
@pytest.mark.parametrize("t,e,k,kw", ROUTER_CASES, ids=[str(i) for i in range(len(ROUTER_CASES))])
@pytest.mark.parametrize("logits_kind", ["random", "ties", "inf_column", "non_finite"])
def test_router(t, e, k, kw, logits_kind):
    torch.manual_seed(t * e + k)
    kw = dict(kw)
    if kw.pop("bias", False):
        kw["expert_bias"] = torch.randn(e) * 0.3
    logits = torch.randn(t, e) * 2
    if logits_kind == "ties":
        # non-negative: sigmoid(x) + sigmoid(-x) == 1 would make group scores tie only up to
        # rounding, where kernel and reference may round apart
        logits = logits.abs().round()
    elif logits_kind == "inf_column":
        logits[:, 1] = float("-inf")
    elif logits_kind == "non_finite":
        logits = sprinkle_non_finite(logits, 0.3, seed=t + e)
    _compare_router(logits, k, kw)


@inside
@given(router_cases())
def test_router_drawn_cases(case):
    logits, k, kw = case
    _compare_router(logits, k, kw)


def _compare_router(logits, k, kw):
    """Kernel == reference through the op, forward and backward: the same routing map (exactly
    k experts per token), probs and gradients within rounding, NaN in the same places."""
    from qmoe.ops import topk_route
    from qmoe.reference import router as reference
    x = logits.clone().requires_grad_(True)
    probs, routing_map = topk_route(x, k, **kw)
    ref_x = logits.clone().requires_grad_(True)
    ref_probs, ref_map = reference.topk_route(ref_x, k, **kw)
    assert (routing_map.sum(1) == k).all()
    assert torch.equal(routing_map, ref_map)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-7, equal_nan=True)
    g = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(probs, x, g)
    (ref_grad,) = torch.autograd.grad(ref_probs, ref_x, g)
    # a bf16 gradient may round to its neighbour when fp32 sums run in another order
    rtol = 2.0 ** -7 if logits.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=1e-6, equal_nan=True)


@inside
@pytest.mark.parametrize("t,e,seq", [(8, 4, 4), (6, 5, 6), (70, 300, 35)])
def test_aux_losses(t, e, seq):
    from qmoe.ops import moe_aux_loss, seq_aux_loss, update_expert_bias, z_loss
    from qmoe.reference import aux_loss as reference
    torch.manual_seed(t + e)
    routing_map = torch.rand(t, e) < 0.4
    counts = routing_map.sum(0)
    for dtype in (torch.float32, torch.bfloat16):
        probs = torch.rand(t, e).to(dtype).requires_grad_(True)
        logits = (torch.randn(t, e) * 3).to(dtype).requires_grad_(True)
        cases = [
            (lambda p, l: moe_aux_loss(p, counts, t, e, 2, 0.1),
             lambda p, l: reference.moe_aux_loss(p, counts, t, e, 2, 0.1)),
            (lambda p, l: moe_aux_loss(p, counts, torch.tensor(t), e, 2, 0.1),
             lambda p, l: reference.moe_aux_loss(p, counts, torch.tensor(t), e, 2, 0.1)),
            (lambda p, l: seq_aux_loss(p, routing_map, seq, 2, 0.1),
             lambda p, l: reference.seq_aux_loss(p, routing_map, seq, 2, 0.1)),
            (lambda p, l: z_loss(l, 1e-2), lambda p, l: reference.z_loss(l, 1e-2)),
        ]
        for op, ref in cases:
            got, want = op(probs, logits), ref(probs, logits)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
            g1 = torch.autograd.grad(got, [probs, logits], allow_unused=True, materialize_grads=True)
            g2 = torch.autograd.grad(want, [probs, logits], allow_unused=True, materialize_grads=True)
            for a, b in zip(g1, g2):
                torch.testing.assert_close(a, b)
    bias, ref_bias = torch.randn(e), None
    ref_bias = bias.clone()
    update_expert_bias(bias, counts, 1e-3)
    reference.update_expert_bias(ref_bias, counts, 1e-3)
    assert torch.equal(bias, ref_bias)


@inside
@pytest.mark.parametrize("t,e,seq", [(70, 300, 35), (512, 32, 512), (1024, 32, 256)])
def test_loss_kernels_leave_their_counters_zeroed(monkeypatch, t, e, seq):
    # Launches share arrival counters (`counters.tickets`), so each kernel must reset every
    # counter it draws from, the seq loss's per-pair ones too ((512, 32, 512) and (1024, 32, 256)
    # split each sequence into row chunks finished by the last to arrive).
    from qmoe.kernels import aux_loss as kernels
    from qmoe.reference import aux_loss as reference
    shared = torch.zeros(4096, dtype=torch.int32)
    monkeypatch.setattr(kernels, "tickets", lambda n, device: shared)
    torch.manual_seed(t + e)
    probs = torch.softmax(torch.randn(t, e), -1)
    routing_map = torch.rand(t, e) < 0.3
    counts = routing_map.sum(0)
    assert kernels._seq_geometry(t // seq, seq, e, probs.device)[0] > 1 or t == 70
    cases = [(kernels.moe_aux_loss, reference.moe_aux_loss, (probs, counts, t, e, 2, 0.1)),
             (kernels.seq_aux_loss, reference.seq_aux_loss, (probs, routing_map, seq, 2, 0.1)),
             (kernels.z_loss, reference.z_loss, (probs * 5, 1e-2))]
    for kernel, ref, args in cases:
        for _ in range(2):  # the second launch finds the counters the first left
            torch.testing.assert_close(kernel(*args), ref(*args), rtol=1e-5, atol=0)
            assert not shared.any(), f"{kernel.__name__} left counters at {shared.nonzero().flatten().tolist()}"


PERMUTE_CASES = [(5, 4, 2, 1, 8), (9, 8, 2, 4, 33), (12, 6, 3, 8, 5), (0, 4, 1, 2, 3), (4, 130, 2, 2, 4)]


@inside
@pytest.mark.parametrize("t,e,k,align,h", PERMUTE_CASES, ids=[str(c) for c in PERMUTE_CASES])
def test_permute(t, e, k, align, h):
    from qmoe.kernels import permute as kernels
    from qmoe.ops import moe_permute, moe_unpermute
    from qmoe.reference import permute as reference
    torch.manual_seed(t * 10 + e)
    routing_map = torch.zeros(t, e, dtype=torch.bool)
    for i in range(t):  # up to k experts a token, expert 0 always empty
        routing_map[i, 1 + torch.randperm(e - 1)[: int(torch.randint(0, k + 1, ()))]] = True
    probs = torch.rand(t, e) * routing_map
    ref_map, ref_split = reference.permute_index(routing_map, k, align)
    got_map, got_split = kernels.permute_index(routing_map, k, align)
    assert torch.equal(got_split, ref_split)
    for name in ("rows", "experts", "counts", "offsets"):
        assert torch.equal(getattr(got_map, name), getattr(ref_map, name)), name

    x = torch.randn(t, h)
    scales = torch.rand(t, 2).to(torch.float8_e8m0fnu)
    xs, ps = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    out, out_probs, row_id_map, split, out_scales = moe_permute(xs, routing_map, ps, align, top_k=k,
                                                                row_scales=scales)
    rx, rp = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    r_out, r_probs, _, _, r_scales = reference.moe_permute(rx, routing_map, rp, align, top_k=k,
                                                           row_scales=scales)
    assert torch.equal(out, r_out) and torch.equal(out_probs, r_probs)
    assert torch.equal(out_scales.view(torch.uint8), r_scales.view(torch.uint8))
    x8 = x.to(torch.float8_e4m3fn)
    assert torch.equal(kernels.permute_rows(x8, ref_map).view(torch.uint8),
                       reference.permute_rows(x8, ref_map).view(torch.uint8))

    y = moe_unpermute(out * 1.5 + out_probs[:, None], row_id_map, ps)
    r_y = reference.moe_unpermute(r_out * 1.5 + r_probs[:, None], ref_map, rp)
    torch.testing.assert_close(y, r_y)
    g = torch.randn(t, h)
    got = torch.autograd.grad(y, [xs, ps], g)
    want = torch.autograd.grad(r_y, [rx, rp], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)

    # without merging probs the backward keeps no copy of the expert outputs, only their shape
    rows = out.detach().clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda v: saved.append(tuple(v.shape)) or v, lambda v: v):
        y2 = moe_unpermute(rows * 1.0, row_id_map)
    assert tuple(rows.shape) not in saved, saved
    r_rows = r_out.detach().clone().requires_grad_(True)
    r_y2 = reference.moe_unpermute(r_rows * 1.0, ref_map)
    torch.testing.assert_close(torch.autograd.grad(y2, rows, g)[0], torch.autograd.grad(r_y2, r_rows, g)[0])
