"""qmoe.kernels._transpose == torch's transpose, bit for bit, through Triton's interpreter (and on
the GPU where there is one): tiles cut by both edges, one-row and one-column tensors, every
element width, NaN payloads and E8M0 bytes copied as bits."""
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernels.interpret import INTERPRETING, inside, launcher, run_under_interpreter

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.uint8, torch.float8_e8m0fnu, torch.bfloat16]


def _random(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    width = torch.empty(0, dtype=dtype).element_size()
    bits = torch.randint(0, 256, (*shape, width), dtype=torch.uint8, generator=g)  # every pattern, NaNs too
    return bits.view(dtype).reshape(shape).to(device)


def _check(r, c, dtype, device, seed=0):
    from qmoe.kernels._layout import raw_bits
    from qmoe.kernels._transpose import transpose_into

    src = _random((r, c), dtype, device, seed)
    out = torch.full((c, r, src.element_size()), 0x5A, dtype=torch.uint8, device=device).view(dtype).reshape(c, r)
    got = transpose_into(out, src)
    assert got is out
    assert torch.equal(raw_bits(out), raw_bits(src).t()), (r, c, dtype)


@launcher
def test_transpose_under_the_interpreter():
    proc = run_under_interpreter(__file__)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.search(r"\b\d+ passed, \d+ skipped in ", proc.stdout), proc.stdout[-2000:]


@inside
@settings(max_examples=12, deadline=None)
@given(r=st.integers(1, 300), c=st.integers(1, 300), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 99))
def test_transpose_bits_equal_torch(r, c, dtype, seed):
    _check(r, c, dtype, "cpu", seed)


@inside
@pytest.mark.parametrize("shape", [(1, 1), (1, 200), (200, 1), (64, 64), (128, 129)])
def test_transpose_edges(shape):
    for dtype in DTYPES:
        _check(*shape, dtype, "cpu")


@pytest.mark.skipif(INTERPRETING, reason="runs on the GPU")
@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(56, 65536), (512, 7168), (224, 65536 + 3), (3, 5), (130, 1000)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_transpose_bits_equal_torch_on_the_gpu(shape, dtype):
    _check(*shape, dtype, "cuda")


def test_bad_arguments_raise_and_write_nothing():
    from qmoe.kernels._transpose import transpose_into

    src, out = torch.arange(6.0).reshape(2, 3), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="transposed"):
        transpose_into(torch.zeros(2, 3), src)
    with pytest.raises(ValueError, match="transposed"):
        transpose_into(torch.zeros(3, 2, dtype=torch.float64), src)
    with pytest.raises(ValueError, match="dense"):
        transpose_into(out, src.t().contiguous().t())
    assert not out.any()
