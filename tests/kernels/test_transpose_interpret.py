"""qmoe.kernels._transpose == torch's transpose, bit for bit, through Triton's interpreter (and on
the GPU where there is one): tiles cut by both edges, one-row and one-column tensors, every
element width, NaN payloads and E8M0 bytes copied as bits, rows padded on either side; and the
block GEMMs' steps-major scales made with it."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernels.interpret import INTERPRETING, inside, launcher, assert_passed_under_interpreter

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
    assert_passed_under_interpreter(__file__, r"\b\d+ passed, \d+ skipped in ")


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


def _check_padded(pad_src, pad_out, device):
    from qmoe.kernels._transpose import transpose_into

    r, c = 70, 130
    src_full = _random((r, c + pad_src), torch.float32, device, seed=pad_src)
    out_full = torch.full((c, r + pad_out), -7.0, device=device)
    src, out = src_full[:, :c], out_full[:, :r]
    transpose_into(out, src)
    assert torch.equal(out.view(torch.int32), src.view(torch.int32).t())
    assert (out_full[:, r:] == -7.0).all()


PADS = [(3, 0), (0, 4), (5, 1)]


@inside
@pytest.mark.parametrize("pad_src,pad_out", PADS)
def test_transpose_between_padded_rows(pad_src, pad_out):
    """Rows padded (as steps-major scales are, to 16 bytes for TMA): only the views' elements move."""
    _check_padded(pad_src, pad_out, "cpu")


def _check_steps_major(device):
    """The block GEMMs' streamed scales ([steps, rows], rows padded to 16 bytes): through the
    transpose on the GPU, through torch's copy on the CPU and for scales whose steps are not dense."""
    from qmoe.kernels import _gluon_sm90 as sm90

    if sm90.gluon is None:
        pytest.skip("this Triton has no Gluon (no TMA descriptors)")
    g = torch.Generator().manual_seed(3)
    for scale in (torch.randn(70, 9, generator=g), torch.randn(9, 70, generator=g).t(), torch.randn(5, 1, generator=g),
                  torch.randn(65536, 56, generator=g)):
        scale = scale.to(device)
        view, _ = sm90.steps_major_scales(scale)
        assert view.stride(0) % 4 == 0 and view.stride(1) == 1
        assert torch.equal(view, scale.t())
    from qmoe.kernels._layout import steps_major
    for rows, steps in ((70, 9), (5, 1), (1, 3), (128, 56)):  # as the block cast stores them: taken, not copied
        scale = steps_major(rows, steps, torch.float32, device)
        scale.copy_(torch.randn(rows, steps, generator=g))
        view, _ = sm90.steps_major_scales(scale)
        assert view.data_ptr() == scale.data_ptr() and torch.equal(view, scale.t())


@inside
def test_steps_major_scales_are_the_scales_transposed():
    _check_steps_major("cpu")


@pytest.mark.skipif(INTERPRETING, reason="runs on the GPU")
@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(56, 65536), (512, 7168), (224, 65536 + 3), (3, 5), (130, 1000)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_transpose_bits_equal_torch_on_the_gpu(shape, dtype):
    _check(*shape, dtype, "cuda")


@pytest.mark.skipif(INTERPRETING, reason="runs on the GPU")
@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("pad_src,pad_out", PADS)
def test_transpose_between_padded_rows_on_the_gpu(pad_src, pad_out):
    _check_padded(pad_src, pad_out, "cuda")


@pytest.mark.skipif(INTERPRETING, reason="runs on the GPU")
@on_gpu
@pytest.mark.gpu
def test_steps_major_scales_on_the_gpu():
    _check_steps_major("cuda")


def test_bad_arguments_raise_and_write_nothing():
    from qmoe.kernels._transpose import transpose_into

    src, out = torch.arange(6.0).reshape(2, 3), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="transposed"):
        transpose_into(torch.zeros(2, 3), src)
    with pytest.raises(ValueError, match="transposed"):
        transpose_into(torch.zeros(3, 2, dtype=torch.float64), src)
    with pytest.raises(ValueError, match="dense"):
        transpose_into(out, src.t().contiguous().t())
    with pytest.raises(ValueError, match="dense"):  # rows that overlap
        transpose_into(out, torch.zeros(3).expand(2, 3))
    assert not out.any()
