"""moe_permute / moe_unpermute: invariants on CPU, kernels == reference and graph safety on GPU."""
import pytest
import torch
from hypothesis import given, strategies as st

from qmoe.ops import moe_permute, moe_unpermute, topk_route
from qmoe.reference import permute as reference


def _routing(t, e, k, seed, empty=()):
    """A routing map with exactly k experts per token, never the experts in `empty`."""
    g = torch.Generator().manual_seed(seed)
    allowed = [i for i in range(e) if i not in empty]
    routing_map = torch.zeros(t, e, dtype=torch.bool)
    for i in range(t):
        pick = torch.randperm(len(allowed), generator=g)[:k]
        routing_map[i, [allowed[j] for j in pick]] = True
    probs = torch.rand(t, e, generator=g) * routing_map
    return routing_map, probs


def _groups(out, split_sizes):
    starts = torch.cumsum(split_sizes, 0) - split_sizes
    return [out[s:s + n] for s, n in zip(starts.tolist(), split_sizes.tolist())]


# ------------------------------------------------------------------ the contract, on CPU


@pytest.mark.parametrize("align", [1, 4, 16])
def test_groups_hold_their_tokens_in_order_then_zero_padding(align):
    t, e, k = 11, 5, 2
    routing_map, probs = _routing(t, e, k, seed=align, empty=(3,))
    x = torch.arange(t, dtype=torch.float32).unsqueeze(1).repeat(1, 3) + 1  # row t holds t + 1
    out, out_probs, row_id_map, split_sizes = moe_permute(x, routing_map, probs, align, top_k=k)
    assert out.shape == (t * k + e * (align - 1), 3)
    assert split_sizes.dtype == torch.int32 and (split_sizes % align == 0).all()
    assert split_sizes[3] == 0
    for expert, (group, group_probs) in enumerate(zip(_groups(out, split_sizes), _groups(out_probs, split_sizes))):
        tokens = routing_map[:, expert].nonzero().flatten()
        n = len(tokens)
        assert torch.equal(group[:n, 0], tokens.float() + 1)          # token order kept
        assert torch.equal(group_probs[:n], probs[tokens, expert])
        assert (group[n:] == 0).all() and (group_probs[n:] == 0).all()  # padding rows are zero
    assert (out[split_sizes.sum():] == 0).all()                        # and so is the tail


def test_unpermute_of_permute_is_x_times_the_prob_sum():
    t, e, k = 9, 6, 3
    routing_map, probs = _routing(t, e, k, seed=0)
    x = torch.randn(t, 7)
    out, _, row_id_map, _ = moe_permute(x, routing_map, probs, 8, top_k=k)
    torch.testing.assert_close(moe_unpermute(out, row_id_map, probs), x * probs.sum(1, keepdim=True))
    torch.testing.assert_close(moe_unpermute(out, row_id_map), x * k)
    y = moe_unpermute(out, row_id_map, probs, restore_shape=(3, 3, 7))
    assert y.shape == (3, 3, 7)


def test_every_expert_empty_but_one_and_tokens_without_experts():
    t, e = 6, 4
    routing_map = torch.zeros(t, e, dtype=torch.bool)
    routing_map[::2, 2] = True                      # odd tokens go nowhere (dropped by capacity)
    x = torch.randn(t, 5)
    out, _, row_id_map, split_sizes = moe_permute(x, routing_map, None, 4, top_k=2)
    assert split_sizes.tolist() == [0, 0, 4, 0]
    assert torch.equal(out[:3], x[::2]) and (out[3:] == 0).all()
    y = moe_unpermute(out, row_id_map)
    assert torch.equal(y[::2], x[::2]) and (y[1::2] == 0).all()


