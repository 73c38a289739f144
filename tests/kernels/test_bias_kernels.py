"""The grouped-bias kernels against the reference on the GPU, at MoE sizes.

The forward computes the reference's fp32 operations in its order (bias * scale rounded, then
+ y, launched without FMA contraction) and rounds once to y's dtype: equal bit for bit. The
backward sums in fp32 in another order (a tree over each 64-row chunk of a group, then the
chunks in order): rtol 1e-5 plus 1e-6 of the sum of the terms' magnitudes (sum_i |dy_ij s_i|
per group and column for dbias, sum_j |dy_ij bias_gj| per row for dscales). It has no atomics,
so it is bit for bit deterministic: two runs, and a CUDA-graph replay on new data and new split
sizes against eager on the same, give the same dbias and dscales.
"""
from __future__ import annotations

import pytest
import torch

from qmoe.contracts.carriers import row_groups
from qmoe.kernels import bias as kernels
from qmoe.reference import bias as reference

DEV = "cuda"


def _case(sizes, tail, n, dtype, with_scales, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = sum(sizes) + tail
    y = torch.randn(r, n, generator=gen).to(DEV, dtype)
    bias = torch.randn(len(sizes), n, generator=gen).to(DEV, dtype)
    scales = torch.rand(r, generator=gen).to(DEV) if with_scales else None
    offsets = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int64, device=DEV)
    return y, bias, offsets, scales


# jagged with an empty group and rows past the last group; DeepSeek-V3's FC2 (N = 7168); one
# group holding every row with N not a multiple of the 128-column tiles
SIZES = [([700, 0, 1, 4095, 2048, 333], 100, 2048), ([256] * 32, 0, 7168), ([0, 0, 8191, 0], 5, 1000)]
SIZE_IDS = ["jagged", "dsv3-fc2", "one-group"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_scales", [True, False])
@pytest.mark.parametrize("sizes, tail, n", SIZES, ids=SIZE_IDS)
def test_forward_equals_reference_bit_for_bit(sizes, tail, n, dtype, with_scales):
    y, bias, offsets, scales = _case(sizes, tail, n, dtype, with_scales)
    got = kernels.grouped_bias_forward(y, bias, offsets, scales)
    assert torch.equal(got, reference.grouped_bias_forward(y, bias, offsets, scales))
    assert torch.equal(got[sum(sizes):], y[sum(sizes):])


def _assert_backward_close(got, want, dy, bias, offsets, scales):
    (got_b, got_s), (want_b, want_s) = got, want
    groups = row_groups(offsets, dy.shape[0])
    e, n = bias.shape
    w = dy.float() if scales is None else dy.float() * scales[:, None]
    scale = torch.zeros(e + 1, n, device=DEV).index_add_(0, groups, w.abs())[:e]
    assert ((got_b - want_b).abs() <= 1e-5 * want_b.abs() + 1e-6 * scale).all()
    for g in range(e):
        if int(offsets[g + 1]) == int(offsets[g]):
            assert torch.equal(got_b[g], torch.zeros(n, device=DEV)), f"empty group {g}"
    if want_s is None:
        assert got_s is None
        return
    padded = torch.cat((bias.float(), bias.new_zeros(1, n, dtype=torch.float32)))
    row_scale = (dy.float() * padded[groups]).abs().sum(1)
    assert ((got_s - want_s).abs() <= 1e-5 * want_s.abs() + 1e-6 * row_scale).all()
    tail = dy.shape[0] - int(offsets[-1])
    assert torch.equal(got_s[int(offsets[-1]):], torch.zeros(tail, device=DEV))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_scales", [True, False])
@pytest.mark.parametrize("sizes, tail, n", SIZES, ids=SIZE_IDS)
def test_backward_matches_reference(sizes, tail, n, dtype, with_scales):
    dy, bias, offsets, scales = _case(sizes, tail, n, dtype, with_scales, seed=1)
    _assert_backward_close(kernels.grouped_bias_backward(dy, bias, offsets, scales),
                           reference.grouped_bias_backward(dy, bias, offsets, scales), dy, bias, offsets, scales)


def _other_split(sizes, seed):
    """As many rows in as many groups, cut elsewhere, the first group empty."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, sum(sizes) + 1, (len(sizes) - 1,), generator=gen).sort().values.tolist()
    new = [b - a for a, b in zip([0] + cuts, cuts + [sum(sizes)])]
    new[1] += new[0]
    return [0] + new[1:]


@pytest.mark.gpu
@pytest.mark.parametrize("sizes, tail, n", SIZES, ids=SIZE_IDS)
def test_backward_is_bit_identical_across_runs_and_in_graph_replay(sizes, tail, n):
    dy, bias, offsets, scales = _case(sizes, tail, n, torch.bfloat16, True, seed=2)

    def step():
        return kernels.grouped_bias_backward(dy, bias, offsets, scales)

    first = step()  # compiles before the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for _ in range(3):
        for a, b in zip(step(), first):
            assert torch.equal(a, b)
    for a, b in zip(second, first):
        assert torch.equal(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    # new data and other split sizes, same shapes: the grids depend on the shapes only
    new_dy, _, new_offsets, new_scales = _case(_other_split(sizes, seed=3), tail, n, torch.bfloat16, True, seed=3)
    dy.copy_(new_dy)
    offsets.copy_(new_offsets)
    scales.copy_(new_scales)
    graph.replay()
    eager = step()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
    _assert_backward_close(captured, reference.grouped_bias_backward(dy, bias, offsets, scales),
                           dy, bias, offsets, scales)
