"""Quantized token rows on the wire: each row's codes and its scales packed into one uint8 row.

Quantized dispatch sends `Quantizer.quantize_for_dispatch` rows: 1 byte per element (FP8)
plus the row's block scales (FP8 1x128: K/128 fp32; MXFP8: K/32 E8M0 bytes), or nothing
more for per-tensor current scaling, whose one scale is the same on every rank (its amax was
all-reduced) and stays here. Packing codes and scales into one byte row lets them travel
through the permutation and the all-to-all together; `unpack` gives the QuantizedTensor back.
"""
from __future__ import annotations

import torch

from qmoe.contracts.scales import gemm_scale
from qmoe.quant import QuantizedTensor


class PackedRows:
    """The byte layout of one batch of quantized rows: [codes K bytes | scales S * itemsize bytes].

    qt: rowwise QuantizedTensor [T, K] from `quantize_for_dispatch`.
    """

    def __init__(self, qt: QuantizedTensor):
        self.quantizer, self.dtype = qt.quantizer, qt.dtype
        self.width = qt.shape_2d[1]
        self.data_dtype = qt.rowwise_data.dtype
        if qt.rowwise_data.element_size() != 1 or qt.rowwise_data.shape[1] != self.width:
            raise ValueError(f"quantized dispatch sends 1-byte codes of K={self.width} per row, got "
                             f"{qt.rowwise_data.dtype} {tuple(qt.rowwise_data.shape)}")
        scale = gemm_scale(qt, False)  # its shape and dtype: no canonical copy needed here
        self.shared_scale = scale if scale.dim() == 0 else None  # per-tensor: one value for every row
        self.scale_dtype = scale.dtype
        self.scale_cols = 0 if scale.dim() == 0 else scale.shape[1]
        self.row_bytes = self.width + self.scale_cols * scale.element_size()

    def pack(self, qt: QuantizedTensor) -> torch.Tensor:
        """[T, row_bytes] uint8."""
        parts = [qt.rowwise_data.view(torch.uint8)]
        if self.shared_scale is None:
            parts.append(qt.rowwise_scale_inv.contiguous().view(torch.uint8))
        return torch.cat(parts, 1) if len(parts) > 1 else parts[0].contiguous()

    def unpack(self, rows: torch.Tensor) -> QuantizedTensor:
        """rows [R, row_bytes] uint8 -> QuantizedTensor [R, K] (padding rows of zero bytes dequantize to 0)."""
        data = rows[:, :self.width].contiguous().view(self.data_dtype)
        if self.shared_scale is not None:
            scale = self.shared_scale
        else:
            scale = rows[:, self.width:].contiguous().view(self.scale_dtype)
        return QuantizedTensor(self.quantizer, torch.Size((rows.shape[0], self.width)), self.dtype,
                               rowwise_data=data, rowwise_scale_inv=scale)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows [R, row_bytes] uint8 -> [R, K] high-precision values."""
        if rows.shape[0] == 0:
            return torch.zeros((0, self.width), dtype=dtype, device=rows.device)
        return self.unpack(rows).dequantize(dtype)