def test_quantized_rows_carry_their_scales():
    t, e, k = 8, 4, 2
    routing_map, _ = _routing(t, e, k, seed=1)
    data = torch.randn(t, 256).to(torch.float8_e4m3fn)                # FP8 1x128 rows
    scales = torch.rand(t, 2) + 0.5                                   # fp32 per-block scales
    out, _, row_id_map, split_sizes, out_scales = moe_permute(data, routing_map, None, 16, top_k=k,
                                                              row_scales=scales)
    assert out.dtype == torch.float8_e4m3fn and out_scales.dtype == torch.float32
    rows = row_id_map.rows.long()
    for i in range(t):
        for r in rows[i]:
            assert torch.equal(out[r].view(torch.uint8), data[i].view(torch.uint8))
            assert torch.equal(out_scales[r], scales[i])
    used = torch.zeros(len(out), dtype=torch.bool)
    used[rows.flatten()] = True
    assert (out[~used].view(torch.uint8) == 0).all() and (out_scales[~used] == 0).all()
    # MXFP8: E8M0 scales are bytes too
    e8m0 = (torch.rand(t, 8) * 4 + 0.25).to(torch.float8_e8m0fnu)
    _, _, row_id_map, _, out_e8m0 = moe_permute(data, routing_map, None, 32, top_k=k, row_scales=e8m0)
    assert out_e8m0.dtype == torch.float8_e8m0fnu
    for slot in range(k):
        assert torch.equal(out_e8m0[row_id_map.rows[:, slot].long()].view(torch.uint8), e8m0.view(torch.uint8))


@st.composite
def permute_cases(draw):
    e = draw(st.integers(1, 9))
    k = draw(st.integers(1, e))
    t = draw(st.integers(0, 12))
    align = draw(st.sampled_from([1, 2, 3, 16, 32]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 999)))
    # each token picks up to k experts (capacity may have dropped some); some experts empty
    counts = torch.randint(0, k + 1, (t,), generator=g)
    routing_map = torch.zeros(t, e, dtype=torch.bool)
    for i in range(t):
        routing_map[i, torch.randperm(e, generator=g)[: counts[i]]] = True
    if e > 1 and draw(st.booleans()):
        routing_map[:, draw(st.integers(0, e - 1))] = False
    probs = torch.rand(t, e, generator=g) * routing_map
    return routing_map, probs, k, align


