"""Quantized tensors keep their scales as the quantizer stored them (the block cast's steps-major
layout, which the GEMMs read), and users read the canonical row-major layout (NUMERICS.md)."""
import torch

from qmoe import GroupedTensor, QuantizedTensor
from qmoe.contracts.scales import gemm_scale
from qmoe.kernels._layout import steps_major
from qmoe.recipes import Float8BlockScaling


def _steps_major_copy(canonical: torch.Tensor) -> torch.Tensor:
    s = steps_major(*canonical.shape, canonical.dtype, canonical.device)
    s.copy_(canonical)
    return s


def test_a_quantized_tensor_shows_canonical_scales_and_keeps_the_stored_ones():
    q = Float8BlockScaling().quantizer("input")
    qt = q.quantize(torch.randn(70, 384), rowwise=True, columnwise=True)
    canonical_row, canonical_col = qt.rowwise_scale_inv, qt.columnwise_scale_inv
    row, col = _steps_major_copy(canonical_row), _steps_major_copy(canonical_col)
    assert not row.is_contiguous() and row.stride(0) == 1 and row.stride(1) == 72  # 70 rows padded to 16 bytes
    qt.rowwise_scale_inv, qt.columnwise_scale_inv = row, col
    assert gemm_scale(qt, False) is row and gemm_scale(qt, True) is col
    for public, want in ((qt.rowwise_scale_inv, canonical_row), (qt.columnwise_scale_inv, canonical_col)):
        assert public.is_contiguous() and public.shape == want.shape and torch.equal(public, want)
    # the dequantized values come from the same scales either way
    assert torch.equal(qt.dequantize(), QuantizedTensor(q, qt.shape, qt.dtype, rowwise_data=qt.rowwise_data,
                                                        rowwise_scale_inv=canonical_row).dequantize())


def test_dense_and_per_tensor_scales_are_handed_out_as_stored():
    q = Float8BlockScaling().quantizer("input")
    dense = torch.rand(4, 3)
    qt = QuantizedTensor(q, torch.Size((4, 384)), torch.float32, rowwise_data=torch.zeros(4, 384),
                         rowwise_scale_inv=dense)
    assert qt.rowwise_scale_inv is dense and qt.columnwise_scale_inv is None
    scalar = torch.tensor(0.5)
    qt.rowwise_scale_inv = scalar
    assert qt.rowwise_scale_inv is scalar and gemm_scale(qt, False) is scalar
    qt.rowwise_scale_inv = None
    assert qt.rowwise_scale_inv is None and gemm_scale(qt, False) is None
    assert "rowwise_scale_inv" not in repr(qt)


def test_a_grouped_tensor_and_its_groups_show_canonical_scales():
    q = Float8BlockScaling().quantizer("input")
    x = torch.randn(300, 256)
    splits = [100, 0, 200]
    gt = GroupedTensor.quantize(x, splits, q)
    want_groups = [(t.rowwise_scale_inv.clone(), t.columnwise_scale_inv.clone()) for t in gt.split()]
    canonical_row, canonical_col = gt.rowwise_scale_inv, gt.columnwise_scale_inv
    gt.rowwise_scale_inv = _steps_major_copy(canonical_row)
    gt.columnwise_scale_inv = _steps_major_copy(canonical_col)
    assert gt.rowwise_scale_inv.is_contiguous() and torch.equal(gt.rowwise_scale_inv, canonical_row)
    assert gt.columnwise_scale_inv.is_contiguous() and torch.equal(gt.columnwise_scale_inv, canonical_col)
    for t, (row, col) in zip(gt.split(), want_groups):
        assert t.rowwise_scale_inv.is_contiguous() and torch.equal(t.rowwise_scale_inv, row)
        assert t.columnwise_scale_inv.is_contiguous() and torch.equal(t.columnwise_scale_inv, col)
    assert torch.equal(gt.dequantize(), GroupedTensor.quantize(x, splits, q).dequantize())


def test_one_block_per_row_reads_row_major_too():
    """A one-column steps-major view counts as contiguous to torch but its last stride is the
    padded row count: the attribute users read has unit stride, so byte views of it work."""
    q = Float8BlockScaling().quantizer("input")
    qt = q.quantize(torch.randn(13, 128), rowwise=True)
    canonical = qt.rowwise_scale_inv
    stored = _steps_major_copy(canonical)
    assert stored.is_contiguous() and stored.stride() == (1, 16)
    qt.rowwise_scale_inv = stored
    public = qt.rowwise_scale_inv
    assert public.stride() == (1, 1) and torch.equal(public.view(torch.uint8), canonical.view(torch.uint8))
