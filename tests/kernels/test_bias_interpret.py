"""The grouped-bias kernels (forward and backward) == their reference on CPU, through Triton's interpreter.

As in test_routing_interpret.py: `TRITON_INTERPRET` must be set before Triton decorates the
kernel, so the one test that runs in the normal session starts a fresh interpreter with
TRITON_INTERPRET=1 on this same file; there the comparisons run. The kernel sums a row block
per group with fp32 atomics, so dbias matches the reference up to fp32 summation order;
dscales (one row at a time) and the zero rows are exact. The forward does the reference's fp32
operations in its order (bias * scale, then + y): exact in fp32 and fp16; the interpreter
truncates fp32 -> bf16 where the GPU rounds to nearest even, so bf16 may be one ulp (2^-7) off
here and is compared exactly on the GPU (tests/kernels/test_bias_kernels.py).
"""
import re

import pytest
import torch

from tests.kernels.interpret import INTERPRETING, inside, launcher, run_under_interpreter  # noqa: F401

pytest.importorskip("triton")


@launcher
def test_bias_kernel_under_the_interpreter():
    proc = run_under_interpreter(__file__)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # everything passed there; the one skip is this launcher test itself
    assert re.search(r"\b\d+ passed, 1 skipped in ", proc.stdout), proc.stdout[-2000:]


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


@inside
@pytest.mark.parametrize("sizes, tail, n, dtype, scales_dtype", CASES, ids=[str(i) for i in range(len(CASES))])
def test_backward_kernel_matches_reference(sizes, tail, n, dtype, scales_dtype):
    from qmoe.kernels import bias as kernel
    from qmoe.reference import bias as reference
    gen = torch.Generator().manual_seed(sum(sizes) + n)
    r = sum(sizes) + tail
    dy = torch.randn(r, n, generator=gen).to(dtype)
    bias = torch.randn(len(sizes), n, generator=gen).to(dtype)
    scales = None if scales_dtype is None else torch.rand(r, generator=gen).to(scales_dtype)
    offsets = _offsets(sizes)
    for need_dscales in (True, False):
        got_b, got_s = kernel.grouped_bias_backward(dy, bias, offsets, scales, need_dscales)
        want_b, want_s = reference.grouped_bias_backward(dy, bias, offsets, scales, need_dscales)
        assert got_b.dtype == torch.float32 and got_b.shape == want_b.shape
        torch.testing.assert_close(got_b, want_b, rtol=1e-5, atol=1e-5)
        for g, m in enumerate(sizes):
            if m == 0:
                assert torch.equal(got_b[g], torch.zeros(n))
        if want_s is None:
            assert got_s is None
        else:
            torch.testing.assert_close(got_s, want_s, rtol=1e-5, atol=1e-5)
            assert torch.equal(got_s[sum(sizes):], torch.zeros(tail))


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
    from qmoe.kernels import bias as kernel
    calls = []
    for name in ("grouped_bias_forward", "grouped_bias_backward"):
        monkeypatch.setattr(kernel, name, lambda *a, f=getattr(kernel, name), name=name: calls.append(name) or f(*a))
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
