"""The grouped-bias kernels against the reference on the GPU, at MoE sizes.

The forward computes the reference's fp32 operations in its order (bias * scale rounded, then
+ y, launched without FMA contraction) and rounds once to y's dtype: equal bit for bit. The
backward sums in fp32 in another order (dbias with atomics per row block): rtol 1e-5 plus 1e-6 of
the sum of the terms' magnitudes (sum_i |dy_ij s_i| per group and column for dbias,
sum_j |dy_ij bias_gj| per row for dscales).
"""
from __future__ import annotations

import pytest
import torch

from qmoe.reference import bias as reference

kernels = pytest.importorskip("qmoe.kernels.bias")

DEV = "cuda"


def _case(sizes, tail, n, dtype, with_scales, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = sum(sizes) + tail
    y = torch.randn(r, n, generator=gen).to(DEV, dtype)
    bias = torch.randn(len(sizes), n, generator=gen).to(DEV, dtype)
    scales = torch.rand(r, generator=gen).to(DEV) if with_scales else None
    offsets = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int64, device=DEV)
    return y, bias, offsets, scales


SIZES = [([700, 0, 1, 4095, 2048, 333], 100, 2048), ([256] * 32, 0, 7168)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_scales", [True, False])
@pytest.mark.parametrize("sizes, tail, n", SIZES, ids=["jagged", "dsv3-fc2"])
def test_forward_equals_reference_bit_for_bit(sizes, tail, n, dtype, with_scales):
    y, bias, offsets, scales = _case(sizes, tail, n, dtype, with_scales)
    got = kernels.grouped_bias_forward(y, bias, offsets, scales)
    assert torch.equal(got, reference.grouped_bias_forward(y, bias, offsets, scales))
    assert torch.equal(got[sum(sizes):], y[sum(sizes):])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes, tail, n", SIZES, ids=["jagged", "dsv3-fc2"])
def test_backward_matches_reference(sizes, tail, n, dtype):
    dy, bias, offsets, scales = _case(sizes, tail, n, dtype, True, seed=1)
    got_b, got_s = kernels.grouped_bias_backward(dy, bias, offsets, scales)
    want_b, want_s = reference.grouped_bias_backward(dy, bias, offsets, scales)
    scale = torch.zeros_like(want_b)
    for g in range(len(sizes)):
        a, b = int(offsets[g]), int(offsets[g + 1])
        scale[g] = (dy[a:b].float() * scales[a:b, None]).abs().sum(0)
    assert ((got_b - want_b).abs() <= 1e-5 * want_b.abs() + 1e-6 * scale).all()
    groups = reference.row_groups(offsets, dy.shape[0])
    padded = torch.cat((bias.float(), bias.new_zeros(1, n, dtype=torch.float32)))
    row_scale = (dy.float() * padded[groups]).abs().sum(1)
    assert ((got_s - want_s).abs() <= 1e-5 * want_s.abs() + 1e-6 * row_scale).all()
    assert torch.equal(got_s[sum(sizes):], torch.zeros(tail, device=DEV))
