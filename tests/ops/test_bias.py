"""Grouped (scaled) bias, `qmoe.reference.bias`: the formula, its gradients, odd groupings.

y[i] += bias[g(i)] * s[i];  dbias[g] = sum_{i in g} dy[i] * s[i];  dscales[i] = <dy[i], bias[g(i)]>.
The backward is checked against autograd of a plain per-group formula; the Triton kernel is
checked against this reference in tests/kernels/test_bias_interpret.py.
"""
import pytest
import torch
from hypothesis import given, strategies as st

from qmoe.dispatch import BIAS
from qmoe.contracts.carriers import row_groups
from qmoe.reference import bias as reference


def _offsets(sizes):
    return torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)


def _plain(y, bias, sizes, scales):
    """y + bias of each row's group (times its scale); rows past the groups unchanged."""
    rows, start = [], 0
    for g, m in enumerate(sizes):
        b = bias[g].float().expand(m, -1)
        rows.append(b * scales[start:start + m, None].float() if scales is not None else b)
        start += m
    rows.append(torch.zeros(y.shape[0] - start, y.shape[1]))
    return y.float() + torch.cat(rows)


CASES = [
    ("even", [4, 4, 4], 0, True),
    ("empty-groups", [0, 5, 0, 3, 0], 0, True),
    ("tail-rows", [2, 3], 4, True),
    ("no-scales", [3, 0, 6], 2, False),
    ("one-row-groups", [1, 1, 1, 1], 0, True),
    ("all-empty", [0, 0], 3, True),
]


@pytest.mark.parametrize("name, sizes, tail, with_scales", CASES, ids=[c[0] for c in CASES])
def test_forward_and_backward_match_plain_formula(name, sizes, tail, with_scales):
    gen = torch.Generator().manual_seed(len(sizes) + tail)
    r, n = sum(sizes) + tail, 7
    y, dy = torch.randn(r, n, generator=gen), torch.randn(r, n, generator=gen)
    bias = torch.randn(len(sizes), n, generator=gen)
    scales = torch.rand(r, generator=gen) if with_scales else None
    offsets = _offsets(sizes)

    out = reference.grouped_bias_forward(y, bias, offsets, scales)
    assert out.dtype == y.dtype
    assert torch.equal(out, _plain(y, bias, sizes, scales))
    assert torch.equal(out[sum(sizes):], y[sum(sizes):])  # rows past the groups take no bias

    b = bias.clone().requires_grad_(True)
    s = scales.clone().requires_grad_(True) if with_scales else None
    _plain(y, b, sizes, s).backward(dy)
    dbias, dscales = reference.grouped_bias_backward(dy, bias, offsets, scales)
    assert dbias.dtype == torch.float32 and dbias.shape == bias.shape
    torch.testing.assert_close(dbias, b.grad, rtol=1e-6, atol=1e-6)
    for g, m in enumerate(sizes):
        if m == 0:
            assert torch.equal(dbias[g], torch.zeros(n))
    if with_scales:
        torch.testing.assert_close(dscales, s.grad, rtol=1e-6, atol=1e-6)
        assert torch.equal(dscales[sum(sizes):], torch.zeros(tail))
        _, none = reference.grouped_bias_backward(dy, bias, offsets, scales, need_dscales=False)
        assert none is None
    else:
        assert dscales is None


def test_low_precision_inputs_accumulate_in_fp32():
    gen = torch.Generator().manual_seed(0)
    sizes = [200, 0, 56]
    y = torch.randn(256, 16, generator=gen).bfloat16()
    dy = torch.randn(256, 16, generator=gen).bfloat16()
    bias = torch.randn(3, 16, generator=gen).bfloat16()
    scales = torch.rand(256, generator=gen).bfloat16()
    offsets = _offsets(sizes)
    out = reference.grouped_bias_forward(y, bias, offsets, scales)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, _plain(y, bias, sizes, scales).bfloat16())  # fp32 math, one rounding
    dbias, dscales = reference.grouped_bias_backward(dy, bias, offsets, scales)
    assert dbias.dtype == dscales.dtype == torch.float32
    want = (dy.double() * scales.double()[:, None])[:200].sum(0)
    torch.testing.assert_close(dbias[0].double(), want, rtol=1e-5, atol=1e-5)  # no bf16 accumulation
    want_s = (dy.double() * bias.double()[0]).sum(1)[:200]
    torch.testing.assert_close(dscales[:200].double(), want_s, rtol=1e-5, atol=1e-5)


def test_row_groups():
    offsets = _offsets([2, 0, 3])
    assert row_groups(offsets, 7).tolist() == [0, 0, 2, 2, 2, 3, 3]


@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=6), tail=st.integers(0, 5),
       n=st.integers(1, 9), with_scales=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_jagged_groups(sizes, tail, n, with_scales, seed):
    gen = torch.Generator().manual_seed(seed)
    r = sum(sizes) + tail
    y, dy = torch.randn(r, n, generator=gen), torch.randn(r, n, generator=gen)
    bias = torch.randn(len(sizes), n, generator=gen)
    scales = torch.randn(r, generator=gen) if with_scales else None
    offsets = _offsets(sizes)
    assert torch.equal(reference.grouped_bias_forward(y, bias, offsets, scales), _plain(y, bias, sizes, scales))
    b = bias.clone().requires_grad_(True)
    s = scales.clone().requires_grad_(True) if with_scales else None
    _plain(y, b, sizes, s).backward(dy)
    dbias, dscales = reference.grouped_bias_backward(dy, bias, offsets, scales)
    torch.testing.assert_close(dbias, b.grad, rtol=1e-6, atol=1e-6)
    if with_scales:
        torch.testing.assert_close(dscales, s.grad, rtol=1e-6, atol=1e-6)


def test_cpu_dispatch_picks_the_reference():
    t = torch.zeros(2, 2)
    assert BIAS.pick("grouped_bias_forward", t) is reference.grouped_bias_forward
    assert BIAS.pick("grouped_bias_backward", t) is reference.grouped_bias_backward