@given(permute_cases())
def test_reference_invariants(case):
    routing_map, probs, k, align = case
    t, e = routing_map.shape
    x = torch.randn(t, 3)
    out, out_probs, row_id_map, split_sizes = reference.moe_permute(x, routing_map, probs, align, top_k=k)
    assert out.shape == (t * k + e * (align - 1), 3)
    counts = routing_map.sum(0)
    assert torch.equal(split_sizes, (counts + align - 1) // align * align)
    assert torch.equal(row_id_map.counts, counts.int())
    rows = row_id_map.rows[row_id_map.rows >= 0]
    assert len(torch.unique(rows)) == len(rows) == int(counts.sum())
    used = torch.zeros(len(out), dtype=torch.bool)
    used[rows.long()] = True
    assert (out[~used] == 0).all() and (out_probs[~used] == 0).all()
    torch.testing.assert_close(reference.moe_unpermute(out, row_id_map, probs), x * probs.sum(1, keepdim=True))


@pytest.mark.parametrize("which", ["x", "probs", "y", "merging_probs"])
def test_gradcheck_fp64_reference(which):
    t, e, k = 5, 4, 2
    routing_map, probs = _routing(t, e, k, seed=2)
    x = torch.randn(t, 3, dtype=torch.float64)
    probs = probs.double()
    row_id_map, _ = reference.permute_index(routing_map, k, 4)
    y = torch.randn(row_id_map.num_rows, 3, dtype=torch.float64)
    fns = {
        "x": (lambda v: reference.permute_rows(v, row_id_map), x),
        "probs": (lambda v: reference.permute_probs(v, row_id_map), probs),
        "y": (lambda v: reference.unpermute_rows(v, row_id_map, probs), y),
        "merging_probs": (lambda v: reference.unpermute_rows(y, row_id_map, v), probs),
    }
    fn, arg = fns[which]
    torch.autograd.gradcheck(fn, (arg.requires_grad_(True),))


def test_backward_twins_equal_autograd():
    t, e, k = 7, 5, 2
    routing_map, probs = _routing(t, e, k, seed=3)
    row_id_map, _ = reference.permute_index(routing_map, k, 2)
    g_out = torch.randn(row_id_map.num_rows, 4)
    x = torch.randn(t, 4, requires_grad=True)
    (gx,) = torch.autograd.grad(reference.permute_rows(x, row_id_map), x, g_out)
    torch.testing.assert_close(reference.permute_rows_backward(g_out, row_id_map), gx)
    p = probs.clone().requires_grad_(True)
    g_p = torch.randn(row_id_map.num_rows)
    (gp,) = torch.autograd.grad(reference.permute_probs(p, row_id_map), p, g_p)
    torch.testing.assert_close(reference.permute_probs_backward(g_p, row_id_map), gp)


@pytest.mark.parametrize("call,err,match", [
    (lambda: moe_permute(torch.randn(4, 2, 2), torch.ones(4, 3, dtype=torch.bool)), ValueError, "2-D"),
    (lambda: moe_permute(torch.randn(4, 2), torch.ones(4, 3)), TypeError, "bool"),
    (lambda: moe_permute(torch.randn(5, 2), torch.ones(4, 3, dtype=torch.bool)), ValueError, r"\[4, N\]"),
    (lambda: moe_permute(torch.randn(4, 2), torch.ones(4, 3, dtype=torch.bool), align_size=0), ValueError,
     "align_size"),
    (lambda: moe_permute(torch.randn(4, 2), torch.ones(4, 3, dtype=torch.bool), top_k=4), ValueError, "top_k"),
    (lambda: moe_permute(torch.randn(4, 2), torch.ones(4, 3, dtype=torch.bool), torch.ones(4, 2)), ValueError, "probs"),
    (lambda: moe_permute(torch.randn(4, 2), torch.ones(4, 3, dtype=torch.bool), top_k=3,
                         row_scales=torch.ones(3, 1)), ValueError, "row_scales"),
    (lambda: moe_unpermute(torch.randn(4, 2), (1, 2)), TypeError, "RowIdMap"),
], ids=["x_rank", "map_dtype", "x_rows", "align", "top_k", "probs_shape", "scales_rows", "row_id_map"])
def test_bad_arguments_raise_clear_errors(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_unpermute_checks_rows_and_restore_shape():
    routing_map, probs = _routing(4, 3, 1, seed=4)
    out, _, row_id_map, _ = moe_permute(torch.randn(4, 2), routing_map, probs, top_k=1)
    with pytest.raises(ValueError, match="y must be"):
        moe_unpermute(out[:-1], row_id_map)
    with pytest.raises(ValueError, match="restore_shape"):
        moe_unpermute(out, row_id_map, restore_shape=(3, 2))
    with pytest.raises(ValueError, match="merging_probs"):
        moe_unpermute(out, row_id_map, probs[:, :2])


# ------------------------------------------------------------------ kernels == reference, on GPU

GPU_CASES = [  # (T, E, K, H, align)
    (1, 4, 1, 8, 1), (37, 8, 2, 96, 16), (300, 64, 6, 130, 32), (1024, 128, 8, 2048, 128),
    (2048, 256, 8, 7168, 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k,h,align", GPU_CASES,
                         ids=[f"T{c[0]}-E{c[1]}-K{c[2]}-H{c[3]}-A{c[4]}" for c in GPU_CASES])
def test_kernels_equal_reference(t, e, k, h, align):
    from qmoe.kernels import permute as kernels
    torch.manual_seed(t)
    probs, routing_map = topk_route(torch.randn(t, e, device="cuda"), k)
    routing_map[: t // 3, 0] = False  # some tokens lost a copy (as after capacity)
    probs = probs * routing_map
    ref_map, ref_split = reference.permute_index(routing_map, k, align)
    got_map, got_split = kernels.permute_index(routing_map, k, align)
    assert torch.equal(got_split, ref_split)
    for name in ("rows", "experts", "counts", "offsets"):
        assert torch.equal(getattr(got_map, name), getattr(ref_map, name)), name
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(kernels.permute_rows(x, ref_map), reference.permute_rows(x, ref_map))
    x8 = x.to(torch.float8_e4m3fn)
    assert torch.equal(kernels.permute_rows(x8, ref_map).view(torch.uint8),
                       reference.permute_rows(x8, ref_map).view(torch.uint8))
    assert torch.equal(kernels.permute_probs(probs, ref_map), reference.permute_probs(probs, ref_map))
    y = torch.randn(ref_map.num_rows, h, device="cuda", dtype=torch.bfloat16)
    for merging in (None, probs):
        torch.testing.assert_close(kernels.unpermute_rows(y, ref_map, merging),
                                   reference.unpermute_rows(y, ref_map, merging))
        g = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        gy_k, gp_k = kernels.unpermute_rows_backward(g, y, ref_map, merging)
        gy_r, gp_r = reference.unpermute_rows_backward(g, y, ref_map, merging)
        assert torch.equal(gy_k, gy_r)
        if merging is not None:
            torch.testing.assert_close(gp_k, gp_r, rtol=1e-4, atol=1e-4)
    g_out = torch.randn(ref_map.num_rows, device="cuda")
    assert torch.equal(kernels.permute_probs_backward(g_out, ref_map),
                       reference.permute_probs_backward(g_out, ref_map))


def _pipeline(logits, x, bias, k, align):
    probs, routing_map = topk_route(logits, k, score_function="sigmoid", num_groups=8, group_topk=4,
                                    expert_bias=bias)
    out, out_probs, row_id_map, split_sizes = moe_permute(x, routing_map, probs, align, top_k=k)
    y = moe_unpermute(out * 2.0, row_id_map, probs)
    return y, split_sizes


@pytest.mark.gpu
def test_pipeline_has_no_host_sync_and_replays_in_a_cuda_graph():
    torch.manual_seed(0)
    t, e, k, h, align = 512, 64, 8, 256, 16
    logits = torch.randn(t, e, device="cuda", requires_grad=True)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.zeros(e, device="cuda")

    def step():
        y, split_sizes = _pipeline(logits, x, bias, k, align)
        grads = torch.autograd.grad(y.float().square().sum(), [logits, x])
        return y, split_sizes, grads

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_y, g_split, g_grads = step()
    with torch.no_grad():
        logits.copy_(torch.randn(t, e, device="cuda"))  # new routing, same buffers
    graph.replay()
    y, split_sizes, grads = step()
    assert torch.equal(g_split, split_sizes)
    torch.testing.assert_close(g_y, y)
    for a, b in zip(g_grads, grads):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
def test_op_gradients_match_reference():
    torch.manual_seed(1)
    t, e, k, h = 256, 32, 4, 64
    probs, routing_map = topk_route(torch.randn(t, e, device="cuda"), k)
    x = torch.randn(t, h, device="cuda")
    results = []
    for backend in ("kernels", "reference"):
        xx, pp = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        if backend == "kernels":
            out, out_probs, row_id_map, _ = moe_permute(xx, routing_map, pp, 8, top_k=k)
            y = moe_unpermute(out * out_probs[:, None], row_id_map, pp)
        else:
            out, out_probs, row_id_map, _ = reference.moe_permute(xx, routing_map, pp, 8, top_k=k)
            y = reference.moe_unpermute(out * out_probs[:, None], row_id_map, pp)
        y.square().sum().backward()
        results.append((y, xx.grad, pp.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
