"""The grouped-bias kernels (forward and backward) == their reference on CPU, through Triton's interpreter.

As in test_routing_interpret.py: `TRITON_INTERPRET` must be set before Triton decorates the
kernel, so the one test that runs in the normal session starts a fresh interpreter with
TRITON_INTERPRET=1 on this same file; there the comparisons run. The backward sums each
group's 64-row chunks and then the chunk partials in a fixed order (no atomics), so dbias and
dscales match the reference up to fp32 summation order (rtol 1e-5 plus 1e-6 of the sum of the
terms' magnitudes, as on the GPU), are bit-identical from run to run, and a group's dbias does
not depend on the other groups; empty groups and rows in no group are exact zeros. The forward
does the reference's fp32 operations in its order (bias * scale, then + y): exact in fp32 and
fp16; the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even, so bf16 may
be one ulp (2^-7) off here and is compared exactly on the GPU (tests/kernels/test_bias_kernels.py).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernels.interpret import inside, launcher, assert_passed_under_interpreter  # noqa: F401


@launcher
def test_bias_kernel_under_the_interpreter():
    # everything passed there; the one skip is this launcher test itself
    assert_passed_under_interpreter(__file__, r"\b\d+ passed, 1 skipped in ")


def _offsets(sizes):
    return torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int64)


# (sizes, tail rows, N, dy dtype, scales dtype or None): the kernel's tiles are 64 rows x 128 columns
CASES = [
    ([5, 0, 9, 2], 0, 8, torch.float32, torch.float32),
    ([0, 0, 7], 3, 5, torch.float32, None),
    ([70, 0, 3, 60], 17, 130, torch.float32, torch.float32),  # blocks spanning groups, two column tiles
    ([70, 0, 3, 60], 17, 130, torch.bfloat16, torch.bfloat16),
    ([1] * 9, 0, 3, torch.bfloat16, torch.float32),
    ([64, 64], 0, 128, torch.float32, None),  # groups aligned to whole tiles
    ([0, 0], 4, 6, torch.float32, torch.float32),  # no rows in any group
    ([0], 0, 4, torch.float32, torch.float32),  # no rows at all (R = 0)
]


# Backward only: the launch covers cdiv(R, 64) + E chunks of one group's rows x 128-column
# blocks, and sums a group's chunk partials 32 chunks x 64 columns at a time.
BACKWARD_CASES = [
    pytest.param([2100], 0, 200, torch.float32, torch.float32, id="one-group-holds-every-row"),  # 33 chunks
    pytest.param([0, 0, 0, 1500, 0, 0], 9, 70, torch.bfloat16, None, id="one-of-many-holds-every-row"),
    pytest.param([0] * 14 + [3] + [0] * 14 + [130], 0, 129, torch.float32, torch.float32, id="mostly-empty"),
    pytest.param([10, 20], 100, 65, torch.float32, torch.float32, id="many-rows-past-the-last-group"),
    pytest.param([], 7, 9, torch.float32, torch.float32, id="no-groups"),
    pytest.param([3, 5], 2, 1, torch.float32, torch.bfloat16, id="one-column"),
    pytest.param([3, 5], 2, 0, torch.float32, torch.float32, id="no-columns"),
]


def _backward_inputs(sizes, tail, n, dtype, scales_dtype, seed, offsets_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    r = sum(sizes) + tail
    dy = torch.randn(r, n, generator=gen).to(dtype)
    bias = torch.randn(len(sizes), n, generator=gen).to(dtype)
    scales = None if scales_dtype is None else torch.rand(r, generator=gen).to(scales_dtype)
    return dy, bias, _offsets(sizes).to(offsets_dtype), scales


def _check_backward(dy, bias, offsets, scales):
    """Kernel == reference to fp32 summation order, zeros where nothing is summed, bit-identical reruns."""
    from qmoe.kernels import bias as kernel
    from qmoe.contracts.carriers import row_groups
    from qmoe.reference import bias as reference
    (r, n), e = dy.shape, bias.shape[0]
    groups = row_groups(offsets, r)
    in_group = groups < e
    w = dy.float() if scales is None else dy.float() * scales.float()[:, None]
    dbias_mag = torch.zeros(e + 1, n).index_add_(0, groups, w.abs())[:e]  # sum of |terms| per entry
    padded = torch.cat((bias.float(), torch.zeros(1, n)))
    dscales_mag = (dy.float() * padded[groups]).abs().sum(1)
    for need_dscales in (True, False):
        got_b, got_s = kernel.grouped_bias_backward(dy, bias, offsets, scales, need_dscales)
        want_b, want_s = reference.grouped_bias_backward(dy, bias, offsets, scales, need_dscales)
        assert got_b.dtype == torch.float32 and got_b.shape == want_b.shape == (e, n)
        assert ((got_b - want_b).abs() <= 1e-5 * want_b.abs() + 1e-6 * dbias_mag).all()
        for g in range(e):
            if not (groups == g).any():
                assert torch.equal(got_b[g], torch.zeros(n)), f"empty group {g}"
        again_b, again_s = kernel.grouped_bias_backward(dy, bias, offsets, scales, need_dscales)
        assert torch.equal(again_b, got_b)
        if want_s is None:
            assert got_s is None and again_s is None
        else:
            assert got_s.dtype == torch.float32 and got_s.shape == (r,)
            assert ((got_s - want_s).abs() <= 1e-5 * want_s.abs() + 1e-6 * dscales_mag).all()
            assert torch.equal(got_s[~in_group], torch.zeros(int((~in_group).sum())))
            assert torch.equal(again_s, got_s)


@inside
@pytest.mark.parametrize("sizes, tail, n, dtype, scales_dtype",
                         [pytest.param(*c, id=str(i)) for i, c in enumerate(CASES)] + BACKWARD_CASES)
def test_backward_kernel_matches_reference(sizes, tail, n, dtype, scales_dtype):
    _check_backward(*_backward_inputs(sizes, tail, n, dtype, scales_dtype, seed=sum(sizes) + n))


@inside
def test_backward_kernel_takes_int32_offsets_and_ignores_offsets0():
    """offsets[0] is not read: group 0 starts at row 0, as reference.row_groups has it."""
    dy, bias, offsets, scales = _backward_inputs([70, 0, 9], 5, 20, torch.float32, torch.float32, seed=3,
                                                 offsets_dtype=torch.int32)
    _check_backward(dy, bias, offsets, scales)
    offsets[0] = 11
    _check_backward(dy, bias, offsets, scales)


@inside
@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.one_of(st.just(0), st.integers(1, 300)), min_size=1, max_size=9),
       tail=st.integers(0, 70), n=st.sampled_from([1, 7, 64, 127, 130]), with_scales=st.booleans())
def test_backward_kernel_on_any_split(sizes, tail, n, with_scales):
    """Jagged splits, empty groups, one group holding every row, rows past the last group."""
    dy, bias, offsets, scales = _backward_inputs(sizes, tail, n, torch.float32,
                                                 torch.float32 if with_scales else None, seed=len(sizes) + tail)
    _check_backward(dy, bias, offsets, scales)


@inside
def test_backward_group_sums_do_not_depend_on_other_groups():
    """A group's chunks start at its first row, so its dbias (and every row's dscales) is the same
    bits as for that group alone: where the group sits and what surrounds it change nothing."""
    from qmoe.kernels import bias as kernel
    sizes = [37, 0, 130, 64, 5]
    dy, bias, offsets, scales = _backward_inputs(sizes, 3, 150, torch.float32, torch.float32, seed=4)
    dbias, dscales = kernel.grouped_bias_backward(dy, bias, offsets, scales)
    for g, m in enumerate(sizes):
        a = int(offsets[g])
        alone_b, alone_s = kernel.grouped_bias_backward(dy[a:a + m], bias[g:g + 1], _offsets([m]), scales[a:a + m])
        assert torch.equal(alone_b[0], dbias[g]), g
        assert torch.equal(alone_s, dscales[a:a + m]), g


@inside
@pytest.mark.parametrize("sizes, tail, n, dtype, scales_dtype", CASES, ids=[str(i) for i in range(len(CASES))])
def test_forward_kernel_matches_reference(sizes, tail, n, dtype, scales_dtype):
    from qmoe.kernels import bias as kernel
    from qmoe.reference import bias as reference
    gen = torch.Generator().manual_seed(sum(sizes) + n + 1)
    r = sum(sizes) + tail
    y = torch.randn(r, n, generator=gen).to(dtype)
    bias = torch.randn(len(sizes), n, generator=gen).to(dtype)
    scales = None if scales_dtype is None else torch.rand(r, generator=gen).to(scales_dtype)
    offsets = _offsets(sizes)
    got = kernel.grouped_bias_forward(y, bias, offsets, scales)
    want = reference.grouped_bias_forward(y, bias, offsets, scales)
    assert got.dtype == dtype and got.shape == (r, n)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2.0 ** -7, atol=0)
    else:
        assert torch.equal(got, want)
    assert torch.equal(got[sum(sizes):], y[sum(sizes):])  # rows after the last group: no bias


@inside
def test_forward_kernel_reads_row_strided_input():
    from qmoe.kernels import bias as kernel
    from qmoe.reference import bias as reference
    wide = torch.randn(30, 24)
    y, bias, scales = wide[:, 4:20], torch.randn(3, 16), torch.rand(30)
    offsets = _offsets([10, 5, 12])
    assert torch.equal(kernel.grouped_bias_forward(y, bias, offsets, scales),
                       reference.grouped_bias_forward(y, bias, offsets, scales))


@inside
def test_grouped_linear_uses_the_kernel_and_matches_reference(monkeypatch):
    """GroupedLinear's scaled-bias backward through the kernel (QMOE_BACKEND=triton) == reference."""
    import qmoe
    from qmoe.dispatch import BIAS
    calls = []
    for name in ("grouped_bias_forward", "grouped_bias_backward"):  # log the kernels the table hands out
        kernel, reference = BIAS.table[name]
        monkeypatch.setitem(BIAS.table, name, (lambda *a, f=kernel, n=name: calls.append(n) or f(*a), reference))
    torch.manual_seed(0)
    layer = qmoe.nn.GroupedLinear(3, 16, 8, scale_bias=True, grouped_path="split")
    x, scales = torch.randn(20, 16), torch.rand(20, requires_grad=True)
    splits = torch.tensor([7, 0, 13])
    layer(x, splits, scales).square().sum().backward()
    got = layer.bias.grad.clone(), scales.grad.clone()
    assert calls == ["grouped_bias_forward", "grouped_bias_backward"]
    monkeypatch.setenv("QMOE_BACKEND", "reference")
    layer.zero_grad()
    scales.grad = None
    layer(x, splits, scales).square().sum().backward()
    torch.testing.assert_close(got[0], layer.bias.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], scales.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args", [
    lambda: (torch.randn(4, 8), torch.randn(2, 9), torch.tensor([0, 2, 4]), None),
    lambda: (torch.randn(4, 8, 1), torch.randn(2, 8), torch.tensor([0, 2, 4]), None),
    lambda: (torch.randn(4, 8), torch.randn(8), torch.tensor([0, 2, 4]), None),
    lambda: (torch.randn(4, 8), torch.randn(2, 8), torch.tensor([0, 2, 4]), torch.rand(5)),
    lambda: (torch.randn(4, 8), torch.randn(2, 8), torch.tensor([0, 2, 4]), torch.rand(4, 1)),
], ids=["bias-width", "dy-3d", "bias-1d", "scales-rows", "scales-2d"])
@pytest.mark.parametrize("name", ["grouped_bias_forward", "grouped_bias_backward"])
def test_launcher_rejects_bad_shapes_before_launching(args, name):
    from qmoe.kernels import bias as kernel
    with pytest.raises(ValueError):
        getattr(kernel, name)(*args())
